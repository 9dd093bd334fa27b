"""One direction of the exchange as one Mosaic GPU kernel (issue 7): inside `jax.shard_map`,
each device copies its rows of a round straight into the peers' outputs (remote refs) and
signals a counter there once a copy; each device returns once each of its own counters has
counted the copies the protocol says it gets. No collective launch, no host sync, no placement
by arrival: the tables (`Moves`) come from mok_jax/exchange_protocol.py. The forward's dispatch
(rows -> the receivers' tile-aligned buffers, a counter a tile) and return (results -> the rows'
own positions, one counter) are both this kernel, with the two directions' tables.

Status (2026-12-01): correct on the H200 with a 1-device mesh (the copies go to the device
itself; bench/results/2026-12-01_exchange_dispatch_h200_s11/), and it lowers for CUDA inside
shard_map on 8 devices (CI). Not yet run across GPUs (the multi-GPU issue). Slow: rows move
through shared memory one 256-column chunk at a time, a load and a store in flight a block
(39 GB/s for a 12 MB round on the H200). No GEMM runs in the kernel yet: the experts read the
buffer after it returns; fusing the tile waits into the grouped GEMM's producer comes next.

Invariants:
  1. Each output row is written by one copy, once a round (the protocol's destinations are
     distinct), so no two stores race.
  2. A copy's signal follows its rows: the kernel waits for the copy's stores to complete
     before the release-ordered signal.
  3. A device's kernel returns only after each of its counters c has counted `arrivals_c[c]`
     signals (block 0 waits), the copies the protocol sends there: every row has landed.
  4. No device writes into a peer's buffer before that peer has entered the kernel: the
     custom call's device barrier at launch (Mosaic GPU's default, `skip_device_barrier` is
     not set). The counters (`pl.get_global`: one set for the kernel) are a slice of
     the kernel's GMEM scratch, which Pallas zeroes before each launch (a zero operand of the
     custom call; the lowering test checks its size).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.exchange.moves import Moves
from pallas_kernels.grouped_matmul import tuning

# Columns a row-chunk copy moves (a TMA box is at most 256 elements a dimension).
MAX_CHUNK_COLS = 256


def _chunk_cols(d_model: int, itemsize: int) -> int:
    """The widest column chunk <= MAX_CHUNK_COLS that divides D, 16 bytes at least."""
    for cols in range(min(d_model, MAX_CHUNK_COLS), 0, -1):
        if d_model % cols == 0 and (cols * itemsize) % 16 == 0:
            return cols
    raise ValueError(f"d_model={d_model} has no column chunk of a multiple of 16 bytes")


def copy_piece(x_ref, dst_ref, row, slot, size, stage_smem, loaded, *, chunk_cols: int) -> None:
    """Rows [row, row + size) of x_ref to rows [slot, slot + size) of dst_ref (a peer's buffer
    through `plgpu.remote_ref`, or this device's), one row-chunk at a time through stage_smem
    [1, chunk_cols]; returns once the stores have completed (invariant 2)."""

    @pl.loop(0, size)
    def _row(i):
        for c in range(x_ref.shape[1] // chunk_cols):
            cols = pl.ds(c * chunk_cols, chunk_cols)
            plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(row + i, 1), cols], stage_smem, loaded)
            plgpu.barrier_wait(loaded)
            plgpu.copy_smem_to_gmem(stage_smem, dst_ref.at[pl.ds(slot + i, 1), cols])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    plgpu.wait_smem_to_gmem(0, wait_read_only=False)


def _send_rows_kernel(
    src_ref,
    src_p_ref,
    dst_p_ref,
    size_p_ref,
    peer_p_ref,
    round_p_ref,
    counter_p_ref,
    count_ref,
    arrivals_ref,
    round_ref,
    out_ref,
    stage_smem,
    loaded,
    *,
    num_blocks: int,
    chunk_cols: int,
    num_counters: int,
    axis_name: str,
    local: bool,
):
    block = lax.axis_index("blocks")
    round_index = round_ref[0]
    # One semaphore a counter for the whole kernel (and, through the peers' copies, for every
    # device): a scratch semaphore would be one per block, so block 0 would count only its own.
    counters = pl.get_global(plgpu.SemaphoreType.REGULAR((num_counters,)))

    # 1. This device's copies of the round, copy p by block p % num_blocks.
    @pl.loop(block, count_ref[0], step=num_blocks)
    def _copy(p):
        @pl.when(round_p_ref[p] == round_index)
        def _send():
            # The peer along the exchange's axis; on the mesh's other axes, this device's own
            # coordinates.
            peer = {axis_name: peer_p_ref[p]}
            # One device: the exchange's copies go to itself (no peer to address).
            dst_ref = out_ref if local else plgpu.remote_ref(out_ref, peer)
            # 2. The rows have landed before the counter counts the copy.
            copy_piece(src_ref, dst_ref, src_p_ref[p], dst_p_ref[p], size_p_ref[p], stage_smem,
                       loaded, chunk_cols=chunk_cols)  # fmt: skip
            sem = counters.at[counter_p_ref[p]]
            pl.semaphore_signal(sem) if local else pl.semaphore_signal(sem, device_id=peer)

    # 3. Block 0 returns once every counter of this device has its copies.
    @pl.when(block == 0)
    def _wait():
        @pl.loop(0, num_counters)
        def _counter(c):
            pl.semaphore_wait(counters.at[c], arrivals_ref[c])


def send_rows(
    src_ad: Array,
    moves: Moves,
    round_index: Array,
    *,
    out_rows: int,
    axis_name: str,
    num_blocks: int | None = None,
) -> Array:
    """This device's output [out_rows, D] of round `round_index`: the rows its peers' `moves`
    (and its own) copy here. Call inside `jax.shard_map` over the exchange's mesh axis; rows
    no copy fills are unspecified.

    src_ad [A, D] (2-byte or 4-byte floats; a row a multiple of 16 bytes) is this device's
    array; moves its copies (`Moves`);
    round_index int32 []. axis_name: the mesh axis of the peers (of size 1, the copies are
    local). num_blocks: the kernel's blocks (default: one a streaming multiprocessor).
    """
    moves.check()
    _, d_model = src_ad.shape
    if num_blocks is None:
        num_blocks = tuning.persistent_grid_size()
    chunk_cols = _chunk_cols(d_model, jnp.dtype(src_ad.dtype).itemsize)
    kernel = functools.partial(
        _send_rows_kernel,
        num_blocks=num_blocks,
        chunk_cols=chunk_cols,
        num_counters=moves.arrivals_c.shape[0],
        axis_name=axis_name,
        local=lax.axis_size(axis_name) == 1,
    )
    out_type = jax.ShapeDtypeStruct((out_rows, d_model), src_ad.dtype)
    tables = (moves.src_p, moves.dst_p, moves.size_p, moves.peer_p, moves.round_p,
              moves.counter_p)  # fmt: skip
    out = plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(num_blocks,),
        grid_names=("blocks",),
        scratch_types=[
            plgpu.SMEM((1, chunk_cols), src_ad.dtype),
            plgpu.Barrier(num_arrivals=1),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(
        src_ad,
        *tables,
        moves.count.reshape(1),
        moves.arrivals_c,
        jnp.asarray(round_index, jnp.int32).reshape(1),
    )
    # The kernel's output type drops the mesh axes it varies over: state them again.
    varying = lambda a: set(jax.typeof(a).manual_axis_type.varying)  # noqa: E731
    missing = tuple(sorted(varying(src_ad) - varying(out)))
    return lax.pcast(out, missing, to="varying") if missing else out
