"""The expert-parallel layer on the GPUs of one host: correctness, weak scaling, bandwidth.

    python -m bench.multi_gpu --out DIR            # every GPU of the machine
    python -m bench.multi_gpu --out DIR --smoke    # CPU, 8 simulated devices
    python -m bench.multi_gpu report DIR/multi_gpu.json ...    # the markdown tables

bench/README.md describes the three parts. `--exchanges` may name `fused` (implementation
"fused", its exchange inside its own kernels; "fused@N": N copy programs) beside the exchanges
run with `--implementation`; each implementation is compared with its own EP 1 run, and fused's
scaling rows have no "no exchange" variant. Times: bench.harness's median of `--timed` samples.
NCCL_NVLS_ENABLE=0 is set before jax starts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
if "--smoke" in sys.argv:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import mok_jax
from bench import harness as h
from mok_jax import compiler_options, exchange, make_mesh, routed
from mok_jax.mesh import shard_params, shard_tokens

# (config, tokens per device) of the weak-scaling runs: DESIGN.md's layer shapes, with the
# tokens per device of the single-GPU layer tests.
SCALING = {
    "qwen3_30b_a3b": (mok_jax.presets["qwen3_30b_a3b"], 4096),
    "mixtral_8x7b": (mok_jax.presets["mixtral_8x7b"], 2048),
    "deepseek_v3_e32": (dataclasses.replace(mok_jax.presets["deepseek_v3"], num_experts=32), 2048),
}
# The correctness runs: a global batch split over 1, 2, 4, ... devices.
CORRECTNESS = {
    "qwen3_30b_a3b": (mok_jax.presets["qwen3_30b_a3b"], 8192),
    "deepseek_v3_e32": (dataclasses.replace(mok_jax.presets["deepseek_v3"], num_experts=32), 4096),
}
SMOKE = {"tiny": (mok_jax.presets["tiny"], 64)}


def loss(x, params, cotangent, cfg, mesh):
    y, aux = mok_jax.moe(x, params, cfg, mesh=mesh)
    return jnp.sum(y.astype(jnp.float32) * cotangent) + aux.loss, (y, aux)


def step_fn(cfg, mesh):
    """A fresh jit of ((loss, (y, aux)), (dx, dparams)) on `mesh`."""
    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    return jax.jit(lambda x, p, c: grad(x, p, c, cfg, mesh), compiler_options=compiler_options())


def inputs(cfg, num_tokens: int, mesh):
    """x, the parameters and the cotangent, placed on `mesh` (None: unplaced)."""
    key_p, key_x, key_c = jax.random.split(jax.random.key(0), 3)
    params = mok_jax.init_params(key_p, cfg)
    x = jax.random.normal(key_x, (num_tokens, cfg.d_model), jnp.float32).astype(cfg.dtype)
    cotangent = jax.random.normal(key_c, (num_tokens, cfg.d_model), jnp.float32)
    if mesh is None:
        return x, params, cotangent
    return shard_tokens(x, mesh), shard_params(params, mesh), shard_tokens(cotangent, mesh)


def sync_time(fn, *args, timed: int) -> tuple[float, float, list[float], object]:
    """(compile + first run s, median ms, all sample ms, last result): bench.harness's
    `time_runner` (one warm-up call) of the jitted fn(*args)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    keep: dict = {}
    t = h.time_fn(fn, *args, timed=timed, keep=keep)
    return first, t["median_ms"], t["samples_ms"], keep.get("out", out)


def to_host(tree):
    return jax.tree.map(np.asarray, tree)


def bitwise(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y)
        for x, y in zip(la, lb, strict=True)
    )


def outputs(result) -> dict[str, np.ndarray]:
    """y, dx and each parameter gradient of a ((loss, (y, aux)), (dx, dparams)) result."""
    (_, (y, _)), (dx, dp) = result
    named = {"y": y, "dx": dx}
    for field in dataclasses.fields(dp):
        if getattr(dp, field.name) is not None:
            named[f"d{field.name}"] = getattr(dp, field.name)
    return {k: np.asarray(v) for k, v in named.items()}


def compare(actual, expected) -> tuple[dict[str, bool], dict[str, float]]:
    """Per output: (bitwise equal, largest |a - e| / max |e|)."""
    a_out, e_out = outputs(actual), outputs(expected)
    same, err = {}, {}
    for name, a in a_out.items():
        e = e_out[name]
        same[name] = bool(a.dtype == e.dtype and np.array_equal(a.view(np.uint8), e.view(np.uint8)))
        a32, e32 = a.astype(np.float32), e.astype(np.float32)
        err[name] = float(np.max(np.abs(a32 - e32)) / max(float(np.max(np.abs(e32))), 1e-30))
    return same, err


def within_tolerance(actual, expected, dtype) -> bool:
    """y, dx and every parameter gradient within the tolerance table; the aux counts (loads,
    drops) exact. The round count may differ with EP and is not compared."""
    from mok_jax.tolerances import tolerance

    (_, (y, aux)), grads = actual
    (_, (y0, aux0)), grads0 = expected
    if not (
        np.array_equal(aux.tokens_per_expert, aux0.tokens_per_expert)
        and np.array_equal(aux.dropped, aux0.dropped)
    ):
        return False
    floats = zip(jax.tree.leaves((y, grads)), jax.tree.leaves((y0, grads0)), strict=True)
    for a, e in floats:
        tol = tolerance(dtype, a.dtype)
        a32, e32 = np.asarray(a, np.float32), np.asarray(e, np.float32)
        if not np.allclose(a32, e32, rtol=tol.rtol, atol=tol.scaled_atol(e32)):
            return False
    return True


EP_DEGREES = [1, 2, 4, 8, 16, 32, 64]
EXCHANGES = list(mok_jax.EXCHANGES)
# "--exchanges ...,fused": implementation "fused", whose exchange runs inside its own kernels;
# "fused@N" the same with options.exchange_programs N (0: the dispatch not overlapped
# with the GEMMs; at EP 1, which has no exchange, it is "fused"). fused's residuals are "inputs"
# at every EP, as under the exchange ("auto" would keep gate and up at EP 1), so that its EP 1
# run computes what the others do. The other exchanges run with --implementation (xla by
# default). The other options are "auto".
FUSED = "fused"
IMPLEMENTATION = ["xla"]


def variant(cfg, exch: str, ep: int):
    """cfg for one exchange of the run at EP `ep`: its implementation and, but for fused, its
    exchange."""
    if exch.split("@")[0] == FUSED:
        options = dataclasses.replace(cfg.options, residuals="inputs")
        if "@" in exch and ep > 1:
            options = dataclasses.replace(options, exchange_programs=int(exch.split("@")[1]))
        return dataclasses.replace(cfg, implementation=FUSED, options=options)
    return dataclasses.replace(cfg, implementation=IMPLEMENTATION[0], exchange=exch)


def ep_degrees(num_devices: int) -> list[int]:
    return [ep for ep in EP_DEGREES if ep <= num_devices]


# --- 1. correctness ------------------------------------------------------------------------


def correctness(name, cfg, num_tokens, record, timed) -> None:
    base = {}  # per implementation: its EP 1 result
    # EP 1 always: it is what every other degree is compared with.
    for ep in sorted({1, *ep_degrees(len(jax.devices()))}):
        for exch in EXCHANGES:
            c = variant(cfg, exch, ep)
            if ep == 1 and c.implementation in base:
                continue  # one device: the exchanges of one implementation take one path
            mesh = make_mesh("expert", devices=jax.devices()[:ep])
            args = inputs(c, num_tokens, mesh)
            fn = step_fn(c, mesh)
            runs = [to_host(fn(*args)) for _ in range(3)]
            row = {
                "part": "correctness",
                "case": name,
                "tokens": num_tokens,
                "ep": ep,
                "implementation": c.implementation,
                "exchange": exch,
                "rounds": int(runs[0][0][1][1].rounds),
                "repeat_bitwise_3_runs": bitwise(runs[0], runs[1]) and bitwise(runs[0], runs[2]),
            }
            if ep == 1:
                base[c.implementation] = runs[0]
                row["is_single_gpu_baseline"] = True
                plain = to_host(step_fn(c, None)(*inputs(c, num_tokens, None)))
                row["bitwise_vs_no_mesh"] = compare(runs[0], plain)[0]
            else:
                one = base[c.implementation]
                same, err = compare(runs[0], one)
                row["within_tolerance_of_single_gpu"] = within_tolerance(runs[0], one, c.dtype)
                row["bitwise_vs_single_gpu"] = same
                row["max_rel_err_vs_single_gpu"] = err
            record(row)


# --- 2. scaling ------------------------------------------------------------------------------


@contextlib.contextmanager
def no_exchange():
    """Replaces the exchange's collectives by local copies of the same rows (timing only: the
    values are wrong): `exchange._transfer` keeps a device's own first rows, the ring's
    ppermute returns its operand."""
    original_transfer, original_lax = exchange._transfer, routed.lax

    def local_transfer(operand_ad, tr, out_rows, axis):
        rows = operand_ad.shape[0]
        if rows >= out_rows:
            return operand_ad[:out_rows] * jnp.ones((), operand_ad.dtype)
        pad = jnp.zeros((out_rows - rows, *operand_ad.shape[1:]), operand_ad.dtype)
        return jnp.concatenate([operand_ad, pad])

    class LocalLax:
        def __getattr__(self, attr):
            return getattr(lax, attr)

        @staticmethod
        def ppermute(x, axis_name, perm):
            return x * jnp.ones((), x.dtype)

    exchange._transfer, routed.lax = local_transfer, LocalLax()
    try:
        yield
    finally:
        exchange._transfer, routed.lax = original_transfer, original_lax


def collectives_in(fn, *args) -> list[str]:
    """The exchange's collectives in fn's lowered program (the counts' all_gather and the
    rounds' pmax are not the exchange and are not listed)."""
    text = fn.lower(*args).as_text()
    names = ("ragged_all_to_all", "all_to_all", "collective_permute")
    return [name for name in names if f"stablehlo.{name}" in text or f"@{name}" in text]


def scaling(name, cfg, tokens_per_device, record, timed, budget_end) -> None:
    for ep in ep_degrees(len(jax.devices())):
        done_at_ep1 = set()
        for exch in EXCHANGES:
            c = variant(cfg, exch, ep)
            key = (c.implementation, c.options)
            if ep == 1 and key in done_at_ep1:
                continue
            done_at_ep1.add(key)
            if time.monotonic() > budget_end:
                record({"part": "scaling", "case": name, "ep": ep, "skipped": "budget"})
                return
            mesh = make_mesh("expert", devices=jax.devices()[:ep])
            num_tokens = tokens_per_device * ep
            args = inputs(c, num_tokens, mesh)
            first, ms, all_ms, out = sync_time(step_fn(c, mesh), *args, timed=timed)
            row = {
                "part": "scaling",
                "case": name,
                "tokens_per_device": tokens_per_device,
                "tokens": num_tokens,
                "ep": ep,
                "implementation": c.implementation,
                "exchange": exch if ep > 1 else "local (one device)",
                "rounds": int(out[0][1][1].rounds),
                "compile_s": round(first, 2),
                "fwd_bwd_ms": round(ms, 3),
                "fwd_bwd_ms_min_max": [round(min(all_ms), 3), round(max(all_ms), 3)],
            }
            if ep > 1 and c.implementation == FUSED:
                # No local stand-in for the in-kernel exchange yet: no share measured.
                row["exchange_collectives"] = collectives_in(step_fn(c, mesh), *args)
            elif ep > 1:
                with no_exchange():
                    local = step_fn(c, mesh)
                    if left := collectives_in(local, *args):
                        raise RuntimeError(f"the no-exchange program still has {left}")
                    _, ms_local, all_local, _ = sync_time(local, *args, timed=timed)
                row["exchange_collectives"] = collectives_in(step_fn(c, mesh), *args)
                row["no_exchange_fwd_bwd_ms"] = round(ms_local, 3)
                row["no_exchange_min_max"] = [round(min(all_local), 3), round(max(all_local), 3)]
                row["exchange_share"] = round(1 - ms_local / ms, 3)
            record(row)


# --- 3. bandwidth ----------------------------------------------------------------------------


def collectives(ep: int, share: int, width: int) -> dict:
    """The exchange's collectives on `share` rows per peer, as shard_map bodies."""

    def ragged(x_nd):
        sizes = jnp.full((ep,), share, jnp.int32)
        remote = jnp.full((ep,), lax.axis_index("expert") * share, jnp.int32)
        offsets = jnp.arange(ep, dtype=jnp.int32) * share
        out = jnp.zeros_like(x_nd)
        return lax.ragged_all_to_all(x_nd, out, offsets, sizes, remote, sizes, axis_name="expert")

    def dense(x_nd):
        chunks = x_nd[: share * ep].reshape(ep, share, width)
        return lax.all_to_all(chunks, "expert", 0, 0, tiled=False).reshape(-1, width)

    def ring_hop(x_nd):
        return lax.ppermute(x_nd[:share], "expert", [(i, (i + 1) % ep) for i in range(ep)])

    sent = share * (ep - 1) * width * 2
    kinds = {"all_to_all": (dense, sent), "ppermute_one_hop": (ring_hop, share * width * 2)}
    if jax.default_backend() != "cpu":  # XLA:CPU has no ragged_all_to_all
        kinds = {"ragged_all_to_all": (ragged, sent), **kinds}
    return kinds


def bandwidth(cfg, tokens_per_device, record, timed) -> None:
    """Each device sends N = T k rows of D, an equal share to every device (its own share
    stays). Bytes leaving a device: N D 2 (EP - 1) / EP."""
    rows, width = tokens_per_device * cfg.top_k, cfg.d_model
    for ep in [ep for ep in ep_degrees(len(jax.devices())) if ep > 1]:
        mesh = make_mesh("expert", devices=jax.devices()[:ep])
        x = jax.device_put(
            jnp.ones((rows * ep, width), jnp.bfloat16),
            jax.sharding.NamedSharding(mesh, P("expert")),
        )
        for kind, (body, moved) in collectives(ep, rows // ep, width).items():
            fn = jax.jit(
                jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert"))
            )
            _, ms, all_ms, _ = sync_time(fn, x, timed=timed)
            record(
                {
                    "part": "bandwidth",
                    "ep": ep,
                    "collective": kind,
                    "rows_per_device": rows,
                    "d": width,
                    "bytes_leaving_each_device": moved,
                    "ms": round(ms, 4),
                    "min_max_ms": [round(min(all_ms), 4), round(max(all_ms), 4)],
                    "gb_per_s_per_device": round(moved / (ms * 1e-3) / 1e9, 1),
                }
            )


# --- the report ------------------------------------------------------------------------------


def report(results: list[dict]) -> str:
    """Markdown tables of one or more runs' JSON (rows tagged with the run's XLA_FLAGS)."""
    rows = [dict(r, xla_flags=res.get("xla_flags", "")) for res in results for r in res["rows"]]
    out = []
    flags = lambda r: r["xla_flags"] or "(default)"  # noqa: E731
    correct = [r for r in rows if r["part"] == "correctness" and "bitwise_vs_single_gpu" in r]
    if correct:
        header = ["case", "T", "EP", "implementation", "exchange", "rounds", "3 runs bitwise"]
        header += ["within tolerance", "bitwise equal to 1 GPU", "not bitwise (max rel. error)"]
        table = []
        for r in correct:
            bits, err = r["bitwise_vs_single_gpu"], r["max_rel_err_vs_single_gpu"]
            diff = ", ".join(f"{k} {err[k]:.1e}" for k, v in bits.items() if not v) or "-"
            table.append([r["case"], r["tokens"], r["ep"], r.get("implementation", "xla"),
                          r["exchange"], r["rounds"], r["repeat_bitwise_3_runs"],
                          r["within_tolerance_of_single_gpu"],
                          ", ".join(k for k, v in bits.items() if v), diff])  # fmt: skip
        out += [*h.table(header, table), ""]
    if band := [r for r in rows if r["part"] == "bandwidth"]:
        header = ["EP", "collective", "XLA_FLAGS", "MB leaving each device", "ms",
                  "GB/s per device"]  # fmt: skip
        table = [[r["ep"], r["collective"], flags(r), f"{r['bytes_leaving_each_device'] / 1e6:.1f}",
                  r["ms"], r["gb_per_s_per_device"]] for r in band]  # fmt: skip
        out += [*h.table(header, table), ""]
    if scale := [r for r in rows if r["part"] == "scaling" and "fwd_bwd_ms" in r]:
        header = ["case", "tokens/device", "EP", "implementation", "exchange", "XLA_FLAGS",
                  "fwd+bwd ms", "no-exchange ms", "exchange share"]  # fmt: skip
        table = [[r["case"], r["tokens_per_device"], r["ep"], r.get("implementation", "xla"),
                  r["exchange"], flags(r), r["fwd_bwd_ms"], r.get("no_exchange_fwd_bwd_ms", "-"),
                  r.get("exchange_share", "-")] for r in scale]  # fmt: skip
        out += [*h.table(header, table), ""]
    return "\n".join(out)


# --- the run ---------------------------------------------------------------------------------


def main(argv: list[str]) -> None:
    if argv[:1] == ["report"]:  # python -m bench.multi_gpu report A.json B.json ...
        print(report([json.loads(pathlib.Path(p).read_text()) for p in argv[1:]]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--parts", default="correctness,scaling,bandwidth")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--timed", type=int, default=10)
    ap.add_argument("--eps", default="", help="comma-separated EP degrees (default: all)")
    ap.add_argument(
        "--exchanges", default="", help="comma-separated, 'fused' among them (default: both)"
    )
    ap.add_argument("--implementation", default="xla", help="of the exchanges but fused")
    ap.add_argument("--budget-s", type=float, default=420.0, help="no scaling run starts after")
    ap.add_argument("--smoke", action="store_true", help="CPU: 8 simulated devices, tiny layer")
    args = ap.parse_args(argv)
    start = time.monotonic()
    if args.eps:
        EP_DEGREES[:] = [int(ep) for ep in args.eps.split(",")]
    if args.exchanges:
        EXCHANGES[:] = args.exchanges.split(",")
    IMPLEMENTATION[:] = [args.implementation]
    args.out.mkdir(parents=True, exist_ok=True)
    devices = jax.devices()
    results = {
        **h.environment("multi_gpu", argv),
        "devices": [str(d) for d in devices],
        "device_kind": devices[0].device_kind,
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "rows": [],
    }
    path = args.out / "multi_gpu.json"

    def record(row: dict) -> None:
        row["t_s"] = round(time.monotonic() - start, 1)
        print(json.dumps(row), flush=True)
        results["rows"].append(row)
        path.write_text(json.dumps(results, indent=1))

    wanted = set(filter(None, args.cases.split(",")))
    pick = lambda table: {k: v for k, v in table.items() if not wanted or k in wanted}  # noqa: E731
    parts = args.parts.split(",")
    correct_cases = SMOKE if args.smoke else pick(CORRECTNESS)
    scaling_cases = SMOKE if args.smoke else pick(SCALING)
    if "correctness" in parts:
        for name, (cfg, num_tokens) in correct_cases.items():
            correctness(name, cfg, num_tokens, record, args.timed)
    if "bandwidth" in parts:
        cfg, tokens = next(iter(scaling_cases.values()))
        bandwidth(cfg, tokens, record, args.timed)
    if "scaling" in parts:
        budget_end = start + args.budget_s
        for name, (cfg, tokens) in scaling_cases.items():
            scaling(name, cfg, tokens if not args.smoke else 8, record, args.timed, budget_end)
    results["wall_s"] = round(time.monotonic() - start, 1)
    path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
