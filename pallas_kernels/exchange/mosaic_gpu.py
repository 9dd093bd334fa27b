"""One direction of the exchange as one Mosaic GPU kernel: inside `jax.shard_map`,
each device copies its rows of a round straight into the peers' outputs (remote refs) and
signals a counter there once a copy; each device returns once each of its own counters has
counted the copies the protocol says it gets. No collective launch, no host sync, no placement
by arrival: the tables (`Moves`) come from protocol.py. The forward's dispatch
(rows -> the receivers' tile-aligned buffers, a counter a tile) and return (results -> the rows'
own positions, one counter) are both this kernel, with the two directions' tables, when they
are not overlapped with the GEMMs (below).

What has run on GPUs (result folders under bench/results/): with a 1-device mesh (the copies go
to the device itself) on one H200, and across two H200s over NVLink, where `fused` at EP 2 gave
the bits of one GPU (2026-12-01_exchange_overlap_h200/, before the zero ranges moved after
the copies and the tables were packed). It lowers for CUDA inside shard_map on 8 devices (a CPU
test). Rows move through shared memory in boxes of whole rows (up to 64 KiB), one load and one
store in flight a copier (~10-13 GB/s a copier in HBM).

The overlapped kernels run each copy of the layer inside a GEMM's kernel:
- `dispatch_swiglu`: the forward's dispatch inside the gate/up GEMMs' kernel, each GEMM tile
  starting once its rows are in.
- `down_return`: the return inside the down projection's kernel, each piece leaving once its
  rows are stored.
- `dispatch_down_grad`: the backward's dispatch (the results' cotangent, with the forward's rows
  and their weights: the backward saves the rows, not the buffer) inside the kernel of its first
  GEMM, g = dy @ w_down.T.
- `dgrad_return`: the input gradient's GEMM with the return of d_x and of the routing weights'
  gradient.
- `dispatch_mlp_return`: the whole forward of a round in one kernel (the dispatch, the gate/up
  tiles, the down tiles, each once its row tile of h is stored, and the return), used under
  `MoEOptions.exchange_fusion="forward"`.
Each gave the bits of the separate kernels on one H200 (2026-12-01_exchange_tail_h200/,
2026-12-01_exchange_backward_dispatch_h200/, 2026-12-01_exchange_backward_return_h200/,
2026-12-02_exchange_one_kernel_forward_h200/); `dispatch_swiglu` also across two H200s in an
earlier form. With bf16 parameters `dispatch_mlp_return` was the slower (2.13 / 6.04 ms
forward / forward+backward against the per-GEMM kernels' 1.97 / 5.75 at qwen3_30b_a3b, 4096
tokens; 2026-12-02_exchange_cotangent_once_h200/).

Invariants (send_rows; the overlapped dispatch's O1-O3, down_return's R1-R3 and the forward
kernel's F1-F3 are in their bodies):
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
  5. The kernel's int32 tables are one operand (`_pack`), whose length is never the
     counters'. The counters' zero operand is aliased to an output and written in place, and
     XLA merges equal constants: a table that is a constant array of zeros of the counters'
     shape (the return's empty zero ranges, [1], against its one counter) became the
     counters' own buffer, so the kernel read its zero ranges from the counters as they
     counted (seen on an H200: rows [13, 26) of a return zeroed after 13 arrivals). The same
     holds for the overlapped kernels (dispatch_swiglu, dispatch_down_grad, down_return,
     dgrad_return).
  6. Rows move through the async proxy (bulk copies, the GEMMs' TMA loads and stores), the
     counters through the generic one (release-ordered signals, acquire-ordered waits). A
     writer needs no proxy fence: its signal follows the completion of its stores
     (cp.async.bulk.wait_group, invariant 2), and a bulk operation's completion carries an
     implicit generic-async proxy fence (PTX ISA, "Async Proxy"). A reader does: after the
     waits that precede bulk loads of rows another block or device stored, it runs
     `fence.proxy.async.global` once (PROXY_FENCE, `_async_proxy_fence`) before loading (the
     overlapped GEMMs' producers and the return's copiers; send_rows loads nothing after its
     waits). It is there for rows written by peers over NVLink: no run on one GPU had shown a
     stale row without it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.exchange import tuning as exchange_tuning
from pallas_kernels.exchange.moves import Moves
from pallas_kernels.grouped_matmul import mosaic_gpu as gmm_kernel
from pallas_kernels.grouped_matmul import tuning
from pallas_kernels.mesh import like

# Rows a copy moves at most (a power of two), and the shared memory its stage may take.
MAX_BOX_ROWS = 64
STAGE_BYTES = 64 * 1024


# A copier's stages in the overlapped kernels (one a kind of row, `_stage_kinds`): 3 copiers a
# program share the streaming multiprocessor's 227 KiB of shared memory.
COPIER_BYTES = 72 * 1024

# Every kernel's: Warpgroup semantics (one thread a warpgroup, as the grouped GEMM's kernels).
_COMPILER_PARAMS = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def stage_rows(d_model: int, itemsize: int, *, budget: int = STAGE_BYTES) -> int:
    """Rows of the copy stage [rows, D]: the largest power of two <= MAX_BOX_ROWS whose rows
    fit in `budget` bytes (STAGE_BYTES). Raises ValueError if a row is not a multiple of 16
    bytes (a bulk copy's unit) or does not fit."""
    row_bytes = d_model * itemsize
    if row_bytes % 16:
        raise ValueError(f"a row of {row_bytes} bytes (D={d_model}) must be a multiple of 16")
    if row_bytes > budget:
        raise ValueError(f"a row of {row_bytes} bytes (D={d_model}) exceeds {budget}")
    rows = MAX_BOX_ROWS
    while rows * row_bytes > budget:
        rows //= 2
    return rows


def _stage_kinds(
    arrays: tuple[Array, ...],
) -> tuple[tuple[tuple[int, jnp.dtype], ...], tuple[int, ...]]:
    """The overlapped dispatch's copier stages: one a kind of row (width, dtype) among the
    arrays it copies, in order of first use, and each array's kind. Arrays of one kind share
    a stage: a copier copies them one after the other, each waiting for its stores."""
    kinds, kind_of = [], []
    for a in arrays:
        kind = (a.shape[1], jnp.dtype(a.dtype))
        if kind not in kinds:
            kinds.append(kind)
        kind_of.append(kinds.index(kind))
    return tuple(kinds), tuple(kind_of)


def _check_sides(sides, rows: int | None, of: str) -> None:
    """Raises TypeError unless `sides` is a tuple (or list) of arrays, and ValueError unless
    each is [rows, C] (`of`: whose rows those are, for the message; rows None: the caller's
    own shape check reports the rows)."""
    if not isinstance(sides, tuple | list) or not all(hasattr(a, "ndim") for a in sides):
        raise TypeError(f"sides must be a tuple of arrays, got {type(sides).__name__}")
    for side in sides:
        if side.ndim != 2 or (rows is not None and side.shape[0] != rows):
            raise ValueError(f"side rows {side.shape} must match {of}")


# Invariant 6: the reader's proxy fence, between its acquire-ordered waits (generic proxy)
# and its bulk loads (async proxy) of rows others stored.
PROXY_FENCE = "fence.proxy.async.global;"


def _async_proxy_fence() -> None:
    """PROXY_FENCE (invariant 6): this warpgroup's generic-proxy accesses to global memory
    before it are ordered with its async-proxy ones after it."""

    @plgpu.inline_mgpu()
    def fence(_ctx):
        mgpu.utils.inline_ptx(PROXY_FENCE, has_side_effects=True)

    fence()


def _programs(exchange_programs: int | None) -> tuple[int, int]:
    """(exchange programs, all programs) of an overlapped kernel, one program a streaming
    multiprocessor; exchange_programs None: the tuning table's value for this device
    (`exchange_tuning.default_exchange_programs`). Raises ValueError unless 0 <
    exchange_programs < programs (some programs must run the GEMMs)."""
    if exchange_programs is None:
        exchange_programs = exchange_tuning.default_exchange_programs()
    programs = tuning.persistent_grid_size()
    if not 0 < exchange_programs < programs:
        raise ValueError(
            f"exchange_programs={exchange_programs} (MoEOptions.exchange_programs) must be in "
            f"[1, {programs}): this GPU runs {programs} programs, and some must run the GEMMs"
        )
    return exchange_programs, programs


def _signal(sem, device_id=None) -> None:
    """One count on `sem`, this device's or (device_id) a peer's: release-ordered, after the
    stores it counts have completed (invariants 2 and 6)."""
    if device_id is None:
        pl.semaphore_signal(sem)
    else:
        pl.semaphore_signal(sem, device_id=device_id)


def _dispatch_boxes(kinds: tuple[tuple[int, jnp.dtype], ...]) -> tuple[int, ...]:
    """The stage rows of the overlapped dispatch's kinds of row (`_stage_kinds`): each
    `stage_rows`' own while the stages fit COPIER_BYTES together (the rows and the routing
    weights' 16-byte column), else each of an equal share of STAGE_BYTES."""
    boxes = tuple(stage_rows(width, dtype.itemsize) for width, dtype in kinds)
    stage_bytes = sum(b * w * d.itemsize for b, (w, d) in zip(boxes, kinds, strict=True))
    if stage_bytes > COPIER_BYTES:
        share = STAGE_BYTES // len(kinds)
        boxes = tuple(stage_rows(width, dtype.itemsize, budget=share) for width, dtype in kinds)
    return boxes


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


@dataclasses.dataclass(frozen=True)
class _Packed:
    """Where each int32 table lies in a kernel's one table operand (invariant 5): (name,
    offset) pairs, static."""

    offsets: tuple[tuple[str, int], ...]

    def views(self, tables_ref, *names: str) -> tuple[_Column, ...]:
        """The named tables of `tables_ref` (the packed operand in the kernel), in order."""
        at = dict(self.offsets)
        return tuple(_Column(tables_ref, at[name]) for name in names)


@dataclasses.dataclass(frozen=True)
class _Column:
    """One table of the packed operand: column[i] is a scalar load of its entry i."""

    ref: object
    offset: int

    def __getitem__(self, i):
        return self.ref[self.offset + i]


def _pack(tables: dict[str, Array], *, counters: int) -> tuple[Array, _Packed]:
    """The int32 tables as one 1-D operand and their offsets (invariant 5). Its length is
    never the counters' (an operand that would have it gets one more entry)."""
    parts, offsets, at = [], [], 0
    for name, table in tables.items():
        table = jnp.asarray(table, jnp.int32).reshape(-1)
        offsets.append((name, at))
        parts.append(table)
        at += table.shape[0]
    if at == counters:
        parts.append(jnp.zeros((1,), jnp.int32))
    return jnp.concatenate(parts), _Packed(tuple(offsets))


def _moves_tables(moves: Moves, round_index: Array) -> dict[str, Array]:
    """A round's `Moves` as the named tables a kernel reads (see `_pack`)."""
    return {
        "src_p": moves.src_p,
        "dst_p": moves.dst_p,
        "size_p": moves.size_p,
        "peer_p": moves.peer_p,
        "round_p": moves.round_p,
        "counter_p": moves.counter_p,
        "count": moves.count,
        "arrivals_c": moves.arrivals_c,
        "zero_dst_z": moves.zero_dst_z,
        "zero_size_z": moves.zero_size_z,
        "round": jnp.asarray(round_index, jnp.int32),
    }


# The names of `_moves_tables`, in its order.
_MOVES = ("src_p", "dst_p", "size_p", "peer_p", "round_p", "counter_p", "count", "arrivals_c",
          "zero_dst_z", "zero_size_z", "round")  # fmt: skip


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


def copy_piece_pipelined(
    src_ref, dst_ref, src_row, dst_row, size, stages_smem, loaded, first_barrier=0
) -> None:
    """`copy_piece` through S >= 2 stages (stages_smem [S, B, D]; barriers of one arrival,
    loaded[first_barrier + s] for stage s), so that loads and stores overlap: the full boxes of
    B rows stream through the stages in turn, box i + S - 1 loading while box i waits for its
    load and stores; the rest (fewer than B rows) then moves by `copy_piece`, through stage 0.
    Returns once the stores have completed. The kernels' `copy_stages` > 1 (not the layer's
    default): bitwise on the H200; 15-20 % faster than `copy_piece` for `send_rows` alone on
    all blocks, no faster at the layer's default exchange programs.

    Each stage is reloaded only after the store that read it has read it (the previous box's:
    `wait_smem_to_gmem(0, wait_read_only=True)` before the load, the later box's store not yet
    issued), and each load is waited for once, on its stage's barrier, in order."""
    num_stages, box = stages_smem.shape[0], stages_smem.shape[1]
    if num_stages < 2:
        raise ValueError(f"a pipelined copy needs 2 or more stages, got {num_stages}")
    full = size // box

    def load(i):
        slot = lax.rem(i, num_stages)
        plgpu.copy_gmem_to_smem(
            src_ref.at[pl.ds(src_row + i * box, box)],
            stages_smem.at[slot],
            loaded.at[first_barrier + slot],
            oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,
        )

    @pl.loop(0, jnp.minimum(full, num_stages - 1))
    def _prologue(i):
        load(i)

    @pl.loop(0, full)
    def _box(i):
        @pl.when(i + num_stages - 1 < full)
        def _next():
            # Its stage last held box i - 1, whose store must have read it.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            load(i + num_stages - 1)

        slot = lax.rem(i, num_stages)
        plgpu.barrier_wait(loaded.at[first_barrier + slot])
        plgpu.copy_smem_to_gmem(stages_smem.at[slot], dst_ref.at[pl.ds(dst_row + i * box, box)])

    # The rest as copy_piece moves it, once the last full box's store has read its stage.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    done = full * box
    copy_piece(src_ref, dst_ref, src_row + done, dst_row + done, size - done, stages_smem.at[0],
               loaded.at[first_barrier])  # fmt: skip


COPY_STAGES = (1, 2, 4)


@dataclasses.dataclass(frozen=True)
class _Stage:
    """One copier's shared memory: `smem` [B, D] and its barrier `loaded` (copy_stages 1:
    `copy_piece`), or `smem` [S, B/S, D] and barriers loaded[first, first + S)
    (`copy_piece_pipelined`)."""

    smem: object
    loaded: object
    first: object = 0
    stages: int = 1

    def copy(self, src_ref, dst_ref, src_row, dst_row, size) -> None:
        if self.stages == 1:
            copy_piece(src_ref, dst_ref, src_row, dst_row, size, self.smem, self.loaded)
        else:
            copy_piece_pipelined(src_ref, dst_ref, src_row, dst_row, size, self.smem,
                                 self.loaded, first_barrier=self.first)  # fmt: skip

    def zeros(self):
        """A stage of this copier filled with zeros (not yet committed), for `zero_rows`.

        Every stage is filled, not only the one returned: Mosaic GPU stores a splat only in
        multiples of 128 elements, and a pipelined stage of the weights' column (B/S rows of
        16 bytes: 16 x 4 f32 at 4 stages) has fewer; the copier's whole [S, B/S, C] has B x C
        (found on the H200; the lowering tests now run 4 stages too)."""
        self.smem[...] = jnp.zeros(self.smem.shape, self.smem.dtype)
        return self.smem if self.stages == 1 else self.smem.at[0]


def _check_copy_stages(stages: int) -> None:
    if stages not in COPY_STAGES:
        raise ValueError(f"copy_stages={stages} must be one of {COPY_STAGES}")


def _stage_smem(lead: tuple[int, ...], box: int, d: int, dtype, stages: int):
    """The SMEM of copiers' stages: [*lead, B, D], or [*lead, S, B/S, D] pipelined. Raises
    ValueError if B < S (a stage of no rows: rows too wide for that many stages)."""
    _check_copy_stages(stages)
    if box < stages:
        raise ValueError(
            f"copy_stages={stages} needs stages of at least one row: a stage of {box} rows of "
            f"D={d} cannot be split in {stages}"
        )
    shape = (box, d) if stages == 1 else (stages, box // stages, d)
    return plgpu.SMEM((*lead, *shape), dtype)


def _copier(smem, loaded, index, stages: int) -> _Stage:
    """Copier `index`'s `_Stage` of smem [copiers, ...] and its barriers (copiers * stages)."""
    if stages == 1:
        return _Stage(smem.at[index], loaded.at[index])
    return _Stage(smem.at[index], loaded, first=index * stages, stages=stages)


def zero_rows(out_ref, dst_row, size, zeros_smem) -> None:
    """Rows [dst_row, + size) of out_ref (this device's) set to zero from zeros_smem [B, D]
    (already zero and committed), in boxes; returns once the stores have completed."""

    def store(offset, rows: int):
        plgpu.copy_smem_to_gmem(_stage(zeros_smem, rows), out_ref.at[pl.ds(dst_row + offset, rows)])

    _in_boxes(size, zeros_smem.shape[0], store)
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)


def _zero_ranges(stages, *, first, step: int, num_zeros: int, zero) -> None:
    """zero(z, zeros_smems) for the zero ranges z = first, first + step, ... < num_zeros, from
    `stages` (a copier's `_Stage`s, which its copies are done with) filled with zeros and
    committed: zeros_smems[k] is stages[k]'s (`_Stage.zeros`). The kernels' zero ranges."""

    @pl.when(first < num_zeros)
    def _zeros():
        zeros_smems = [stage.zeros() for stage in stages]
        plgpu.commit_smem()

        @pl.loop(first, num_zeros, step=step)
        def _zero(z):
            zero(z, zeros_smems)


def _send_rows_kernel(
    src_ref,
    tables_ref,
    out_ref,
    stage_smem,
    loaded,
    *,
    packed: _Packed,
    num_blocks: int,
    num_counters: int,
    num_zeros: int,
    axis_name: str,
    local: bool,
    copy_stages: int,
):
    (src_p_ref, dst_p_ref, size_p_ref, peer_p_ref, round_p_ref, counter_p_ref, count_ref,
     arrivals_ref, zero_dst_ref, zero_size_ref,
     round_ref) = packed.views(tables_ref, *_MOVES)  # fmt: skip
    stage = _Stage(stage_smem, loaded, stages=copy_stages)
    block = lax.axis_index("blocks")
    round_index = round_ref[0]
    # One semaphore a counter for the whole kernel (and, through the peers' copies, for every
    # device): a scratch semaphore would be one per block, so block 0 would count only its own.
    counters = pl.get_global(plgpu.SemaphoreType.REGULAR((num_counters,)))

    # 1. This device's copies of the round, copy p by block p % num_blocks (first: the peers
    #    wait for them).
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
            stage.copy(src_ref, dst_ref, src_p_ref[p], dst_p_ref[p], size_p_ref[p])
            _signal(counters.at[counter_p_ref[p]], None if local else peer)

    # 2. This device's zero ranges (rows no copy lands in, disjoint from the copies' rows),
    #    range z by block z % num_blocks, from the stage filled with zeros once the block's
    #    copies are done with it (copy_piece returns after its stores completed).
    def zero(z, zeros_smems):
        zero_rows(out_ref, zero_dst_ref[z], zero_size_ref[z], zeros_smems[0])

    _zero_ranges([stage], first=block, step=num_blocks, num_zeros=num_zeros, zero=zero)

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
    copy_stages: int = 1,
) -> Array:
    """This device's output [out_rows, D] of round `round_index`: the rows its peers' `moves`
    (and its own) copy here, and zeros in its own zero ranges. Call inside `jax.shard_map` over
    the exchange's mesh axis; other rows are unspecified.

    src_ad [A, D] (a row a multiple of 16 bytes, at most STAGE_BYTES) is this device's
    array; moves its copies (`Moves`);
    round_index int32 []. axis_name: the mesh axis of the peers (of size 1, the copies are
    local). num_blocks: the kernel's blocks (default: one a streaming multiprocessor).
    copy_stages: 1 (`copy_piece`), or 2 or 4 (`copy_piece_pipelined` through that many
    stages of the same shared memory; timed on the H200: faster alone on all blocks, not
    at the layer's default exchange programs).
    """
    moves.check()
    _check_copy_stages(copy_stages)
    _, d_model = src_ad.shape
    if num_blocks is None:
        num_blocks = tuning.persistent_grid_size()
    box = stage_rows(d_model, jnp.dtype(src_ad.dtype).itemsize)
    num_counters = moves.arrivals_c.shape[0]
    tables, packed = _pack(_moves_tables(moves, round_index), counters=num_counters)
    kernel = functools.partial(
        _send_rows_kernel,
        packed=packed,
        num_blocks=num_blocks,
        num_counters=num_counters,
        num_zeros=moves.zero_dst_z.shape[0],
        axis_name=axis_name,
        local=lax.axis_size(axis_name) == 1,
        copy_stages=copy_stages,
    )
    out_type = jax.ShapeDtypeStruct((out_rows, d_model), src_ad.dtype)
    out = plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(num_blocks,),
        grid_names=("blocks",),
        scratch_types=[
            _stage_smem((), box, d_model, src_ad.dtype, copy_stages),
            plgpu.Barrier(num_arrivals=1)
            if copy_stages == 1
            else plgpu.Barrier(num_arrivals=1, num_barriers=copy_stages),
        ],
        compiler_params=_COMPILER_PARAMS,
    )(src_ad, tables)
    return like(out, src_ad)


# ----------------------------------------------------------------------------------------------
# What the overlapped kernels share (the dispatch with its first GEMM, a GEMM with the return,
# the forward of a round): one grid of copy programs and GEMM programs, launched alike.


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Overlap:
    """An overlapped kernel's grid, static: `programs` programs ("sm", one a streaming
    multiprocessor) of `num_wg` warpgroups ("wg": the GEMM tiles' consumers and producer).
    Programs [0, exchange_programs) copy, each warpgroup one copier with `copy_stages` stages
    a kind of row, to the peers along `axis_name` (to this device when `local`: an axis of
    size 1); programs [exchange_programs, programs) run the GEMMs. The copy programs come
    first in the grid, so they start before any GEMM program that waits for them."""

    programs: int
    exchange_programs: int
    num_wg: int
    axis_name: str
    local: bool
    copy_stages: int

    @property
    def copiers(self) -> int:
        return self.exchange_programs * self.num_wg

    def gemm_programs(self) -> dict[str, int]:
        """`gmm_kernel.programs_body`'s programs: the GEMM programs."""
        return {
            "programs": self.programs - self.exchange_programs,
            "first_program": self.exchange_programs,
        }


def _overlap(
    exchange_programs: int | None, *, num_consumers: int, axis_name: str, copy_stages: int
) -> _Overlap:
    """The grid of an overlapped kernel whose GEMM tiles run `num_consumers` consumers, its
    programs split by `_programs` (which raises ValueError for exchange_programs)."""
    exchange_programs, programs = _programs(exchange_programs)
    return _Overlap(
        programs=programs,
        exchange_programs=exchange_programs,
        num_wg=num_consumers + 1,
        axis_name=axis_name,
        local=lax.axis_size(axis_name) == 1,
        copy_stages=copy_stages,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Rows:
    """What a copier's stages hold: the kinds of row among the arrays it copies and each
    array's kind (`_stage_kinds`), and each kind's stage rows (`_dispatch_boxes`)."""

    kinds: tuple[tuple[int, jnp.dtype], ...]
    kind_of: tuple[int, ...]
    boxes: tuple[int, ...]

    @classmethod
    def of(cls, arrays) -> _Rows:
        """The stages of a copier of `arrays` (arrays or their shapes, each [rows, C])."""
        kinds, kind_of = _stage_kinds(tuple(arrays))
        return cls(kinds=kinds, kind_of=kind_of, boxes=_dispatch_boxes(kinds))


def _run_programs(overlap: _Overlap, num_counters: int, *, gemm, copy) -> None:
    """An overlapped kernel's body: `num_counters` counters (`pl.get_global`: one set for the
    kernel and, through the peers' copies, for every device, as in send_rows), then
    gemm(counters) in the GEMM programs and copy(counters, copier) in each warpgroup of the
    copy programs, copier = program * num_wg + warpgroup."""
    program = lax.axis_index("sm")
    counters = pl.get_global(plgpu.SemaphoreType.REGULAR((num_counters,)))

    @pl.when(program >= overlap.exchange_programs)
    def _gemm():
        gemm(counters)

    @pl.when(program < overlap.exchange_programs)
    def _copy():
        copy(counters, program * overlap.num_wg + lax.axis_index("wg"))


def _with_copier_stages(body, rows: _Rows, overlap: _Overlap) -> None:
    """Runs body(stages) in this warpgroup, one copier: `stages` its `_Stage`s, one a kind of
    row (`rows`: arrays of one kind share it, each copy waiting for its stores), on barriers
    of their own. Call it in every warpgroup of a copy program."""
    num_wg, copy_stages = overlap.num_wg, overlap.copy_stages

    def scope(*scoped):
        *kind_stages, loaded = scoped
        wg = lax.axis_index("wg")
        body([_copier(smem, loaded, wg, copy_stages) for smem in kind_stages])

    pl.run_scoped(
        scope,
        *(_stage_smem((num_wg,), box, width, dtype, copy_stages)
          for box, (width, dtype) in zip(rows.boxes, rows.kinds, strict=True)),
        plgpu.Barrier(num_arrivals=1, num_barriers=num_wg * copy_stages),
        collective_axes="wg",
    )  # fmt: skip


def _launch(kernel, overlap: _Overlap, out_types: tuple[jax.ShapeDtypeStruct, ...], *operands):
    """The outputs of the overlapped `kernel` (a body taking refs of `operands`, then of
    `out_types`) on `overlap`'s grid."""
    return plgpu.kernel(
        kernel,
        out_type=out_types,
        grid=(overlap.programs,),
        grid_names=("sm",),
        num_threads=overlap.num_wg,
        thread_name="wg",
        compiler_params=_COMPILER_PARAMS,
    )(*operands)


def _kernel_rows(rows: int, block_m: int) -> int:
    """The rows of a GEMM operand or output of `rows` rows in an overlapped kernel: the GEMM's
    row tiles load whole 8-row tiles, and a tile's box may not be taller than the array, so
    whole 8-row tiles and at least block_m rows (rows past `rows`: stored by no tile, sliced
    off)."""
    return max(pl.cdiv(rows, 8) * 8, block_m)


def _gemm_config(
    gemm: gmm_kernel.ProgramsGemm, *, k: int, n: int, dtype, out_dtype, num_rhs: int
) -> tuning.TileConfig:
    """The tiles `gmm_kernel.programs_body` runs `gemm` with, K = k, N = n, `dtype` inputs and
    `out_dtype` outputs (num_rhs rhs tiles a stage), checked (`gmm_kernel.check_config`)."""
    config = gmm_kernel.programs_config(gemm, n=n, dtype=dtype)
    gmm_kernel.check_config(
        config, k=k, n=n, itemsize=jnp.dtype(dtype).itemsize,
        out_itemsize=jnp.dtype(out_dtype).itemsize, num_rhs=num_rhs,
    )  # fmt: skip
    return config


def _check_dispatch(moves: Moves, *, tile: int, out_rows: int) -> int:
    """Checks an overlapped dispatch's tables (one counter a buffer tile of `tile` rows, the
    tiles covering out_rows) and returns its counters."""
    moves.check()
    num_tiles = moves.arrivals_c.shape[0]
    if num_tiles * tile != out_rows:
        raise ValueError(f"{num_tiles} counters of {tile} rows must cover out_rows={out_rows}")
    return num_tiles


def _check_return(back: Moves) -> None:
    """Checks an overlapped return's tables: the rows back count on one counter."""
    back.check()
    if back.arrivals_c.shape != (1,):
        raise ValueError(f"the return counts on one counter, got arrivals {back.arrivals_c.shape}")


# ----------------------------------------------------------------------------------------------
# The dispatch overlapped with the first expert GEMMs: one kernel.


def _wait_tiles(counters, wait_ref, tile: int, first, end) -> None:
    """Returns once buffer rows [first, end) are in place: each tile of `tile` rows they touch
    has counted (counter c, wait_ref[c] counts) its copies and zero ranges, whose stores
    completed before their signals (O1); then the reader's proxy fence (invariant 6)."""

    @pl.loop(first // tile, (end + tile - 1) // tile)
    def _wait(c):
        pl.semaphore_wait(counters.at[c], wait_ref[c], decrement=False)

    _async_proxy_fence()  # invariant 6: before the tile's bulk loads


def _dispatch_copies(stages, srcs, dsts, kind_of, tables, counters, *, copier,
                     overlap: _Overlap, num_zeros: int) -> None:  # fmt: skip
    """O3, one copier's part of the dispatch: the zero ranges that count on tiles first (the
    padding inside the groups, which the GEMMs wait for), then the round's copies, then the
    other zero ranges (the first slots past the groups), copier i taking ranges and copies i,
    i + copiers, ... Each copy moves its rows of every array of `srcs` to `dsts` (on the
    peer) through the stage of its kind, then signals the tile's counter there. A copier
    never waits for anything but its own copies. tables: the views of `_MOVES[:10]`,
    zero_first_z, zero_end_z and round."""
    (src_p_ref, dst_p_ref, size_p_ref, peer_p_ref, round_p_ref, counter_p_ref, count_ref, _,
     zero_dst_ref, zero_size_ref, zero_first_ref, zero_end_ref, round_ref) = tables  # fmt: skip
    round_index = round_ref[0]
    copiers, local = overlap.copiers, overlap.local

    def zeros(signalled: bool):
        """The copier's zero ranges that count on tiles (`signalled`) or the others."""

        def zero(z, zeros_smems):
            first, end = zero_first_ref[z], zero_end_ref[z]
            dst, size = zero_dst_ref[z], zero_size_ref[z]

            @pl.when((end > first) == signalled)
            def _range():
                for out_ref, kind in zip(dsts, kind_of, strict=True):
                    zero_rows(out_ref, dst, size, zeros_smems[kind])

                # The range's tiles that a GEMM tile reads for its stored rows.
                @pl.loop(first, end)
                def _count(c):
                    _signal(counters.at[c])

        _zero_ranges(stages, first=copier, step=copiers, num_zeros=num_zeros, zero=zero)

    zeros(signalled=True)

    @pl.loop(copier, count_ref[0], step=copiers)
    def _copy_piece(p):
        @pl.when(round_p_ref[p] == round_index)
        def _send():
            peer = {overlap.axis_name: peer_p_ref[p]}
            rows = (src_p_ref[p], dst_p_ref[p], size_p_ref[p])
            for src, dst, kind in zip(srcs, dsts, kind_of, strict=True):
                dst = dst if local else plgpu.remote_ref(dst, peer)
                stages[kind].copy(src, dst, *rows)
            _signal(counters.at[counter_p_ref[p]], None if local else peer)

    # Last, the ranges no GEMM tile waits for (the first slots past the groups, which the
    # weight gradients' kernel reads: protocol.TAIL_ZERO_ROWS): the stages are free
    # again, each copy having waited for its stores.
    zeros(signalled=False)


_DISPATCH_TABLES = (*_MOVES[:10], "zero_first_z", "zero_end_z", "round")


def _dispatch_gemm_kernel(
    schedule_ref,
    src_ref,
    *refs,
    gemm: gmm_kernel.ProgramsGemm,
    packed: _Packed,
    config,
    overlap: _Overlap,
    rows: _Rows,
    num_sides: int,
    tile: int,
    num_counters: int,
    num_zeros: int,
):
    # The sides, the tables, the GEMM's weights, then the outputs: the buffer, the sides'
    # rows, the GEMM's.
    num_weights = len(refs) - 2 * num_sides - 3
    side_refs, tables_ref = refs[:num_sides], refs[num_sides]
    weight_refs = refs[num_sides + 1 : num_sides + 1 + num_weights]
    buffer_ref, *side_out_refs, gemm_out_ref = refs[num_sides + 1 + num_weights :]
    tables = packed.views(tables_ref, *_DISPATCH_TABLES)
    wait_ref = tables[_DISPATCH_TABLES.index("arrivals_c")]
    srcs, dsts = (src_ref, *side_refs), (buffer_ref, *side_out_refs)

    # O1. One counter a buffer tile, for the whole kernel and every device (`_run_programs`,
    #     as in send_rows): the copies into the tile and the zero ranges in it count there.

    # O2. Programs [exchange_programs, programs) run the GEMM's tiles on the buffer
    #     (gmm_swiglu's, or the transposed gmm's), each tile once the rows it stores are in
    #     place (the grouped GEMM's invariant 11). Every row before the groups' end is stored
    #     by some tile, so every tile that counts a copy or a zero range is waited for before
    #     the kernel returns: the buffer is complete.
    def run_gemm(counters):
        gmm_kernel.programs_body(
            gemm, schedule_ref, buffer_ref, *weight_refs, gemm_out_ref, config=config,
            before_tile=lambda mi, first, end: _wait_tiles(counters, wait_ref, tile, first, end),
            **overlap.gemm_programs(),
        )  # fmt: skip

    # O3. Programs [0, exchange_programs) copy, each of their warpgroups one copier with its own
    #     stages (`_dispatch_copies`). The copy programs come first in the grid, so they start
    #     before any GEMM program that waits for them.
    def copy(counters, copier):
        _with_copier_stages(
            lambda stages: _dispatch_copies(
                stages, srcs, dsts, rows.kind_of, tables, counters, copier=copier,
                overlap=overlap, num_zeros=num_zeros,
            ),
            rows, overlap,
        )  # fmt: skip

    _run_programs(overlap, num_counters, gemm=run_gemm, copy=copy)


def _zero_signals(moves: Moves, groups_end: Array, tile: int, num_counters: int):
    """Per zero range z, the tiles [first_z, end_z) whose counters count it: those of its rows
    before `groups_end` (the padding inside the groups, whose h rows the GEMM stores; past the
    groups no GEMM tile waits: their GEMM output rows are zeros stored by tiles that load
    nothing). And
    the count each counter then waits for: the protocol's arrivals plus its zero ranges."""
    start_z, size_z = moves.zero_dst_z, moves.zero_size_z
    end_z = jnp.minimum(start_z + size_z, groups_end)
    signals_z = (size_z > 0) & (start_z < end_z)
    first_z = jnp.where(signals_z, start_z // tile, 0).astype(jnp.int32)
    last_z = jnp.where(signals_z, (end_z + tile - 1) // tile, 0).astype(jnp.int32)
    tile_c = jnp.arange(num_counters, dtype=jnp.int32)
    covers_zc = (first_z[:, None] <= tile_c) & (tile_c < last_z[:, None])
    wait_c = moves.arrivals_c + jnp.sum(covers_zc, axis=0, dtype=jnp.int32)
    return first_z, last_z, wait_c


def _dispatch_waits(
    moves: Moves, group_sizes_g: Array, *, tile: int, out_rows: int, block_m: int
) -> tuple[Array, dict[str, Array]]:
    """The GEMM's schedule on the dispatch's buffer (`gmm_kernel.schedule_table`, row tiles of
    block_m) and the dispatch's tables beyond its moves' (`_DISPATCH_TABLES`): the count each
    buffer tile's counter waits for, and each zero range's tiles (`_zero_signals`)."""
    groups_end = jnp.sum(group_sizes_g, dtype=jnp.int32)
    num_tiles = moves.arrivals_c.shape[0]
    zero_first_z, zero_end_z, wait_c = _zero_signals(moves, groups_end, tile, num_tiles)
    schedule_t4 = gmm_kernel.schedule_table(group_sizes_g, num_rows=out_rows, tile_m=block_m)
    return schedule_t4, {"arrivals_c": wait_c, "zero_first_z": zero_first_z,
                         "zero_end_z": zero_end_z}  # fmt: skip


def dispatch_swiglu(
    src_ad: Array,
    side_ac: Array,
    moves: Moves,
    round_index: Array,
    w_gate_gdf: Array,
    w_up_gdf: Array,
    group_sizes_g: Array,
    *,
    out_rows: int,
    tile: int,
    axis_name: str,
    exchange_programs: int | None = None,
    copy_stages: int = 1,
) -> tuple[Array, Array, Array]:
    """The dispatch of round `round_index` and the first expert GEMMs in one kernel, overlapped:
    -> (buffer [out_rows, D], side [out_rows, C], h [out_rows, F]).

    `exchange_programs` of the kernel's programs (one a streaming multiprocessor; None: the
    tuning table's value for this device, `exchange.tuning.default_exchange_programs`) copy this
    device's rows of the round into the peers' buffers as `send_rows` does (src [A, D] and,
    with the same tables, side [A, C], a row a multiple of 16 bytes: the routing weights); the
    others run `gmm_swiglu`'s tiles on this device's buffer, h = silu(buffer @ w_gate[g]) *
    (buffer @ w_up[g]) for the groups `group_sizes_g` ([G], the buffer's padded expert runs),
    each tile as soon as the buffer tiles ([tile] rows, a counter each) under its stored rows
    have counted their copies and zero ranges. So buffer and side are `send_rows`' outputs
    and h is `gmm_swiglu(buffer, w_gate, w_up, group_sizes_g)`, bit for bit; rows no copy or
    zero range fills are unspecified (h's past the groups are zeros). Call inside
    `jax.shard_map` over `axis_name`."""
    _check_sides((side_ac,), src_ad.shape[0], f"the rows {src_ad.shape}")
    buffer, (side,), h = _dispatch_gemm(
        "swiglu", src_ad, (side_ac,), moves, round_index, (w_gate_gdf, w_up_gdf),
        ("w_gate", "w_up"), group_sizes_g, out_rows=out_rows, tile=tile, axis_name=axis_name,
        exchange_programs=exchange_programs, copy_stages=copy_stages,
    )  # fmt: skip
    return buffer, side, h


def dispatch_down_grad(
    dy_ad: Array,
    sides: tuple[Array, ...],
    moves: Moves,
    round_index: Array,
    w_down_gfd: Array,
    group_sizes_g: Array,
    *,
    out_rows: int,
    tile: int,
    axis_name: str,
    exchange_programs: int | None = None,
    copy_stages: int = 1,
) -> tuple[Array, tuple[Array, ...], Array]:
    """The backward's dispatch of round `round_index` (the results' cotangent to the buffers,
    and whatever else the backward needs there) and its first expert GEMM in one kernel,
    overlapped: -> (dy [out_rows, D], the sides' rows (each [out_rows, C]), g f32 [out_rows,
    F]).

    As `dispatch_swiglu`, with the GEMM g = dy @ w_down[g].T in f32 (`gmm(dy, w_down,
    group_sizes_g, transpose_rhs=True, out_dtype=f32)`, bit for bit): copy programs move the
    rows of dy [A, D] (bf16: the cotangent as the GEMMs read it) and, with the same tables,
    of each side [A, C] (a row a multiple of 16 bytes: the layer's are the forward's rows
    and their routing weights, which the backward recomputes from and scales dy by; dy
    times the weight is formed at the buffer), and each GEMM
    tile starts once the rows it stores are in. Call inside `jax.shard_map` over
    `axis_name`."""
    _check_sides(sides, dy_ad.shape[0], f"dy's rows {dy_ad.shape}")
    return _dispatch_gemm(
        "transposed", dy_ad, sides, moves, round_index, (w_down_gfd,), ("w_down",),
        group_sizes_g, out_rows=out_rows, tile=tile, axis_name=axis_name,
        exchange_programs=exchange_programs, copy_stages=copy_stages,
    )  # fmt: skip


def _dispatch_gemm(
    gemm: gmm_kernel.ProgramsGemm,
    src_ad: Array,
    sides: tuple[Array, ...],
    moves: Moves,
    round_index: Array,
    weights: tuple[Array, ...],
    weight_names: tuple[str, ...],
    group_sizes_g: Array,
    *,
    out_rows: int,
    tile: int,
    axis_name: str,
    exchange_programs: int | None,
    copy_stages: int,
) -> tuple[Array, tuple[Array, ...], Array]:
    """`dispatch_swiglu` and `dispatch_down_grad`: the dispatch (of src and its sides) and
    `gemm` on the buffer in one kernel (O1-O3). The weights are [G, D, N] ("swiglu") or
    [G, N, D] ("transposed")."""
    num_counters = _check_dispatch(moves, tile=tile, out_rows=out_rows)
    _check_copy_stages(copy_stages)
    gmm_kernel.check_inputs(src_ad, weights, group_sizes_g, weight_names)
    d_model = src_ad.shape[1]
    transposed = gemm == "transposed"
    k_axis, n = (2, weights[0].shape[1]) if transposed else (1, weights[0].shape[2])
    if weights[0].shape[k_axis] != d_model:
        raise ValueError(
            f"the rows' D={d_model} must equal {weight_names[0]}'s (shape {weights[0].shape})"
        )
    out_dtype = src_ad.dtype if gemm == "swiglu" else jnp.float32
    config = _gemm_config(gemm, k=d_model, n=n, dtype=src_ad.dtype, out_dtype=out_dtype,
                          num_rhs=len(weights))  # fmt: skip
    overlap = _overlap(exchange_programs, num_consumers=config.num_consumers,
                       axis_name=axis_name, copy_stages=copy_stages)  # fmt: skip
    kernel_rows = _kernel_rows(out_rows, config.block_m)
    schedule_t4, waits = _dispatch_waits(moves, group_sizes_g, tile=tile, out_rows=out_rows,
                                         block_m=config.block_m)  # fmt: skip
    tables, packed = _pack(_moves_tables(moves, round_index) | waits, counters=num_counters)
    kernel = functools.partial(
        _dispatch_gemm_kernel,
        gemm=gemm,
        packed=packed,
        config=config,
        overlap=overlap,
        rows=_Rows.of((src_ad, *sides)),
        num_sides=len(sides),
        tile=tile,
        num_counters=num_counters,
        num_zeros=moves.zero_dst_z.shape[0],
    )
    out_types = (
        jax.ShapeDtypeStruct((kernel_rows, d_model), src_ad.dtype),
        *(jax.ShapeDtypeStruct((kernel_rows, side.shape[1]), side.dtype) for side in sides),
        jax.ShapeDtypeStruct((kernel_rows, n), out_dtype),
    )
    outs = _launch(kernel, overlap, out_types, schedule_t4, src_ad, *sides, tables, *weights)
    buffer, *sides_out, out = (a[:out_rows] for a in outs)
    sides_out = tuple(like(a, side) for a, side in zip(sides_out, sides, strict=True))
    return like(buffer, src_ad), sides_out, like(out, src_ad)


# ----------------------------------------------------------------------------------------------
# The down projection overlapped with the return: one kernel (the way back).


def _return_copies(stages, srcs, dsts, kind_of, tables, tile_counter, arrived, *, copier,
                   overlap: _Overlap, tile_signals: int, num_zeros: int) -> None:  # fmt: skip
    """R3, one copier's part of the return: piece p (copier p % copiers) waits until every row
    tile storing its rows (tile_counter(t), t in [first_p, end_p)) has counted its
    `tile_signals`, copies its rows of every array of `srcs` to its source's rows (`dsts`,
    on the peer), then signals the peer's `arrived`; then the copier zeroes its zero ranges
    of this device's `dsts`. Copier 0 last waits for the arrivals of this device's round
    (every row is back). A copier waits only for this device's GEMM tiles and for the peers'
    copiers. tables: the views of `_RETURN_TABLES`."""
    (src_p_ref, dst_p_ref, size_p_ref, peer_p_ref, round_p_ref, count_ref, arrivals_ref,
     zero_dst_ref, zero_size_ref, round_ref, first_p_ref, end_p_ref) = tables  # fmt: skip
    round_index = round_ref[0]
    copiers, local = overlap.copiers, overlap.local

    @pl.loop(copier, count_ref[0], step=copiers)
    def _copy_piece(p):
        @pl.when(round_p_ref[p] == round_index)
        def _send():
            @pl.loop(first_p_ref[p], end_p_ref[p])
            def _wait(t):
                pl.semaphore_wait(tile_counter(t), tile_signals, decrement=False)

            _async_proxy_fence()  # invariant 6: before the piece's bulk loads

            peer = {overlap.axis_name: peer_p_ref[p]}
            for src, dst, kind in zip(srcs, dsts, kind_of, strict=True):
                dst = dst if local else plgpu.remote_ref(dst, peer)
                stages[kind].copy(src, dst, src_p_ref[p], dst_p_ref[p], size_p_ref[p])
            _signal(arrived, None if local else peer)

    def zero(z, zeros_smems):
        for dst, kind in zip(dsts, kind_of, strict=True):
            zero_rows(dst, zero_dst_ref[z], zero_size_ref[z], zeros_smems[kind])

    _zero_ranges(stages, first=copier, step=copiers, num_zeros=num_zeros, zero=zero)

    @pl.when(copier == 0)
    def _arrivals():
        pl.semaphore_wait(arrived, arrivals_ref[0])


# The return's tables: `_MOVES` but counter_p (one counter), and each piece's row tiles.
_RETURN_TABLES = (*_MOVES[:5], *_MOVES[6:], "first_p", "end_p")


def _gemm_return_kernel(
    schedule_ref,
    lhs_ref,
    *refs,
    gemm: gmm_kernel.ProgramsGemm,
    packed: _Packed,
    config,
    overlap: _Overlap,
    rows: _Rows,
    num_sides: int,
    tile_signals: int,
    num_row_tiles: int,
    num_zeros: int,
):
    # The GEMM's other operands (weights, row scale), the sides, the tables, then the GEMM's
    # output y, the rows back and the sides' rows back.
    num_gemm = len(refs) - 2 * num_sides - 3
    gemm_refs, side_refs = refs[:num_gemm], refs[num_gemm : num_gemm + num_sides]
    tables_ref, y_ref, out_ref, *side_out_refs = refs[num_gemm + num_sides :]
    srcs, dsts = (y_ref, *side_refs), (out_ref, *side_out_refs)
    tables = packed.views(tables_ref, *_RETURN_TABLES)

    # R1. One counter a row tile of the GEMM's schedule, counting this device's own stores
    #     (its consumers signal, invariant 12 of the grouped GEMM), then one counter for the
    #     return's arrivals: every peer's copies to this device count there. One set for the
    #     kernel and every device (`_run_programs`, as in send_rows).

    # R2. Programs [exchange_programs, programs) run the GEMM's tiles (y = (h @ w_down[g]) *
    #     scale in f32, or the input gradient [d_gate | d_up] @ [w_gate | w_up][g].T), each
    #     consumer signalling its row tile once its stores of a tile have completed. They
    #     wait for nothing.
    def run_gemm(counters):
        gmm_kernel.programs_body(
            gemm, schedule_ref, lhs_ref, *gemm_refs, y_ref, config=config,
            after_tile=lambda mi: _signal(counters.at[mi]), **overlap.gemm_programs(),
        )  # fmt: skip

    # R3. Programs [0, exchange_programs) copy, each warpgroup one copier (`_return_copies`). A
    #     copier waits only for this device's GEMM tiles, which wait for nothing, and for the
    #     peers' copiers, which do the same: no cycle.
    def copy(counters, copier):
        _with_copier_stages(
            lambda stages: _return_copies(
                stages, srcs, dsts, rows.kind_of, tables, lambda t: counters.at[t],
                counters.at[num_row_tiles], copier=copier, overlap=overlap,
                tile_signals=tile_signals, num_zeros=num_zeros,
            ),
            rows, overlap,
        )  # fmt: skip

    _run_programs(overlap, num_row_tiles + 1, gemm=run_gemm, copy=copy)


def _row_tile_waits(moves: Moves, schedule_t4: Array) -> tuple[Array, Array]:
    """Per piece p, the schedule's row tiles [first_p, end_p) that store its rows [src_p[p],
    + size_p[p]): the stored ranges (row0 + lo, row0 + hi) of the tiles in order partition
    the rows (unused entries store nothing, at the end), so both ends are binary searches."""
    stored_lo = schedule_t4[:, 1] + schedule_t4[:, 2]
    stored_hi = schedule_t4[:, 1] + schedule_t4[:, 3]
    start, end = moves.src_p, moves.src_p + moves.size_p
    first_p = jnp.searchsorted(stored_hi, start, side="right", method="scan_unrolled")
    end_p = jnp.searchsorted(stored_lo, end, side="left", method="scan_unrolled")
    real = moves.size_p > 0
    return jnp.where(real, first_p, 0).astype(jnp.int32), jnp.where(real, end_p, 0).astype(
        jnp.int32
    )


def down_return(
    h_sf: Array,
    scale_s: Array,
    w_down_gfd: Array,
    group_sizes_g: Array,
    back: Moves,
    round_index: Array,
    *,
    out_rows: int,
    axis_name: str,
    exchange_programs: int | None = None,
    copy_stages: int = 1,
) -> tuple[Array, Array]:
    """The down projection of round `round_index` and the return of its results in one kernel,
    overlapped: -> (y [S, D] f32, out [out_rows, D] f32).

    The GEMM programs compute y = (h @ w_down[g]) * scale per row, f32, over the groups
    `group_sizes_g` ([G], the buffer's padded expert runs: `gmm(h, w_down, group_sizes,
    row_scale_m=scale, out_dtype=f32)`, bit for bit) from h [S, F] (bf16, `dispatch_swiglu`'s)
    and scale f32 [S] (the routing weights). `exchange_programs` of the kernel's programs (None:
    the tuning table's value, as in `dispatch_swiglu`) copy this device's pieces of y back to
    their sources as `send_rows(y, back, ...)` does, each piece as soon as the row tiles
    storing its rows have completed: out is the rows every device's `back` copies here (rows
    of other rounds unspecified), and zeros in `back`'s zero ranges. Call inside
    `jax.shard_map` over `axis_name`."""
    num_slots = h_sf.shape[0]
    if h_sf.ndim != 2 or w_down_gfd.ndim != 3 or h_sf.shape[1] != w_down_gfd.shape[1]:
        raise ValueError(f"h {h_sf.shape} must be [S, F] and w_down {w_down_gfd.shape} [G, F, D]")
    if scale_s.shape != (num_slots,) or scale_s.dtype != jnp.float32:
        raise ValueError(f"scale must be f32 [{num_slots}], got {scale_s.dtype} {scale_s.shape}")
    y, out, _ = _gemm_return(
        "scaled", h_sf, (w_down_gfd,), ("w_down",), group_sizes_g, back, round_index,
        n=w_down_gfd.shape[2], scale_s=scale_s, sides=(), out_rows=out_rows,
        axis_name=axis_name, exchange_programs=exchange_programs, copy_stages=copy_stages,
    )  # fmt: skip
    return y, out


def dgrad_return(
    d_gate_up_s2f: Array,
    w_gate_gdf: Array,
    w_up_gdf: Array,
    group_sizes_g: Array,
    back: Moves,
    round_index: Array,
    *,
    sides: tuple[Array, ...] = (),
    out_rows: int,
    axis_name: str,
    exchange_programs: int | None = None,
    copy_stages: int = 1,
) -> tuple[Array, Array, tuple[Array, ...]]:
    """The expert MLP's input gradient of round `round_index` and its return to the rows'
    sources in one kernel, overlapped (the backward's way back): -> (d_buffer [S, D], d_x
    [out_rows, D] in the dtype of d_gate_up, the sides' rows back (each [out_rows, C])).

    The GEMM programs compute d_buffer = [d_gate | d_up] @ [w_gate | w_up][g].T over the
    groups `group_sizes_g` (`gmm(d_gate_up, (w_gate, w_up), group_sizes, transpose_rhs=True)`,
    bit for bit) from d_gate_up [S, 2F] and w_gate, w_up [G, D, F]; the copy programs send
    each piece of it back along `back` as `send_rows(d_buffer, back, ...)` does, as soon as
    the row tiles storing its rows have completed (as `down_return`), and with it the
    piece's rows of each side [S, C] (a row a multiple of 16 bytes: the layer's is the
    routing weights' gradient, f32 [S, 4]), as `send_rows(side, back, ...)` does."""
    rows = d_gate_up_s2f.shape[0] if d_gate_up_s2f.ndim == 2 else None
    _check_sides(sides, rows, f"the slots {d_gate_up_s2f.shape}")
    if (
        d_gate_up_s2f.ndim != 2
        or w_gate_gdf.ndim != 3
        or (d_gate_up_s2f.shape[1] != 2 * w_gate_gdf.shape[2])
    ):
        raise ValueError(
            f"d_gate_up {d_gate_up_s2f.shape} must be [S, 2F] and w_gate {w_gate_gdf.shape} "
            "[G, D, F]"
        )
    return _gemm_return(
        "dgrad", d_gate_up_s2f, (w_gate_gdf, w_up_gdf), ("w_gate", "w_up"), group_sizes_g, back,
        round_index, n=w_gate_gdf.shape[1], scale_s=None, sides=sides,
        out_rows=out_rows, axis_name=axis_name, exchange_programs=exchange_programs,
        copy_stages=copy_stages,
    )  # fmt: skip


def _gemm_return(
    gemm: gmm_kernel.ProgramsGemm,
    lhs_sk: Array,
    weights: tuple[Array, ...],
    weight_names: tuple[str, ...],
    group_sizes_g: Array,
    back: Moves,
    round_index: Array,
    *,
    n: int,
    scale_s: Array | None,
    sides: tuple[Array, ...],
    out_rows: int,
    axis_name: str,
    exchange_programs: int | None,
    copy_stages: int,
) -> tuple[Array, Array, tuple[Array, ...]]:
    """`down_return` ("scaled", with scale_s) and `dgrad_return` ("dgrad"): `gemm` (N = n) on
    lhs and the return of its output, with the sides' rows, in one kernel (R1-R3)."""
    _check_return(back)
    _check_copy_stages(copy_stages)
    num_slots = lhs_sk.shape[0]
    gmm_kernel.check_inputs(lhs_sk, weights, group_sizes_g, weight_names)
    out_dtype = jnp.dtype(jnp.float32 if gemm == "scaled" else lhs_sk.dtype)
    config = _gemm_config(gemm, k=lhs_sk.shape[1], n=n, dtype=lhs_sk.dtype, out_dtype=out_dtype,
                          num_rhs=1)  # fmt: skip
    part_k = lhs_sk.shape[1] // len(weights)
    if part_k % config.block_k:
        raise ValueError(f"each rhs part's K={part_k} must be a multiple of {config.block_k}")
    overlap = _overlap(exchange_programs, num_consumers=config.num_consumers,
                       axis_name=axis_name, copy_stages=copy_stages)  # fmt: skip
    # As in the dispatch (rows past S: zeros in lhs); a row scale is read for whole tiles.
    kernel_rows = _kernel_rows(num_slots, config.block_m)
    y_type = jax.ShapeDtypeStruct((kernel_rows, n), out_dtype)
    if kernel_rows != num_slots:
        lhs_sk = jnp.pad(lhs_sk, ((0, kernel_rows - num_slots), (0, 0)))
    operands = weights
    if scale_s is not None:
        operands += (jnp.pad(scale_s, (0, kernel_rows - num_slots + config.block_m)),)
    schedule_t4 = gmm_kernel.schedule_table(
        group_sizes_g, num_rows=num_slots, tile_m=config.block_m
    )
    first_p, end_p = _row_tile_waits(back, schedule_t4)
    named = _moves_tables(back, round_index) | {"first_p": first_p, "end_p": end_p}
    tables, packed = _pack(named, counters=schedule_t4.shape[0] + 1)
    kernel = functools.partial(
        _gemm_return_kernel,
        gemm=gemm,
        packed=packed,
        config=config,
        overlap=overlap,
        rows=_Rows.of((y_type, *sides)),
        num_sides=len(sides),
        tile_signals=(n // config.block_n) * config.num_consumers,
        num_row_tiles=schedule_t4.shape[0],
        num_zeros=back.zero_dst_z.shape[0],
    )
    out_types = (
        y_type,
        jax.ShapeDtypeStruct((out_rows, n), out_dtype),
        *(jax.ShapeDtypeStruct((out_rows, side.shape[1]), side.dtype) for side in sides),
    )
    y, out, *sides_out = _launch(
        kernel, overlap, out_types, schedule_t4, lhs_sk, *operands, *sides, tables
    )
    sides_out = tuple(like(a, side) for a, side in zip(sides_out, sides, strict=True))
    return like(y[:num_slots], lhs_sk), like(out, lhs_sk), sides_out


# ----------------------------------------------------------------------------------------------
# The forward of a round in one kernel: dispatch, gate/up, down projection and return.


def _forward_kernel(
    schedule_ref,
    src_ref,
    side_ref,
    tables_ref,
    w_gate_ref,
    w_up_ref,
    w_down_ref,
    buffer_ref,
    side_out_ref,
    h_ref,
    y_ref,
    out_ref,
    *,
    packed: _Packed,
    swiglu_config,
    down_config,
    overlap: _Overlap,
    dispatch_rows: _Rows,
    return_rows: _Rows,
    tile: int,
    num_tiles: int,
    num_row_tiles: int,
    h_signals: int,
    y_signals: int,
    num_zeros: int,
    num_return_zeros: int,
):
    dispatch = packed.views(tables_ref, *_DISPATCH_TABLES)
    back = packed.views(tables_ref, *(f"back_{name}" for name in _RETURN_TABLES))
    wait_ref = dispatch[_DISPATCH_TABLES.index("arrivals_c")]
    # F1. One set of counters for the kernel and every device (`_run_programs`, as in
    #     send_rows): a counter a buffer tile (the dispatch's copies and zero ranges into it,
    #     O1), a counter a row tile of h (the gate/up tiles' stores of it, the grouped GEMM's
    #     invariant 12), a counter a row tile of y (the down tiles' stores), then the return's
    #     arrivals. The two GEMMs share one schedule (the same block_m), so a row tile is the
    #     same rows in both.
    num_counters = num_tiles + 2 * num_row_tiles + 1

    def h_counter(counters, mi):
        return counters.at[num_tiles + mi]

    def y_counter(counters, mi):
        return counters.at[num_tiles + num_row_tiles + mi]

    # F2. Programs [exchange_programs, programs) run every gate/up tile of theirs (O2: each
    #     once its buffer rows are in; each consumer signals the tile's row of h once its
    #     stores completed), then every down tile of theirs, each once its row tile of h has
    #     every signal (the producer) and once the routing weights of its rows are in (each
    #     consumer, before it loads them: the grouped GEMM's invariant 13); each consumer
    #     signals the tile's row of y once its stores completed. A down tile waits for
    #     gate/up tiles, which every GEMM program runs before any down tile, and which wait
    #     only for the copies: no cycle, all programs being resident (one a streaming
    #     multiprocessor).
    def run_gemm(counters):
        def wait_h(mi, first, end):
            """The down tile's h rows [first, end) are stored: every gate/up tile of row tile
            mi has signalled from every consumer (h_signals)."""
            del first, end
            pl.semaphore_wait(h_counter(counters, mi), h_signals, decrement=False)
            _async_proxy_fence()  # invariant 6: before the tile's bulk loads of h

        wait_rows = functools.partial(_wait_tiles, counters, wait_ref, tile)
        gmm_kernel.programs_body(
            "swiglu", schedule_ref, buffer_ref, w_gate_ref, w_up_ref, h_ref,
            config=swiglu_config, before_tile=lambda mi, first, end: wait_rows(first, end),
            after_tile=lambda mi: _signal(h_counter(counters, mi)), **overlap.gemm_programs(),
        )  # fmt: skip
        gmm_kernel.programs_body(
            "scaled", schedule_ref, h_ref, w_down_ref, side_out_ref.at[:, 0], y_ref,
            config=down_config, before_tile=wait_h, before_scale=wait_rows,
            after_tile=lambda mi: _signal(y_counter(counters, mi)), set_registers=False,
            **overlap.gemm_programs(),
        )  # fmt: skip

    # F3. Programs [0, exchange_programs) copy, each warpgroup one copier: the dispatch of the
    #     rows and their weights (`_dispatch_copies`), then the return of y (`_return_copies`,
    #     each piece once the row tiles of y storing it have every signal). A copier's
    #     dispatch waits for nothing; its return waits for this device's down tiles and the
    #     peers' copiers, which wait for the dispatch of every device, which all copiers run
    #     first.
    def copy(counters, copier):
        _with_copier_stages(
            lambda stages: _dispatch_copies(
                stages, (src_ref, side_ref), (buffer_ref, side_out_ref), dispatch_rows.kind_of,
                dispatch, counters, copier=copier, overlap=overlap, num_zeros=num_zeros,
            ),
            dispatch_rows, overlap,
        )  # fmt: skip
        _with_copier_stages(
            lambda stages: _return_copies(
                stages, (y_ref,), (out_ref,), return_rows.kind_of, back,
                functools.partial(y_counter, counters), counters.at[num_counters - 1],
                copier=copier, overlap=overlap, tile_signals=y_signals,
                num_zeros=num_return_zeros,
            ),
            return_rows, overlap,
        )  # fmt: skip

    _run_programs(overlap, num_counters, gemm=run_gemm, copy=copy)


def dispatch_mlp_return(
    src_ad: Array,
    side_ac: Array,
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
    exchange_programs: int | None = None,
    copy_stages: int = 1,
) -> tuple[Array, Array, Array, Array, Array]:
    """The forward of round `round_index` in one kernel: the dispatch, the gate/up GEMMs, the
    down projection and the return, overlapped -> (buffer [out_rows, D], side [out_rows, C],
    h [out_rows, F], y f32 [out_rows, D], out f32 [A, D]).

    `dispatch_swiglu(src, side, moves, ...)` then `down_return(h, side[:, 0], w_down,
    group_sizes, back, ...)`, bit for bit, in one kernel: `exchange_programs` copy programs
    (None: the tuning table's value, as in `dispatch_swiglu`) dispatch the rows src [A, D]
    and their routing weights side f32 [A, C] (column 0; a row a multiple of 16 bytes), then
    return each piece of y to its source's rows as soon as the row tiles storing it are
    stored; the GEMM programs run each gate/up tile once its buffer rows are in, then each
    down tile once its row tile of h is stored (every gate/up tile of it), with the weights
    of the dispatched side in its epilogue. out is the rows every device's
    `back` copies here (rows of other rounds unspecified), zeros in `back`'s zero ranges;
    buffer and side rows no copy or zero range fills are unspecified. Call inside
    `jax.shard_map` over `axis_name`. Bitwise equal to the separate kernels on one H200 (its
    GPU twin)."""
    num_tiles = _check_dispatch(moves, tile=tile, out_rows=out_rows)
    _check_return(back)
    _check_copy_stages(copy_stages)
    _check_sides((side_ac,), src_ad.shape[0], f"the rows {src_ad.shape}")
    if side_ac.dtype != jnp.float32:
        raise ValueError(f"the side (the weights in column 0) must be f32, got {side_ac.dtype}")
    gmm_kernel.check_inputs(src_ad, (w_gate_gdf, w_up_gdf), group_sizes_g, ("w_gate", "w_up"))
    if w_down_gfd.dtype != src_ad.dtype:
        raise ValueError(f"w_down's dtype {w_down_gfd.dtype} must be the rows' {src_ad.dtype}")
    num_rows, d_model = src_ad.shape
    d_ff = w_gate_gdf.shape[2]
    if w_gate_gdf.shape[1] != d_model or w_down_gfd.shape != (w_gate_gdf.shape[0], d_ff, d_model):
        raise ValueError(
            f"w_gate {w_gate_gdf.shape} must be [G, D={d_model}, F] and w_down "
            f"{w_down_gfd.shape} [G, F, D]"
        )
    dtype = src_ad.dtype
    swiglu_config = _gemm_config("swiglu", k=d_model, n=d_ff, dtype=dtype, out_dtype=dtype,
                                 num_rhs=2)  # fmt: skip
    down_config = _gemm_config("scaled", k=d_ff, n=d_model, dtype=dtype, out_dtype=jnp.float32,
                               num_rhs=1)  # fmt: skip
    shared = ("block_m", "num_consumers")
    if any(getattr(swiglu_config, a) != getattr(down_config, a) for a in shared):
        raise ValueError(
            f"the forward in one kernel needs its gate/up and down tiles to share block_m and "
            f"num_consumers, and at D={d_model}, F={d_ff} they do not ({swiglu_config} against "
            f"{down_config}; on the H200's tiles D must be a multiple of 128): use "
            f"exchange_fusion='per_gemm'"
        )
    overlap = _overlap(exchange_programs, num_consumers=swiglu_config.num_consumers,
                       axis_name=axis_name, copy_stages=copy_stages)  # fmt: skip
    block_m = swiglu_config.block_m
    # As in the two kernels; the routing weights are read for whole row tiles, so the side has
    # block_m rows more (unfilled: their rows are not stored).
    kernel_rows = _kernel_rows(out_rows, block_m)
    schedule_t4, waits = _dispatch_waits(moves, group_sizes_g, tile=tile, out_rows=out_rows,
                                         block_m=block_m)  # fmt: skip
    num_row_tiles = schedule_t4.shape[0]
    first_p, end_p = _row_tile_waits(back, schedule_t4)
    named = _moves_tables(moves, round_index) | waits
    back_named = _moves_tables(back, round_index) | {"first_p": first_p, "end_p": end_p}
    named |= {f"back_{name}": back_named[name] for name in _RETURN_TABLES}
    tables, packed = _pack(named, counters=num_tiles + 2 * num_row_tiles + 1)
    y_type = jax.ShapeDtypeStruct((kernel_rows, d_model), jnp.float32)
    kernel = functools.partial(
        _forward_kernel,
        packed=packed,
        swiglu_config=swiglu_config,
        down_config=down_config,
        overlap=overlap,
        dispatch_rows=_Rows.of((src_ad, side_ac)),
        return_rows=_Rows.of((y_type,)),
        tile=tile,
        num_tiles=num_tiles,
        num_row_tiles=num_row_tiles,
        h_signals=(d_ff // swiglu_config.block_n) * swiglu_config.num_consumers,
        y_signals=(d_model // down_config.block_n) * down_config.num_consumers,
        num_zeros=moves.zero_dst_z.shape[0],
        num_return_zeros=back.zero_dst_z.shape[0],
    )
    out_types = (
        jax.ShapeDtypeStruct((kernel_rows, d_model), dtype),
        jax.ShapeDtypeStruct((kernel_rows + block_m, side_ac.shape[1]), side_ac.dtype),
        jax.ShapeDtypeStruct((kernel_rows, d_ff), dtype),
        y_type,
        jax.ShapeDtypeStruct((num_rows, d_model), jnp.float32),
    )
    outs = _launch(kernel, overlap, out_types, schedule_t4, src_ad, side_ac, tables, w_gate_gdf,
                   w_up_gdf, w_down_gfd)  # fmt: skip
    buffer, side, h, y, out = outs
    buffer, side, h, y = (a[:out_rows] for a in (buffer, side, h, y))
    return tuple(like(a, src_ad) for a in (buffer, side, h, y, out))
