"""The MoE layer as a function: `moe(x, params, cfg, mesh=None) -> (y, aux)`.

The `xla` implementation runs the same stages on one device and on every device of a mesh
(inside `jax.shard_map`, on that device's tokens and experts), each under `jax.named_scope`
(`pallas` is the same stages with the Mosaic GPU grouped GEMMs in the experts stage; `fused`
merges dispatch and the routing weights into the kernels, see `_fused_experts`, and under a
mesh moves the rows inside kernels too, see `_fused_exchange`):

  route     logits, scores, top-k experts and weights                 [T, D] -> [T, K]
  plan      stable sort of the N = T*K rows by expert; global counts  [T, K] -> Plan
  dispatch  rows in expert order, then to the devices of their experts [T, D] -> [R, D]
  experts   SwiGLU in fixed-shape tiles, one expert per tile           [R, D] -> [R, D] f32
  return    results back to the rows' devices                          [R, D] -> [N, D] f32
  combine   fixed-order weighted sum over the K slots, plus the shared experts

Every step is deterministic: no scatter-add on the forward or backward path (see permute.py),
rows placed by (source device, position) (see exchange.py), and every row meets its weights in
a dot of one fixed shape (see tiles.py), so y and dx are the same bits for every mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.sharding import NamedSharding, PartitionSpec

from mok_jax.config import MoEConfig
from mok_jax.mesh import ShardingRules, shard_params, shard_tokens
from mok_jax.mesh import param_specs as mesh_param_specs
from mok_jax.options import current_target
from mok_jax.params import MoEParams, validate_params
from mok_jax.permute import rows_to_slots, sum_kept_slots, sum_slots, take_rows, tokens_to_rows
from mok_jax.plan import Plan, make_plan
from mok_jax.reference import moe_reference
from mok_jax.resolve import Resolution, resolve
from mok_jax.routed import RoutedSpec, routed_experts
from mok_jax.routing import (
    MoEAux,
    Routing,
    load_balancing_loss,
    route_logits,
    router_logits,
    router_scores,
    router_z_loss,
    score_shares,
)
from mok_jax.tiles import token_swiglu, token_tiled
from pallas_kernels.routing import ops as routing_ops


@dataclasses.dataclass(frozen=True)
class _Axes:
    """The mesh axes the stages run under: none on one device."""

    expert: str | None = None
    tokens: tuple[str, ...] = ()
    num_devices: int = 1  # devices along `tokens`
    expert_devices: int = 1  # EP


def _psum(x: Array, axes: _Axes) -> Array:
    return lax.psum(x, axes.tokens) if axes.tokens else x


def _route(x_td: Array, params: MoEParams, cfg: MoEConfig) -> tuple[Routing, Array, Array]:
    """(routing, score shares [T, E] (with the router kernel: their sum over the tokens, [E]),
    logsumexp of the logits [T]) of every token."""
    with jax.named_scope("route"):
        if cfg.implementation == "fused" and cfg.options.router == "kernel":
            return _route_in_kernel(x_td, params, cfg)

        # Token by token, in fixed-shape chunks: a reduction over a token's K weights or E
        # scores (and its gradient) must not change order with the number of tokens here.
        def chunk(x_cd):
            logits_ce = router_logits(x_cd, params.router)
            routing = route_logits(logits_ce, params.router_bias, cfg)
            lse_c = jax.nn.logsumexp(logits_ce, axis=-1)
            return routing, score_shares(routing.scores_te), lse_c

        return token_tiled(chunk, x_td, cfg.options.token_chunk)


def _route_in_kernel(
    x_td: Array, params: MoEParams, cfg: MoEConfig
) -> tuple[Routing, Array, Array]:
    """The router's kernels (pallas_kernels/routing), forward and backward: one program per 64
    tokens, each token's results and input gradient from its own row (the same bits on every
    mesh)."""
    if x_td.dtype != jnp.bfloat16:
        raise ValueError(
            f"router='kernel' routes bfloat16 tokens; x is {x_td.dtype}: cast x to bfloat16 "
            "or use router 'xla'"
        )
    routed = routing_ops.route(
        x_td,
        params.router,
        params.router_bias,
        cfg.router_spec,
        interpret=current_target().interpret,
    )
    routing = Routing(
        experts_tk=routed.experts_tk,
        weights_tk=routed.weights_tk,
        logits_te=routed.logits_te,
        scores_te=router_scores(routed.logits_te, cfg),  # its shape only: XLA drops the rest
    )
    return routing, jnp.sum(routed.shares_ue, axis=0), routed.lse_t


def _plan(routing: Routing, cfg: MoEConfig, axes: _Axes) -> tuple[Plan, Array]:
    """The local plan, with the capacity applied in global token order; and the global load."""
    with jax.named_scope("plan"):
        plan = make_plan(routing.experts_tk, cfg.num_experts)
        tokens_per_expert = _psum(plan.group_sizes_e, axes)
        capacity = cfg.capacity(routing.experts_tk.shape[0] * axes.num_devices)
        if capacity is None:
            return plan, tokens_per_expert
        # Rows of each expert on the devices before this one come first (tokens are sharded in
        # device order), so a row's global rank is that count plus its local rank.
        before_e = jnp.zeros_like(plan.group_sizes_e)
        if axes.tokens:
            counts_ve = lax.all_gather(plan.group_sizes_e, axes.tokens)
            me = lax.axis_index(axes.tokens)
            before_e = jnp.sum(
                jnp.where((jnp.arange(counts_ve.shape[0]) < me)[:, None], counts_ve, 0),
                axis=0,
                dtype=jnp.int32,
            )
        experts_n = routing.experts_tk.reshape(-1)
        rank_n = plan.inverse_n - plan.group_starts_e[experts_n] + before_e[experts_n]
        return dataclasses.replace(plan, keep_n=rank_n < capacity), tokens_per_expert


def _dispatch(x_td: Array, plan: Plan, cfg: MoEConfig) -> Array:
    with jax.named_scope("dispatch"):
        return tokens_to_rows(x_td.astype(cfg.dtype), plan.order_n, plan.inverse_n, cfg.top_k)


def _experts(
    x_nd: Array,
    params: MoEParams,
    plan: Plan,
    cfg: MoEConfig,
    axes: _Axes,
    scale_n: Array | None = None,
):
    """Dispatch to the experts' devices, the expert GEMMs and the return, in rounds (`fused`:
    with the rows' routing weights scale_n, inside kernels)."""
    # The in-kernel exchange's options apply to `fused` only (resolved there).
    fused = {}
    if cfg.implementation == "fused":
        opts = cfg.options
        fused = {
            "recompute": opts.recompute,
            "exchange_tile": opts.exchange_tile,
            "exchange_programs": opts.exchange_programs,
            "exchange_fusion": opts.exchange_fusion,
        }
    spec = RoutedSpec(
        axis=axes.expert,
        rounds_axes=axes.tokens,
        num_devices=axes.expert_devices,
        num_local=cfg.num_experts // axes.expert_devices,
        exchange=cfg.exchange,
        buffer_rows=_buffer_rows(x_nd.shape[0], cfg, axes),
        row_tile=cfg.row_tile,
        dtype=cfg.dtype,
        kernel=cfg.implementation if cfg.implementation in ("pallas", "fused") else "xla",
        **fused,
    )
    weights = (params.w_gate, params.w_up, params.w_down)
    return routed_experts(x_nd, weights, plan.group_sizes_e, spec, scale_n)


def _buffer_rows(num_rows: int, cfg: MoEConfig, axes: _Axes) -> int:
    """The receive window (rows per round per device) or the ring's chunk (rows per hop), as
    `buffer_factor` times the balanced load, capped by what can arrive at all."""
    ep = axes.expert_devices
    tokens = num_rows // cfg.top_k
    most = tokens * min(cfg.top_k, cfg.num_experts // ep)  # one source's rows for one device
    if cfg.exchange == "ring" and axes.expert is not None and cfg.implementation != "fused":
        return max(1, min(math.ceil(cfg.buffer_factor * num_rows / ep), most))
    return max(1, min(math.ceil(cfg.buffer_factor * num_rows), most * ep))


def _combine(
    y_nd: Array,
    x_td: Array,
    routing: Routing,
    plan: Plan,
    params: MoEParams,
    cfg: MoEConfig,
    *,
    weighted: bool = False,
) -> Array:
    """y[t] = sum_j w[t, j] * y[t, j] in slot order (f32), plus the shared experts. `weighted`:
    y_nd's rows already hold w[t, j] * y[t, j], summed as they are; dropped slots add +0."""
    with jax.named_scope("combine"):
        num_tokens, top_k = routing.weights_tk.shape
        y_tkd = rows_to_slots(y_nd, plan.order_n, plan.inverse_n).reshape(num_tokens, top_k, -1)
        keep_tk = jnp.ones((num_tokens, top_k), bool) if plan.keep_n is None else plan.keep_n
        keep_tk = keep_tk.reshape(num_tokens, top_k)

        # Token by token in fixed-shape chunks, like the routing: the weights' gradient is a
        # sum over D that must not change order with the number of tokens here. Weighted rows
        # (`fused`) have no such sum: a where and K - 1 adds, elementwise, are the same bits at
        # any shape, so they run in one pass over all tokens (no chunk loop).
        tokens = cfg.options.token_chunk
        if weighted:
            y_td = sum_slots(y_tkd) if plan.keep_n is None else sum_kept_slots(y_tkd, keep_tk)
        else:
            y_td = token_tiled(_weighted_sum, (y_tkd, routing.weights_tk, keep_tk), tokens)
        if cfg.num_shared_experts:
            shared = (params.shared_w_gate, params.shared_w_up, params.shared_w_down)
            y_td = y_td + token_swiglu(x_td, *shared, cfg.dtype, tokens)
        return y_td.astype(x_td.dtype)


def _weighted_sum(args):
    """One chunk of the unweighted rows' combine: [C, K, D] rows, [C, K] weights and kept
    slots -> f32 [C, D]."""
    y_ckd, weights_ck, keep_ck = args
    # A dropped slot adds +0.
    terms_ckd = jnp.where(keep_ck[..., None], weights_ck[..., None] * y_ckd, 0.0)
    # A fusion boundary: XLA may contract w * y + acc into one FMA in one program and not in
    # another, which changes the last bit; products first, then the sum.
    return sum_slots(lax.optimization_barrier(terms_ckd))


def _aux(
    routed: tuple[Routing, Array, Array],
    plan: Plan,
    tokens_per_expert: Array,
    rounds: Array,
    cfg: MoEConfig,
    axes: _Axes,
) -> MoEAux:
    routing, shares, lse_t = routed
    # Shares per token [T, E], or (the router kernel) their sum over the tokens [E].
    given = {"shares_te": shares} if shares.ndim == 2 else {"share_sums_e": shares}
    with jax.named_scope("aux"):
        return MoEAux(
            aux_loss=load_balancing_loss(
                routing.scores_te, tokens_per_expert, cfg, axes.tokens, **given
            ),
            z_loss=router_z_loss(routing.logits_te, cfg, axes.tokens, lse_t=lse_t),
            tokens_per_expert=tokens_per_expert,
            dropped=_psum(plan.dropped, axes),
            rounds=rounds,
        )


def _local_moe(x_td: Array, params: MoEParams, cfg: MoEConfig, axes: _Axes):
    """The stages on one device's tokens x [T, D] and experts (`fused`: dispatch and the
    routing weights inside the experts stage, see `_fused_experts`; under a mesh the exchange
    inside kernels too, see `_fused_exchange`)."""
    routed = _route(x_td, params, cfg)
    routing = routed[0]
    plan, tokens_per_expert = _plan(routing, cfg, axes)
    fused = cfg.implementation == "fused"
    # One device on the expert axis: the rows are where their experts are (unless the
    # exchange's kernels are asked for there, `exchange_on_one_device`).
    local = axes.expert is None or (
        axes.expert_devices == 1 and not cfg.options.exchange_on_one_device
    )
    if fused and local:
        y_nd = _fused_experts(x_td, routing, plan, params, cfg)
        rounds = jnp.ones((), jnp.int32)
    elif fused:
        y_nd, rounds = _fused_exchange(x_td, routing, plan, params, cfg, axes)
    else:
        x_nd = _dispatch(x_td, plan, cfg)
        y_nd, rounds = _experts(x_nd, params, plan, cfg, axes)
    y_td = _combine(y_nd, x_td, routing, plan, params, cfg, weighted=fused)
    return y_td, _aux(routed, plan, tokens_per_expert, rounds, cfg, axes)


def moe_xla(x_td: Array, params: MoEParams, cfg: MoEConfig) -> tuple[Array, MoEAux]:
    """The `xla`, `pallas` and `fused` implementations on one device, x [T, D] (already
    validated); they differ only in the experts stage."""
    return _local_moe(x_td, params, cfg, _Axes())


def _fused_experts(
    x_td: Array, routing: Routing, plan: Plan, params: MoEParams, cfg: MoEConfig
) -> Array:
    """The `fused` implementation's dispatch + experts + routing weights: tokens [T, D] ->
    weighted rows f32 [N, D] in expert order.

    The gate/up kernel reads the expert-sorted rows from a copy of the tokens, or with
    options.rows="gathered" straight from x through the plan's order; h is written once, and
    the down projection's epilogue multiplies each row by its routing weight; combine
    (weighted=True) gathers each token's K weighted rows and sums them in slot order. So y is
    the `pallas` implementation's, bit for bit. The backward runs the unfused kernels
    (ops.swiglu_mlp_grads: 8 GEMM passes, 6 with residuals "gate_up") on the rows gathered
    once. Measured figures: bench/results/ (README.md there lists them).
    """
    from mok_jax.experts import grouped_swiglu_fused

    with jax.named_scope("experts"):
        scale_n = _row_weights(routing, plan)
        return grouped_swiglu_fused(
            x_td,
            params.w_gate,
            params.w_up,
            params.w_down,
            scale_n,
            plan.group_sizes_e,
            plan.order_n,
            plan.inverse_n,
            cfg.top_k,
            cfg.dtype,
            # Under a mesh the rows are copied (`resolve` rejects "gathered" there): the
            # gathered rows' kernel cannot take operands that vary over mesh axes (its
            # producer's warp_map).
            rows=cfg.options.rows,
            residuals=cfg.options.residuals,
            recompute=cfg.options.recompute,
            interpret=current_target().interpret,
        )


def _row_weights(routing: Routing, plan: Plan) -> Array:
    """f32 [N]: each expert-sorted row's routing weight (0 for a dropped row: it adds nothing
    and gets 0)."""
    weights_n = routing.weights_tk.reshape(-1).astype(jnp.float32)
    if plan.keep_n is not None:
        weights_n = jnp.where(plan.keep_n, weights_n, 0.0)
    # Pair order -> expert order, a permutation: its gradient is the inverse gather.
    return take_rows(weights_n[:, None], plan.order_n, plan.inverse_n)[:, 0]


def _fused_exchange(
    x_td: Array, routing: Routing, plan: Plan, params: MoEParams, cfg: MoEConfig, axes: _Axes
) -> tuple[Array, Array]:
    """The `fused` implementation under a mesh: tokens [T, D] -> (weighted rows f32 [N, D] in
    expert order, rounds). The expert-sorted rows and their routing weights go to the experts'
    devices, round by round, inside kernels (remote copies and semaphores: routed.py's
    `_fused_round`); the grouped-GEMM kernels run on the received buffer with each row's
    weight in the down projection's epilogue, and the results come back the same way. Each
    row meets the kernels of `_fused_experts`, so y and dx are its bits on any mesh.

    With exchange_programs > 0 every copy runs inside a GEMM's kernel: two kernels a round
    forward (dispatch + gate/up, down + return; one with exchange_fusion "forward"), and in the
    backward the dispatch of the cotangent, the rows and their weights inside g = dy @
    w_down.T's kernel and the input gradient's return inside its GEMM's; the backward
    recomputes gate and up from the rows it dispatches again. On an expert axis of one device
    the layer runs `_fused_experts` instead (the copies cost 15-19 % of the layer there on one
    H200) unless options.exchange_on_one_device asks for this path.
    """
    with jax.named_scope("dispatch"):
        x_nd = _dispatch(x_td, plan, cfg)
        scale_n = _row_weights(routing, plan)
    return _experts(x_nd, params, plan, cfg, axes, scale_n)


def _aux_specs() -> MoEAux:
    return MoEAux(*(PartitionSpec() for _ in dataclasses.fields(MoEAux)))


def _explicit(mesh, axes: tuple[str, ...]) -> bool:
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    return all(types[a] == jax.sharding.AxisType.Explicit for a in axes)


def _token_spec_of_shape(shape: tuple[int, ...], mesh, axes: tuple[str, ...]) -> PartitionSpec:
    """A spec for [..., D] that shards the token dimensions over `axes`, in order, as far as
    they divide (what an explicitly sharded reshape of the tokens needs)."""
    dims: list[list[str]] = [[] for _ in shape]
    dim, left = 0, shape[0] if shape else 1
    for axis in axes:
        size = mesh.shape[axis]
        while dim < len(shape) - 1 and left % size:
            dim += 1
            left = shape[dim]
        if dim == len(shape) - 1:
            break
        dims[dim].append(axis)
        left //= size
    return PartitionSpec(*(tuple(d) if len(d) > 1 else (d[0] if d else None) for d in dims))


def _reshape(a: Array, shape: tuple[int, ...], mesh, rules: ShardingRules | None) -> Array:
    """a.reshape(shape); under explicitly sharded mesh axes, with the sharding stated."""
    if rules is None or not _explicit(mesh, rules.tokens):
        return a.reshape(shape)
    spec = _token_spec_of_shape(shape, mesh, rules.tokens)
    return lax.reshape(a, shape, out_sharding=NamedSharding(mesh, spec))


def moe_sharded(
    x_td: Array, params: MoEParams, cfg: MoEConfig, mesh, rules: ShardingRules
) -> tuple[Array, MoEAux]:
    """The `xla`, `pallas` or `fused` implementation inside `jax.shard_map` over `mesh`
    (already checked)."""
    if cfg.implementation == "reference":
        raise ValueError(
            "implementation='reference' runs on one device; under a mesh use 'xla', 'pallas' "
            "or 'fused'"
        )
    axes = _Axes(
        expert=rules.experts,
        tokens=rules.tokens,
        num_devices=math.prod(mesh.shape[a] for a in rules.tokens),
        expert_devices=mesh.shape[rules.experts],
    )
    x_spec = rules.spec("tokens", "embed")
    param_specs = mesh_param_specs(params, rules)
    # A reshard inside jit, a transfer outside it: shard_map rejects mismatched inputs.
    x_td = shard_tokens(x_td, mesh, rules)
    params = shard_params(params, mesh, rules)
    local = jax.shard_map(
        functools.partial(_local_moe, cfg=cfg, axes=axes),
        mesh=mesh,
        in_specs=(x_spec, param_specs),
        out_specs=(x_spec, _aux_specs()),
    )
    return local(x_td, params)


_IMPLEMENTATIONS: dict[str, Callable[[Array, MoEParams, MoEConfig], tuple[Array, MoEAux]]] = {
    "reference": moe_reference,
    "xla": moe_xla,
    "pallas": moe_xla,
    "fused": moe_xla,
}


def _check_input(x: jax.typing.ArrayLike, cfg: MoEConfig) -> Array:
    if not isinstance(cfg, MoEConfig):
        raise ValueError(f"cfg must be a MoEConfig, got {type(cfg).__name__}")
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"x must have a floating dtype, got {dtype}: cast it yourself, the layer does not guess"
        )
    shape = jnp.shape(x)
    if len(shape) == 0 or shape[-1] != cfg.d_model:
        raise ValueError(f"x has shape {shape}; its last dimension must be d_model={cfg.d_model}")
    return jnp.asarray(x)


def _no_tokens(x: Array, cfg: MoEConfig) -> tuple[Array, MoEAux]:
    zero_f32, zero_i32 = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
    return x, MoEAux(
        aux_loss=zero_f32,
        z_loss=zero_f32,
        tokens_per_expert=jnp.zeros((cfg.num_experts,), jnp.int32),
        dropped=zero_i32,
        rounds=zero_i32,
    )


def _context_mesh():
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def resolution(
    cfg: MoEConfig, num_tokens: int, mesh=None, rules: ShardingRules | None = None
) -> Resolution:
    """What `moe` resolves cfg's "auto" choices to for `num_tokens` tokens in all (over the
    mesh's token-sharding devices, with `rules`' default; `mok_jax.resolve`)."""
    if mesh is None:
        return resolve(cfg, num_tokens=num_tokens)
    rules = ShardingRules() if rules is None else rules
    devices = math.prod(mesh.shape[a] for a in rules.tokens)
    return resolve(
        cfg,
        num_tokens=num_tokens // devices,
        meshed=True,
        expert_devices=mesh.shape[rules.experts],
    )


def moe(
    x: jax.typing.ArrayLike,
    params: MoEParams,
    cfg: MoEConfig,
    *,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    rules: ShardingRules | None = None,
) -> tuple[Array, MoEAux]:
    """Applies a Mixture-of-Experts layer (top-k routing, SwiGLU experts, weighted combine).

    Deterministic: the same inputs give the same bits, run after run, and y and dx are the same
    bits on every mesh (see the module docstring). Dropless unless `cfg.capacity_factor` is set.
    Differentiable in `x` and every parameter but `router_bias`.

    Args:
      x: [..., D] tokens, any float dtype; every leading dimension is a token dimension (T is
        their product). Computed in `cfg.dtype` with f32 accumulation.
      params: `MoEParams` with the shapes of `cfg` (see `init_params`).
      cfg: the layer's `MoEConfig` (static: hashable, pass it as a static jit argument).
      mesh: a mesh with the axes of `rules` (see `make_mesh`); the layer then runs expert
        parallel inside `jax.shard_map`, tokens sharded over (`data`, `expert`) and experts
        over `expert`. It places x and params itself, whatever their sharding. None: the
        mesh set by `jax.set_mesh`, if any, else one device.
      rules: the `ShardingRules` (default: tokens over ("data", "expert"), experts over
        "expert").

    Returns:
      (y, aux): y [..., D] with x's shape and dtype; aux a `MoEAux` with the load-balancing and
      z losses (f32 scalars, coefficients applied), tokens_per_expert int32 [E], dropped
      int32 [] and the exchange's rounds int32 [], all global (the same on every device).

    Raises:
      ValueError: x is not floating or its last dimension is not D, params do not fit cfg,
        the mesh cannot run it (no expert axis, E or T not divisible by the device counts,
        implementation 'reference'), or an explicit implementation or option cannot run or
        does not apply here (see `mok_jax.resolve`, which makes cfg's "auto" choices).

    Example:
      >>> cfg = mok_jax.presets["tiny"]
      >>> params = mok_jax.init_params(jax.random.key(0), cfg)
      >>> y, aux = jax.jit(mok_jax.moe, static_argnames="cfg")(jnp.ones((4, 16, 64)), params,
      ...                                                     cfg=cfg)
      >>> y.shape, aux.tokens_per_expert.sum()
      ((4, 16, 64), Array(128, dtype=int32))
    """
    x = _check_input(x, cfg)
    validate_params(params, cfg)
    mesh = _context_mesh() if mesh is None else mesh
    num_tokens = math.prod(x.shape[:-1])
    if mesh is not None:
        rules = ShardingRules() if rules is None else rules
        rules.check(mesh, cfg, num_tokens)
    cfg = resolution(cfg, num_tokens, mesh, rules).config
    if num_tokens == 0:
        return _no_tokens(x, cfg)
    if mesh is None:
        x_td = x.reshape(num_tokens, cfg.d_model)
        y_td, aux = _IMPLEMENTATIONS[cfg.implementation](x_td, params, cfg)
        return y_td.reshape(x.shape), aux
    x_td = _reshape(x, (num_tokens, cfg.d_model), mesh, rules)
    y_td, aux = moe_sharded(x_td, params, cfg, mesh, rules)
    return _reshape(y_td, x.shape, mesh, rules), aux
