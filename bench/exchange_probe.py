"""The in-kernel exchange on the GPU, from its dispatch kernels to the layer: each probe runs in
a subprocess under --timeout (a wrong semaphore count hangs rather than fails), and writes one
JSON record a probe to --out.

    python -m bench.exchange_probe --out probe.json [--timeout 540] [--only layer]
        [--tiles 64] [--programs 24] [--fusions per_gemm,forward] [--param-dtype bfloat16]

bench/README.md describes the probes `dispatch`, `overlap` and `layer`. `dispatch` takes the
round's tables alone out of its time; `overlap` runs qwen3_30b_a3b's round (4096 tokens, top-8,
128 experts, a window of --window-factor times the rows) at each of --programs and
--copy-stages, and times the copies alone on 16, 48 and all blocks; `layer` runs both sides
with residuals "inputs" and parameters in --param-dtype, and counts the Mosaic GPU kernels in
XLA's optimized HLO. Times: bench.harness's median of samples of back-to-back calls.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time

import numpy as np

from bench import harness as h

PROBES = ("dispatch", "overlap", "layer")


def _case():
    """The GPU test's first case: 4 local experts, 4096 rows, window 3072, tile 64, D 2048."""
    from tests.pallas_kernels.exchange import test_mosaic_gpu as t

    return t, dict(num_local=4, num_rows=4096, window=3072, tile=64)


def _dispatch() -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    t_mod, case = _case()
    d_model = 2048
    devices = jax.devices()
    ep, num_rows = len(devices), case["num_rows"]
    counts_se = t_mod.random_counts(1, ep, case["num_local"], num_rows)
    x = jax.random.normal(jax.random.key(0), (ep * num_rows, d_model), jnp.float32)
    x = x.astype(jnp.bfloat16)
    want, filled, rounds = t_mod.planned_buffers(
        counts_se, np.asarray(x).reshape(ep, num_rows, d_model), case["num_local"],
        case["window"], case["tile"],
    )  # fmt: skip
    mesh = jax.make_mesh((ep,), (t_mod.AXIS,), devices=devices)
    body, slots = t_mod.dispatch_fn(*case.values(), kernel=True)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(t_mod.AXIS), P(), P()),
                               out_specs=(P(t_mod.AXIS),) * 2))  # fmt: skip
    ok = True
    for r in range(rounds):
        args = t_mod.placed(mesh, x, counts_se, r)
        got = np.asarray(fn(*args)[0]).reshape(ep, slots, d_model)
        ok &= bool(np.array_equal(got[filled[:, r]], want[:, r][filled[:, r]]))
    args = t_mod.placed(mesh, x, counts_se, 0)
    best_ms = h.time_fn(fn, *args)["min_ms"]

    # The round's tables alone (the same jit without the copies), to take out of the time.
    def tables_only(x, counts_se, round_index):
        from pallas_kernels.exchange import protocol as xp

        t = xp.traffic(counts_se, case["num_local"])
        me = jax.lax.axis_index(t_mod.AXIS)
        moves = xp.exchange_moves(t, me, round_index, num_rows, case["window"], case["tile"])
        return x[:1].astype(jnp.float32) + sum(jnp.sum(m.src_p) for m in moves)

    tables = jax.jit(jax.shard_map(tables_only, mesh=mesh, in_specs=(P(t_mod.AXIS), P(), P()),
                                   out_specs=P(t_mod.AXIS)))  # fmt: skip
    table_ms = h.time_fn(tables, *args)["min_ms"]
    rows = int(np.sum(filled[:, 0]))
    copies = (best_ms - table_ms) / 1e3
    # Dispatch and return: each round-0 row moves twice (to a peer when EP > 1). Per device:
    # the rows' bytes over the devices.
    return {"ok": ok, "devices": ep, "rounds": int(rounds), "round0_rows_all_devices": rows,
            "best_ms": best_ms, "tables_best_ms": table_ms, "copies_ms": 1e3 * copies,
            "round0_GBps_per_device": 2 * rows * d_model * 2 / ep / copies / 1e9}  # fmt: skip


def _median_ms(fn, *args, iters: int = 10) -> float:
    return h.time_fn(fn, *args, timed=iters)["median_ms"]


def _overlap(programs: tuple[int, ...], window_factor: float, stages: tuple[int, ...]) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from pallas_kernels.exchange import mosaic_gpu
    from pallas_kernels.exchange import protocol as xp
    from pallas_kernels.grouped_matmul import mosaic_gpu as grouped
    from pallas_kernels.mesh import like

    t_mod, _ = _case()
    axis = t_mod.AXIS
    num_local, num_rows, tile, d_model, d_ff = 128, 32768, 64, 2048, 768
    # The layer's window at EP > 1 is buffer_factor (2) times the balanced load: past the
    # groups lies about half of the buffer, which the dispatch zeroes.
    window = int(window_factor * num_rows)
    slots = xp.num_tiles(window, tile, num_local) * tile
    mesh = jax.make_mesh((1,), (axis,), devices=jax.devices()[:1])
    counts_se = t_mod.random_counts(3, 1, num_local, num_rows)
    x, side, w_gate, w_up = t_mod.dispatch_swiglu_inputs(mesh, num_local, num_rows, d_model, d_ff)

    # The round's tables once, outside the timed functions (one device: me = 0).
    @jax.jit
    def tables(counts_se):
        t = xp.traffic(counts_se, num_local)
        moves = xp.exchange_moves(t, jnp.int32(0), jnp.int32(0), num_rows, window, tile)
        return moves, xp.buffer_layout(t, jnp.int32(0), jnp.int32(0), window, tile)[0]

    (dispatch, back), group_sizes = tables(jnp.asarray(counts_se))
    zero = jnp.zeros((), jnp.int32)

    def sharded(body, num_in):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axis),) * num_in + (P(), P()),
                                     out_specs=P(axis)))  # fmt: skip

    def send(x, moves, round_index, num_blocks=None, copy_stages=1):
        return mosaic_gpu.send_rows(x, moves, round_index, axis_name=axis, out_rows=slots,
                                    num_blocks=num_blocks, copy_stages=copy_stages)  # fmt: skip

    def key(name: str, s: int) -> str:  # copy stages other than 1 named in the record
        return name if s == 1 else f"{name}_stages{s}"

    def separate(x, side, w_gate, w_up, moves, group_sizes):
        buf = send(x, moves, zero)
        h = grouped.gmm_swiglu(buf, w_gate, w_up, group_sizes)
        return buf, send(side, moves, zero), like(h, buf)

    def overlapped(c, s):
        def run(x, side, w_gate, w_up, moves, group_sizes):
            return mosaic_gpu.dispatch_swiglu(x, side, moves, zero, w_gate, w_up, group_sizes,
                                              out_rows=slots, tile=tile, axis_name=axis,
                                              exchange_programs=c, copy_stages=s)  # fmt: skip

        return run

    args = (x, side, w_gate, w_up, dispatch, group_sizes)
    want = sharded(lambda *a: separate(*a), 4)(*args)
    groups_end = int(jnp.sum(group_sizes))
    record = {"ok": True, "window": window, "slots": slots, "rows": num_rows,
              "zeroed_rows": slots - num_rows, "groups_end": groups_end}  # fmt: skip
    # The parts of the separate version, alone: the copies of x (and the zero ranges) with
    # send_rows on 16, 48 and all blocks (one copier a block; dispatch_swiglu's copy programs
    # have three), and gate/up on their buffer.
    for blocks, s in itertools.product((16, 48, None), stages):
        fn = sharded(lambda x, *a, b=blocks, s=s: send(x, a[3], zero, b, s), 4)
        got = fn(*args)
        record["ok"] &= bool(jnp.all(got[:groups_end] == want[0][:groups_end]))
        record[key(f"send_x_blocks{blocks or 'all'}_ms", s)] = _median_ms(fn, *args)
    gemm = jax.jit(lambda buf, wg, wu, g: grouped.gmm_swiglu(buf, wg, wu, g))
    # Off the mesh: plain arrays (an array placed on the mesh keeps its sharding's type).
    one = lambda a: jnp.asarray(np.asarray(a))  # noqa: E731
    gemm_args = (one(want[0]), one(w_gate), one(w_up), one(group_sizes))
    record["gate_up_ms"] = _median_ms(gemm, *gemm_args, iters=20)
    record["programs0_ms"] = _median_ms(sharded(lambda *a: separate(*a), 4), *args, iters=20)
    for c, s in itertools.product(programs, stages):
        fn = sharded(overlapped(c, s), 4)
        got = fn(*args)
        record["ok"] &= all(bool(jnp.all(a == b)) for a, b in zip(got, want, strict=True))
        record[key(f"programs{c}_ms", s)] = _median_ms(fn, *args, iters=20)
        print(json.dumps({"partial": True, **record}), flush=True)

    # The way back: the down projection (the weights in its epilogue) and the return of the
    # round's results (f32), by gmm then send_rows (0), or overlapped (down_return).
    w_down = jax.random.normal(jax.random.key(5), (num_local, d_ff, d_model)) / d_ff**0.5
    w_down = jax.device_put(w_down.astype(jnp.bfloat16), jax.NamedSharding(mesh, P(axis)))

    def back_separate(h, side_s, w_down, back, group_sizes):
        y = grouped.gmm(h, w_down, group_sizes, row_scale_m=side_s[:, 0], out_dtype=jnp.float32)
        y = like(y, h)
        return mosaic_gpu.send_rows(y, back, zero, axis_name=axis, out_rows=num_rows)

    def back_overlapped(c, s):
        def run(h, side_s, w_down, back, group_sizes):
            return mosaic_gpu.down_return(h, side_s[:, 0], w_down, group_sizes, back, zero,
                                          out_rows=num_rows, axis_name=axis,
                                          exchange_programs=c, copy_stages=s)[1]  # fmt: skip

        return run

    back_args = (want[2], want[1], w_down, back, group_sizes)
    want_back = sharded(back_separate, 3)(*back_args)
    down = jax.jit(lambda h, w, g, s: grouped.gmm(h, w, g, row_scale_m=s, out_dtype=jnp.float32))
    down_args = (one(want[2]), one(w_down), one(group_sizes), one(want[1])[:, 0])
    record["down_ms"] = _median_ms(down, *down_args, iters=20)
    record["return_programs0_ms"] = _median_ms(sharded(back_separate, 3), *back_args, iters=20)
    for c, s in itertools.product(programs, stages):
        fn = sharded(back_overlapped(c, s), 3)
        record["ok"] &= bool(jnp.all(fn(*back_args) == want_back))
        record[key(f"return_programs{c}_ms", s)] = _median_ms(fn, *back_args, iters=20)
        print(json.dumps({"partial": True, **record}), flush=True)

    # The backward's way back: the input gradient's GEMM (bf16) and the return of d_x, by gmm
    # then send_rows (0), or overlapped (dgrad_return).
    d_gate_up = t_mod.dgrad_return_inputs(mesh, num_local, slots, d_model, d_ff, seed=7)[0]

    def dgrad_separate(d_gate_up, w_gate, w_up, back, group_sizes):
        d_buffer = grouped.gmm(d_gate_up, (w_gate, w_up), group_sizes, transpose_rhs=True)
        d_buffer = like(d_buffer, d_gate_up)
        return mosaic_gpu.send_rows(d_buffer, back, zero, axis_name=axis, out_rows=num_rows)

    def dgrad_overlapped(c, s):
        def run(d_gate_up, w_gate, w_up, back, group_sizes):
            return mosaic_gpu.dgrad_return(d_gate_up, w_gate, w_up, group_sizes, back, zero,
                                           out_rows=num_rows, axis_name=axis,
                                           exchange_programs=c, copy_stages=s)[1]  # fmt: skip

        return run

    dgrad_args = (d_gate_up, w_gate, w_up, back, group_sizes)
    want_dgrad = sharded(dgrad_separate, 3)(*dgrad_args)
    dgrad = jax.jit(lambda a, wg, wu, g: grouped.gmm(a, (wg, wu), g, transpose_rhs=True))
    record["dgrad_ms"] = _median_ms(dgrad, one(d_gate_up), one(w_gate), one(w_up),
                                    one(group_sizes), iters=20)  # fmt: skip
    record["dgrad_return_programs0_ms"] = _median_ms(sharded(dgrad_separate, 3), *dgrad_args,
                                                     iters=20)  # fmt: skip
    for c, s in itertools.product(programs, stages):
        fn = sharded(dgrad_overlapped(c, s), 3)
        record["ok"] &= bool(jnp.all(fn(*dgrad_args) == want_dgrad))
        record[key(f"dgrad_return_programs{c}_ms", s)] = _median_ms(fn, *dgrad_args, iters=20)
        print(json.dumps({"partial": True, **record}), flush=True)
    return record


def _layer(
    tiles: tuple[int, ...], programs: tuple[int, ...], fusions: tuple[str, ...], param_dtype: str
) -> dict:
    import dataclasses

    import jax
    import jax.numpy as jnp

    from mok_jax import MoEOptions, make_mesh, moe, presets
    from tests.mok_jax.cases import random_inputs

    # Residuals "inputs" without the mesh too, so that both backward passes recompute gate and up.
    base = dataclasses.replace(
        presets["qwen3_30b_a3b"], implementation="fused", options=MoEOptions(residuals="inputs")
    )
    x, params, cotangent = random_inputs(base, 4096, 0)
    params = jax.tree.map(lambda a: a.astype(param_dtype), params)
    mesh = make_mesh("expert", devices=jax.devices()[:1])

    def timed(fn, *args):
        return jax.block_until_ready(fn(*args)), _median_ms(fn, *args, iters=5)

    record, outs = {"ok": True}, {}
    runs = [("no_mesh", None, base)]
    runs += [
        (f"mesh_1_tile{t}_programs{c}" + ("" if f == "per_gemm" else f"_{f}"), mesh,
         dataclasses.replace(base, options=dataclasses.replace(
             base.options, exchange_tile=t, exchange_programs=c, exchange_fusion=f,
             exchange_on_one_device=True)))
        for t in tiles
        for c in programs
        for f in fusions
        if c or f == "per_gemm"  # with 0 copy programs every copy is a kernel of its own
    ]  # fmt: skip
    for name, m, cfg in runs:
        start = time.perf_counter()  # compiling both, checking, timing: the seconds a run takes
        fwd = jax.jit(lambda x, p, m=m, cfg=cfg: moe(x, p, cfg, mesh=m))
        fwd = fwd.lower(x, params).compile()
        record[f"{name}_fwd_kernels"] = fwd.as_text().count('custom_call_target="mosaic_gpu')

        def loss(x, p, m=m, cfg=cfg):
            y = moe(x, p, cfg, mesh=m)[0]
            return jnp.vdot(y.astype(jnp.float32), cotangent), y

        # y among the outputs: the loss is linear in y, so jax.grad alone needs no forward
        # expert kernel and XLA would drop them, timing the routing and the backward only.
        # Compiled once: the object timed is the one whose kernels are counted.
        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        grad = grad.lower(x, params).compile()
        (y, aux), record[f"{name}_fwd_ms"] = timed(fwd, x, params)
        ((_, y_bwd), (dx, _)), record[f"{name}_fwd_bwd_ms"] = timed(grad, x, params)
        record["ok"] &= bool(jnp.all(y_bwd == y))
        record[f"{name}_rounds"] = int(aux.rounds)
        # The Mosaic GPU kernels XLA kept (dead ones, e.g. the backward's re-run forward's,
        # dropped): counted in the optimized HLO of forward+backward.
        hlo = grad.as_text()
        record[f"{name}_fwd_bwd_kernels"] = hlo.count('custom_call_target="mosaic_gpu')
        if outs:  # y and dx the bits of the run without a mesh
            same = bool(jnp.all(y == outs["y"])) and bool(jnp.all(dx == outs["dx"]))
            record[f"{name}_bitwise"] = same
            record["ok"] &= same
        else:
            outs = {"y": y, "dx": dx}
        record[f"{name}_seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps({"partial": True, **record}), flush=True)
    return record


def _run_one(
    name: str,
    tiles: tuple[int, ...],
    programs: tuple[int, ...],
    window_factor: float,
    stages: tuple[int, ...],
    fusions: tuple[str, ...],
    param_dtype: str,
) -> None:
    record = {"probe": name}
    start = time.perf_counter()
    if name == "layer":
        record.update(_layer(tiles, programs, fusions, param_dtype), param_dtype=param_dtype)
    elif name == "overlap":
        record.update(_overlap(tuple(c for c in programs if c), window_factor, stages))
    else:
        record.update(globals()[f"_{name}"]())
    record["seconds"] = time.perf_counter() - start
    print(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds a probe at most")
    parser.add_argument("--only", choices=PROBES)
    parser.add_argument("--tiles", default="64", help="layer: exchange tiles, comma-separated")
    parser.add_argument(
        "--programs", default="16", help="overlap, layer: copy programs, comma-separated"
    )
    parser.add_argument(
        "--window-factor", type=float, default=2.0,
        help="overlap: the window as a multiple of the rows (the layer's buffer_factor at EP > 1)",
    )  # fmt: skip
    parser.add_argument(
        "--copy-stages", default="1",
        help="overlap: the copiers' stages (1: copy_piece; 2, 4: copy_piece_pipelined)",
    )  # fmt: skip
    parser.add_argument(
        "--fusions", default="per_gemm",
        help="layer: options.exchange_fusion values, comma-separated (per_gemm, forward)",
    )  # fmt: skip
    parser.add_argument(
        "--param-dtype", default="float32", choices=("float32", "bfloat16"),
        help="layer: the parameters' dtype (the kernels take bf16 either way)",
    )  # fmt: skip
    parser.add_argument("--child", choices=PROBES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.window_factor < 1:
        # The overlap probe checks and counts one round: a smaller window takes several.
        parser.error(f"--window-factor must be >= 1, got {args.window_factor}")
    if args.child:
        ints = lambda text: tuple(int(v) for v in text.split(","))  # noqa: E731
        _run_one(args.child, ints(args.tiles), ints(args.programs), args.window_factor,
                 ints(args.copy_stages), tuple(args.fusions.split(",")),
                 args.param_dtype)  # fmt: skip
        return
    records = []
    for name in [args.only] if args.only else PROBES:
        cmd = [sys.executable, "-m", "bench.exchange_probe", "--out", "-", "--child", name,
               "--tiles", args.tiles, "--programs", args.programs,
               "--window-factor", str(args.window_factor),
               "--copy-stages", args.copy_stages, "--fusions", args.fusions,
               "--param-dtype", args.param_dtype]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            record = json.loads(lines[-1]) if lines else {"probe": name, "ok": False}
            record["returncode"] = done.returncode
            record["stderr_tail"] = done.stderr[-3000:]
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            record = {"probe": name, "ok": False, "hung": True, "timeout_s": args.timeout}
            record["last_partial"] = json.loads(lines[-1]) if lines else None
        print(json.dumps({k: v for k, v in record.items() if k != "stderr_tail"}), flush=True)
        records.append(record)
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
