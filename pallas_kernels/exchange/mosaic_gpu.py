"""One direction of the exchange as one Mosaic GPU kernel (issue 7): inside `jax.shard_map`,
each device copies its rows of a round straight into the peers' outputs (remote refs) and
signals a counter there once a copy; each device returns once each of its own counters has
counted the copies the protocol says it gets. No collective launch, no host sync, no placement
by arrival: the tables (`Moves`) come from mok_jax/exchange_protocol.py. The forward's dispatch
(rows -> the receivers' tile-aligned buffers, a counter a tile) and return (results -> the rows'
own positions, one counter) are both this kernel, with the two directions' tables.

Status (2026-12-01): correct on the H200 with a 1-device mesh (the copies go to the device
itself; bench/results/2026-12-01_exchange_dispatch_h200_s11/), and it lowers for CUDA inside
shard_map on 8 devices (CI). Not yet run across GPUs (the multi-GPU issue). Rows move through
shared memory in boxes of whole rows (up to 64 KiB), one load and one store in flight a block;
at qwen3_30b_a3b (4096 tokens) `fused` on a 1-device mesh, three of these kernels a forward,
took 2.82 ms against 2.75 without a mesh. No GEMM runs in the kernel yet: the experts read the
buffer after it returns; fusing the tile waits into the grouped GEMM's producer comes next.

Invariants:
  1. Each output row is written by one copy, once a round (the protocol's destinations are
     distinct), so no two stores race.
  2. A copy's signal follows its rows: the kernel waits for the copy's stores to complete
     before the release-ordered signal.
  3. A device's kernel returns only after each of its counters c has counted `arrivals_c[c]`
     signals (block c % blocks waits), the copies the protocol sends there: every row has
     landed. Its zero ranges are stored (and waited for) by its own blocks before they return.
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

# Rows a copy moves at most (a power of two), and the shared memory its stage may take.
MAX_BOX_ROWS = 64
STAGE_BYTES = 64 * 1024


def stage_rows(d_model: int, itemsize: int) -> int:
    """Rows of the copy stage [rows, D]: the largest power of two <= MAX_BOX_ROWS whose rows
    fit in STAGE_BYTES. Raises ValueError if a row is not a multiple of 16 bytes (a bulk copy's
    unit) or does not fit."""
    row_bytes = d_model * itemsize
    if row_bytes % 16:
        raise ValueError(f"a row of {row_bytes} bytes (D={d_model}) must be a multiple of 16")
    if row_bytes > STAGE_BYTES:
        raise ValueError(f"a row of {row_bytes} bytes (D={d_model}) exceeds {STAGE_BYTES}")
    rows = MAX_BOX_ROWS
    while rows * row_bytes > STAGE_BYTES:
        rows //= 2
    return rows


def _in_boxes(size, box: int, move) -> None:
    """move(offset, rows) over [0, size) in boxes: B = `box` rows (a power of two) at a time,
    then one box a set bit of the rest (B/2, ..., 1); rows static, offset traced."""
    full = size // box

    @pl.loop(0, full)
    def _full(i):
        move(i * box, box)

    rest = size - full * box
    rows = box // 2
    while rows >= 1:
        # The rest's boxes in decreasing size: this one starts after the larger ones.
        @pl.when((rest & rows) != 0)
        def _part(rows=rows):
            move(full * box + (rest & ~(2 * rows - 1)), rows)

        rows //= 2


def _stage(stage_smem, rows: int):
    return stage_smem if rows == stage_smem.shape[0] else stage_smem.at[pl.ds(0, rows)]


def copy_piece(src_ref, dst_ref, src_row, dst_row, size, stage_smem, loaded) -> None:
    """Rows [src_row, + size) of src_ref to rows [dst_row, + size) of dst_ref (a peer's array
    through `plgpu.remote_ref`, or this device's) through stage_smem [B, D] (B a power of
    two), in boxes (`_in_boxes`), each loaded and then stored; returns once the stores have
    completed (invariant 2).

    Whole rows keep every box contiguous in memory, so Mosaic GPU moves it with a bulk copy
    whose remote address is computed on the device from the peer's id: a strided box (a
    column chunk of several rows) would need a tensor map built on the host, which cannot
    know a peer read from a table."""

    def move(offset, rows: int):
        stage = _stage(stage_smem, rows)
        plgpu.copy_gmem_to_smem(
            src_ref.at[pl.ds(src_row + offset, rows)],
            stage,
            loaded,
            # In bounds by the protocol: the plain bulk copy, not a tensor map (see above).
            oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,
        )
        plgpu.barrier_wait(loaded)
        plgpu.copy_smem_to_gmem(stage, dst_ref.at[pl.ds(dst_row + offset, rows)])
        # The stage is read before the next load overwrites it.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    _in_boxes(size, stage_smem.shape[0], move)
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)


def zero_rows(out_ref, dst_row, size, zeros_smem) -> None:
    """Rows [dst_row, + size) of out_ref (this device's) set to zero from zeros_smem [B, D]
    (already zero and committed), in boxes; returns once the stores have completed."""

    def store(offset, rows: int):
        plgpu.copy_smem_to_gmem(_stage(zeros_smem, rows), out_ref.at[pl.ds(dst_row + offset, rows)])

    _in_boxes(size, zeros_smem.shape[0], store)
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
    zero_dst_ref,
    zero_size_ref,
    round_ref,
    out_ref,
    stage_smem,
    loaded,
    *,
    num_blocks: int,
    num_counters: int,
    num_zeros: int,
    axis_name: str,
    local: bool,
):
    block = lax.axis_index("blocks")
    round_index = round_ref[0]
    # One semaphore a counter for the whole kernel (and, through the peers' copies, for every
    # device): a scratch semaphore would be one per block, so block 0 would count only its own.
    counters = pl.get_global(plgpu.SemaphoreType.REGULAR((num_counters,)))

    # 0. This device's zero ranges (rows no copy lands in, disjoint from the copies' rows),
    #    range z by block z % num_blocks, from the stage filled with zeros.
    @pl.when(block < num_zeros)
    def _zeros():
        stage_smem[...] = jnp.zeros(stage_smem.shape, stage_smem.dtype)
        plgpu.commit_smem()

        @pl.loop(block, num_zeros, step=num_blocks)
        def _zero(z):
            zero_rows(out_ref, zero_dst_ref[z], zero_size_ref[z], stage_smem)

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
                       loaded)  # fmt: skip
            sem = counters.at[counter_p_ref[p]]
            if local:
                pl.semaphore_signal(sem)
            else:
                pl.semaphore_signal(sem, device_id=peer)

    # 3. The kernel returns once every counter of this device has its copies: counter c is
    #    waited for by block c % num_blocks.
    @pl.loop(block, num_counters, step=num_blocks)
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
    (and its own) copy here, and zeros in its own zero ranges. Call inside `jax.shard_map` over
    the exchange's mesh axis; other rows are unspecified.

    src_ad [A, D] (a row a multiple of 16 bytes, at most STAGE_BYTES) is this device's
    array; moves its copies (`Moves`);
    round_index int32 []. axis_name: the mesh axis of the peers (of size 1, the copies are
    local). num_blocks: the kernel's blocks (default: one a streaming multiprocessor).
    """
    moves.check()
    _, d_model = src_ad.shape
    if num_blocks is None:
        num_blocks = tuning.persistent_grid_size()
    box = stage_rows(d_model, jnp.dtype(src_ad.dtype).itemsize)
    kernel = functools.partial(
        _send_rows_kernel,
        num_blocks=num_blocks,
        num_counters=moves.arrivals_c.shape[0],
        num_zeros=moves.zero_dst_z.shape[0],
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
            plgpu.SMEM((box, d_model), src_ad.dtype),
            plgpu.Barrier(num_arrivals=1),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(
        src_ad,
        *tables,
        moves.count.reshape(1),
        moves.arrivals_c,
        moves.zero_dst_z,
        moves.zero_size_z,
        jnp.asarray(round_index, jnp.int32).reshape(1),
    )
    # The kernel's output type drops the mesh axes it varies over: state them again.
    varying = lambda a: set(jax.typeof(a).manual_axis_type.varying)  # noqa: E731
    missing = tuple(sorted(varying(src_ad) - varying(out)))
    return lax.pcast(out, missing, to="varying") if missing else out
