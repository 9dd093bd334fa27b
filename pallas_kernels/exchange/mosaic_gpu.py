"""The exchange's dispatch as one Mosaic GPU kernel (issue 7, first piece): inside
`jax.shard_map`, each device copies its pieces of a round straight into the receivers' buffers
(remote refs) and signals each piece's tile there; each device returns once every tile of its
own buffer has counted the pieces the protocol says it gets. No collective launch, no host
sync, no placement by arrival: slots and counts come from mok_jax/exchange_protocol.py.

Status (2026-12-01): NOT YET SHOWN TO WORK, and called by nothing in the library. It lowers for
CUDA inside shard_map on 8 devices (a CI test). Its first run on the H200 (a 1-device mesh, the
copies going to the device itself) hung (bench/results/2026-12-01_exchange_dispatch_h200/).
Found afterwards, on the CPU: the tile semaphores were kernel scratch, which Pallas allocates
per block, so block 0 counted only its own pieces; they are now one set for the kernel
(`pl.get_global`). The copy path (`copy_piece`) is checked under interpret mode in CI. Not
yet re-run on a GPU.
The protocol it carries out is tested on its own (tests/mok_jax/test_exchange_protocol.py).
The design: rows move through shared memory one row-chunk at a time, and no GEMM runs in the
kernel yet (the experts read the buffer afterwards); fusing the tile waits into the grouped
GEMM's producer comes after it works.

Invariants:
  1. Each slot of a receiver's buffer is written by one piece, once a round (the protocol's
     slots are distinct), so no two stores race.
  2. A piece's signal follows its rows: the kernel waits for the piece's stores to complete
     before the release-ordered signal.
  3. A device's kernel returns only after each of its tiles has counted `arrivals[u]` signals
     (block 0 waits), the number of pieces the protocol sends there: every row has landed.
  4. No device writes into a peer's buffer before that peer has entered the kernel: the
     custom call's device barrier at launch (Mosaic GPU's default, `skip_device_barrier` is
     not set). The tile semaphores (`pl.get_global`: one set for the kernel) are a slice of
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


def _dispatch_kernel(
    x_ref,
    row_ref,
    slot_ref,
    size_ref,
    dest_ref,
    piece_round_ref,
    tile_ref,
    count_ref,
    arrivals_ref,
    round_ref,
    buf_ref,
    stage_smem,
    loaded,
    *,
    num_blocks: int,
    chunk_cols: int,
    num_tiles: int,
    local: bool,
):
    block = lax.axis_index("blocks")
    round_index = round_ref[0]
    # One semaphore a tile for the whole kernel (and, through the peers' copies, for every
    # device): a scratch semaphore would be one per block, so block 0 would count only its own.
    arrive_sems = pl.get_global(plgpu.SemaphoreType.REGULAR((num_tiles,)))

    # 1. This device's pieces of the round, piece p by block p % num_blocks.
    @pl.loop(block, count_ref[0], step=num_blocks)
    def _piece(p):
        @pl.when(piece_round_ref[p] == round_index)
        def _send():
            dest = dest_ref[p]
            # One device: the exchange's copies go to itself (no peer to address).
            remote = buf_ref if local else plgpu.remote_ref(buf_ref, dest)
            # 2. The rows have landed before the tile counts the piece.
            copy_piece(x_ref, remote, row_ref[p], slot_ref[p], size_ref[p], stage_smem, loaded,
                       chunk_cols=chunk_cols)  # fmt: skip
            sem = arrive_sems.at[tile_ref[p]]
            pl.semaphore_signal(sem) if local else pl.semaphore_signal(sem, device_id=dest)

    # 3. Block 0 returns once every tile of this device has its pieces.
    @pl.when(block == 0)
    def _wait():
        @pl.loop(0, num_tiles)
        def _tile(u):
            pl.semaphore_wait(arrive_sems.at[u], arrivals_ref[u])


def dispatch(
    x_nd: Array,
    row_p: Array,
    slot_p: Array,
    size_p: Array,
    dest_p: Array,
    round_p: Array,
    tile_p: Array,
    count: Array,
    arrivals_u: Array,
    round_index: Array,
    *,
    num_slots: int,
    tile: int,
    axis_name: str,
    num_blocks: int | None = None,
) -> Array:
    """This device's receive buffer [S, D] of round `round_index` (call inside `jax.shard_map`
    over the expert axis, one axis; the buffer's slots that no piece fills are unspecified).

    x_nd [N, D] (2-byte or 4-byte floats) are this device's rows; the pieces (int32 [P] each,
    the first `count` [] real, as `mok_jax.exchange_protocol.pieces` gives them): first row,
    first slot, size, receiver (index along the mesh axis), round and tile; arrivals_u
    (int32 [U], U = S / tile) the pieces this device's tiles get in this round
    (`exchange_protocol.tile_arrivals`). axis_name: the mesh axis of the receivers (of size 1,
    the copies are local). num_blocks: the kernel's blocks (default: the device's core
    count).
    """
    _, d_model = x_nd.shape
    if num_slots % tile:
        raise ValueError(f"num_slots={num_slots} must be a multiple of tile={tile}")
    num_tiles = num_slots // tile
    if arrivals_u.shape != (num_tiles,):
        raise ValueError(f"arrivals_u has shape {arrivals_u.shape}; expected ({num_tiles},)")
    tables = (row_p, slot_p, size_p, dest_p, round_p, tile_p)
    if any(a.shape != row_p.shape or a.dtype != jnp.int32 for a in tables):
        raise ValueError("the piece tables must be int32 of one shape [P]")
    if num_blocks is None:
        num_blocks = jax.devices()[0].core_count
    chunk_cols = _chunk_cols(d_model, jnp.dtype(x_nd.dtype).itemsize)
    kernel = functools.partial(
        _dispatch_kernel,
        num_blocks=num_blocks,
        chunk_cols=chunk_cols,
        num_tiles=num_tiles,
        local=lax.axis_size(axis_name) == 1,
    )
    scalar = lambda a: jnp.asarray(a, jnp.int32).reshape(1)  # noqa: E731
    # Inside shard_map the buffer varies over the mesh axes the rows do.
    out_type = jax.ShapeDtypeStruct(
        (num_slots, d_model), x_nd.dtype, manual_axis_type=jax.typeof(x_nd).manual_axis_type
    )
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(num_blocks,),
        grid_names=("blocks",),
        scratch_types=[
            plgpu.SMEM((1, chunk_cols), x_nd.dtype),
            plgpu.Barrier(num_arrivals=1),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(x_nd, *tables, scalar(count), arrivals_u, scalar(round_index))
