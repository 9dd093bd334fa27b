"""Expert compute: SwiGLU over expert-sorted rows as grouped GEMMs, and the shared experts.

Numerics (every implementation): inputs and weights are cast to the compute dtype, products
accumulate in f32, SwiGLU runs in f32, its output h is cast to the compute dtype for the down
projection, and the down projection's f32 result goes to the combine unrounded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from mok_jax.options import RECOMPUTES, RESIDUALS, ROWS
from mok_jax.permute import tokens_to_rows
from pallas_kernels.mesh import like, vary_alike


def dot_precision(dtype: np.dtype) -> lax.Precision | None:
    """Full precision for f32 compute (no TF32 on GPU); the default for 16-bit inputs."""
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def swiglu(gate: Array, up: Array) -> Array:
    """silu(gate) * up, in f32."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    return jax.nn.silu(gate) * up


def grouped_swiglu_ragged(
    x_nd: Array,
    w_gate_edf: Array,
    w_up_edf: Array,
    w_down_efd: Array,
    group_sizes_e: Array,
    dtype: np.dtype,
) -> Array:
    """Rows sorted by expert [N, D] -> f32 [N, D], with `jax.lax.ragged_dot`.

    Rows past sum(group_sizes_e) belong to no expert and come out as zeros.
    """
    precision = dot_precision(dtype)

    def grouped(lhs, rhs):
        return lax.ragged_dot(
            lhs.astype(dtype),
            rhs.astype(dtype),
            group_sizes_e,
            precision=precision,
            preferred_element_type=jnp.float32,
        )

    x_nd = x_nd.astype(dtype)
    h_nf = swiglu(grouped(x_nd, w_gate_edf), grouped(x_nd, w_up_edf))
    return grouped(h_nf, w_down_efd)


def dense_swiglu(
    x_td: Array, w_gate_df: Array, w_up_df: Array, w_down_fd: Array, dtype: np.dtype
) -> Array:
    """One SwiGLU applied to every token: x [T, D] -> f32 [T, D] (the shared experts)."""
    precision = dot_precision(dtype)

    def dense(lhs, rhs):
        return jnp.dot(
            lhs.astype(dtype),
            rhs.astype(dtype),
            precision=precision,
            preferred_element_type=jnp.float32,
        )

    h_tf = swiglu(dense(x_td, w_gate_df), dense(x_td, w_up_df))
    return dense(h_tf, w_down_fd)


def _check_kernel_dtype(dtype: np.dtype) -> None:
    """The Mosaic GPU kernels compute in bfloat16 or float16."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"dtype={jnp.dtype(dtype).name} must be bfloat16 or float16")


def grouped_swiglu_pallas(
    x_nd: Array,
    w_gate_edf: Array,
    w_up_edf: Array,
    w_down_efd: Array,
    group_sizes_e: Array,
    dtype: np.dtype,
    weights_n: Array | None = None,
    *,
    interpret: bool = False,
) -> Array:
    """Rows sorted by expert [N, D] -> f32 [N, D], with the Mosaic GPU grouped-GEMM kernels.

    The contract of `grouped_swiglu_ragged` (module docstring), differentiable (custom VJPs that
    run kernels forward and backward). Gate and up run in one kernel with SwiGLU in its
    epilogue; with `weights_n` (f32 [N]) the down projection's epilogue multiplies each row by
    its weight (in f32) and the weighted rows are returned, and `weights_n` gets a gradient.
    Rows past sum(group_sizes_e) come out as zeros. `dtype` must be bfloat16 or float16; D and F
    must be multiples of 64 (the defaults table's tiles narrow to fit). `interpret=True` runs the
    kernels under GPU interpret mode (CPU tests). The backward recomputes gate and up as
    `ops.swiglu_mlp` does by default (`ops.Recompute` "gmm").

    Example:
      y_nd = grouped_swiglu_pallas(x, w_gate, w_up, w_down, sizes, jnp.bfloat16, weights_n=w)
    """
    # Imported here: the kernels load only when the pallas implementation runs.
    from pallas_kernels.grouped_matmul import ops as grouped_ops

    _check_kernel_dtype(dtype)
    if weights_n is not None:
        weights_n = weights_n.astype(jnp.float32)
    weights = (w.astype(dtype) for w in (w_gate_edf, w_up_edf, w_down_efd))
    return grouped_ops.swiglu_mlp(
        x_nd.astype(dtype), *weights, group_sizes_e, row_scale_m=weights_n, interpret=interpret
    )


def grouped_swiglu_fused(
    x_td: Array,
    w_gate_edf: Array,
    w_up_edf: Array,
    w_down_efd: Array,
    scale_n: Array,
    group_sizes_e: Array,
    order_n: Array,
    inverse_n: Array,
    top_k: int,
    dtype: np.dtype,
    *,
    rows: str = "copied",
    residuals: str = "inputs",
    recompute: str = "gmm",
    interpret: bool = False,
) -> Array:
    """Tokens x [T, D] -> f32 [N, D], row p the SwiGLU of token order_n[p] // top_k with its
    expert's weights, times scale_n[p]: the expert-sorted rows of a plan (N = T * top_k).

    `grouped_swiglu_pallas(x_td[order_n // top_k], ..., weights_n=scale_n)` bit for bit: h [N, F]
    is written once, and the down projection's epilogue multiplies each row by its scale in
    f32. `rows` (options.Rows): "gathered", the gate/up kernel loads each row from x
    through the plan's order (`lhs_rows_m`), with no permuted copy of the tokens; "copied",
    it runs on that copy (x[order_n // top_k], one XLA gather), which is faster on the H200.
    Differentiable in x, the weights and scale_n; the backward is `ops.swiglu_mlp`'s on the
    rows gathered once. `residuals` (options.Residuals): "inputs", it recomputes gate and
    up (8 GEMM passes); "gate_up", the forward's kernel also stores gate and up and keeps them
    with h for the backward (3 [N, F] arrays in `dtype` more memory, 6 GEMM passes).
    `recompute` (options.Recompute), with "inputs": how gate and up are recomputed; "gmm"
    rounds them to `dtype` as "gate_up" keeps them, so the two give the same gradient bits.
    `dtype` bfloat16 or float16; D and F multiples of 64.

    Shapes: w_gate, w_up [E, D, F]; w_down [E, F, D]; scale_n f32 [N]; group_sizes_e int32 [E]
    (the plan's, summing to N); order_n, inverse_n int32 [N] (the plan's permutation).

    Its custom VJP lives here, not in pallas_kernels' ops.py: the backward needs the plan's
    permutation of tokens into rows (`permute.tokens_to_rows`), which is the layer's.

    Example:
      plan = make_plan(experts_tk, num_experts)
      y_nd = grouped_swiglu_fused(x, w_gate, w_up, w_down, weights_n[plan.order_n],
                                  plan.group_sizes_e, plan.order_n, plan.inverse_n, top_k,
                                  jnp.bfloat16)
    """
    _check_kernel_dtype(dtype)
    if rows not in ROWS:
        raise ValueError(f"rows={rows!r} must be one of {ROWS}")
    if residuals not in RESIDUALS:
        raise ValueError(f"residuals={residuals!r} must be one of {RESIDUALS}")
    if recompute not in RECOMPUTES:
        raise ValueError(f"recompute={recompute!r} must be one of {RECOMPUTES}")
    weights = tuple(w.astype(dtype) for w in (w_gate_edf, w_up_edf, w_down_efd))
    # Inside shard_map (a mesh of data axes): every operand varies over the mesh axes any of
    # them varies over, as in ops.swiglu_mlp: the weights meet every device's rows, so their
    # gradients come back summed over those axes.
    operands = vary_alike(
        x_td.astype(dtype), *weights, scale_n.astype(jnp.float32), group_sizes_e, order_n,
        inverse_n,
    )  # fmt: skip
    return _fused((top_k, rows, residuals, recompute, interpret), *operands)


def _fused_forward(
    static, x_td, w_gate, w_up, w_down, scale_n, group_sizes_e, order_n, _, *, keep: bool
):
    """(y_nd, (h, gate, up) if `keep` else None): the two kernels, the gate/up kernel's rows
    read from x through the plan's order or from their copy."""
    from pallas_kernels.grouped_matmul import mosaic_gpu

    top_k, rows, _, _, interpret = static
    rows_n = order_n // top_k
    swiglu = functools.partial(mosaic_gpu.gmm_swiglu, gate_up_out=keep, interpret=interpret)
    if rows == "gathered":
        out = swiglu(x_td, w_gate, w_up, group_sizes_e, lhs_rows_m=rows_n)
    else:
        out = swiglu(jnp.take(x_td, rows_n, axis=0), w_gate, w_up, group_sizes_e)
    # A kernel's outputs typed to vary as its operands (the kernels' types drop it): a y typed
    # invariant under a mesh of data axes would have its cotangent summed over them.
    out = jax.tree.map(lambda a: like(a, x_td), out)
    h_nf = out[0] if keep else out
    y_nd = mosaic_gpu.gmm(
        h_nf,
        w_down,
        group_sizes_e,
        row_scale_m=scale_n,
        out_dtype=jnp.float32,
        interpret=interpret,
    )
    return like(y_nd, x_td), (out if keep else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(static, *operands):
    return _fused_forward(static, *operands, keep=False)[0]


def _fused_fwd(static, *operands):
    y_nd, saved = _fused_forward(static, *operands, keep=static[2] == "gate_up")
    return y_nd, (operands, saved)


def _fused_bwd(static, residuals, g_nd):
    from pallas_kernels.grouped_matmul import ops as grouped_ops

    top_k, _, _, recompute, interpret = static
    operands, saved = residuals
    x_td, w_gate, w_up, w_down, scale_n, group_sizes_e, order_n, inverse_n = operands

    # The gradients of the unfused kernels' VJP (ops.swiglu_mlp: gate and up recomputed once,
    # or with residuals "gate_up" the forward's h, gate and up) on the rows gathered once; x's
    # gradient sums each token's rows in slot order (tokens_to_rows's backward: a gather and a
    # fixed-order sum, no scatter-add).
    x_nd, rows_vjp = jax.vjp(lambda x: tokens_to_rows(x, order_n, inverse_n, top_k), x_td)
    d_x_nd, d_w_gate, d_w_up, d_w_down, _, d_scale = grouped_ops.swiglu_mlp_grads(
        x_nd,
        w_gate,
        w_up,
        w_down,
        group_sizes_e,
        scale_n,
        g_nd,
        saved=saved,
        recompute=recompute,
        interpret=interpret,
    )
    (d_x_td,) = rows_vjp(d_x_nd)
    return d_x_td, d_w_gate, d_w_up, d_w_down, d_scale, None, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)
