"""Differentiable grouped matmuls: `jax.custom_vjp`s whose forward and backward run kernels.

  gmm         y = lhs @ rhs[g]                (rhs[g].T with transpose_rhs)
              d_lhs = gmm(dy, rhs, transpose_rhs=not transpose_rhs);  d_rhs = tgmm(lhs, dy)
              (tgmm(dy, lhs) with transpose_rhs)
  gmm with row_scale_m (the weighted down projection), y = s * (lhs @ rhs[g]) in f32:
              d_lhs = gmm(dy, rhs, transpose_rhs=True, row_scale_m=s) (scale in the epilogue)
              d_s = rowsum(dy * (lhs @ rhs[g])) in f32: the unscaled output is RECOMPUTED (one
              more gmm, f32 out) rather than stored (an [M, N] f32 residual); d_rhs = tgmm(lhs,
              s * dy), dy rounded before the product (`scaled_cotangent`).
  gmm_swiglu  h = silu(lhs @ w_gate[g]) * (lhs @ w_up[g])
              the backward recomputes gate and up (two f32 gmm calls; nothing stored), forms
              d_gate = dh * up * silu'(gate) and d_up = dh * silu(gate) in f32, casts them to
              the compute dtype, and runs ONE transposed gmm over [d_gate | d_up] (K = 2F, the
              weights read in two parts: no [w_gate | w_up] copy) for d_lhs and ONE tgmm for
              [d_w_gate | d_w_up] (stored as two arrays: no slices of a [G, K, 2F] product).

  swiglu_mlp  y = s * (swiglu(lhs @ w_gate[g], lhs @ w_up[g]) @ w_down[g]) in f32 (s optional),
              the whole expert MLP in one VJP. Its backward recomputes gate and up (nothing
              stored) and forms g = dy @ w_down[g].T (dy rounded to the compute dtype), h (the
              forward's bits), [d_gate | d_up] with dh = s * g, and d_s = rowsum(h * g) over F
              (no recomputed down projection), in one of two ways (`Recompute`):
              "gmm", the forward's gmm_swiglu kernel again (h, gate and up in the compute
              dtype, the bits a kept forward hands over) and one f32 gmm for g, then XLA's
              elementwise pass; "kernel", ONE kernel,
              `mosaic_gpu.gmm_swiglu_bwd`, whose epilogue forms them from the f32 gate and up
              with no f32 [M, F] array in HBM. Then gmm_swiglu's d_lhs and weight gradients,
              and d_w_down = tgmm(h, s * dy): 8 GEMM passes (in 5 kernels or 4), against the 11 of
              gmm_swiglu's and gmm's VJPs chained (whose h, gate/up and unscaled output are
              each recomputed). With `saved` (h, gate, up of the forward) g is one gmm and the
              rest as gmm_swiglu's backward: 6 passes, and "gmm"'s gradient bits.
              `swiglu_mlp_grads_from_g` takes g and s * dy formed elsewhere (the exchange's
              kernel, which forms g as dy arrives).
              With input_grad=False both hand back [d_gate | d_up] instead of d_lhs, whose
              GEMM (`swiglu_input_grad`) the exchange runs in the kernel that returns d_lhs.
Cotangents are cast to the compute dtype (lhs's) before they enter a kernel; weight gradients
come out in the weights' dtype, input gradients in lhs's, d_s in f32. group_sizes gets no
gradient. Every kernel call uses the defaults table's tiles (`tuning.py`).

Inside `jax.shard_map` a kernel's output is typed as invariant over the mesh axes whatever its
inputs, and a custom VJP's cotangents must have their primal's type. So the public functions
first make every operand vary over the axes any of them varies over (`vary_alike`: the
gradient of an operand made to vary comes back summed over those axes), and every kernel
result is made to vary over them too (`like`), both from pallas_kernels/mesh.py. Outside
shard_map both are no-ops.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Literal

import jax
import jax.numpy as jnp
from jax import Array

from pallas_kernels.grouped_matmul import mosaic_gpu
from pallas_kernels.grouped_matmul.mosaic_gpu_wgrad import tgmm
from pallas_kernels.mesh import like, vary_alike

# How swiglu_mlp's backward recomputes gate, up and g = dy @ w_down.T, and forms h,
# [d_gate | d_up] and d_s from them (module docstring). The same values either way (h to the
# bit; the rest to their f32 rounding and to that of gate and up, which "gmm" rounds to the
# compute dtype as the forward keeps them); on the H200 at qwen3_30b_a3b (131072 rows, D 2048,
# F 768) "gmm" took 3.03 ms and "kernel" 3.73 ms (bench/results/2026-12-01_fused_probe_h200),
# so "gmm" is the default; "kernel" keeps 3 f32 [M, F] arrays (12 * M * F bytes) out of HBM.
Recompute = Literal["gmm", "kernel"]
RECOMPUTES: tuple[str, ...] = typing.get_args(Recompute)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Static:
    transpose_rhs: bool = False
    out_dtype: jnp.dtype | None = None
    interpret: bool = False
    recompute: Recompute = "gmm"
    input_grad: bool = True  # the swiglu MLP's backward computes d_lhs (else [d_gate | d_up])


# ----------------------------------------------------------------------------------------------
# gmm


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gmm(static: _Static, lhs, rhs, group_sizes):
    out = mosaic_gpu.gmm(
        lhs,
        rhs,
        group_sizes,
        transpose_rhs=static.transpose_rhs,
        out_dtype=static.out_dtype,
        interpret=static.interpret,
    )
    return like(out, lhs)


def _gmm_fwd(static, lhs, rhs, group_sizes):
    return _gmm(static, lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _gmm_bwd(static, residuals, dy):
    lhs, rhs, group_sizes = residuals
    dy = dy.astype(lhs.dtype)
    d_lhs = mosaic_gpu.gmm(
        dy, rhs, group_sizes, transpose_rhs=not static.transpose_rhs, interpret=static.interpret
    )
    if static.transpose_rhs:
        d_rhs = tgmm(dy, lhs, group_sizes, out_dtype=rhs.dtype, interpret=static.interpret)
    else:
        d_rhs = tgmm(lhs, dy, group_sizes, out_dtype=rhs.dtype, interpret=static.interpret)
    return like(d_lhs, lhs), like(d_rhs, rhs), None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


# ----------------------------------------------------------------------------------------------
# gmm with a row scale (the weighted down projection), f32 out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gmm_scaled(static: _Static, lhs, rhs, group_sizes, row_scale):
    out = mosaic_gpu.gmm(
        lhs,
        rhs,
        group_sizes,
        row_scale_m=row_scale,
        out_dtype=jnp.float32,
        interpret=static.interpret,
    )
    return like(out, lhs)


def _gmm_scaled_fwd(static, lhs, rhs, group_sizes, row_scale):
    out = _gmm_scaled(static, lhs, rhs, group_sizes, row_scale)
    return out, (lhs, rhs, group_sizes, row_scale)


def scaled_cotangent(dy_c: Array, row_scale: Array) -> Array:
    """dy times the row scale, for the down projection's weight gradient: dy_c [M, N] (the
    cotangent already rounded to the compute dtype, as the GEMMs read it) times row_scale f32
    [M] in f32, rounded to dy_c's dtype. From the rounded dy, not the f32 one, so that a
    device that receives only the rounded rows (the exchange's backward,
    pallas_kernels/exchange) forms the same bits as one that holds the f32 cotangent."""
    return (dy_c.astype(jnp.float32) * row_scale.astype(jnp.float32)[:, None]).astype(dy_c.dtype)


def _gmm_scaled_bwd(static, residuals, dy):
    lhs, rhs, group_sizes, row_scale = residuals
    run = functools.partial(mosaic_gpu.gmm, interpret=static.interpret)
    # d_s = rowsum(dy * (lhs @ rhs[g])) in f32, from the recomputed unscaled output.
    unscaled = like(run(lhs, rhs, group_sizes, out_dtype=jnp.float32), lhs)
    d_scale = jnp.sum(dy.astype(jnp.float32) * unscaled, axis=1)
    dy_c = dy.astype(lhs.dtype)
    # d_lhs = s * (dy @ rhs[g].T): the scale in the epilogue, in f32, before the cast.
    d_lhs = run(dy_c, rhs, group_sizes, transpose_rhs=True, row_scale_m=row_scale)
    scaled_dy = scaled_cotangent(dy_c, row_scale)
    d_rhs = tgmm(lhs, scaled_dy, group_sizes, out_dtype=rhs.dtype, interpret=static.interpret)
    return like(d_lhs, lhs), like(d_rhs, rhs), None, d_scale


_gmm_scaled.defvjp(_gmm_scaled_fwd, _gmm_scaled_bwd)


def gmm(
    lhs_mk: Array,
    rhs_gkn: Array,
    group_sizes_g: Array,
    *,
    transpose_rhs: bool = False,
    row_scale_m: Array | None = None,
    out_dtype=None,
    interpret: bool = False,
) -> Array:
    """Differentiable `mosaic_gpu.gmm`: [M, K] x [G, K, N] -> [M, N] (rhs [G, N, K] if
    `transpose_rhs`). With `row_scale_m` (f32 [M]) the output is f32, each row times its scale,
    and the scale gets a gradient too (not with transpose_rhs)."""
    if row_scale_m is None:
        static = _Static(transpose_rhs=transpose_rhs, out_dtype=out_dtype, interpret=interpret)
        return _gmm(static, *vary_alike(lhs_mk, rhs_gkn, group_sizes_g))
    if transpose_rhs:
        raise ValueError("row_scale_m is supported with transpose_rhs=False only")
    if out_dtype is not None and jnp.dtype(out_dtype) != jnp.float32:
        raise ValueError(
            f"with row_scale_m the output is float32, got out_dtype={jnp.dtype(out_dtype).name}"
        )
    operands = vary_alike(lhs_mk, rhs_gkn, group_sizes_g, row_scale_m)
    return _gmm_scaled(_Static(interpret=interpret), *operands)


# ----------------------------------------------------------------------------------------------
# gmm_swiglu


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gmm_swiglu(static: _Static, lhs, w_gate, w_up, group_sizes):
    out = mosaic_gpu.gmm_swiglu(lhs, w_gate, w_up, group_sizes, interpret=static.interpret)
    return like(out, lhs)


def _gmm_swiglu_fwd(static, lhs, w_gate, w_up, group_sizes):
    out = _gmm_swiglu(static, lhs, w_gate, w_up, group_sizes)
    return out, (lhs, w_gate, w_up, group_sizes)


def _gate_up(static, lhs, w_gate, w_up, group_sizes) -> tuple[Array, Array]:
    """The f32 gate and up projections (recomputed for a backward)."""
    run = functools.partial(mosaic_gpu.gmm, out_dtype=jnp.float32, interpret=static.interpret)
    return like(run(lhs, w_gate, group_sizes), lhs), like(run(lhs, w_up, group_sizes), lhs)


def _gmm_swiglu_bwd(static, residuals, dh):
    lhs, w_gate, w_up, group_sizes = residuals
    gate, up = _gate_up(static, lhs, w_gate, w_up, group_sizes)
    return _swiglu_input_grads(static, residuals, gate, up, dh.astype(jnp.float32))


def _swiglu_input_grads(static, residuals, gate, up, dh):
    """(d_lhs, d_w_gate, d_w_up, None) of h = silu(lhs @ w_gate) * (lhs @ w_up), from the f32
    gate, up and dh."""
    lhs = residuals[0]
    sig = jax.nn.sigmoid(gate)
    d_gate = dh * up * (sig * (1.0 + gate * (1.0 - sig)))
    d_up = dh * (gate * sig)
    d_gate_up = jnp.concatenate([d_gate, d_up], axis=1).astype(lhs.dtype)
    return (*_gate_up_grads(static, residuals, d_gate_up), None)


def swiglu_input_grad(
    d_gate_up_m2f: Array,
    w_gate_gkf: Array,
    w_up_gkf: Array,
    group_sizes_g: Array,
    *,
    interpret: bool = False,
) -> Array:
    """The expert MLP's input gradient from [d_gate | d_up] ([M, 2F]) -> [M, K] in its dtype:
    [d_gate | d_up] @ [w_gate | w_up][g].T, one transposed gmm over K = 2F with the weights
    read as two parts along K (no concatenated copy of them). `swiglu_mlp_grads(...,
    input_grad=False)` leaves this GEMM to its caller, which runs it here or in a kernel of
    its own (`exchange.mosaic_gpu.dgrad_return`, the same bits)."""
    return like(
        mosaic_gpu.gmm(d_gate_up_m2f, (w_gate_gkf, w_up_gkf), group_sizes_g, transpose_rhs=True,
                       interpret=interpret),
        d_gate_up_m2f,
    )  # fmt: skip


def _gate_up_grads(static, residuals, d_gate_up):
    """(d_lhs, d_w_gate, d_w_up) from [d_gate | d_up] ([M, 2F], lhs dtype); d_gate_up itself
    in place of d_lhs without static.input_grad."""
    lhs, w_gate, w_up, group_sizes = residuals
    d_lhs = (
        swiglu_input_grad(d_gate_up, w_gate, w_up, group_sizes, interpret=static.interpret)
        if static.input_grad
        else d_gate_up
    )
    # ONE tgmm for [d_w_gate | d_w_up], stored as two arrays (no slicing copies).
    d_w_gate, d_w_up = tgmm(
        lhs, d_gate_up, group_sizes, out_dtype=w_gate.dtype, out_parts=2, interpret=static.interpret
    )
    return like(d_lhs, lhs), like(d_w_gate, w_gate), like(d_w_up, w_up)


_gmm_swiglu.defvjp(_gmm_swiglu_fwd, _gmm_swiglu_bwd)


def gmm_swiglu(
    lhs_mk: Array,
    w_gate_gkf: Array,
    w_up_gkf: Array,
    group_sizes_g: Array,
    *,
    interpret: bool = False,
) -> Array:
    """Differentiable `mosaic_gpu.gmm_swiglu`: silu(lhs @ w_gate[g]) * (lhs @ w_up[g]) -> [M, F]
    in lhs dtype."""
    operands = vary_alike(lhs_mk, w_gate_gkf, w_up_gkf, group_sizes_g)
    return _gmm_swiglu(_Static(interpret=interpret), *operands)


# ----------------------------------------------------------------------------------------------
# swiglu_mlp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _swiglu_mlp(static: _Static, lhs, w_gate, w_up, w_down, group_sizes, row_scale):
    h = mosaic_gpu.gmm_swiglu(lhs, w_gate, w_up, group_sizes, interpret=static.interpret)
    out = mosaic_gpu.gmm(
        h,
        w_down,
        group_sizes,
        row_scale_m=row_scale,
        out_dtype=jnp.float32,
        interpret=static.interpret,
    )
    return like(out, lhs)


def _swiglu_mlp_fwd(static, *operands):
    return _swiglu_mlp(static, *operands), operands


def _swiglu_mlp_bwd(static, residuals, dy):
    return swiglu_mlp_grads(*residuals, dy, recompute=static.recompute, interpret=static.interpret)


def swiglu_mlp_grads(
    lhs: Array,
    w_gate: Array,
    w_up: Array,
    w_down: Array,
    group_sizes: Array,
    row_scale: Array | None,
    dy: Array,
    *,
    saved: tuple[Array, Array, Array] | None = None,
    recompute: Recompute = "gmm",
    input_grad: bool = True,
    interpret: bool = False,
) -> tuple[Array, Array, Array, Array, None, Array | None]:
    """The gradients of `swiglu_mlp` for its output's cotangent dy (f32 [M, N]): (d_lhs,
    d_w_gate, d_w_up, d_w_down, None, d_row_scale), d_row_scale None without a row scale.
    dy enters the GEMMs rounded to lhs's dtype, d_row_scale included (f32 out, from that
    rounded dy). Public for `fused` layers whose forward reads lhs rows another way (gathered
    in-kernel). Outside shard_map, or with operands that already vary over the same mesh axes
    (`swiglu_mlp` aligns them; this function does not). Without `saved`, gate and up are
    recomputed as `recompute` says (`Recompute`). Without `input_grad` the first output is
    [d_gate | d_up] ([M, 2F], lhs dtype) instead of d_lhs: its caller runs d_lhs's GEMM
    (`swiglu_input_grad`), e.g. in the kernel that also returns it to the rows' sources."""
    if recompute not in RECOMPUTES:
        raise ValueError(f"recompute={recompute!r} must be one of {RECOMPUTES}")
    static = _Static(interpret=interpret, input_grad=input_grad)
    dy_c = dy.astype(lhs.dtype)
    scale = None if row_scale is None else row_scale.astype(jnp.float32)[:, None]
    # dy times the row scale, for d_w_down.
    dy_down = dy_c if row_scale is None else scaled_cotangent(dy_c, row_scale)
    if saved is None and recompute == "gmm":
        saved = _recomputed(static, lhs, w_gate, w_up, group_sizes)
    if saved is None:
        # One kernel: gate, up and g = dy @ w_down.T over K = D, and from them (in its epilogue,
        # nothing f32 stored) h, [d_gate | d_up] and d_s.
        h, d_gate_up, d_scale = mosaic_gpu.gmm_swiglu_bwd(
            lhs,
            dy_c,
            w_gate,
            w_up,
            w_down,
            group_sizes,
            row_scale_m=None if row_scale is None else row_scale.astype(jnp.float32),
            interpret=interpret,
        )
        h, d_gate_up = like(h, lhs), like(d_gate_up, lhs)
        d_scale = None if d_scale is None else like(d_scale, lhs)
        d_w_down = tgmm(h, dy_down, group_sizes, out_dtype=w_down.dtype, interpret=interpret)
        d_lhs, d_w_gate, d_w_up = _gate_up_grads(
            static, (lhs, w_gate, w_up, group_sizes), d_gate_up
        )
        return d_lhs, d_w_gate, d_w_up, like(d_w_down, w_down), None, d_scale
    # g = dy @ w_down[g].T in f32: dh without the row scale.
    g = like(
        mosaic_gpu.gmm(
            dy_c,
            w_down,
            group_sizes,
            transpose_rhs=True,
            out_dtype=jnp.float32,
            interpret=interpret,
        ),
        lhs,
    )
    # h, gate and up recomputed above, or the forward's (gmm_swiglu(gate_up_out=True)).
    return _grads_from_g(static, lhs, w_gate, w_up, w_down, group_sizes, scale, saved, g, dy_down)


def _grads_from_g(static, lhs, w_gate, w_up, w_down, group_sizes, scale, saved, g, dy_down):
    """`swiglu_mlp_grads`' last steps, from (h, gate, up) (lhs dtype: the forward's kept
    ones or `_recomputed`'s, the same bits), g = dy @ w_down[g].T (f32) and dy_down (dy times
    the row scale, lhs dtype)."""
    h, gate, up = saved
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if scale is None:
        dh, d_scale = g, None
    else:
        dh = g * scale
        # d_s = rowsum(dy * (h @ w_down[g])) = rowsum(h * (dy @ w_down[g].T)): over F.
        d_scale = jnp.sum(h.astype(jnp.float32) * g, axis=1)
    d_w_down = tgmm(h, dy_down, group_sizes, out_dtype=w_down.dtype, interpret=static.interpret)
    d_lhs, d_w_gate, d_w_up, _ = _swiglu_input_grads(
        static, (lhs, w_gate, w_up, group_sizes), gate, up, dh
    )
    return d_lhs, d_w_gate, d_w_up, like(d_w_down, w_down), None, d_scale


def swiglu_mlp_grads_from_g(
    lhs: Array,
    w_gate: Array,
    w_up: Array,
    w_down: Array,
    group_sizes: Array,
    row_scale: Array | None,
    g: Array,
    dy_down: Array,
    *,
    input_grad: bool = True,
    interpret: bool = False,
) -> tuple[Array, Array, Array, Array, None, Array | None]:
    """`swiglu_mlp_grads(..., dy, recompute="gmm")` from its first backward GEMM's result
    instead of dy: g = gmm(dy.astype(lhs.dtype), w_down, group_sizes, transpose_rhs=True,
    out_dtype=f32) ([M, F]) and dy_down = scaled_cotangent(dy.astype(lhs.dtype), row_scale)
    ([M, N]; dy.astype(lhs.dtype) without a row scale), computed elsewhere (after the
    exchange's kernel, pallas_kernels/exchange, which sends dy rounded and computes g). The
    same outputs, bit for bit; gate and up are recomputed. `input_grad` as in
    `swiglu_mlp_grads`."""
    static = _Static(interpret=interpret, input_grad=input_grad)
    scale = None if row_scale is None else row_scale.astype(jnp.float32)[:, None]
    saved = _recomputed(static, lhs, w_gate, w_up, group_sizes)
    return _grads_from_g(static, lhs, w_gate, w_up, w_down, group_sizes, scale, saved, g, dy_down)


def _recomputed(static, lhs, w_gate, w_up, group_sizes) -> tuple[Array, Array, Array]:
    """(h, gate, up) recomputed (recompute "gmm"), all three in lhs's dtype, by the forward's
    own kernel: gmm_swiglu(gate_up_out=True), whose outputs a `fused` layer with residuals
    "gate_up" keeps.

    Invariant: the backward that recomputes them and the one handed the kept ones feed
    `_grads_from_g` the same bits, on a GPU too. There the kernel's epilogue computes h with
    its own exp and division, which XLA's need not match bit for bit (measured on an H100: h
    recomputed in XLA from two gmm products changed dx and the weights' gradients), so h, gate
    and up all come from the one kernel (a row's bits do not depend on where its group starts:
    gmm invariant 1)."""
    h, gate, up = mosaic_gpu.gmm_swiglu(
        lhs, w_gate, w_up, group_sizes, gate_up_out=True, interpret=static.interpret
    )
    return like(h, lhs), like(gate, lhs), like(up, lhs)


_swiglu_mlp.defvjp(_swiglu_mlp_fwd, _swiglu_mlp_bwd)


def swiglu_mlp(
    lhs_mk: Array,
    w_gate_gkf: Array,
    w_up_gkf: Array,
    w_down_gfk: Array,
    group_sizes_g: Array,
    *,
    row_scale_m: Array | None = None,
    recompute: Recompute = "gmm",
    interpret: bool = False,
) -> Array:
    """Differentiable expert MLP on grouped rows: lhs [M, K] -> f32 [M, K],
    swiglu(lhs @ w_gate[g], lhs @ w_up[g]) @ w_down[g], each row times row_scale_m (f32 [M],
    optional, which then gets a gradient). The forward is `mosaic_gpu.gmm_swiglu` then
    `mosaic_gpu.gmm`, bit for bit; the backward runs 8 GEMM passes (module docstring), its
    recomputation as `recompute` says (`Recompute`)."""
    if recompute not in RECOMPUTES:
        raise ValueError(f"recompute={recompute!r} must be one of {RECOMPUTES}")
    operands = vary_alike(lhs_mk, w_gate_gkf, w_up_gkf, w_down_gfk, group_sizes_g, row_scale_m)
    return _swiglu_mlp(_Static(interpret=interpret, recompute=recompute), *operands)
