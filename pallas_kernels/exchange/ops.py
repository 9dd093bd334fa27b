"""The exchange's copies as a differentiable op: `send_rows(src, moves, back, round, ...)`.

A copy's gradient is the copy back: the cotangent of the output travels along `back`, the
reverse direction's tables (what each device sends when the roles swap), into the source's
rows. No scatter-add: every destination row has one source (the protocol's invariant 1), so
the reverse is a copy too.

`dispatch_mlp(x, scale, moves, back, round, w_gate, w_up, w_down, group_sizes, ...)` is a
round's exchange and expert MLP as one differentiable op: its forward runs the dispatch inside
the gate/up GEMMs' kernel (`mosaic_gpu.dispatch_swiglu`) and the return inside the down
projection's (`mosaic_gpu.down_return`). It saves the rows, not the buffer: its backward
dispatches them again, with their weights and the results' cotangent (with recompute "gmm",
all inside the kernel of the first backward GEMM: `mosaic_gpu.dispatch_down_grad`), runs the
rest of `grouped_matmul.ops.swiglu_mlp_grads` there, and returns the input gradient and the
routing weights' inside the input gradient's GEMM's kernel (`mosaic_gpu.dgrad_return`).
The values and gradients are those of `send_rows`, then `grouped_matmul.ops.swiglu_mlp`,
then `send_rows` back.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Literal

import jax
import jax.numpy as jnp
from jax import Array, lax

from pallas_kernels.exchange import mosaic_gpu, reference, tuning
from pallas_kernels.exchange.moves import Moves
from pallas_kernels.grouped_matmul import mosaic_gpu as grouped_kernel
from pallas_kernels.grouped_matmul import ops as grouped_ops
from pallas_kernels.mesh import like, vary_alike

Implementation = Literal["auto", "mosaic_gpu", "reference"]
# Which kernels of `dispatch_mlp` (with exchange programs, on a GPU) carry the exchange's copies:
# "per_gemm", each copy inside the kernel of the GEMM next to it (the forward's dispatch with
# gate/up, `mosaic_gpu.dispatch_swiglu`; its return with the down projection,
# `mosaic_gpu.down_return`); "forward", the round's whole forward (dispatch, gate/up, down and
# return) in one kernel, `mosaic_gpu.dispatch_mlp_return`. The same bits; the backward's
# kernels are the same with either.
ExchangeFusion = Literal["per_gemm", "forward"]
EXCHANGE_FUSIONS: tuple[str, ...] = typing.get_args(ExchangeFusion)


def _send(src_ad, moves, round_index, out_rows, axis_name, implementation):
    run_kernel = functools.partial(mosaic_gpu.send_rows, out_rows=out_rows, axis_name=axis_name)
    run_reference = functools.partial(reference.send_rows, out_rows=out_rows, axis_name=axis_name)
    if implementation == "mosaic_gpu":
        return run_kernel(src_ad, moves, round_index)
    if implementation == "reference":
        return run_reference(src_ad, moves, round_index)
    # "auto": the kernel on GPUs; the all_gather spec on the CPU (Mosaic GPU's interpret mode
    # has no remote refs or semaphores).
    return lax.platform_dependent(src_ad, moves, round_index, cpu=run_reference, default=run_kernel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def send_rows(
    src_ad: Array,
    moves: Moves,
    back: Moves,
    round_index: Array,
    out_rows: int,
    axis_name: str,
    implementation: Implementation = "auto",
) -> Array:
    """Round `round_index` of one direction of the exchange: src [A, D] -> [out_rows, D], the
    rows every device's `moves` copy to this device, zeros in its zero ranges (inside
    `jax.shard_map` over `axis_name`; other rows are unspecified with the kernel, zeros with
    the reference).

    `back` are the reverse direction's tables (this device's copies from its output rows back
    to the source rows, with its own zero ranges); the gradient travels along them, so the
    gradient of a source row that no copy of the round reads is unspecified with the kernel
    (zero with the reference) unless `back`'s zero ranges cover it. implementation: "auto"
    (the Mosaic GPU kernel on GPUs, the reference on the CPU), "mosaic_gpu" or "reference".
    """
    return _send(src_ad, moves, round_index, out_rows, axis_name, implementation)


def _send_rows_fwd(src_ad, moves, back, round_index, out_rows, axis_name, implementation):
    out = _send(src_ad, moves, round_index, out_rows, axis_name, implementation)
    return out, (back, round_index, src_ad.shape[0])


def _send_rows_bwd(out_rows, axis_name, implementation, residuals, g_od):
    back, round_index, num_rows = residuals
    del out_rows
    g_ad = _send(g_od, back, round_index, num_rows, axis_name, implementation)
    return g_ad, None, None, None


send_rows.defvjp(_send_rows_fwd, _send_rows_bwd)


# ----------------------------------------------------------------------------------------------
# The dispatch and the expert MLP: the dispatch overlapped with the first GEMMs.


@dataclasses.dataclass(frozen=True, kw_only=True)
class _MlpStatic:
    out_rows: int
    tile: int
    axis_name: str
    recompute: grouped_ops.Recompute
    exchange_programs: int
    grad_exchange_programs: int
    exchange_fusion: ExchangeFusion
    interpret: bool


def _column4(v_n: Array) -> Array:
    """f32 [N] -> [N, 4], v in the first column, zeros after: a 16-byte row, as a copy moves
    whole 16-byte chunks. A concatenate, not a broadcast, so that v's gradient is the first
    column's, bit for bit."""
    return jnp.concatenate([v_n[:, None], jnp.zeros((v_n.shape[0], 3), jnp.float32)], 1)


def _dispatch_gate_up(static: _MlpStatic, x_nd, scale_n, moves, round_index, w_gate, w_up,
                      group_sizes):  # fmt: skip
    """(buffer [S, D], routing weights [S], h [S, F]) of the round: by the overlapped kernel
    (exchange_programs > 0), by the exchange kernel then gmm_swiglu (0), or with `interpret` (the
    CPU) by `send_rows` (its spec there) then gmm_swiglu in interpret mode."""
    scale_n4 = _column4(scale_n)
    send = functools.partial(
        _send, out_rows=static.out_rows, axis_name=static.axis_name, implementation="auto"
    )

    def separate(interpret: bool):
        def run(x_nd, scale_n4, moves, round_index, w_gate, w_up, group_sizes):
            buffer = send(x_nd, moves, round_index)
            side = send(scale_n4, moves, round_index)
            h = grouped_kernel.gmm_swiglu(buffer, w_gate, w_up, group_sizes, interpret=interpret)
            return buffer, side, like(h, buffer)

        return run

    def overlapped(x_nd, scale_n4, moves, round_index, w_gate, w_up, group_sizes):
        return mosaic_gpu.dispatch_swiglu(
            x_nd,
            scale_n4,
            moves,
            round_index,
            w_gate,
            w_up,
            group_sizes,
            out_rows=static.out_rows,
            tile=static.tile,
            axis_name=static.axis_name,
            exchange_programs=static.exchange_programs,
        )

    if static.interpret:
        run = separate(interpret=True)
    else:
        run = overlapped if static.exchange_programs else separate(interpret=False)
    buffer, side, h = run(x_nd, scale_n4, moves, round_index, w_gate, w_up, group_sizes)
    return buffer, side[:, 0], h


def _down_return(static: _MlpStatic, h, scale_s, w_down, group_sizes, back, round_index,
                 num_rows: int):  # fmt: skip
    """The round's results back at their sources, f32 [N, D] (rows of other rounds
    unspecified): the down projection with the weights in its epilogue, then the return along
    `back`; by the overlapped kernel (exchange_programs > 0), by gmm then the exchange kernel (0),
    or with `interpret` by gmm in interpret mode then `send_rows` (its spec on the CPU)."""
    if static.exchange_programs and not static.interpret:
        _, out = mosaic_gpu.down_return(
            h,
            scale_s,
            w_down,
            group_sizes,
            back,
            round_index,
            out_rows=num_rows,
            axis_name=static.axis_name,
            exchange_programs=static.exchange_programs,
        )
        return out
    y = grouped_kernel.gmm(
        h,
        w_down,
        group_sizes,
        row_scale_m=scale_s,
        out_dtype=jnp.float32,
        interpret=static.interpret,
    )
    y = like(y, h)
    return _send(y, back, round_index, num_rows, static.axis_name, "auto")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch_mlp(static, x_nd, scale_n, moves, back, round_index, w_gate, w_up, w_down,
                  group_sizes):  # fmt: skip
    return _dispatch_mlp_fwd(static, x_nd, scale_n, moves, back, round_index, w_gate, w_up,
                             w_down, group_sizes)[0]  # fmt: skip


def _dispatch_mlp_fwd(static, x_nd, scale_n, moves, back, round_index, w_gate, w_up, w_down,
                      group_sizes):  # fmt: skip
    if static.exchange_fusion == "forward" and static.exchange_programs and not static.interpret:
        # The round's whole forward in one kernel: the same bits as the two below.
        *_, out = mosaic_gpu.dispatch_mlp_return(
            x_nd, _column4(scale_n), moves, back, round_index, w_gate, w_up, w_down,
            group_sizes, out_rows=static.out_rows, tile=static.tile,
            axis_name=static.axis_name, exchange_programs=static.exchange_programs,
        )  # fmt: skip
    else:
        _, scale_s, h = _dispatch_gate_up(
            static, x_nd, scale_n, moves, round_index, w_gate, w_up, group_sizes
        )
        out = _down_return(
            static, h, scale_s, w_down, group_sizes, back, round_index, x_nd.shape[0]
        )
    # The rows, not the buffer: the backward dispatches them again, with the cotangent.
    residuals = (x_nd, scale_n, w_gate, w_up, w_down, group_sizes, moves, back, round_index)
    return out, residuals


def _grads_at_buffers(static: _MlpStatic, d_out, residuals):
    """`swiglu_mlp_grads(..., input_grad=False)` on the buffers for the round's results'
    cotangent d_out [N, D] ([d_gate | d_up] first, for `_dgrad_return`): the dispatch again,
    of the rows x and their weights (the GEMMs' operands, recomputed) and of d_out (the
    return's gradient: each slot's cotangent from its row; zeros in the slots no row fills,
    the dispatch's zero ranges).

    With grad_exchange_programs > 0 (recompute "gmm") the three travel inside the first backward
    GEMM's kernel (`mosaic_gpu.dispatch_down_grad`): d_out as the GEMMs read it, rounded, x
    and the weights as the forward's dispatch sends them; at the buffer, d_out times its
    row's weight (for d_w_down) is formed from the rounded rows (`scaled_cotangent`, as
    `swiglu_mlp_grads` forms it from f32 d_out), so d_out crosses once. With `interpret` (the
    CPU) the same path runs as the kernel's spec. Otherwise each is a copy of its own
    (`send_rows`)."""
    x_nd, scale_n, w_gate, w_up, w_down, group_sizes, moves, round_index = residuals
    send = functools.partial(
        _send, out_rows=static.out_rows, axis_name=static.axis_name, implementation="auto"
    )
    scale_n4 = _column4(scale_n)
    if static.grad_exchange_programs and static.recompute == "gmm":
        dy_c = d_out.astype(x_nd.dtype)
        if static.interpret:
            # The CPU: the kernel's spec, the copies by `send_rows` (its reference there) and the
            # GEMM in interpret mode, so the CPU tests hold this path's bits too.
            dy_s, buffer, scale_s4 = (send(a, moves, round_index) for a in (dy_c, x_nd, scale_n4))
            g = grouped_kernel.gmm(dy_s, w_down, group_sizes, transpose_rhs=True,
                                   out_dtype=jnp.float32, interpret=True)  # fmt: skip
            g = like(g, dy_s)
        else:
            dy_s, (buffer, scale_s4), g = mosaic_gpu.dispatch_down_grad(
                dy_c,
                (x_nd, scale_n4),
                moves,
                round_index,
                w_down,
                group_sizes,
                out_rows=static.out_rows,
                tile=static.tile,
                axis_name=static.axis_name,
                exchange_programs=static.grad_exchange_programs,
            )
        scale_s = scale_s4[:, 0]
        return grouped_ops.swiglu_mlp_grads_from_g(
            buffer, w_gate, w_up, w_down, group_sizes, scale_s, g,
            grouped_ops.scaled_cotangent(dy_s, scale_s),
            input_grad=False, interpret=static.interpret,
        )  # fmt: skip
    buffer, scale_s4, dy = (send(a, moves, round_index) for a in (x_nd, scale_n4, d_out))
    return grouped_ops.swiglu_mlp_grads(
        buffer,
        w_gate,
        w_up,
        w_down,
        group_sizes,
        scale_s4[:, 0],
        dy,
        recompute=static.recompute,
        input_grad=False,
        interpret=static.interpret,
    )


def _dgrad_return(static: _MlpStatic, d_gate_up, d_scale_s, w_gate, w_up, group_sizes, back,
                  round_index, num_rows: int):  # fmt: skip
    """The round's rows' gradients at their sources, (d_x [N, D], d_scale f32 [N]) (rows of
    other rounds unspecified): d_buffer = `swiglu_input_grad(d_gate_up, ...)`, then its return
    along `back` with the weights' gradient d_scale_s [S]; by the overlapped kernel
    (grad_exchange_programs > 0: `mosaic_gpu.dgrad_return`, d_scale as its side), by the gmm then
    the exchange kernel for each (0), or with `interpret` by the gmm in interpret mode then
    `send_rows` (its spec on the CPU)."""
    d_scale_s4 = _column4(d_scale_s)
    if static.grad_exchange_programs and not static.interpret:
        _, d_x, (d_scale4,) = mosaic_gpu.dgrad_return(
            d_gate_up,
            w_gate,
            w_up,
            group_sizes,
            back,
            round_index,
            sides=(d_scale_s4,),
            out_rows=num_rows,
            axis_name=static.axis_name,
            exchange_programs=static.grad_exchange_programs,
        )
        return d_x, d_scale4[:, 0]
    d_buffer = grouped_ops.swiglu_input_grad(
        d_gate_up, w_gate, w_up, group_sizes, interpret=static.interpret
    )
    send_back = functools.partial(
        _send, out_rows=num_rows, axis_name=static.axis_name, implementation="auto"
    )
    return send_back(d_buffer, back, round_index), send_back(d_scale_s4, back, round_index)[:, 0]


def _dispatch_mlp_bwd(static, residuals, d_out):
    x_nd, scale_n, w_gate, w_up, w_down, group_sizes, moves, back, round_index = residuals
    num_rows = x_nd.shape[0]
    d_gate_up, d_w_gate, d_w_up, d_w_down, _, d_scale_s = _grads_at_buffers(
        static,
        d_out,
        (x_nd, scale_n, w_gate, w_up, w_down, group_sizes, moves, round_index),
    )
    # d_x by its GEMM and its return, d_scale with it: each row's gradients from the slot it
    # was copied to.
    d_x, d_scale = _dgrad_return(static, d_gate_up, d_scale_s, w_gate, w_up, group_sizes, back,
                                 round_index, num_rows)  # fmt: skip
    return d_x, d_scale, None, None, None, d_w_gate, d_w_up, d_w_down, None


_dispatch_mlp.defvjp(_dispatch_mlp_fwd, _dispatch_mlp_bwd)


def dispatch_mlp(
    x_nd: Array,
    scale_n: Array,
    moves: Moves,
    back: Moves,
    round_index: Array,
    w_gate_gdf: Array,
    w_up_gdf: Array,
    w_down_gfd: Array,
    group_sizes_g: Array,
    *,
    out_rows: int,
    tile: int,
    axis_name: str,
    recompute: grouped_ops.Recompute = "gmm",
    exchange_programs: int | None = None,
    grad_exchange_programs: int | None = None,
    exchange_fusion: ExchangeFusion = "per_gemm",
    interpret: bool = False,
) -> Array:
    """Round `round_index` of the exchange and the expert MLP: this device's rows x [N, D] with
    their routing weights scale f32 [N] -> their weighted results f32 [N, D] (rows of other
    rounds unspecified; inside `jax.shard_map` over `axis_name`).

    The rows travel as `send_rows(x, moves, back, ...)` sends them into the receivers'
    buffers of `out_rows` slots (`tile`-row tiles counting their copies); the buffer's rows,
    grouped by `group_sizes_g` ([G], the padded expert runs), go through
    `grouped_ops.swiglu_mlp` with the weights as its row scale; the results come back as
    `send_rows(y, back, moves, ...)` returns them. Values and gradients are those of these
    three, bit for bit. With exchange_programs > 0 the dispatch runs inside the first GEMMs'
    kernel (`mosaic_gpu.dispatch_swiglu`: that many of its programs copy while the others
    compute each tile as soon as its rows are in) and the return inside the down
    projection's (`mosaic_gpu.down_return`: each piece leaves as soon as its rows are
    stored); with 0 both are kernels of their own. exchange_programs None: the tuning table's
    value for this device (`tuning.default_exchange_programs`). With `interpret` (for the CPU)
    the copies are `send_rows` (there its spec, reference.py) and the GEMMs run in Mosaic
    GPU's interpret mode.

    grad_exchange_programs (None: exchange_programs) does the same for the backward, which
    saves x, not the buffer, and dispatches it again: with recompute "gmm" and
    grad_exchange_programs > 0 the rows, their weights and the results' cotangent travel to
    the buffers inside the kernel of the first backward GEMM (`mosaic_gpu.dispatch_down_grad`);
    with 0, or recompute "kernel" (whose first GEMM also recomputes gate and up), in kernels
    of their own. With grad_exchange_programs > 0 the rows' gradient returns to them inside
    the kernel of the GEMM that computes it, with the routing weights' gradient
    (`mosaic_gpu.dgrad_return`, either recompute).

    exchange_fusion (`ExchangeFusion`): "forward" (with exchange_programs > 0, on a GPU) runs
    the forward's dispatch, GEMMs and return in one kernel (`mosaic_gpu.dispatch_mlp_return`,
    the same bits: its GPU twins on one H200); "per_gemm", or exchange_programs
    0, as above."""
    if exchange_programs is None:
        exchange_programs = tuning.default_exchange_programs()
    if grad_exchange_programs is None:
        grad_exchange_programs = exchange_programs
    if exchange_programs < 0 or grad_exchange_programs < 0:
        raise ValueError(f"{exchange_programs=} and {grad_exchange_programs=} must be >= 0")
    if recompute not in grouped_ops.RECOMPUTES:
        raise ValueError(f"recompute={recompute!r} must be one of {grouped_ops.RECOMPUTES}")
    if exchange_fusion not in EXCHANGE_FUSIONS:
        raise ValueError(f"exchange_fusion={exchange_fusion!r} must be one of {EXCHANGE_FUSIONS}")
    static = _MlpStatic(out_rows=out_rows, tile=tile, axis_name=axis_name, recompute=recompute,
                        exchange_programs=exchange_programs,
                        grad_exchange_programs=grad_exchange_programs,
                        exchange_fusion=exchange_fusion, interpret=interpret)  # fmt: skip
    # As swiglu_mlp does: every operand varies over the mesh axes any of them varies over (an
    # operand made to vary gets its gradient summed over those axes).
    x_nd, scale_n, w_gate_gdf, w_up_gdf, w_down_gfd, group_sizes_g = vary_alike(
        x_nd, scale_n, w_gate_gdf, w_up_gdf, w_down_gfd, group_sizes_g
    )
    return _dispatch_mlp(static, x_nd, scale_n, moves, back, round_index, w_gate_gdf, w_up_gdf,
                         w_down_gfd, group_sizes_g)  # fmt: skip
