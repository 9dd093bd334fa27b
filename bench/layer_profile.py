"""Where the MoE layer's time goes on the GPU: kernel time per stage, from a JAX profile.

    python -m bench.layer_profile --out DIR [--shapes qwen3,mixtral]
        [--implementations pallas,fused] [--products forward,fwd_bwd] [--iters 3]
        [--token-chunks 512,2048] [--no-command-buffers]

bench/README.md describes the stages and tables. The layer's options are "auto" (the token
chunk each of --token-chunks where given); fwd_bwd differentiates sum(y * cotangent) and the
aux loss. After warm-up, `iters` calls run under jax.profiler; each kernel of the trace is
charged to the stage named in its HLO instruction's op_name (whose end it keeps as `op`). The
wall span per call runs from the first kernel's start to the last one's end over all the calls,
divided by their number. Runs on a CPU too (the host's XLA thunks stand in for kernels).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import collections
import dataclasses
import itertools
import json
import pathlib
import re
import sys
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from bench import harness as h
from bench.harness.profile import module_name, op_names, traced_events
from mok_jax import MoEOptions, init_params, make_mesh, moe, presets, scale_down

# exchange_experts: `fused` under a mesh, whose kernels exchange rows while they compute.
STAGES = ("route", "plan", "dispatch", "exchange_experts", "experts", "return", "combine", "aux")
# An implementation name suffixed "_meshN" runs under an N-device expert mesh with N times the
# shape's tokens (the same tokens a device; "fused_mesh1": the in-kernel exchange's kernels,
# copying to the device itself). Kernel times are the first GPU's.
_MESH = re.compile(r"(.+)_mesh(\d+)")
OTHER = "other"
# (preset, tokens T, experts) of bench/moe_layer.py's shapes; E, k, D, F from the preset.
SHAPES = {
    "qwen3": ("qwen3_30b_a3b", 16384, None),
    "mixtral": ("mixtral_8x7b", 8192, None),
    "dsv3": ("deepseek_v3", 4096, 32),
    "tiny": ("qwen3_30b_a3b", 1024, 8),  # scaled down: the CPU test's shape
}
_STAGE = re.compile(r"\b(" + "|".join(STAGES) + r")\b")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel (or, on a CPU, one XLA thunk) of the profiled calls."""

    name: str  # the HLO instruction
    stage: str
    total_ns: float
    count: int
    op: str = ""  # the end of its op_name: which jax operation (or Pallas kernel) it came from


def stage_of_instructions(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the layer stage in its op_name (OTHER where none is)."""
    # The backward's scopes read transpose(jvp(route)): the stage is a word of the name.
    found = {name: _STAGE.search(op_name) for name, op_name in op_names(hlo_text).items()}
    return {name: f.group(1) if f else OTHER for name, f in found.items()}


def op_of_instructions(hlo_text: str, *, chars: int = 160) -> dict[str, str]:
    """HLO instruction name -> the last `chars` characters of its op_name (the jax operations
    it came from: which of a mesh's several Mosaic GPU kernels an mpmd_map is, say)."""
    return {name: op_name[-chars:] for name, op_name in op_names(hlo_text).items()}


def profile_calls(fn: Callable, args: Sequence, *, iters: int, warmup: int = 2) -> dict:
    """Profiles `iters` calls of jitted fn(*args): kernels per stage, per call."""
    compiled = jax.jit(fn).lower(*args).compile()
    hlo_text = compiled.as_text()
    module = module_name(hlo_text)
    stages, ops = stage_of_instructions(hlo_text), op_of_instructions(hlo_text)
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    events, _ = traced_events(lambda: jax.block_until_ready(compiled(*args)), module, iters)
    totals, counts = collections.Counter(), collections.Counter()
    for op, _, duration in events:
        totals[op] += duration
        counts[op] += 1
    kernels = sorted(
        (
            Kernel(
                op, stages.get(op, OTHER), totals[op] / iters, counts[op] // iters, ops.get(op, "")
            )
            for op in totals
        ),
        key=lambda k: -k.total_ns,
    )
    per_stage = collections.defaultdict(lambda: {"kernel_ms": 0.0, "kernels": 0})
    for kernel in kernels:
        per_stage[kernel.stage]["kernel_ms"] += kernel.total_ns / 1e6
        per_stage[kernel.stage]["kernels"] += kernel.count
    span_ns = max(s + d for _, s, d in events) - min(s for _, s, _ in events)
    return {
        "module": module,
        "iters": iters,
        "kernel_ms": sum(k.total_ns for k in kernels) / 1e6,
        "span_ms": span_ns / iters / 1e6,
        "kernels_per_call": sum(k.count for k in kernels),
        "stages": {s: per_stage[s] for s in (*STAGES, OTHER) if s in per_stage},
        "top": [dataclasses.asdict(k) for k in kernels[:15]],
        "kernels": [dataclasses.asdict(k) for k in kernels],
    }


def _layer(name: str, implementation: str, product: str, token_chunk: int | None = None):
    mesh, num_devices = None, 1
    if found := _MESH.fullmatch(implementation):
        implementation, num_devices = found.group(1), int(found.group(2))
        if not 1 <= num_devices <= len(jax.devices()):
            raise ValueError(f"{found.group(0)} needs {num_devices} devices of {jax.devices()}")
        mesh = make_mesh("expert", devices=jax.devices()[:num_devices])
    preset, tokens, experts = SHAPES[name]
    tokens *= num_devices
    cfg = presets[preset]
    if name == "tiny":
        cfg = scale_down(cfg)
    if experts is not None:
        cfg = dataclasses.replace(cfg, num_experts=experts)
    # fused on a 1-device mesh runs the in-kernel exchange's kernels (its copies to the device
    # itself); on more devices it runs them anyway. token_chunk None: "auto".
    options = MoEOptions(
        token_chunk="auto" if token_chunk is None else token_chunk,
        exchange_on_one_device=implementation == "fused" and num_devices == 1 and mesh is not None,
    )
    cfg = dataclasses.replace(cfg, implementation=implementation, options=options)
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (tokens, cfg.d_model), jnp.float32).astype(jnp.bfloat16)
    cotangent = jax.random.normal(keys[1], x.shape, jnp.float32).astype(jnp.bfloat16)
    # bf16 parameters, as bench/moe_layer.py times them (f32 ones add their casts to the
    # experts' stage: ~0.28 ms each of w_gate, w_up and w_down at qwen3).
    params = init_params(keys[2], cfg, dtype=jnp.bfloat16)

    def forward(x, params):
        return moe(x, params, cfg, mesh=mesh)[0]

    def fwd_bwd(x, params):
        def loss(x, params):
            y, aux = moe(x, params, cfg, mesh=mesh)
            return jnp.sum(y.astype(jnp.float32) * cotangent) + aux.aux_loss

        return jax.value_and_grad(loss, argnums=(0, 1))(x, params)

    return (forward if product == "forward" else fwd_bwd), (x, params)


def render(records: Sequence[dict]) -> str:
    # Token chunk "default": options.token_chunk "auto" (2048 on a GPU); in records made before
    # the options moved into MoEOptions, the default of then (8 * row_tile, 512 at these shapes).
    columns = (*STAGES, OTHER)
    header = ["shape", "implementation", "token chunk", "product", "wall span ms/call"]
    header += ["kernel ms/call", "kernels/call", *(f"{s} ms (kernels)" for s in columns)]
    rows = []
    for r in records:
        st = r["stages"]
        cells = [
            f"{st[s]['kernel_ms']:.3f} ({st[s]['kernels']})" if s in st else "-" for s in columns
        ]
        rows.append([r["shape"], r["implementation"], r.get("token_chunk") or "default",
                     r["product"], f"{r['span_ms']:.3f}", f"{r['kernel_ms']:.3f}",
                     r["kernels_per_call"], *cells])  # fmt: skip
    lines = [*h.table(header, rows), ""]
    for r in records:
        chunk = r.get("token_chunk") or "default"
        lines.append(
            f"Top kernels, {r['shape']} {r['implementation']} (token chunk {chunk}) {r['product']}:"
        )
        lines.append("")
        for k in r["top"][:8]:
            op = k.get("op", "")[-60:]
            lines.append(
                f"- {k['stage']}: `{k['name']}` {k['total_ns'] / 1e6:.3f} ms x{k['count']}"
                + (f" (`{op}`)" if op else "")
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--shapes", default="qwen3,mixtral", help=f"of {sorted(SHAPES)}")
    parser.add_argument("--implementations", default="pallas,fused")
    parser.add_argument("--products", default="forward,fwd_bwd")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument(
        "--token-chunks",
        default="",
        help="comma-separated MoEOptions.token_chunk values to profile each case at (default: "
        "'auto', shown as 'default' in the table)",
    )
    parser.add_argument(
        "--no-command-buffers",
        action="store_true",
        help="XLA launches each kernel itself (no CUDA graphs), so each is named and staged",
    )
    args = parser.parse_args(argv)
    if args.no_command_buffers:
        # Read when the backend starts, which is at the first computation below.
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_enable_command_buffer=".strip()
    if args.iters < 1:
        parser.error(f"--iters must be >= 1, got {args.iters}")
    args.out.mkdir(parents=True, exist_ok=True)
    header = h.environment("layer_profile", argv)
    records = []
    chunks = [int(c) for c in args.token_chunks.split(",") if c] or [None]
    cases = itertools.product(
        args.shapes.split(","), args.implementations.split(","), chunks, args.products.split(",")
    )
    for shape, implementation, chunk, product in cases:
        fn, fn_args = _layer(shape, implementation, product, chunk)
        result = profile_calls(fn, fn_args, iters=args.iters)
        record = {**header, "shape": shape, "implementation": implementation}
        record |= {"token_chunk": chunk, "product": product, **result}
        records.append(record)
        brief = ("shape", "implementation", "token_chunk", "product", "span_ms", "stages")
        print(json.dumps({k: record[k] for k in brief}), flush=True)
        text = f"`{header['command']}`, {header['date']}, {h.versions_line(header)}\n\n"
        h.write_files(
            args.out,
            {
                "layer_profile.json": json.dumps(records, indent=1),
                "layer_profile.md": text + render(records),
            },
        )


if __name__ == "__main__":
    main(sys.argv[1:])
