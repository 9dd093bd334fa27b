"""The MoE layer on one GPU: our `fused` layer against our `xla` and `pallas` layers, MaxText's
dropless recipe on tokamax's mosaic ragged_dot, and PyTorch's torch._grouped_mm, in one process,
every candidate checked before it is timed.

    python -m bench.moe_layer --out DIR [--shapes qwen3_30b_a3b,...] [--candidates fused,...]
        [--products forward,fwd_bwd] [--fused-options residuals=gate_up,...] [--budget-s S]
    python -m bench.moe_layer --smoke --out DIR     # CPU: tiny layers, interpret mode

bench/README.md describes the shapes, candidates, check and tables. Inputs: x and the cotangent
~ N(0, 1) in bf16, `mok_jax.init_params` weights in bf16, torch reading the same buffers through
DLPack. fwd_bwd is jax.value_and_grad of sum(y * cotangent) in f32 with respect to x and every
weight (torch: autograd.grad), returning y and the gradients; a token's y and dx depend on that
token alone, so the reference runs on the first --check-tokens tokens. The anchor is the first
candidate in run order whose reference check passed. backward = fwd_bwd - forward medians;
TFLOP/s counts the three expert GEMMs (2*T*k*D*F*3 forward, 3x for forward+backward). Writes
DIR/moe_layer.{json,md}, rewritten after every candidate.
"""

from __future__ import annotations

import os

# torch shares the GPU with JAX in this process: JAX must not take 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.80")
# torch.use_deterministic_algorithms(True) refuses cuBLAS (the router's f32 matmul) without it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse
import dataclasses
import functools
import gc
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness as h
from mok_jax import MoEConfig, MoEOptions, MoEParams, init_params, moe, presets, resolve
from mok_jax.config import scale_down
from mok_jax.layer import _route
from mok_jax.reference import moe_reference
from mok_jax.routing import router_logits, router_scores, select_experts
from mok_jax.tolerances import tolerance

NAME = "moe_layer"
SEED = 0
ZIPF_EXPONENT = 1.2
PRODUCTS = ("forward", "fwd_bwd")
# Run order: the first whose reference check passes is the anchor; `fused` is the pairing base.
CANDIDATES = ("fused", "pallas", "tokamax", "torch", "torch_det", "xla")
SMOKE_CANDIDATES = ("fused", "tokamax", "torch", "torch_det", "xla")
DISPLAY_ORDER = ("xla", "tokamax", "torch", "torch_det", "pallas", "fused")
# mok_jax.tolerances' bf16 entry, for every candidate (the baselines' bf16 gate/up and backward
# intermediates stayed within it on the CPU smoke layers: at most 0.0062 max|ref| of 0.0156).
TOLERANCE = tolerance(jnp.bfloat16)
TITLES = {
    "xla": "1. mok_jax xla",
    "tokamax": "2. MaxText recipe + tokamax mosaic",
    "torch": "3. torch._grouped_mm",
    "torch_det": "3. torch._grouped_mm, deterministic",
    "pallas": "4. mok_jax pallas",
    "fused": "5. mok_jax fused",
}
COMPUTES = {
    "xla": "mok_jax.moe(x, params, cfg), implementation='xla' (fixed-shape tile scan)",
    "pallas": "mok_jax.moe, implementation='pallas' (route, plan, gather, Mosaic GPU gmm_swiglu "
    "and gmm, fixed-order combine)",
    "fused": "mok_jax.moe, implementation='fused' (the gate/up kernel on the expert-sorted "
    "rows, copied or read from x by the kernel (options.rows), routing weights in the down "
    "kernel's epilogue, one-pass weighted combine; backward: ops.swiglu_mlp's kernels, gate "
    "and up recomputed or kept (options.residuals))",
    "tokamax": "mok_jax's route stage (same experts and weights), then MaxText's dropless "
    "recipe: stable argsort by expert, jnp.take of the rows, tokamax.ragged_dot (mosaic) for "
    "gate, up, down with silu(gate)*up in bf16, jnp.take back by the inverse order, "
    "einsum('tkd,tk->td') in f32; shared expert (dsv3) as a dense SwiGLU",
    "torch": "the routing in torch (f32 logits, softmax/sigmoid, bias, group limit, topk, "
    "normalize, scale), argsort(stable) + index_select, torch._grouped_mm for gate, up, down "
    "with silu(gate)*up in bf16, index_select back, weighted sum over the k slots in f32; "
    "shared expert (dsv3) as a dense SwiGLU; forward under no_grad, fwd_bwd through "
    "autograd.grad",
}
COMPUTES["torch_det"] = COMPUTES["torch"] + ", under torch.use_deterministic_algorithms(True)"
# The fused fwd_bwd speedup a shape's target asks for: over tokamax; over the faster torch mode.
TARGETS = {"qwen3_30b_a3b": (2.37, 1.2), "mixtral_8x7b": (2.37, 1.0), "deepseek_v3": (2.37, 1.2)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerShape:
    """One MoE layer on one GPU (all experts local): a mok_jax preset at T tokens."""

    name: str
    preset: str
    tokens: int
    num_experts: int | None = None  # overrides the preset's (the deepseek_v3 slice)
    routing: str = "router"  # "router" (the router on random data) or "zipf" (biased)
    smoke: bool = False  # scaled down (D = F = 64, E <= 32: mok_jax.scale_down)
    # DESIGN.md's first measurement, ms (forward, forward+backward), by candidate key.
    design_ms: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)

    def config(self, implementation: str = "xla") -> MoEConfig:
        cfg = presets[self.preset]
        if self.num_experts is not None:
            cfg = dataclasses.replace(cfg, num_experts=self.num_experts)
        if self.smoke:
            cfg = scale_down(cfg)
        return dataclasses.replace(cfg, implementation=implementation, dtype=jnp.bfloat16)


def _design(tokamax, torch, torch_det):
    return {"tokamax": tokamax, "torch": torch, "torch_det": (float("nan"), torch_det)}


SHAPES: tuple[LayerShape, ...] = (
    LayerShape(name="qwen3_30b_a3b", preset="qwen3_30b_a3b", tokens=16384,
               design_ms=_design((5.42, 26.5), (5.46, 18.1), 17.6)),
    LayerShape(name="mixtral_8x7b", preset="mixtral_8x7b", tokens=8192,
               design_ms=_design((19.2, 73.7), (10.4, 31.7), 32.8)),
    LayerShape(name="dsv3_slice", preset="deepseek_v3", tokens=4096, num_experts=32,
               design_ms=_design((10.6, 43.3), (7.5, 23.8), 23.4)),
    LayerShape(name=f"qwen3_30b_a3b_zipf{ZIPF_EXPONENT}", preset="qwen3_30b_a3b", tokens=16384,
               routing="zipf"),
)  # fmt: skip
SMOKE_SHAPES: tuple[LayerShape, ...] = (
    LayerShape(name="smoke_mixtral", preset="mixtral_8x7b", tokens=64, smoke=True),
    LayerShape(name="smoke_qwen3", preset="qwen3_30b_a3b", tokens=64, smoke=True),
    LayerShape(name="smoke_dsv3", preset="deepseek_v3", tokens=64, num_experts=32, smoke=True),
    LayerShape(name=f"smoke_qwen3_zipf{ZIPF_EXPONENT}", preset="qwen3_30b_a3b", tokens=64,
               routing="zipf", smoke=True),
)  # fmt: skip


def capped_zipf_loads(rows: int, experts: int, cap: int, exponent: float) -> np.ndarray:
    """f64 [E]: rows split over the experts in proportion to 1 / rank**exponent, each capped at
    `cap` (an expert gets each token at most once: cap = T), the excess of a capped expert
    shared by the others in the same proportions."""
    weights = np.arange(1, experts + 1, dtype=np.float64) ** -exponent
    loads, free, left = np.zeros(experts), np.ones(experts, bool), float(rows)
    while True:
        share = left * np.where(free, weights, 0.0) / weights[free].sum()
        over = free & (share > cap)
        if not over.any():
            loads[free] = share[free]
            return loads
        loads[over], free = cap, free & ~over
        left -= cap * int(over.sum())


def zipf_router_bias(scores_te: jax.Array, cfg: MoEConfig, *, exponent: float) -> jax.Array:
    """f32 [E]: a router bias (selection only, never the weights) under which the layer's own
    routing of these scores sends each expert about its capped-Zipf share of the T*K rows (the
    hot experts shuffled over the expert ids). Found by 150 steps of bias += lr * (target -
    load) / T, lr decaying 0.05 * 0.97^i: DeepSeek-V3's balancing update, aimed at Zipf loads."""
    num_tokens = scores_te.shape[0]
    target = capped_zipf_loads(num_tokens * cfg.top_k, cfg.num_experts, num_tokens, exponent)
    target_e = jnp.asarray(np.random.default_rng(SEED).permutation(target), jnp.float32)

    @jax.jit
    def step(bias_e, lr):
        experts = select_experts(scores_te, bias_e, cfg).reshape(-1)
        load_e = jnp.bincount(experts, length=cfg.num_experts).astype(jnp.float32)
        return bias_e + lr * (target_e - load_e) / num_tokens

    bias_e = jnp.zeros((cfg.num_experts,), jnp.float32)
    for i in range(150):
        bias_e = step(bias_e, jnp.float32(0.05 * 0.97**i))
    return bias_e


def route(x, params: MoEParams, cfg: MoEConfig):
    """The routing of x by mok_jax's route stage, with cfg's "auto" options resolved as the
    layer resolves them."""
    return _route(x, params, resolve(cfg, num_tokens=x.shape[0]).config)[0]


@dataclasses.dataclass
class Inputs:
    """One layer's inputs on the device (torch views of the same buffers in `t`)."""

    shape: LayerShape
    cfg: MoEConfig
    x: jax.Array  # [T, D] bf16
    params: MoEParams  # bf16
    cot: jax.Array  # [T, D] bf16, the cotangent of y
    experts_tk: jax.Array  # int32 [T, K]: mok_jax's routing of x (torch's check uses it)
    loads: np.ndarray  # rows per expert
    torch: Any = None
    t: dict = dataclasses.field(default_factory=dict)

    @property
    def shared(self) -> bool:
        return self.cfg.num_shared_experts > 0


def output_names(product: str, shared: bool) -> tuple[str, ...]:
    if product == "forward":
        return ("y",)
    weights = ("router", "w_gate", "w_up", "w_down")
    weights += ("shared_w_gate", "shared_w_up", "shared_w_down") if shared else ()
    # y, not the loss sum(y * cotangent): with a random cotangent that sum cancels (139 against
    # sqrt(sum (y cot)^2) = 4290 at dsv3_slice), so no tolerance on it is a fair check.
    return ("y", "dx", *(f"d_{w}" for w in weights))


def make_inputs(shape: LayerShape, torch) -> Inputs:
    cfg = shape.config()
    kx, kp, kc = jax.random.split(jax.random.key(SEED), 3)
    x = jax.random.normal(kx, (shape.tokens, cfg.d_model), jnp.float32).astype(jnp.bfloat16)
    cot = jax.random.normal(kc, x.shape, jnp.float32).astype(jnp.bfloat16)
    params = init_params(kp, cfg, dtype=jnp.bfloat16)
    if shape.routing == "zipf":
        scores = router_scores(router_logits(x, params.router), cfg)
        bias = zipf_router_bias(scores, cfg, exponent=ZIPF_EXPONENT)
        params = dataclasses.replace(params, router_bias=bias.astype(jnp.bfloat16))
    experts_tk = jax.jit(lambda x, p: route(x, p, cfg).experts_tk)(x, params)
    jax.block_until_ready((x, cot, params, experts_tk))
    loads = np.bincount(np.asarray(experts_tk).reshape(-1), minlength=cfg.num_experts)
    inputs = Inputs(shape, cfg, x, params, cot, experts_tk, loads)
    if torch is not None:
        view = torch.from_dlpack
        inputs.torch = torch
        inputs.t = {"x": view(x), "cot": view(cot), "experts": view(experts_tk).long()}
        for name in output_names("fwd_bwd", inputs.shared)[2:]:
            inputs.t[name[2:]] = view(getattr(params, name[2:]))
        inputs.t["router_bias"] = view(params.router_bias)
    return inputs


def reference_subset(inp: Inputs, n: int) -> dict[str, jax.Array]:
    """y and dx of the first n tokens from mok_jax's reference (every expert on every token)."""
    cfg = dataclasses.replace(inp.cfg, implementation="reference")

    def y_dx(x, params, cot):
        y, vjp = jax.vjp(lambda x: moe_reference(x, params, cfg)[0], x)
        return y, vjp(cot.astype(y.dtype))[0]

    jitted = jax.jit(y_dx, compiler_options=h.REFERENCE_COMPILER_OPTIONS)
    y, dx = jitted(inp.x[:n], inp.params, inp.cot[:n])
    return {"y": y, "dx": dx}


# ---------------------------------------------------------------------------------------------
# The candidates' layers


def jax_products(layer: Callable[[jax.Array, MoEParams], jax.Array], product: str, shared: bool):
    """fn(x, params, cot) -> the product's outputs (see `output_names`)."""
    if product == "forward":
        return lambda x, params, cot: (layer(x, params),)

    def fwd_bwd(x, params, cot):
        def loss(x, params):
            y = layer(x, params)
            return jnp.sum(y.astype(jnp.float32) * cot.astype(jnp.float32)), y

        (_, y), (dx, dparams) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
        grads = (getattr(dparams, n[2:]) for n in output_names("fwd_bwd", shared)[2:])
        return (y, dx, *grads)

    return fwd_bwd


def maxtext_tokamax_layer(x, params: MoEParams, cfg: MoEConfig, tokamax) -> jax.Array:
    """MaxText's dropless MoE (sort, three ragged_dots, unsort, einsum combine) on tokamax's
    mosaic ragged_dot, routed by mok_jax's own route stage."""
    routing = route(x, params, cfg)
    num_tokens, top_k = routing.experts_tk.shape
    flat = routing.experts_tk.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = jnp.take(x.astype(cfg.dtype), order // top_k, axis=0)
    group_sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)

    def ragged(lhs, w):
        return tokamax.ragged_dot(lhs, w.astype(cfg.dtype), group_sizes, implementation="mosaic")

    out = ragged(
        jax.nn.silu(ragged(rows, params.w_gate)) * ragged(rows, params.w_up), params.w_down
    )
    slots = jnp.take(out, jnp.argsort(order), axis=0).reshape(num_tokens, top_k, -1)
    y = jnp.einsum("tkd,tk->td", slots.astype(jnp.float32), routing.weights_tk)
    if cfg.num_shared_experts:

        def mm(a, b):
            return jnp.matmul(
                a.astype(cfg.dtype), b.astype(cfg.dtype), preferred_element_type=jnp.float32
            )

        h_s = jax.nn.silu(mm(x, params.shared_w_gate)) * mm(x, params.shared_w_up)
        y = y + mm(h_s.astype(cfg.dtype), params.shared_w_down)
    return y.astype(x.dtype)


def torch_select_experts(torch, cfg: MoEConfig, scores, bias):
    """int64 [T, K]: mok_jax's selection rule in torch (biased scores, group limit, top-k)."""
    num_tokens = scores.shape[0]
    biased = scores.detach() + bias.float()
    if cfg.num_groups is not None:
        best_two = biased.view(num_tokens, cfg.num_groups, -1).topk(2, dim=-1).values
        groups = best_two.sum(-1).topk(cfg.topk_groups, dim=-1).indices
        keep = (groups[..., None] == torch.arange(cfg.num_groups, device=scores.device)).any(1)
        keep = keep.repeat_interleave(cfg.experts_per_group, dim=1)
        biased = biased.masked_fill(~keep, float("-inf"))
    return biased.topk(cfg.top_k, dim=-1).indices


def torch_scores(torch, cfg: MoEConfig, x, router):
    logits = x.float() @ router.float()
    return torch.softmax(logits, -1) if cfg.score_fn == "softmax" else torch.sigmoid(logits)


def torch_route(torch, cfg: MoEConfig, x, router, bias, experts=None):
    """torch's routing of x [T, D]: (experts [T, K] int64 (given, for the check, or chosen),
    their weights [T, K] f32, the T*K slots sorted by expert (argsort, stable) and x's rows in
    that order)."""
    scores = torch_scores(torch, cfg, x, router)
    if experts is None:
        experts = torch_select_experts(torch, cfg, scores, bias)
    weights = scores.gather(1, experts)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights * cfg.routed_scaling
    order = torch.argsort(experts.reshape(-1), stable=True)
    return experts, weights, order, x.index_select(0, order // cfg.top_k)


def torch_layer(torch, cfg: MoEConfig, w: dict, bias, experts=None):
    """The layer in torch on the tensors `w` (x and the weights): torch's own routing (or
    `experts` [T, K] int64, for the check), then argsort/index_select, three
    torch._grouped_mm, index_select back and a weighted sum over the slots."""
    silu = torch.nn.functional.silu
    x, top_k = w["x"], cfg.top_k
    experts, weights, order, rows = torch_route(torch, cfg, x, w["router"], bias, experts)
    counts = torch.bincount(experts.reshape(-1), minlength=cfg.num_experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    gate = torch._grouped_mm(rows, w["w_gate"], offs=offs)
    up = torch._grouped_mm(rows, w["w_up"], offs=offs)
    out = torch._grouped_mm(silu(gate) * up, w["w_down"], offs=offs)
    slots = out.index_select(0, torch.argsort(order)).view(x.shape[0], top_k, -1)
    y = (slots.float() * weights[..., None]).sum(1)
    if cfg.num_shared_experts:
        h_s = silu(x @ w["shared_w_gate"]) * (x @ w["shared_w_up"])
        y = y + (h_s @ w["shared_w_down"]).float()
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Building, checking and timing the candidates


class Bench:
    """Builds the candidates of one layer (each a `h.Runner`)."""

    def __init__(self, args, inputs: Inputs | None, shape: LayerShape):
        self.args, self.inp, self.shape = args, inputs, shape

    def computes(self, key: str) -> str:
        options = self.args.fused_options if key == "fused" else {}
        return COMPUTES[key] + (f"; with {options}" if options else "")

    def build(self, key: str, product: str, *, for_check: bool = False) -> h.Runner:
        inp = self.inp
        if key.startswith("torch"):
            return self._torch(product, deterministic=key == "torch_det", for_check=for_check)
        if key == "tokamax":
            tokamax, _ = h.import_tokamax()
            layer = functools.partial(maxtext_tokamax_layer, cfg=inp.cfg, tokamax=tokamax)
        else:
            chosen = self.args.fused_options if key == "fused" else {}
            try:
                options = dataclasses.replace(inp.cfg.options, **chosen)
                cfg = dataclasses.replace(inp.cfg, implementation=key, options=options)
            except ValueError as e:
                raise h.NotAvailable(f"{key}: {e}") from e
            layer = lambda x, params: moe(x, params, cfg)[0]  # noqa: E731
        return h.jax_runner(jax_products(layer, product, inp.shared), inp.x, inp.params, inp.cot)

    def _torch(self, product: str, *, deterministic: bool, for_check: bool) -> h.Runner:
        inp, torch = self.inp, self.inp.torch
        if torch is None:
            raise h.NotAvailable(self.args.torch_missing)
        if not hasattr(torch, "_grouped_mm"):
            raise h.NotAvailable(f"torch {torch.__version__} has no _grouped_mm")
        t, cfg = inp.t, inp.cfg
        experts = t["experts"] if for_check else None
        names = ("x", *(n[2:] for n in output_names("fwd_bwd", inp.shared)[2:]))

        def forward():
            with torch.no_grad():
                return torch_layer(torch, cfg, t, t["router_bias"], experts)

        def fwd_bwd():
            leaves = {n: t[n].detach().requires_grad_(True) for n in names}
            with torch.enable_grad():
                y = torch_layer(torch, cfg, leaves, t["router_bias"], experts)
                loss = (y.float() * t["cot"].float()).sum()
                grads = torch.autograd.grad(loss, list(leaves.values()))
            return (y.detach(), *grads)

        plain = forward if product == "forward" else fwd_bwd

        def fn():
            if not deterministic:
                return plain()
            before = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(True)
            try:
                return plain()
            finally:
                torch.use_deterministic_algorithms(before)

        return h.torch_runner(torch, fn, on_gpu=jax.default_backend() == "gpu")

    def torch_own_experts(self) -> jax.Array:
        """torch's own top-k of the layer's routing (as in its timed runs), for the record."""
        torch, t, cfg = self.inp.torch, self.inp.t, self.inp.cfg
        with torch.no_grad():
            scores = torch_scores(torch, cfg, t["x"], t["router"])
            experts = torch_select_experts(torch, cfg, scores, t["router_bias"])
        return jax.dlpack.from_dlpack(experts.to(torch.int32).contiguous())


compare = functools.partial(h.compare, rtol=TOLERANCE.rtol, atol=TOLERANCE.atol, scale="max")


def check_outputs(names: Sequence[str], outs: tuple, ref: dict, anchor, n: int) -> dict:
    """Each output against the reference subset (y, dx: first n tokens) and the anchor's
    (`(key, outputs)` or None)."""
    if len(outs) != len(names):
        return {"ok": False, "why": f"{len(outs)} outputs, expected {len(names)}"}
    result: dict[str, Any] = {"ok": True, "bound": dataclasses.asdict(TOLERANCE), "outputs": {}}
    for name, out in zip(names, outs, strict=True):
        part: dict[str, Any] = {}
        if name in ref:
            part["vs_reference_first_tokens"] = compare(out[:n], ref[name])
        if anchor is not None:
            part[f"vs_{anchor[0]}"] = compare(out, anchor[1][names.index(name)])
        part["ok"] = all(c["ok"] for c in part.values())
        result["outputs"][name] = part
        result["ok"] &= part["ok"]
    result["reference_ok"] = all(
        p.get("vs_reference_first_tokens", {"ok": True})["ok"] for p in result["outputs"].values()
    )
    return result


def gemm_flops(cfg: MoEConfig, tokens: int) -> float:
    """The three expert GEMMs of the forward: 2 * T*k * D * F * 3."""
    return 2.0 * tokens * cfg.top_k * cfg.d_model * cfg.d_ff * 3


def run_product(product: str, inp: Inputs, ref: dict, args, budget: h.Budget, save) -> dict:
    """Every candidate of one product in run order: `fused` timed alone, the others paired
    with it."""
    bench = Bench(args, inp, inp.shape)
    names = output_names(product, inp.shared)
    flops = gemm_flops(inp.cfg, inp.shape.tokens) * (3 if product == "fwd_bwd" else 1)
    entry: dict[str, Any] = {"gemm_flops": flops, "outputs": list(names), "candidates": []}
    anchor, fused = None, None
    for key in args.candidates:
        rec: dict[str, Any] = {"name": TITLES[key], "key": key, "computes": bench.computes(key)}
        entry["candidates"].append(rec)
        if (skipped := budget.skip_reason()) is not None:
            rec["status"] = skipped
            continue

        def check(outs, key=key, rec=rec, anchor=anchor):
            if key.startswith("torch"):  # its own top-k may break a near-tie the other way
                runner = bench.build(key, product, for_check=True)
                outs = runner.to_jax(runner.call())
                rec["check_with"] = "mok_jax's experts (its own top-k is timed)"
                if product == "forward":
                    same = jnp.all(bench.torch_own_experts() == inp.experts_tk, axis=1)
                    rec["own_routing_tokens_differing"] = int((~np.asarray(same)).sum())
            return check_outputs(names, outs, ref, anchor, args.check_tokens)

        paired = fused if args.paired else None
        measured, runner, first = h.measure(
            functools.partial(bench.build, key, product), check, names=names, args=args,
            paired_with=paired,
        )  # fmt: skip
        rec.update(measured)
        if "paired" in rec:
            ratios = h.ratio_stats(rec["timing"], rec["paired"]["base_timing"])
            rec["paired"]["this_over_base"] = ratios
            rec["fused_speedup_paired"] = ratios["median"]
            rec["fused_speedup_paired_p25_p75"] = [ratios["p25"], ratios["p75"]]
        if anchor is None and first and rec["check"].get("reference_ok"):
            anchor, rec["anchor"] = (key, first), True
        if key == "fused" and "timing" in rec:
            fused = runner
        del runner, first
        rec["t_end_s"] = round(budget.elapsed(), 1)
        if "timing" in rec:
            rec["tflops"] = flops / (rec["timing"]["median_ms"] * 1e-3) / 1e12
        _print(inp.shape.name, product, rec)
        save()
    entry["anchor"] = anchor[0] if anchor else None
    fused_rec = _find(entry, "fused")
    for c in entry["candidates"]:
        if fused_rec and "timing" in fused_rec and "timing" in c and c is not fused_rec:
            c["fused_speedup"] = c["timing"]["median_ms"] / fused_rec["timing"]["median_ms"]
    return entry


def _find(entry: dict | None, key: str) -> dict | None:
    return next((c for c in (entry or {}).get("candidates", []) if c.get("key") == key), None)


def _print(shape: str, product: str, rec: dict) -> None:
    t = rec.get("timing")
    ms = f"{t['median_ms']:.3f} ms" if t else "-"
    speed = rec.get("fused_speedup_paired")
    extra = f" fused x{speed:.2f}" if speed else ""
    bits = rec.get("bitwise_repeatable", {}).get("identical")
    print(f"{shape} {product} {rec['name']}: {rec.get('status')}; {ms}; check "
          f"{rec.get('check', {}).get('ok')}; bits {bits}{extra}", flush=True)  # fmt: skip


def derive_backward(result: dict) -> None:
    """backward = fwd_bwd - forward, per candidate with both timed."""
    fwd, both = result["products"].get("forward"), result["products"].get("fwd_bwd")
    if not fwd or not both:
        return
    out = {}
    for c in both["candidates"]:
        f = _find(fwd, c.get("key", ""))
        if f is not None and "timing" in f and "timing" in c:
            ms = c["timing"]["median_ms"] - f["timing"]["median_ms"]
            tflops = 2 * fwd["gemm_flops"] / (ms * 1e-3) / 1e12
            out[c["key"]] = {"median_ms": ms, "tflops": tflops}
    for key, b in out.items():
        if "fused" in out and key != "fused":
            b["fused_speedup"] = b["median_ms"] / out["fused"]["median_ms"]
    result["backward_derived"] = out


def run_shape(shape: LayerShape, args, budget: h.Budget, torch, save) -> dict:
    result: dict[str, Any] = {"shape": dataclasses.asdict(shape), "products": {}}
    cfg = shape.config()
    result["config"] = {f.name: str(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    result["gemm_flops_forward"] = gemm_flops(cfg, shape.tokens)
    t0 = time.perf_counter()
    if (skipped := budget.skip_reason()) is not None:
        result["skipped"] = skipped
        return result
    inp = make_inputs(shape, torch)
    loads = inp.loads
    result["routing"] = {
        "how": (
            f"router bias fitted so the layer's routing gives capped Zipf loads (1/rank^"
            f"{ZIPF_EXPONENT}, each expert <= T rows, hot experts shuffled; see zipf_router_bias)"
            if shape.routing == "zipf"
            else "the layer's router on random data (about uniform)"
        ),
        "rows_per_expert": {
            "min": int(loads.min()),
            "median": float(np.median(loads)),
            "max": int(loads.max()),
            "empty": int((loads == 0).sum()),
            "max_over_mean": float(loads.max() / loads.mean()),
            "top4": sorted(loads.tolist(), reverse=True)[:4],
        },
    }
    save(result)
    t1 = time.perf_counter()
    ref = jax.block_until_ready(reference_subset(inp, args.check_tokens))
    result["reference_s"] = round(time.perf_counter() - t1, 2)
    for product in args.products:
        result["products"][product] = {}
        entry = run_product(product, inp, ref, args, budget, lambda: save(result))
        result["products"][product] = entry
        save(result)
    derive_backward(result)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    del inp, ref
    gc.collect()
    if torch is not None and jax.default_backend() == "gpu":
        torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------------------------------------
# Markdown


def _ms(c: dict | None) -> str:
    return f"{c['timing']['median_ms']:.3f}" if c and "timing" in c else "-"


def _speed(c: dict | None) -> str:
    if not c or "fused_speedup" not in c:
        return "-"
    text = f"{c['fused_speedup']:.3g}x"
    if "fused_speedup_paired" in c:
        lo, hi = c["fused_speedup_paired_p25_p75"]
        text += f" (paired {c['fused_speedup_paired']:.3g}x [{lo:.3g}-{hi:.3g}])"
    return text


def _status(c: dict | None) -> str:
    if c is None:
        return "-"
    status = c.get("status", "-")
    if status == "ok" or status.startswith("FAILED"):
        bits = c.get("bitwise_repeatable", {})
        diff = bits.get("outputs_differing", [])
        same = f"bitwise x{bits.get('runs')}" if not diff else f"NOT bitwise: {diff}"
        if bits.get("last_timed_run_identical") is False:
            same += ", last timed run differs"
        status = ("ok" if status == "ok" else "**FAILED CHECK**") + f"; {same}"
    return status.replace("|", "/")[:200]


def _target_cell(c: dict | None, goal: float) -> str:
    ratio = c.get("fused_speedup_paired", c.get("fused_speedup")) if c else None
    if ratio is None:
        return f"- (>= {goal})"
    return f"{ratio:.2f}x (>= {goal}: {'met' if ratio >= goal else '**missed**'})"


def _deviation(design: tuple[float, float], f: dict | None, b: dict | None) -> str:
    parts = []
    for ref, c in zip(design, (f, b), strict=True):
        if c and "timing" in c and not np.isnan(ref):
            dev = c["timing"]["median_ms"] / ref - 1
            parts.append(f"{dev:+.0%}" + (" **FLAG**" if abs(dev) > 0.10 else ""))
    return f" ({', '.join(parts)})" if parts else ""


def render_markdown(results: dict) -> str:
    env = results["environment"]
    lines = [
        "# MoE layer on one GPU",
        "",
        f"`{env['command']}` at {env['date']}; {h.versions_line(env)}.",
        "",
        f"Method: {results['method']}",
        "",
        "## What each candidate computes",
        "",
        *(f"- {TITLES[k]}: {COMPUTES[k]}." for k in DISPLAY_ORDER),
        "",
        "## Targets: fused forward+backward speedup (candidate ms / fused ms)",
        "",
        "Judged on the paired ratio where there is one.",
        "",
    ]
    rows = []
    for s in results["shapes"]:
        both, target = s["products"].get("fwd_bwd"), TARGETS.get(s["shape"]["preset"])
        if target is None or not both:
            continue
        torches = [
            c for c in (_find(both, "torch"), _find(both, "torch_det")) if c and "timing" in c
        ]
        best = min(torches, key=lambda c: c["timing"]["median_ms"]) if torches else None
        fused = (_find(s["products"].get("forward"), "fused"), _find(both, "fused"))
        bits = "; ".join(
            "-" if c is None else str(c.get("bitwise_repeatable", {}).get("identical", "-"))
            for c in fused
        )
        best_txt = _target_cell(best, target[1]) + (f" vs {best['key']}" if best else "")
        rows.append(
            [s["shape"]["name"], _target_cell(_find(both, "tokamax"), target[0]), best_txt, bits]
        )
    header = ["shape", "over 2 (target)", "over 3, the faster mode (target)",
              "fused bitwise x3 (fwd; fwd+bwd)"]  # fmt: skip
    lines += h.table(header, rows)
    header = ["candidate", "fwd ms", "bwd ms (derived)", "fwd+bwd ms",
              "TFLOP/s fwd / bwd / fwd+bwd", "fused speedup fwd", "fused speedup fwd+bwd",
              "DESIGN.md fwd / fwd+bwd", "check / bits fwd", "check / bits fwd+bwd"]  # fmt: skip
    for s in results["shapes"]:
        sh = s["shape"]
        lines += ["", f"## {sh['name']}: T={sh['tokens']}", ""]
        if "skipped" in s:
            lines.append(f"Skipped: {s['skipped']}")
            continue
        cfg, r = s["config"], s.get("routing", {})
        lines.append(
            f"D={cfg['d_model']} F={cfg['d_ff']} E={cfg['num_experts']} k={cfg['top_k']}, "
            f"score {cfg['score_fn']}, groups {cfg['num_groups']}/{cfg['topk_groups']}, shared "
            f"experts {cfg['num_shared_experts']}. Routing: {r.get('how')}; rows per expert "
            f"{r.get('rows_per_expert')}. Forward GEMM FLOPs {s['gemm_flops_forward']:.3g}."
        )
        fwd, both = s["products"].get("forward"), s["products"].get("fwd_bwd")
        back, rows = s.get("backward_derived", {}), []
        for key in DISPLAY_ORDER:
            f, b, bk = _find(fwd, key), _find(both, key), back.get(key)
            if f is None and b is None:
                continue
            tf = " / ".join(
                f"{c['tflops']:.3g}" if c and "tflops" in c else "-" for c in (f, bk, b)
            )
            design, design_txt = sh["design_ms"].get(key), "-"
            if design:
                design_txt = " / ".join("-" if np.isnan(v) else f"{v}" for v in design)
                design_txt += _deviation(design, f, b)
            bspeed = f" (bwd {bk['fused_speedup']:.2f}x)" if bk and "fused_speedup" in bk else ""
            bwd = f"{bk['median_ms']:.3f}" if bk else "-"
            rows.append([TITLES[key], _ms(f), bwd, _ms(b), tf, _speed(f), _speed(b) + bspeed,
                         design_txt, _status(f), _status(b)])  # fmt: skip
        lines += ["", *h.table(header, rows)]
        notes = []
        for product, entry in s["products"].items():
            notes.append(f"{product}: anchor {entry.get('anchor')}")
            for c in entry.get("candidates", []):
                if "own_routing_tokens_differing" in c:
                    notes.append(f"{c['name']}: its own top-k picks other experts than mok_jax's "
                                 f"for {c['own_routing_tokens_differing']} tokens (checked with "
                                 "mok_jax's)")  # fmt: skip
        lines += ["", "; ".join(notes) + "."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    h.add_run_args(ap, time_failed=True)
    ap.add_argument("--products", default=",".join(PRODUCTS))
    ap.add_argument(
        "--candidates", default=None,
        help=f"of {','.join(CANDIDATES)} (default: all; --smoke: {','.join(SMOKE_CANDIDATES)})",
    )  # fmt: skip
    ap.add_argument(
        "--fused-options", default="",
        help="MoEOptions fields of the fused candidate, comma-separated key=value (e.g. "
        "residuals=gate_up,token_chunk=2048); the others stay 'auto'",
    )  # fmt: skip
    ap.add_argument("--check-tokens", type=int, default=None, help="tokens checked (256)")
    args = ap.parse_args(argv)
    h.check_run_args(ap, args, SMOKE_SHAPES if args.smoke else SHAPES)
    args.products = h.pick(ap, args.products, PRODUCTS, "product")
    default = ",".join(SMOKE_CANDIDATES if args.smoke else CANDIDATES)
    picked = h.pick(ap, args.candidates or default, CANDIDATES, "candidate")
    args.candidates = [c for c in CANDIDATES if c in picked]  # run order: fused first
    args.check_tokens = args.check_tokens or (64 if args.smoke else 256)
    fields, text, args.fused_options = (
        {f.name for f in dataclasses.fields(MoEOptions)},
        args.fused_options,
        {},
    )
    for item in (i for i in text.split(",") if i):
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            ap.error(f"--fused-options: {item!r} is not key=value of a MoEOptions field")
        args.fused_options[key] = int(value) if value.lstrip("-").isdigit() else value
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    torch, args.torch_missing = h.import_torch()
    budget = h.Budget(args.budget_s)
    env = h.environment(NAME, argv)
    env["cublas_workspace_config"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    results: dict[str, Any] = {
        "environment": env,
        "method": (
            f"bf16 random data (x, cotangent ~ N(0,1); mok_jax.init_params weights in bf16); "
            f"each candidate checked first: y and dx of the first {args.check_tokens} tokens vs "
            "mok_jax's reference, every output vs the anchor, |err| <= rtol |ref| + atol "
            f"max|ref| (mok_jax.tolerances, bf16: rtol = atol = {TOLERANCE.rtol}); "
            f"{args.repeats} runs compared bitwise; {args.warmup} warm-up + 1 calibration call, "
            f"then the median of {args.timed} samples of >= {args.sample_s * 1e3:.0f} ms "
            "(back-to-back calls between two syncs, host clock)"
            + ("; each candidate timed in alternation with fused" if args.paired else "")
            + "; fused speedup = candidate ms / fused ms; backward = fwd+bwd - fwd medians; "
            "TFLOP/s counts the three expert GEMMs: 2*T*k*D*F*3 forward, 3x for fwd+bwd, 2x "
            "for the backward (not the router, shared expert or permutations); JAX candidates "
            "jitted with XLA's default options; CUBLAS_WORKSPACE_CONFIG="
            f"{env['cublas_workspace_config']} for both torch modes"
            + ("; SMOKE RUN: no number here means anything" if args.smoke else "")
        ),
        "args": {k: v for k, v in vars(args).items() if k != "shape_list"},
        "shapes": [],
    }
    print(json.dumps(env, indent=1), flush=True)

    def save(index: int, shape_result: dict) -> None:
        results["shapes"][index : index + 1] = [shape_result]
        results["elapsed_s"] = round(budget.elapsed(), 1)
        h.save(args.out, NAME, results, render_markdown(results))

    for index, shape in enumerate(args.shape_list):
        save(index, run_shape(shape, args, budget, torch, functools.partial(save, index)))
    print(f"wrote {args.out}/{NAME}.{{json,md}} after {budget.elapsed():.0f} s")
    return results


if __name__ == "__main__":
    main()
