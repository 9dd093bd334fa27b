"""Activation memory of the MoE layer per token: what each implementation saves for
its backward pass, measured on the CPU without allocating it.

    python -m bench.activation_memory --out DIR/activation_memory
        [--shapes qwen3_30b_a3b,mixtral_8x7b,dsv3_slice]
        [--implementations xla,pallas,fused,fused_gate_up]
    python -m bench.activation_memory --smoke     # tiny layers, for a quick look

bench/README.md describes the method and what it does not count. The residuals come from jax's
`saved_residuals` on `jax.ShapeDtypeStruct`s (the pallas and fused kernels are traced, never
run); the trace at 2T marks each residual as growing with the tokens or fixed (casts of the
weights, loop-invariant constants). Shapes: bench/moe_layer.py's layers (the residuals' shapes
do not depend on the routing: the layer is dropless), bf16 inputs and parameters. Writes OUT.md
and OUT.json with --out, and prints the markdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import re
import sys
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bench.moe_layer import SHAPES as LAYER_SHAPES
from bench.moe_layer import SMOKE_SHAPES as LAYER_SMOKE_SHAPES
from bench.moe_layer import LayerShape
from mok_jax import MoEConfig, init_params, moe

ROOT = pathlib.Path(__file__).resolve().parents[1]
# fused: implementation "fused" with options.residuals "inputs" (the backward recomputes gate and
# up; set, not "auto", whose choice depends on the target's memory); fused_gate_up: the same with
# residuals "gate_up" (h, gate and up kept).
IMPLEMENTATIONS = ("xla", "pallas", "fused", "fused_gate_up")
BASELINE = "xla"
# The layer benchmark's three layers (the Zipf-routed qwen3 has qwen3's residual shapes).
SHAPES: tuple[LayerShape, ...] = tuple(s for s in LAYER_SHAPES if s.routing == "router")
SMOKE_SHAPES: tuple[LayerShape, ...] = tuple(s for s in LAYER_SMOKE_SHAPES if s.routing == "router")
ARGUMENT = "argument"  # a residual that is an input (x or a parameter): listed, not counted
ACTIVATION = "activation"
# A residual's source, as jax summarizes it: "<what> from <file>:<line>:<col> (<function>)".
_SOURCE = re.compile(r"^(?P<what>.*?) from (?P<file>[^ ]+?):(?P<line>\d+)(:\d+)? \((?P<fn>.+)\)$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Residual:
    """One array the VJP saves: its type, size and where it comes from.

    Attributes:
      shape, dtype: the array's.
      nbytes: its size in bytes.
      source: jax's description ("output of scan from mok_jax/tiles.py:91 (token_tiled)",
        "from the argument p.w_gate"), paths relative to the repository.
      kind: ARGUMENT (an input, not counted) or ACTIVATION (counted).
      stage: the `jax.named_scope` the producing equation ran under ("route", "combine"), or
        "" (none: e.g. a loop-invariant value hoisted out of a stage's loop).
      grows: whether it grows with the tokens (None: not known, the 2T trace did not align).
    """

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    source: str
    kind: str
    stage: str = ""
    grows: bool | None = None

    @property
    def where(self) -> str:
        """The stage, producing function and line ("combine: tiles.py:91 token_tiled"), or the
        source."""
        m = _SOURCE.match(self.source)
        if m is None:
            return self.source
        where = f"{pathlib.Path(m['file']).name}:{m['line']} {m['fn']}"
        return f"{self.stage}: {where}" if self.stage else where

    def type_str(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


def _relative(source: str) -> str:
    return source.replace(f"{ROOT}/", "")


def _stage(eqn) -> str:
    """The `jax.named_scope` stage an equation ran under ("route", "combine"), jvp( ) removed."""
    stack = str(eqn.source_info.name_stack)
    return re.sub(r"(jvp|transpose)\(([^()]*)\)", r"\2", stack)


def saved_residuals(fn: Callable, *args, arg_names: Sequence[str] | None = None) -> list[Residual]:
    """The residuals of `jax.vjp(fn, *args)`, traced on abstract values (args may be
    `jax.ShapeDtypeStruct` pytrees): inputs marked ARGUMENT (named from `arg_names`, default
    arg0, arg1, ..., and the pytree path: "params.w_gate"), the rest ACTIVATION.

    The listing of jax's `saved_residuals` (jax._src.ad_checkpoint, what
    `jax.ad_checkpoint.print_saved_residuals` prints), with the producing equation's named
    scope added and a residual saved twice (the same variable) listed once.
    """
    from jax._src import source_info_util  # summarize(): "file:line:col (function)"

    paths_leaves, tree = jax.tree_util.tree_flatten_with_path(args)
    leaves = [leaf for _, leaf in paths_leaves]
    arg_names = [f"arg{i}" for i in range(len(args))] if arg_names is None else arg_names
    if len(arg_names) != len(args):
        raise ValueError(f"{len(arg_names)=} names for {len(args)} arguments")
    names = [
        ".".join(
            (arg_names[path[0].idx], jax.tree_util.keystr(path[1:], simple=True, separator="."))
        ).rstrip(".")
        for path, _ in paths_leaves
    ]

    def vjp_of_leaves(*leaves):
        return jax.vjp(fn, *jax.tree.unflatten(tree, leaves))

    closed, out_shape = jax.make_jaxpr(vjp_of_leaves, return_shape=True)(*leaves)
    jaxpr = closed.jaxpr
    num_residuals = len(jax.tree.leaves(out_shape[1]))
    producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    argument = dict(zip(jaxpr.invars, names, strict=True))
    out, seen = [], set()
    for v in jaxpr.outvars[len(jaxpr.outvars) - num_residuals :]:
        if isinstance(v, jax.extend.core.Literal) or v in seen:
            continue
        seen.add(v)
        if v in argument:
            source, kind, stage = f"from the argument {argument[v]}", ARGUMENT, ""
        elif v in producer:
            eqn = producer[v]
            where = _relative(source_info_util.summarize(eqn.source_info))
            stage = _stage(eqn)
            source = f"output of {eqn.primitive.name} from {where}"
            kind = ACTIVATION
        else:
            source, kind, stage = "from a constant", ACTIVATION, ""
        dtype = np.dtype(v.aval.dtype)
        out.append(
            Residual(
                shape=tuple(v.aval.shape),
                dtype=dtype.name,
                nbytes=int(np.prod(v.aval.shape, dtype=np.int64)) * dtype.itemsize,
                source=source,
                kind=kind,
                stage=stage,
            )
        )
    return out


def layer_residuals(cfg: MoEConfig, tokens: int) -> list[Residual]:
    """The residuals of `moe(x, params, cfg)[0]`'s VJP for x bf16 [tokens, D] and bf16
    parameters, abstractly (nothing is allocated or run)."""
    if tokens < 1:
        raise ValueError(f"{tokens=} must be >= 1")
    params = jax.eval_shape(lambda: init_params(jax.random.key(0), cfg, dtype=jnp.bfloat16))
    x = jax.ShapeDtypeStruct((tokens, cfg.d_model), jnp.bfloat16)
    return saved_residuals(
        lambda x, params: moe(x, params, cfg)[0], x, params, arg_names=("x", "params")
    )


def counted_bytes(residuals: Sequence[Residual]) -> int:
    """Bytes of the residuals that are not inputs."""
    return sum(r.nbytes for r in residuals if r.kind == ACTIVATION)


def _mark_growth(at_t: list[Residual], at_2t: list[Residual]) -> list[Residual]:
    """at_t, each residual marked by whether it grew at 2T (when the two lists align)."""
    aligned = len(at_t) == len(at_2t) and all(
        a.source == b.source and a.dtype == b.dtype for a, b in zip(at_t, at_2t, strict=True)
    )
    if not aligned:
        return at_t
    return [
        dataclasses.replace(a, grows=b.nbytes > a.nbytes) for a, b in zip(at_t, at_2t, strict=True)
    ]


def measure(cfg: MoEConfig, tokens: int) -> dict:
    """One (layer, implementation): its residuals at T and the counts derived from them.

    Returns a dict: tokens, residuals (list of dicts), counted_bytes, bytes_per_token
    (counted / T), slope_bytes_per_token ((counted at 2T - counted at T) / T), fixed_bytes
    (counted at T - slope * T), argument_bytes (the inputs the VJP keeps, not counted).
    """
    at_t = layer_residuals(cfg, tokens)
    at_2t = layer_residuals(cfg, 2 * tokens)
    residuals = _mark_growth(at_t, at_2t)
    total, total_2t = counted_bytes(at_t), counted_bytes(at_2t)
    slope = (total_2t - total) / tokens
    return {
        "tokens": tokens,
        "counted_bytes": total,
        "bytes_per_token": total / tokens,
        "slope_bytes_per_token": slope,
        "fixed_bytes": total - slope * tokens,
        "argument_bytes": sum(r.nbytes for r in residuals if r.kind == ARGUMENT),
        "residuals": [
            {**dataclasses.asdict(r), "type": r.type_str(), "where": r.where} for r in residuals
        ],
    }


def shape_config(shape: LayerShape, implementation: str) -> MoEConfig:
    if implementation in ("fused", "fused_gate_up"):
        cfg = shape.config("fused")
        residuals = "gate_up" if implementation == "fused_gate_up" else "inputs"
        return dataclasses.replace(
            cfg, options=dataclasses.replace(cfg.options, residuals=residuals)
        )
    return shape.config(implementation)


def run(shapes: Sequence[LayerShape], implementations: Sequence[str]) -> dict:
    """Measures every (shape, implementation); the result is what --out writes as JSON."""
    rows = []
    for shape in shapes:
        for implementation in implementations:
            cfg = shape_config(shape, implementation)
            result = measure(cfg, shape.tokens)
            rows.append(
                {
                    "shape": shape.name,
                    "implementation": implementation,
                    "config": {
                        "T": shape.tokens,
                        "D": cfg.d_model,
                        "F": cfg.d_ff,
                        "E": cfg.num_experts,
                        "K": cfg.top_k,
                        "shared_experts": cfg.num_shared_experts,
                        "row_tile": cfg.row_tile,
                        "dtype": cfg.dtype.name,
                    },
                    **result,
                }
            )
            print(
                f"{shape.name:16s} {implementation:7s} {result['bytes_per_token']:12,.0f} B/token",
                file=sys.stderr,
            )
    return {
        "what": "bytes the MoE layer's VJP saves for the backward pass (residuals), per token",
        "method": "jax saved_residuals of jax.vjp(lambda x, p: moe(x, p, cfg)[0], x, params) "
        "on ShapeDtypeStructs (bf16 x and params); inputs listed, not counted; also traced "
        "at 2T for the per-token slope and the fixed part",
        "jax": jax.__version__,
        "rows": rows,
    }


def _kib(nbytes: float) -> str:
    return f"{nbytes / 1024:,.1f} KiB"


def _groups(row: dict) -> list[tuple[str, str, int, int]]:
    """(where, types, bytes, count) of the counted residuals grouped by producing line, largest
    first."""
    groups: dict[str, list[dict]] = {}
    for r in row["residuals"]:
        if r["kind"] == ACTIVATION:
            groups.setdefault(r["where"], []).append(r)
    out = [
        (where, ", ".join(sorted({r["type"] for r in rs})), sum(r["nbytes"] for r in rs), len(rs))
        for where, rs in groups.items()
    ]
    return sorted(out, key=lambda g: -g[2])


def render_markdown(results: dict, *, command: str, date: str, min_share: float = 0.01) -> str:
    rows = results["rows"]
    base = {r["shape"]: r["bytes_per_token"] for r in rows if r["implementation"] == BASELINE}
    lines = [
        "# MoE layer activation memory per token",
        "",
        f"Date: {date}. Command: `{command}`. jax {results['jax']}, measured on the CPU by "
        "abstract evaluation (nothing allocated, no kernel run).",
        "",
        "What is counted: the residuals of `jax.vjp(lambda x, p: mok_jax.moe(x, p, cfg)[0], x, "
        "p)` (jax's `saved_residuals` on ShapeDtypeStructs, bf16 x and parameters), minus the "
        "inputs x and the parameters. Per token = counted bytes / T; slope = the growth per "
        "token from T to 2T; fixed = what does not grow with T. Not counted: the residuals of "
        "the nested VJPs that recompute the experts stage during the backward (they live only "
        "while the layer's backward runs), the aux losses' residuals, and what XLA changes "
        "after jax (fusion, copies).",
        "",
        "| shape (T, D, F, E, K) | implementation | per token | vs xla | slope per token | fixed "
        "| residuals |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        c = r["config"]
        ratio = r["bytes_per_token"] / base[r["shape"]] if r["shape"] in base else float("nan")
        counted = sum(1 for x in r["residuals"] if x["kind"] == ACTIVATION)
        lines.append(
            f"| {r['shape']} ({c['T']}, {c['D']}, {c['F']}, {c['E']}, {c['K']}) "
            f"| {r['implementation']} | {_kib(r['bytes_per_token'])} | {ratio:.2f}x "
            f"| {_kib(r['slope_bytes_per_token'])} | {r['fixed_bytes'] / 2**20:,.1f} MiB "
            f"| {counted} |"
        )
    lines += ["", "## What is saved", ""]
    lines.append(
        f"Per (shape, implementation): the counted residuals grouped by the line that produced "
        f"them, largest first, in bytes per token (groups under {min_share:.0%} of the total "
        "summed as 'other'); 'grows' says whether the group grows with T. The inputs the VJP "
        "keeps are listed last. Every residual is in the JSON."
    )
    for r in rows:
        total = r["counted_bytes"]
        lines += ["", f"### {r['shape']}, {r['implementation']}: {_kib(r['bytes_per_token'])}", ""]
        other_bytes, other_count = 0, 0
        for where, types, nbytes, count in _groups(r):
            if nbytes < min_share * total:
                other_bytes, other_count = other_bytes + nbytes, other_count + count
                continue
            grows = {x["grows"] for x in r["residuals"] if x["where"] == where}
            grows_s = "grows" if grows == {True} else "fixed" if grows == {False} else "mixed"
            lines.append(
                f"- {_kib(nbytes / r['tokens'])} ({nbytes / total:.0%}, {grows_s}): {types}"
                f"{f' x{count}' if count > 1 else ''} from `{where}`"
            )
        if other_count:
            lines.append(f"- {_kib(other_bytes / r['tokens'])}: other ({other_count} residuals)")
        inputs = [x for x in r["residuals"] if x["kind"] == ARGUMENT]
        if inputs:
            named = ", ".join(f"{x['source'].removeprefix('from the argument ')}" for x in inputs)
            lines.append(f"- not counted (inputs): {named}")
    return "\n".join(lines) + "\n"


def _shapes(names: str | None, smoke: bool) -> tuple[LayerShape, ...]:
    table = SMOKE_SHAPES if smoke else SHAPES
    if names is None:
        return table
    by_name = {s.name: s for s in table}
    picked = []
    for name in names.split(","):
        if name not in by_name:
            raise ValueError(f"unknown shape {name!r}; choose from {sorted(by_name)}")
        picked.append(by_name[name])
    return tuple(picked)


def _implementations(names: str) -> tuple[str, ...]:
    picked = tuple(names.split(","))
    for name in picked:
        if name not in IMPLEMENTATIONS:
            raise ValueError(f"unknown implementation {name!r}; choose from {IMPLEMENTATIONS}")
    return picked


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", help="comma-separated shape names (default: all)")
    parser.add_argument("--implementations", default=",".join(IMPLEMENTATIONS))
    parser.add_argument("--smoke", action="store_true", help="tiny layers (scale_down, T 64)")
    parser.add_argument("--out", type=pathlib.Path, help="writes OUT.md and OUT.json")
    args = parser.parse_args(argv)
    shapes = _shapes(args.shapes, args.smoke)
    results = run(shapes, _implementations(args.implementations))
    command = "python -m bench.activation_memory " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    date = datetime.date.today().isoformat()
    results["command"], results["date"] = command.strip(), date
    text = render_markdown(results, command=command.strip(), date=date)
    print(text)
    if args.out is not None:
        out = args.out.with_suffix("") if args.out.suffix in (".md", ".json") else args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_name(out.name + ".json").write_text(json.dumps(results, indent=1) + "\n")
        out.with_name(out.name + ".md").write_text(text)
    return results


if __name__ == "__main__":
    main()
