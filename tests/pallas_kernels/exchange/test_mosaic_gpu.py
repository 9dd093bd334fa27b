"""The exchange's kernels (exchange/mosaic_gpu.py) and the harness that runs a round of each
inside shard_map: `send_rows` (one direction of a round) and the kernels that overlap the copies
with the expert GEMMs (dispatch_swiglu, dispatch_down_grad, down_return, dgrad_return,
dispatch_mlp_return). Their contracts (lowering for CUDA inside shard_map on 8 devices, with
their launches' invariants; on GPUs, the bits of the protocol's plan or of separate kernels,
round by round) are rows of tests/pallas_kernels/test_contracts.py, which runs this file's
harness (`dispatch_fn`, `*_fn`, `*_inputs`, `planned_buffers`, `specified_slots`). Here: the
spec (reference.py) puts every row where the protocol says and back; the copies and zero ranges
in GPU interpret mode (semaphores aside); the tables no operand can share; the protocol's waits
replayed on the host; bad tables and arguments."""

from __future__ import annotations

import dataclasses
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import PartitionSpec as P

from pallas_kernels.exchange import Moves, mosaic_gpu, reference
from pallas_kernels.exchange import protocol as xp
from pallas_kernels.mesh import like

AXIS = "expert"


def random_counts(seed: int, num_devices: int, num_local: int, num_rows: int) -> np.ndarray:
    """[EP, E]: each source's rows over the experts, skewed (some experts get none)."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(num_devices * num_local, 0.5))
    return np.stack(
        [
            np.bincount(rng.choice(weights.size, num_rows, p=weights), minlength=weights.size)
            for _ in range(num_devices)
        ]
    ).astype(np.int32)


def dispatch_fn(
    num_local, num_rows, window, tile, *, kernel: bool, num_blocks=None, copy_stages: int = 1
):
    """(x [EP * N, D], counts [EP, E], round []) -> (buffers [EP * S, D], rows back
    [EP * N, D]), inside shard_map: the round's dispatch, then its return of the buffers."""
    slots = xp.num_tiles(window, tile, num_local) * tile

    def body(x, counts_se, round_index):
        me = jax.lax.axis_index(AXIS)
        t = xp.traffic(counts_se, num_local)
        dispatch, back = xp.exchange_moves(t, me, round_index, num_rows, window, tile)
        if kernel:
            send = functools.partial(mosaic_gpu.send_rows, axis_name=AXIS, num_blocks=num_blocks,
                                     copy_stages=copy_stages)  # fmt: skip
        else:
            send = functools.partial(reference.send_rows, axis_name=AXIS)
        buf = send(x, dispatch, round_index, out_rows=slots)
        return buf, send(buf, back, round_index, out_rows=num_rows)

    return body, slots


def placed(mesh, x, counts_se, round_index):
    """The arguments of a dispatch_fn, placed as its shard_map's in_specs say."""
    put = lambda a, spec: jax.device_put(jnp.asarray(a), jax.NamedSharding(mesh, spec))  # noqa: E731
    return put(x, P(AXIS)), put(counts_se, P()), put(jnp.int32(round_index), P())


# The sizes the exchange's kernels are lowered (and traced) at on this machine: 8 devices, 4
# experts and 512 rows a device, a 640-row window in tiles of 64, D and F of qwen3.
EP, NUM_LOCAL, NUM_ROWS, WINDOW, TILE, D_MODEL, D_FF = 8, 4, 512, 640, 64, 2048, 768


def sharded(mesh, shape, dtype, spec: P | None = None) -> jax.ShapeDtypeStruct:
    """An abstract argument of `shape`, placed on `mesh` as `spec` says (default: split along
    AXIS)."""
    spec = P(AXIS) if spec is None else spec
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.NamedSharding(mesh, spec))


def round_arguments(mesh) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """The abstract counts [EP, E] and round index [] of a round, replicated."""
    num_devices = mesh.devices.size
    return (sharded(mesh, (num_devices, num_devices * NUM_LOCAL), jnp.int32, P()),
            sharded(mesh, (), jnp.int32, P()))  # fmt: skip


def assert_no_operand_can_share_the_counters(text: str) -> None:
    """Invariant 5 of the exchange's kernels: in every Mosaic GPU call of the lowering, the
    counters' zero operand (aliased to an output, written in place) has a type no other
    operand has, so XLA cannot merge a constant table with it."""
    calls = re.findall(
        r"custom_call @mosaic_gpu_v2\(.*?output_operand_aliases = \[(.*?)>\].*?\} : \((.*?)\) ->",
        text,
    )
    assert calls
    for aliases, operands in calls:
        types = re.findall(r"tensor<[^>]*>", operands)
        indices = re.findall(r"operand_index = (\d+)", aliases)
        assert indices, aliases  # the counters' zero operand
        for index in indices:
            counters = types[int(index)]
            others = types[: int(index)] + types[int(index) + 1 :]
            assert counters not in others, (counters, types)


def assert_fences(text: str, *, fenced: bool) -> None:
    """Invariant 6 of the exchange's kernels: every Mosaic GPU call of the lowering has the
    reader's proxy fence in its module (`fenced`: an overlapped kernel, whose one fence site
    is where its GEMM producers, or its copiers, wait for rows before loading them) or none
    (send_rows: nothing loads after its waits). A module stores each string once, so this
    sees whether a kernel has the fence, which with one site is whether the site has it."""
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert calls
    assert [mosaic_gpu.PROXY_FENCE in line for line in calls] == [fenced] * len(calls)


def test_the_return_tables_cannot_share_its_one_counter():
    """The return counts on one counter ([1]) and has no zero ranges (constant zeros of shape
    [1]): before the tables were packed into one operand, XLA gave the zero ranges the
    counters' buffer, and the kernel read them as the counter counted (invariant 5)."""
    num_local, num_rows, window, tile, d_model = 3, 200, 96, 8, 2048
    mesh = jax.make_mesh((1,), (AXIS,), devices=jax.devices()[:1])
    slots = xp.num_tiles(window, tile, num_local) * tile

    def body(y, counts_se, round_index):
        t = xp.traffic(counts_se, num_local)
        _, back = xp.exchange_moves(t, jnp.int32(0), round_index, num_rows, window, tile)
        assert back.arrivals_c.shape == back.zero_dst_z.shape == (1,)
        return mosaic_gpu.send_rows(y, back, round_index, out_rows=num_rows, axis_name=AXIS)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P(), P()), out_specs=P(AXIS)))
    sharded = lambda shape, dtype, spec: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=jax.NamedSharding(mesh, spec)
    )
    args = (
        sharded((slots, d_model), jnp.float32, P(AXIS)),
        sharded((1, num_local), jnp.int32, P()),
        sharded((), jnp.int32, P()),
    )
    assert_no_operand_can_share_the_counters(
        fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    )


def test_bad_tables_raise():
    x = jnp.zeros((8, 128), jnp.bfloat16)
    table = jnp.zeros((8,), jnp.int32)
    zeros = jnp.zeros((2,), jnp.int32)
    good = Moves(*(table,) * 6, count=jnp.int32(1), arrivals_c=jnp.zeros(4, jnp.int32),
                 zero_dst_z=zeros, zero_size_z=zeros)  # fmt: skip
    send = functools.partial(mosaic_gpu.send_rows, out_rows=16, axis_name=AXIS, num_blocks=2)
    with pytest.raises(ValueError, match="of one shape"):
        send(x, dataclasses.replace(good, dst_p=jnp.zeros((7,), jnp.int32)), 0)
    with pytest.raises(ValueError, match="count must be"):
        send(x, dataclasses.replace(good, count=jnp.zeros((1,), jnp.int32)), 0)
    with pytest.raises(ValueError, match="must be int32"):
        send(x, dataclasses.replace(good, size_p=table.astype(jnp.float32)), 0)
    with pytest.raises(ValueError, match="zero ranges"):
        send(x, dataclasses.replace(good, zero_size_z=jnp.zeros((3,), jnp.int32)), 0)
    with pytest.raises(ValueError, match="multiple of 16"):
        send(jnp.zeros((8, 6), jnp.bfloat16), good, 0)
    with pytest.raises(ValueError, match="exceeds"):
        send(jnp.zeros((8, 32768), jnp.float32), good, 0)
    with pytest.raises(ValueError, match="copy_stages"):
        send(x, good, 0, copy_stages=3)


def planned_buffers(counts_se, x_snd, num_local, window, tile):
    """On the host, from the protocol's row places: [EP, R, S, D] buffers and [EP, R, S] the
    slots a row fills."""
    num_devices, num_rows, d_model = x_snd.shape
    t = xp.traffic(jnp.asarray(counts_se), num_local)
    rounds = int(xp.window_rounds(t, window))
    slots = xp.num_tiles(window, tile, num_local) * tile
    buf = np.zeros((num_devices, rounds, slots, d_model), x_snd.dtype)
    filled = np.zeros((num_devices, rounds, slots), bool)
    for s in range(num_devices):
        places = xp.row_places(t, jnp.int32(s), num_rows, window, tile)
        for n in np.flatnonzero(np.asarray(places.dest_n) >= 0):
            d, r, q = (int(np.asarray(a)[n]) for a in (places.dest_n, places.round_n,
                                                         places.slot_n))  # fmt: skip
            assert not filled[d, r, q]
            buf[d, r, q], filled[d, r, q] = x_snd[s, n], True
    return buf, filled, rounds


def specified_slots(counts_se, num_local, num_rows, window, tile, round_index):
    """[EP, S] bool: the slots of each device's buffer in a round that the dispatch specifies,
    those a row fills and those its zero ranges cover (the padding inside the groups and the
    first TAIL_ZERO_ROWS past them); the kernel leaves the others unspecified."""
    t = xp.traffic(jnp.asarray(counts_se), num_local)
    slots = xp.num_tiles(window, tile, num_local) * tile
    num_devices = counts_se.shape[0]
    specified = np.zeros((num_devices, slots), bool)
    for d in range(num_devices):
        me, r = jnp.int32(d), jnp.int32(round_index)
        dispatch, _ = xp.exchange_moves(t, me, r, num_rows, window, tile)
        specified[d] = np.asarray(xp.buffer_layout(t, me, r, window, tile)[1])
        for dst, size in zip(np.asarray(dispatch.zero_dst_z), np.asarray(dispatch.zero_size_z),
                             strict=True):  # fmt: skip
            specified[d, dst : dst + size] = True
    return specified


def planned_returns(counts_se, x_snd, num_local, window, tile, round_index):
    """[EP, N, D]: every device's rows of the round, zeros elsewhere (what the return brings
    back when the buffers are sent back as they came)."""
    t = xp.traffic(jnp.asarray(counts_se), num_local)
    rows = np.zeros_like(x_snd)
    for s in range(x_snd.shape[0]):
        places = xp.row_places(t, jnp.int32(s), x_snd.shape[1], window, tile)
        mine = np.asarray(places.round_n) == round_index
        rows[s][mine] = x_snd[s][mine]
    return rows


def test_the_reference_puts_every_row_where_the_protocol_says_and_back():
    num_devices, num_local, num_rows, window, tile, d_model = 8, 2, 24, 24, 4, 16
    counts_se = random_counts(0, num_devices, num_local, num_rows)
    x_snd = np.arange(num_devices * num_rows * d_model, dtype=np.float32).reshape(
        num_devices, num_rows, d_model
    )
    want, filled, rounds = planned_buffers(counts_se, x_snd, num_local, window, tile)
    assert rounds >= 2
    mesh = jax.make_mesh((num_devices,), (AXIS,))
    body, slots = dispatch_fn(num_local, num_rows, window, tile, kernel=False)

    def with_layout(x, counts_se, round_index):
        me = jax.lax.axis_index(AXIS)
        t = xp.traffic(counts_se, num_local)
        _, filled_s = xp.buffer_layout(t, me, round_index, window, tile)
        return *body(x, counts_se, round_index), filled_s

    fn = jax.jit(
        jax.shard_map(with_layout, mesh=mesh, in_specs=(P(AXIS), P(), P()),
                      out_specs=(P(AXIS),) * 3)
    )  # fmt: skip
    for r in range(rounds):
        buf, back, filled_s = fn(*placed(mesh, x_snd.reshape(-1, d_model), counts_se, r))
        chex.assert_trees_all_equal(np.asarray(buf).reshape(num_devices, slots, -1), want[:, r])
        chex.assert_trees_all_equal(np.asarray(filled_s).reshape(num_devices, -1), filled[:, r])
        chex.assert_trees_all_equal(
            np.asarray(back).reshape(x_snd.shape),
            planned_returns(counts_se, x_snd, num_local, window, tile, r),
        )


def test_the_piece_copies_place_every_row_in_interpret_mode():
    """The kernel's copy path (`copy_piece`, steps 1-2 without the signal: Mosaic GPU's
    interpret mode runs no semaphores) on one device, 4 blocks taking the pieces in turn as
    the kernel does, through a stage of 4 rows (pieces of up to 8 rows take a full box and
    the rest's boxes): every row lands in the slot the protocol gives it, in every round."""
    num_local, num_rows, window, tile, d_model, blocks = 3, 200, 96, 8, 256, 4
    counts_se = random_counts(1, 1, num_local, num_rows)
    t = xp.traffic(jnp.asarray(counts_se), num_local)
    x = jax.random.normal(jax.random.key(0), (num_rows, d_model), jnp.float32)
    x = x.astype(jnp.bfloat16)
    want, filled, rounds = planned_buffers(counts_se, np.asarray(x)[None], num_local, window, tile)
    assert rounds >= 2
    pcs = xp.pieces(xp.row_places(t, jnp.int32(0), num_rows, window, tile), tile)

    def copies(x_ref, row_ref, slot_ref, size_ref, round_p_ref, count_ref, round_ref, buf_ref,
               stage_smem, loaded):  # fmt: skip
        @pl.loop(jax.lax.axis_index("blocks"), count_ref[0], step=blocks)
        def _piece(p):
            @pl.when(round_p_ref[p] == round_ref[0])
            def _send():
                mosaic_gpu.copy_piece(x_ref, buf_ref, row_ref[p], slot_ref[p], size_ref[p],
                                      stage_smem, loaded)  # fmt: skip

    slots = xp.num_tiles(window, tile, num_local) * tile
    run = plgpu.kernel(
        copies,
        out_type=jax.ShapeDtypeStruct((slots, d_model), x.dtype),
        grid=(blocks,),
        grid_names=("blocks",),
        scratch_types=[plgpu.SMEM((4, d_model), x.dtype), plgpu.Barrier(num_arrivals=1)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams(),
    )
    for r in range(rounds):
        got = run(x, pcs.row_p, pcs.slot_p, pcs.size_p, pcs.round_p, pcs.count.reshape(1),
                  jnp.int32(r).reshape(1))  # fmt: skip
        mask = filled[0, r]
        np.testing.assert_array_equal(np.asarray(got)[mask], want[0, r][mask])


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_copy_piece_moves_every_size_in_interpret_mode(stages):
    """`copy_piece` with a stage of 4 rows (or `copy_piece_pipelined` with 2 or 3 of them),
    sizes 0 to 13 (full boxes and every combination of the rest's boxes), each piece one row
    apart from the next in an output that starts as a sentinel: exactly the piece's rows move,
    in order, and no other row changes. The interpreter checks each barrier's arrivals and
    phases, so a load waited for twice, or never, fails."""
    sizes = np.arange(14, dtype=np.int32)
    dst = np.concatenate([[0], np.cumsum(sizes + 1)[:-1]]).astype(np.int32)  # a gap each
    src = np.asarray((np.arange(14) * 5) % 17, np.int32)
    x = np.arange(40 * 8, dtype=np.float32).reshape(40, 8)
    out_rows = int(dst[-1] + sizes[-1]) + 3
    sentinel = np.full((out_rows, 8), -1.0, np.float32)

    def copies(x_ref, src_ref, dst_ref, size_ref, sentinel_ref, out_ref, stage_smem, loaded):
        out_ref[...] = sentinel_ref[...]

        copy = mosaic_gpu.copy_piece if stages == 1 else mosaic_gpu.copy_piece_pipelined

        @pl.loop(0, sizes.size)
        def _piece(p):
            copy(x_ref, out_ref, src_ref[p], dst_ref[p], size_ref[p], stage_smem, loaded)

    stage_shape = (4, 8) if stages == 1 else (stages, 4, 8)
    run = plgpu.kernel(
        copies,
        out_type=jax.ShapeDtypeStruct((out_rows, 8), jnp.float32),
        scratch_types=[
            plgpu.SMEM(stage_shape, jnp.float32),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages)
            if stages > 1
            else plgpu.Barrier(num_arrivals=1),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams(),
    )
    want = sentinel.copy()
    for a, b, n in zip(src, dst, sizes, strict=True):
        want[b : b + n] = x[a : a + n]
    chex.assert_trees_all_equal(np.asarray(run(x, src, dst, sizes, sentinel)), want)


def test_copy_piece_pipelined_lowers_for_cuda():
    """The pipelined copy lowers to a Mosaic GPU kernel for CUDA (its stages and barriers
    indexed by traced box numbers), and refuses a single stage."""
    x = jax.ShapeDtypeStruct((256, 2048), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((3,), jnp.int32)

    def kernel(stages: int):
        def copies(x_ref, src_ref, dst_ref, size_ref, out_ref, stage_smem, loaded):
            @pl.loop(0, 3)
            def _piece(p):
                mosaic_gpu.copy_piece_pipelined(x_ref, out_ref, src_ref[p], dst_ref[p],
                                                size_ref[p], stage_smem, loaded)  # fmt: skip

        return plgpu.kernel(
            copies,
            out_type=jax.ShapeDtypeStruct((256, 2048), jnp.bfloat16),
            scratch_types=[
                plgpu.SMEM((stages, 8, 2048), jnp.bfloat16),
                plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            ],
            compiler_params=plgpu.CompilerParams(
                lowering_semantics=plgpu.LoweringSemantics.Warpgroup
            ),
        )

    text = jax.jit(kernel(2)).trace(x, table, table, table).lower(lowering_platforms=("cuda",))
    assert re.search(r"custom_call @mosaic_gpu", text.as_text())
    with pytest.raises(ValueError, match="2 or more stages"):
        jax.jit(kernel(1)).trace(x, table, table, table)


def test_zero_rows_in_interpret_mode():
    """`zero_rows` from a stage of 4 rows set to zero: ranges of 0 to 9 rows become zeros, and
    no other row changes."""
    sizes = np.arange(10, dtype=np.int32)
    dst = (np.concatenate([[0], np.cumsum(sizes + 1)[:-1]])).astype(np.int32)  # a gap each
    out_rows = int(dst[-1] + sizes[-1] + 1)
    x = np.arange(out_rows * 8, dtype=np.float32).reshape(out_rows, 8) + 1

    def zeros(x_ref, dst_ref, size_ref, out_ref, stage_smem):
        out_ref[...] = x_ref[...]
        stage_smem[...] = jnp.zeros(stage_smem.shape, stage_smem.dtype)
        plgpu.commit_smem()

        @pl.loop(0, sizes.size)
        def _range(z):
            mosaic_gpu.zero_rows(out_ref, dst_ref[z], size_ref[z], stage_smem)

    run = plgpu.kernel(
        zeros,
        out_type=jax.ShapeDtypeStruct((out_rows, 8), jnp.float32),
        scratch_types=[plgpu.SMEM((4, 8), jnp.float32)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams(),
    )
    want = x.copy()
    for a, n in zip(dst, sizes, strict=True):
        want[a : a + n] = 0
    chex.assert_trees_all_equal(np.asarray(run(x, dst, sizes)), want)


def test_stage_rows_kinds_and_sides():
    assert mosaic_gpu.stage_rows(256, 2) == 64  # 32 KiB
    assert mosaic_gpu.stage_rows(2048, 2) == 16  # 64 KiB
    assert mosaic_gpu.stage_rows(2048, 4) == 8
    assert mosaic_gpu.stage_rows(7168, 4) == 2  # 56 KiB
    assert mosaic_gpu.stage_rows(2048, 2, budget=32 * 1024) == 8
    # The overlapped dispatch: a stage a kind of row; the weights' column beside the rows
    # keeps both boxes; two wide kinds share STAGE_BYTES (the smem limit otherwise).
    bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
    arrays = [jnp.zeros((8, w), d) for w, d in ((2048, bf16), (2048, bf16), (4, f32), (2048, bf16))]
    assert mosaic_gpu._stage_kinds(tuple(arrays)) == (((2048, bf16), (4, f32)), (0, 0, 1, 0))
    assert mosaic_gpu._dispatch_boxes(((2048, bf16), (4, f32))) == (16, 64)
    assert mosaic_gpu._dispatch_boxes(((2048, bf16),)) == (16,)
    assert mosaic_gpu._dispatch_boxes(((7168, bf16), (4, f32))) == (4, 64)
    assert mosaic_gpu._dispatch_boxes(((2048, bf16), (2048, f32))) == (8, 4)
    # Sides given as one array, not a tuple of them: refused before anything reads them.
    rows = jnp.zeros((8, 2048), jnp.bfloat16)
    with pytest.raises(TypeError, match="tuple of arrays"):
        mosaic_gpu.dispatch_down_grad(rows, rows, None, None, None, None, out_rows=8, tile=8,
                                      axis_name=AXIS)  # fmt: skip
    with pytest.raises(TypeError, match="tuple of arrays"):
        mosaic_gpu.dgrad_return(rows, None, None, None, None, None, sides=rows, out_rows=8,
                                axis_name=AXIS)  # fmt: skip
    with pytest.raises(TypeError, match="tuple of arrays"):
        mosaic_gpu.dgrad_return(rows, None, None, None, None, None, sides=(None,), out_rows=8,
                                axis_name=AXIS)  # fmt: skip
    # A side of other rows than the rows it travels with.
    with pytest.raises(ValueError, match="side rows"):
        mosaic_gpu.dispatch_down_grad(rows, (rows[:4],), None, None, None, None, out_rows=8,
                                      tile=8, axis_name=AXIS)  # fmt: skip
    # Stages of no rows: refused (2 rows of 7168 bf16 cannot be split in 4).
    with pytest.raises(ValueError, match="copy_stages=4"):
        mosaic_gpu._stage_smem((), 2, 7168, jnp.bfloat16, 4)
    assert mosaic_gpu.stage_rows(4, 4) == 64


# ---------------------------------------------------------------------------------------------
# The dispatch overlapped with the first GEMMs (`dispatch_swiglu`).


def round_tables(counts_se, round_index, num_local, num_rows, window, tile):
    """This device's (dispatch moves, return moves, buffer group sizes) of a round, inside
    shard_map over AXIS."""
    me = jax.lax.axis_index(AXIS)
    t = xp.traffic(counts_se, num_local)
    dispatch, back = xp.exchange_moves(t, me, round_index, num_rows, window, tile)
    group_sizes, _ = xp.buffer_layout(t, me, round_index, window, tile)
    return dispatch, back, group_sizes


def dispatch_swiglu_fn(num_local, num_rows, window, tile, *, exchange_programs: int,
                       copy_stages: int = 1):  # fmt: skip
    """(x [EP * N, D], scale [EP * N, 4], w_gate, w_up [EP * G, D, F], counts [EP, E], round [])
    -> (buffer [EP * S, D], side [EP * S, 4], h [EP * S, F]) inside shard_map: the round's
    dispatch and gate/up by the overlapped kernel (exchange_programs > 0), or by `send_rows` then
    `gmm_swiglu` (0)."""
    from pallas_kernels.grouped_matmul import mosaic_gpu as grouped

    slots = xp.num_tiles(window, tile, num_local) * tile

    def body(x, side, w_gate, w_up, counts_se, round_index):
        dispatch, _, group_sizes = round_tables(counts_se, round_index, num_local, num_rows,
                                                window, tile)  # fmt: skip
        if exchange_programs:
            return mosaic_gpu.dispatch_swiglu(
                x, side, dispatch, round_index, w_gate, w_up, group_sizes, out_rows=slots,
                tile=tile, axis_name=AXIS, exchange_programs=exchange_programs,
                copy_stages=copy_stages,
            )  # fmt: skip
        send = functools.partial(mosaic_gpu.send_rows, axis_name=AXIS, out_rows=slots)
        buf = send(x, dispatch, round_index)
        h = grouped.gmm_swiglu(buf, w_gate, w_up, group_sizes)
        return buf, send(side, dispatch, round_index), like(h, buf)

    return body, slots


def dispatch_swiglu_inputs(mesh, num_local, num_rows, d_model, d_ff, seed=0):
    """Random (x, side, w_gate, w_up) for dispatch_swiglu_fn, placed on `mesh`."""
    num_devices = mesh.devices.size
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (num_devices * num_rows, d_model), jnp.float32)
    side = jax.random.uniform(keys[1], (num_devices * num_rows, 4), jnp.float32)
    w = [
        (jax.random.normal(k, (num_devices * num_local, d_model, d_ff)) / d_model**0.5)
        for k in keys[2:]
    ]
    put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, P(AXIS)))  # noqa: E731
    return put(x.astype(jnp.bfloat16)), put(side), *(put(a.astype(jnp.bfloat16)) for a in w)


def test_dispatch_swiglu_refuses_all_programs_copying_or_more_than_the_sms():
    """Every program copying (no GEMM program left), or more programs than SMs: refused."""
    mesh = jax.make_mesh((EP,), (AXIS,))
    args = (
        sharded(mesh, (EP * NUM_ROWS, D_MODEL), jnp.bfloat16),
        sharded(mesh, (EP * NUM_ROWS, 4), jnp.float32),
        sharded(mesh, (EP * NUM_LOCAL, D_MODEL, D_FF), jnp.bfloat16),
        sharded(mesh, (EP * NUM_LOCAL, D_MODEL, D_FF), jnp.bfloat16),
        *round_arguments(mesh),
    )
    for programs in (132, 500):
        bad, _ = dispatch_swiglu_fn(NUM_LOCAL, NUM_ROWS, WINDOW, TILE, exchange_programs=programs)
        bad = jax.jit(jax.shard_map(bad, mesh=mesh, in_specs=(P(AXIS),) * 4 + (P(), P()),
                                    out_specs=(P(AXIS),) * 3))  # fmt: skip
        with pytest.raises(ValueError, match="exchange_programs"):
            bad.trace(*args)


def test_zero_signals_count_the_padding_inside_the_groups():
    """A zero range counts on the tiles of its rows before the groups' end (the padding the
    GEMMs store), never on those past it; each counter then waits for its copies plus them."""
    zero_dst = jnp.asarray([5, 16, 30, 0], jnp.int32)
    zero_size = jnp.asarray([3, 8, 10, 0], jnp.int32)
    moves = Moves(*(jnp.zeros((2,), jnp.int32),) * 6, count=jnp.int32(0),
                  arrivals_c=jnp.asarray([1, 2, 0, 1, 0], jnp.int32),
                  zero_dst_z=zero_dst, zero_size_z=zero_size)  # fmt: skip
    # tile 8, groups end at row 32: [5, 8) -> tile 0; [16, 24) -> tile 2; [30, 32) of [30, 40)
    # -> tile 3; the empty range -> none.
    first, end, wait = mosaic_gpu._zero_signals(moves, jnp.int32(32), 8, 5)
    chex.assert_trees_all_equal(first, jnp.asarray([0, 2, 3, 0], jnp.int32))
    chex.assert_trees_all_equal(end, jnp.asarray([1, 3, 4, 0], jnp.int32))
    chex.assert_trees_all_equal(wait, jnp.asarray([2, 2, 1, 2, 0], jnp.int32))


@pytest.mark.slow
@pytest.mark.parametrize(
    "seed,num_devices,num_local,num_rows,window,tile",
    [(0, 1, 3, 200, 96, 8), (1, 2, 2, 64, 48, 4), (2, 4, 2, 40, 30, 3), (3, 3, 4, 120, 200, 16)],
)
def test_overlapped_waits_cover_every_stored_row(
    seed, num_devices, num_local, num_rows, window, tile
):
    """The overlapped dispatch's protocol (dispatch_swiglu's, and dispatch_down_grad's: the same
    tables and waits, and the same 128-row GEMM tiles), replayed on the host from the tables
    the kernel gets, as its copiers and GEMM producers use them, every round and receiver:
    each buffer slot up to TAIL_ZERO_ROWS past the groups is written once (a copy or a zero
    range), none after them; each counter's wait
    (`_zero_signals`) is exactly the signals sent to it (no deadlock, no early return); and
    each slot the GEMMs store (before the groups' end) is written by a writer that signals
    that slot's own tile, the counter a tile storing the row waits for (no read before the
    write); and every counter that counts something is waited for by a GEMM tile (the buffer
    is complete when the kernel returns)."""
    from pallas_kernels.grouped_matmul import mosaic_gpu as grouped

    block_m = grouped.programs_config("swiglu", n=768, dtype=jnp.bfloat16).block_m
    assert grouped.programs_config("transposed", n=768, dtype=jnp.bfloat16).block_m == block_m
    counts_se = random_counts(seed, num_devices, num_local, num_rows)
    t = xp.traffic(jnp.asarray(counts_se), num_local)
    rounds = int(xp.window_rounds(t, window))
    slots = xp.num_tiles(window, tile, num_local) * tile
    num_tiles = slots // tile
    for r in range(rounds):
        sent = [
            jax.tree.map(np.asarray, xp.exchange_moves(t, jnp.int32(s), jnp.int32(r), num_rows,
                                                       window, tile)[0])
            for s in range(num_devices)
        ]  # fmt: skip
        for d in range(num_devices):
            group_sizes, _ = xp.buffer_layout(t, jnp.int32(d), jnp.int32(r), window, tile)
            groups_end = int(np.sum(group_sizes))
            first_z, end_z, wait_c = (
                np.asarray(a)
                for a in mosaic_gpu._zero_signals(
                    jax.tree.map(jnp.asarray, sent[d]), jnp.int32(groups_end), tile, num_tiles
                )
            )
            signals = np.zeros(num_tiles, np.int64)
            writes = np.zeros(slots, np.int64)
            signalled_by_writer = [set() for _ in range(slots)]
            for m in sent:  # every source's copies of the round to d (the copiers' loop)
                for p in range(int(m.count)):
                    if int(m.peer_p[p]) != d or int(m.round_p[p]) != r:
                        continue
                    c, dst, size = int(m.counter_p[p]), int(m.dst_p[p]), int(m.size_p[p])
                    signals[c] += 1
                    writes[dst : dst + size] += 1
                    for row in range(dst, dst + size):
                        signalled_by_writer[row].add(c)
            m = sent[d]  # d's own zero ranges
            for z in range(m.zero_dst_z.shape[0]):
                dst, size = int(m.zero_dst_z[z]), int(m.zero_size_z[z])
                writes[dst : dst + size] += 1
                tiles_z = range(int(first_z[z]), int(end_z[z]))
                for c in tiles_z:
                    signals[c] += 1
                for row in range(dst, dst + size):
                    signalled_by_writer[row].update(tiles_z)
            # Once up to TAIL_ZERO_ROWS past the groups' end; never after.
            kept = min(groups_end + xp.TAIL_ZERO_ROWS, slots)
            chex.assert_trees_all_equal(writes, (np.arange(slots) < kept).astype(np.int64))
            chex.assert_trees_all_equal(signals, wait_c.astype(np.int64))
            unsignalled = [q for q in range(groups_end) if q // tile not in signalled_by_writer[q]]
            assert not unsignalled, (r, d, unsignalled[:8])
            # The GEMM tiles wait for every counter that counts something (O2: the buffer is
            # complete when the kernel returns), each tile for those under its stored rows.
            schedule = np.asarray(
                grouped.schedule_table(group_sizes, num_rows=slots, tile_m=block_m)
            )
            waited = set()
            for group, row0, lo, hi in schedule:
                if hi > lo and group < num_local:
                    waited.update(range((row0 + lo) // tile, -(-(row0 + hi) // tile)))
            assert set(np.flatnonzero(signals)) <= waited, (r, d)


# ---------------------------------------------------------------------------------------------
# The backward's dispatch overlapped with its first GEMM (`dispatch_down_grad`).


def dispatch_down_grad_fn(num_local, num_rows, window, tile, *, exchange_programs: int,
                          copy_stages: int = 1):  # fmt: skip
    """(w_down [EP * G, F, D], counts [EP, E], round [], dy [EP * N, D], *sides [EP * N, C])
    -> (dy [EP * S, D], sides [EP * S, C], g f32 [EP * S, F]) inside shard_map: the round's
    dispatch of the cotangent (and its sides) and g = dy @ w_down[g].T by the overlapped
    kernel (exchange_programs > 0), or by `send_rows` for each then the transposed gmm (0)."""
    from pallas_kernels.grouped_matmul import mosaic_gpu as grouped

    slots = xp.num_tiles(window, tile, num_local) * tile

    def body(w_down, counts_se, round_index, dy, *sides):
        dispatch, _, group_sizes = round_tables(counts_se, round_index, num_local, num_rows,
                                                window, tile)  # fmt: skip
        if exchange_programs:
            return mosaic_gpu.dispatch_down_grad(
                dy, sides, dispatch, round_index, w_down, group_sizes, out_rows=slots,
                tile=tile, axis_name=AXIS, exchange_programs=exchange_programs,
                copy_stages=copy_stages,
            )  # fmt: skip
        send = functools.partial(mosaic_gpu.send_rows, axis_name=AXIS, out_rows=slots)
        buf = send(dy, dispatch, round_index)
        g = grouped.gmm(buf, w_down, group_sizes, transpose_rhs=True, out_dtype=jnp.float32)
        sides_s = tuple(send(side, dispatch, round_index) for side in sides)
        return buf, sides_s, like(g, buf)

    return body, slots


def dispatch_down_grad_specs(mesh, num_sides: int) -> dict:
    """shard_map's specs for dispatch_down_grad_fn's body with `num_sides` sides."""
    return dict(mesh=mesh, in_specs=(P(AXIS), P(), P()) + (P(AXIS),) * (1 + num_sides),
                out_specs=(P(AXIS), (P(AXIS),) * num_sides, P(AXIS)))  # fmt: skip


def dispatch_down_grad_inputs(mesh, num_local, num_rows, d_model, d_ff, num_sides, seed=0):
    """Random (w_down, dy, *sides) for dispatch_down_grad_fn, placed on `mesh`: bf16 w_down
    and dy; sides of the layer's kinds, two bf16 [N, D] arrays (the layer sends one, x) and
    the weights (f32 [N, 4]), the first `num_sides` of them."""
    num_devices = mesh.devices.size
    keys = jax.random.split(jax.random.key(seed), 5)
    w_down = jax.random.normal(keys[0], (num_devices * num_local, d_ff, d_model)) / d_model**0.5
    rows = [jax.random.normal(k, (num_devices * num_rows, d_model)) for k in keys[1:4]]
    weights = jax.random.uniform(keys[4], (num_devices * num_rows, 4), jnp.float32)
    arrays = (*(a.astype(jnp.bfloat16) for a in (w_down, *rows)), weights)
    put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, P(AXIS)))  # noqa: E731
    return tuple(put(a) for a in arrays[: 2 + num_sides])


# dispatch_down_grad's custom call with three sides (the layer sends the last two): dy, a second
# bf16 array and x [S, D] bf16, the weights [S, 4] f32, g [S, F] f32.
DOWN_GRAD_CALL = (
    r"custom_call @mosaic_gpu.*-> \(tensor<(\d+)x(\d+)xbf16>, tensor<\1x\2xbf16>, "
    r"tensor<\1x\2xbf16>, tensor<\1x4xf32>, tensor<\1x\d+xf32>"
)


def test_dispatch_down_grad_refuses_a_w_down_of_another_shape_and_sides_of_other_rows():
    mesh = jax.make_mesh((EP,), (AXIS,))
    specs = dispatch_down_grad_specs(mesh, num_sides=3)
    body, _ = dispatch_down_grad_fn(NUM_LOCAL, NUM_ROWS, WINDOW, TILE, exchange_programs=16)
    fn = jax.jit(jax.shard_map(body, **specs))
    rows = sharded(mesh, (EP * NUM_ROWS, D_MODEL), jnp.bfloat16)
    args = (
        sharded(mesh, (EP * NUM_LOCAL, D_FF, D_MODEL), jnp.bfloat16),
        *round_arguments(mesh),
        rows,
        rows,
        rows,
        sharded(mesh, (EP * NUM_ROWS, 4), jnp.float32),
    )
    # w_down of another width than dy, or not of rank 3, or a side of other rows: refused.
    for w_down, match in (((EP * NUM_LOCAL, D_FF, 1024), "D=2048 must equal w_down"),
                          ((EP * NUM_LOCAL, D_FF), "rank 3")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            fn.trace(sharded(mesh, w_down, jnp.bfloat16), *args[1:])
    short = sharded(mesh, (EP * (NUM_ROWS - 8), 4), jnp.float32)
    with pytest.raises(ValueError, match="side rows"):
        fn.trace(*args[:-1], short)


# ---------------------------------------------------------------------------------------------
# The down projection overlapped with the return (`down_return`).


def down_return_fn(num_local, num_rows, window, tile, *, exchange_programs: int,
                   copy_stages: int = 1):  # fmt: skip
    """(h [EP * S, F], scale [EP * S], w_down [EP * G, F, D], counts [EP, E], round []) ->
    (y [EP * S, D], out [EP * N, D]) inside shard_map: the round's down projection and return
    by the overlapped kernel (exchange_programs > 0), or by gmm then `send_rows` (0)."""
    from pallas_kernels.grouped_matmul import mosaic_gpu as grouped

    slots = xp.num_tiles(window, tile, num_local) * tile

    def body(h, scale, w_down, counts_se, round_index):
        _, back, group_sizes = round_tables(counts_se, round_index, num_local, num_rows,
                                            window, tile)  # fmt: skip
        if exchange_programs:
            return mosaic_gpu.down_return(
                h, scale, w_down, group_sizes, back, round_index, out_rows=num_rows,
                axis_name=AXIS, exchange_programs=exchange_programs, copy_stages=copy_stages,
            )  # fmt: skip
        y = grouped.gmm(h, w_down, group_sizes, row_scale_m=scale, out_dtype=jnp.float32)
        y = like(y, h)
        return y, mosaic_gpu.send_rows(y, back, round_index, out_rows=num_rows, axis_name=AXIS)

    return body, slots


def down_return_inputs(mesh, num_local, slots, d_model, d_ff, seed=0):
    """Random (h, scale, w_down) for down_return_fn, placed on `mesh`."""
    num_devices = mesh.devices.size
    keys = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(keys[0], (num_devices * slots, d_ff), jnp.float32)
    scale = jax.random.uniform(keys[1], (num_devices * slots,), jnp.float32)
    w = jax.random.normal(keys[2], (num_devices * num_local, d_ff, d_model)) / d_ff**0.5
    put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, P(AXIS)))  # noqa: E731
    return put(h.astype(jnp.bfloat16)), put(scale), put(w.astype(jnp.bfloat16))


def test_down_return_refuses_bad_programs_and_gemm_inputs():
    mesh = jax.make_mesh((EP,), (AXIS,))
    specs = dict(mesh=mesh, in_specs=(P(AXIS),) * 3 + (P(), P()), out_specs=(P(AXIS),) * 2)
    body, slots = down_return_fn(NUM_LOCAL, NUM_ROWS, WINDOW, TILE, exchange_programs=16)
    fn = jax.jit(jax.shard_map(body, **specs))
    args = (
        sharded(mesh, (EP * slots, D_FF), jnp.bfloat16),
        sharded(mesh, (EP * slots,), jnp.float32),
        sharded(mesh, (EP * NUM_LOCAL, D_FF, D_MODEL), jnp.bfloat16),
        *round_arguments(mesh),
    )
    for programs in (132, 500):
        bad, _ = down_return_fn(NUM_LOCAL, NUM_ROWS, WINDOW, TILE, exchange_programs=programs)
        with pytest.raises(ValueError, match="exchange_programs"):
            jax.jit(jax.shard_map(bad, **specs)).trace(*args)
    # The GEMM's inputs are checked as gmm checks them: w_down of another dtype, and an F that
    # is no multiple of the tiles' block_k (its last K step would be dropped).
    for h_type, w_type, match in (
        ((EP * slots, D_FF), (EP * NUM_LOCAL, D_FF, D_MODEL), "dtype"),
        ((EP * slots, 96), (EP * NUM_LOCAL, 96, D_MODEL), "block_k"),
    ):
        w_dtype = jnp.float16 if match == "dtype" else jnp.bfloat16
        bad_args = (sharded(mesh, h_type, jnp.bfloat16), args[1], sharded(mesh, w_type, w_dtype),
                    *args[3:])  # fmt: skip
        with pytest.raises(ValueError, match=match):
            fn.trace(*bad_args)


@pytest.mark.parametrize(
    "seed,num_devices,num_local,num_rows,window,tile",
    [(0, 1, 3, 200, 96, 8), (1, 2, 2, 64, 48, 4), (2, 4, 2, 40, 30, 3), (3, 3, 4, 120, 200, 16)],
)
@pytest.mark.parametrize("block_m", [64, 128])
def test_return_waits_are_the_row_tiles_that_store_each_piece(
    seed, num_devices, num_local, num_rows, window, tile, block_m
):
    """down_return's copier of a piece waits for the schedule's row tiles [first, end): each
    of them stores rows of the piece (so each signals: a tile that stores nothing never does,
    and waiting for it would hang), and together they store every row of it (no copy before
    its rows are stored). Every round, every device's return pieces."""
    from pallas_kernels.grouped_matmul import mosaic_gpu as grouped

    counts_se = random_counts(seed, num_devices, num_local, num_rows)
    t = xp.traffic(jnp.asarray(counts_se), num_local)
    rounds = int(xp.window_rounds(t, window))
    slots = xp.num_tiles(window, tile, num_local) * tile
    pieces = 0
    for r in range(rounds):
        for d in range(num_devices):
            _, back = xp.exchange_moves(t, jnp.int32(d), jnp.int32(r), num_rows, window, tile)
            group_sizes, _ = xp.buffer_layout(t, jnp.int32(d), jnp.int32(r), window, tile)
            schedule = grouped.schedule_table(group_sizes, num_rows=slots, tile_m=block_m)
            first_p, end_p = (np.asarray(a) for a in mosaic_gpu._row_tile_waits(back, schedule))
            schedule, back = np.asarray(schedule), jax.tree.map(np.asarray, back)
            stored = [range(row0 + lo, row0 + hi) for _, row0, lo, hi in schedule]
            for p in range(int(back.count)):
                if back.round_p[p] != r:
                    continue
                rows = set(range(back.src_p[p], back.src_p[p] + back.size_p[p]))
                tiles = range(first_p[p], end_p[p])
                assert all(rows & set(stored[i]) for i in tiles), (r, d, p)
                assert rows <= set().union(*(stored[i] for i in tiles)), (r, d, p)
                pieces += 1
    assert pieces


# ---------------------------------------------------------------------------------------------
# The input gradient overlapped with its return (`dgrad_return`).


def dgrad_return_fn(num_local, num_rows, window, tile, *, exchange_programs: int):
    """(d_gate_up [EP * S, 2F], w_gate, w_up [EP * G, D, F], counts [EP, E], round [], *sides
    [EP * S, C]) -> (d_buffer [EP * S, D], d_x [EP * N, D], sides back [EP * N, C]) inside
    shard_map: the round's input gradient and its return (with the sides') by the overlapped
    kernel (exchange_programs > 0), or by the transposed gmm over the two weights then
    `send_rows` for each (0)."""
    from pallas_kernels.grouped_matmul import mosaic_gpu as grouped

    slots = xp.num_tiles(window, tile, num_local) * tile

    def body(d_gate_up, w_gate, w_up, counts_se, round_index, *sides):
        _, back, group_sizes = round_tables(counts_se, round_index, num_local, num_rows,
                                            window, tile)  # fmt: skip
        if exchange_programs:
            return mosaic_gpu.dgrad_return(
                d_gate_up, w_gate, w_up, group_sizes, back, round_index, sides=sides,
                out_rows=num_rows, axis_name=AXIS, exchange_programs=exchange_programs,
            )  # fmt: skip
        d_buffer = grouped.gmm(d_gate_up, (w_gate, w_up), group_sizes, transpose_rhs=True)
        d_buffer = like(d_buffer, d_gate_up)
        send = functools.partial(mosaic_gpu.send_rows, out_rows=num_rows, axis_name=AXIS)
        sides_back = tuple(send(side, back, round_index) for side in sides)
        return d_buffer, send(d_buffer, back, round_index), sides_back

    return body, slots


def dgrad_return_specs(mesh, num_sides: int) -> dict:
    """shard_map's specs for dgrad_return_fn's body with `num_sides` sides."""
    return dict(mesh=mesh, in_specs=(P(AXIS),) * 3 + (P(), P()) + (P(AXIS),) * num_sides,
                out_specs=(P(AXIS), P(AXIS), (P(AXIS),) * num_sides))  # fmt: skip


def dgrad_return_inputs(mesh, num_local, slots, d_model, d_ff, num_sides=0, seed=0):
    """Random (d_gate_up, w_gate, w_up) in bf16 for dgrad_return_fn and `num_sides` sides, f32
    [S, 4] (the layer's: the routing weights' gradient), placed on `mesh`."""
    num_devices = mesh.devices.size
    keys = jax.random.split(jax.random.key(seed), 3 + num_sides)
    d_gate_up = jax.random.normal(keys[0], (num_devices * slots, 2 * d_ff))
    w = [jax.random.normal(k, (num_devices * num_local, d_model, d_ff)) / d_ff**0.5
         for k in keys[1:3]]  # fmt: skip
    sides = [jax.random.normal(k, (num_devices * slots, 4)) for k in keys[3:]]
    put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, P(AXIS)))  # noqa: E731
    return (*(put(a.astype(jnp.bfloat16)) for a in (d_gate_up, *w)), *(put(a) for a in sides))


def test_dgrad_return_refuses_a_narrow_d_gate_up_and_sides_of_other_rows():
    mesh = jax.make_mesh((EP,), (AXIS,))
    body, slots = dgrad_return_fn(NUM_LOCAL, NUM_ROWS, WINDOW, TILE, exchange_programs=16)
    fn = jax.jit(jax.shard_map(body, **dgrad_return_specs(mesh, num_sides=1)))
    w_type = sharded(mesh, (EP * NUM_LOCAL, D_MODEL, D_FF), jnp.bfloat16)
    args = (
        sharded(mesh, (EP * slots, 2 * D_FF), jnp.bfloat16),
        w_type,
        w_type,
        *round_arguments(mesh),
        sharded(mesh, (EP * slots, 4), jnp.float32),
    )
    # d_gate_up narrower than the two weights' 2F, or a side of other rows: refused.
    with pytest.raises(ValueError, match="2F"):
        fn.trace(sharded(mesh, (EP * slots, D_FF), jnp.bfloat16), *args[1:])
    with pytest.raises(ValueError, match="side rows"):
        fn.trace(*args[:-1], sharded(mesh, (EP * (slots - 8), 4), jnp.float32))


# ---------------------------------------------------------------------------------------------
# The forward of a round in one kernel (`dispatch_mlp_return`).


def forward_fn(num_local, num_rows, window, tile, *, exchange_programs: int, copy_stages: int = 1):
    """(x [EP * N, D], side [EP * N, 4], w_gate, w_up [EP * G, D, F], w_down [EP * G, F, D],
    counts [EP, E], round []) -> (buffer [EP * S, D], side [EP * S, 4], h [EP * S, F], y f32
    [EP * S, D], out f32 [EP * N, D]) inside shard_map: the round's forward in one kernel
    (exchange_programs > 0), or by send_rows, gmm_swiglu, the scaled gmm and send_rows (0)."""
    from pallas_kernels.grouped_matmul import mosaic_gpu as grouped

    slots = xp.num_tiles(window, tile, num_local) * tile

    def body(x, side, w_gate, w_up, w_down, counts_se, round_index):
        dispatch, back, group_sizes = round_tables(counts_se, round_index, num_local, num_rows,
                                                   window, tile)  # fmt: skip
        if exchange_programs:
            return mosaic_gpu.dispatch_mlp_return(
                x, side, dispatch, back, round_index, w_gate, w_up, w_down, group_sizes,
                out_rows=slots, tile=tile, axis_name=AXIS, exchange_programs=exchange_programs,
                copy_stages=copy_stages,
            )  # fmt: skip
        send = functools.partial(mosaic_gpu.send_rows, axis_name=AXIS)
        buf = send(x, dispatch, round_index, out_rows=slots)
        side_s = send(side, dispatch, round_index, out_rows=slots)
        h = like(grouped.gmm_swiglu(buf, w_gate, w_up, group_sizes), buf)
        y = grouped.gmm(h, w_down, group_sizes, row_scale_m=side_s[:, 0], out_dtype=jnp.float32)
        y = like(y, h)
        return buf, side_s, h, y, send(y, back, round_index, out_rows=num_rows)

    return body, slots


def forward_inputs(mesh, num_local, num_rows, d_model, d_ff, seed=0):
    """Random (x, side, w_gate, w_up, w_down) for forward_fn, placed on `mesh`."""
    x, side, w_gate, w_up = dispatch_swiglu_inputs(mesh, num_local, num_rows, d_model, d_ff,
                                                   seed=seed)  # fmt: skip
    key = jax.random.fold_in(jax.random.key(seed), 1)
    w_down = jax.random.normal(key, (mesh.devices.size * num_local, d_ff, d_model)) / d_ff**0.5
    w_down = jax.device_put(w_down.astype(jnp.bfloat16), jax.NamedSharding(mesh, P(AXIS)))
    return x, side, w_gate, w_up, w_down


FORWARD_SPECS = dict(in_specs=(P(AXIS),) * 5 + (P(), P()), out_specs=(P(AXIS),) * 5)


def test_dispatch_mlp_return_refuses_bad_programs_a_bf16_side_and_a_narrow_w_down():
    mesh = jax.make_mesh((EP,), (AXIS,))
    body, _ = forward_fn(NUM_LOCAL, NUM_ROWS, WINDOW, TILE, exchange_programs=16)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, **FORWARD_SPECS))
    weights = (EP * NUM_LOCAL, D_MODEL, D_FF)
    args = (
        sharded(mesh, (EP * NUM_ROWS, D_MODEL), jnp.bfloat16),
        sharded(mesh, (EP * NUM_ROWS, 4), jnp.float32),
        sharded(mesh, weights, jnp.bfloat16),
        sharded(mesh, weights, jnp.bfloat16),
        sharded(mesh, (EP * NUM_LOCAL, D_FF, D_MODEL), jnp.bfloat16),
        *round_arguments(mesh),
    )
    for programs in (132, 500):
        bad, _ = forward_fn(NUM_LOCAL, NUM_ROWS, WINDOW, TILE, exchange_programs=programs)
        with pytest.raises(ValueError, match="exchange_programs"):
            jax.jit(jax.shard_map(bad, mesh=mesh, **FORWARD_SPECS)).trace(*args)
    # Weights in bf16 with a side in bf16, or a w_down of another width: refused.
    with pytest.raises(ValueError, match="must be f32"):
        fn.trace(args[0], sharded(mesh, (EP * NUM_ROWS, 8), jnp.bfloat16), *args[2:])
    narrow = sharded(mesh, (EP * NUM_LOCAL, D_FF, 1024), jnp.bfloat16)
    with pytest.raises(ValueError, match="w_down"):
        fn.trace(*args[:4], narrow, *args[5:])
