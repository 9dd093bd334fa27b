"""The in-kernel exchange's protocol: its tables checked row by row against the layout it
promises (property tests), and the protocol run on a CPU model of remote copies and semaphores
with races reported, where a protocol broken in one rule must fail (protocol_sim.py)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pallas_kernels.exchange import protocol as xp
from tests.pallas_kernels.exchange.protocol_sim import pieces

ROOT = pathlib.Path(__file__).resolve().parents[3]


# The protocol's tables as the kernels run them, traced (sizes static, device and round traced;
# test_the_tables_trace_under_jit_with_traced_device_and_round holds them to the tables run op
# by op): a hypothesis example compiles each table once for its sizes. Run op by op, each of
# their operations compiled for the example's sizes, about 70% of the property tests' time.
tables = types.SimpleNamespace(
    row_places=jax.jit(xp.row_places, static_argnums=(2, 3, 4)),
    tile_arrivals=jax.jit(xp.tile_arrivals, static_argnums=(3, 4)),
    return_arrivals=jax.jit(xp.return_arrivals, static_argnums=(3, 4)),
    pieces=jax.jit(xp.pieces, static_argnums=(1,)),
    buffer_layout=jax.jit(xp.buffer_layout, static_argnums=(3, 4)),
    exchange_moves=jax.jit(xp.exchange_moves, static_argnums=(3, 4, 5)),
)


@st.composite
def protocol_cases(draw):
    num_devices = draw(st.sampled_from([1, 2, 3, 4]))
    num_local = draw(st.integers(1, 3))
    num_rows = draw(st.integers(1, 24))
    # Each source routes at most its N rows (the rest are padding that goes nowhere).
    counts = []
    for _ in range(num_devices):
        experts = draw(st.lists(st.integers(0, num_devices * num_local - 1), max_size=num_rows))
        counts.append(np.bincount(experts, minlength=num_devices * num_local))
    window = draw(st.integers(1, 20))
    tile = draw(st.sampled_from([1, 2, 4, 8]))
    return np.array(counts, np.int32), num_local, num_rows, window, tile


def all_places(counts_se, num_local, num_rows, window, tile):
    t = xp.traffic(jnp.asarray(counts_se), num_local)
    places = [
        tables.row_places(t, jnp.int32(s), num_rows, window, tile)
        for s in range(counts_se.shape[0])
    ]
    return t, [{f: np.asarray(getattr(p, f)) for f in ("dest_n", "expert_n", "round_n", "slot_n")}
               for p in places]  # fmt: skip


@given(protocol_cases())
def test_every_row_has_its_own_slot_in_expert_major_order(case):
    counts_se, num_local, _, window, tile = case
    num_devices = counts_se.shape[0]
    t, places = all_places(*case)
    rounds = int(xp.window_rounds(t, window))
    slots = xp.num_tiles(window, tile, num_local) * tile
    for s, p in enumerate(places):
        routed = int(counts_se[s].sum())
        # Rows past the counts go nowhere; the others to their expert's device, in a round.
        assert (p["dest_n"][routed:] == -1).all() and (p["slot_n"][routed:] == -1).all()
        experts = np.repeat(np.arange(counts_se.shape[1]), counts_se[s])
        np.testing.assert_array_equal(p["dest_n"][:routed], experts // num_local)
        np.testing.assert_array_equal(p["expert_n"][:routed], experts % num_local)
        assert ((p["round_n"][:routed] >= 0) & (p["round_n"][:routed] < rounds)).all()
    for d in range(num_devices):
        # What d must receive, in expert-major order: (expert, source, row).
        order = sorted(
            (int(p["expert_n"][n]), s, n)
            for s, p in enumerate(places)
            for n in np.flatnonzero(p["dest_n"] == d)
        )
        for r in range(rounds):
            rows = [(g, s, n) for g, s, n in order if places[s]["round_n"][n] == r]
            # Round r carries positions [r W, (r + 1) W) of that order.
            assert rows == [row for i, row in enumerate(order) if i // window == r]
            slot = [int(places[s]["slot_n"][n]) for _, s, n in rows]
            assert len(set(slot)) == len(slot) and all(0 <= q < slots for q in slot)
            assert slot == sorted(slot)  # slots follow the expert-major order
            for i, (g, _, _) in enumerate(rows):
                if i == 0 or rows[i - 1][0] != g:
                    assert slot[i] % tile == 0  # an expert's run starts a tile
                else:
                    assert slot[i] == slot[i - 1] + 1
            tiles = {}
            for (g, _, _), q in zip(rows, slot, strict=True):
                assert tiles.setdefault(q // tile, g) == g  # one expert a tile


@given(protocol_cases())
def test_semaphore_counts_are_the_pieces_sent(case):
    """Each wait counts what the other side sends: tile_arrivals against the pieces cut from
    the row places, return_arrivals against the pieces each source sent."""
    counts_se, num_local, num_rows, window, tile = case
    num_devices = counts_se.shape[0]
    t = xp.traffic(jnp.asarray(counts_se), num_local)
    rounds = int(xp.window_rounds(t, window))
    sent = [
        pieces(tables.row_places(t, jnp.int32(s), num_rows, window, tile), s, tile)
        for s in range(num_devices)
    ]
    every = [p for ps in sent for p in ps]
    assert sum(p.size for p in every) == counts_se.sum()
    for r in range(rounds):
        for d in range(num_devices):
            arrivals = np.asarray(tables.tile_arrivals(t, jnp.int32(d), jnp.int32(r), window, tile))
            counted = np.zeros_like(arrivals)
            for p in every:
                if (p.dest, p.round) == (d, r):
                    counted[p.tile] += 1
            np.testing.assert_array_equal(arrivals, counted)
        for s in range(num_devices):
            back = np.asarray(tables.return_arrivals(t, jnp.int32(s), jnp.int32(r), window, tile))
            counted = np.bincount([p.dest for p in sent[s] if p.round == r], minlength=num_devices)
            np.testing.assert_array_equal(back, counted)


@given(st.lists(st.booleans(), min_size=1, max_size=40))
def test_true_first_is_the_stable_partitions_first_part(mask):
    mask_n = np.array(mask)
    got = np.asarray(xp.true_first(jnp.asarray(mask_n)))
    count = int(mask_n.sum())
    np.testing.assert_array_equal(got[:count], np.argsort(~mask_n, kind="stable")[:count])
    np.testing.assert_array_equal(got[count:], 0)


@given(protocol_cases())
def test_pieces_are_the_runs_of_rows_in_one_tile(case):
    """The traceable `pieces` (what the kernels read) against a loop over the rows."""
    counts_se, num_local, num_rows, window, tile = case
    t = xp.traffic(jnp.asarray(counts_se), num_local)
    for s in range(counts_se.shape[0]):
        places = tables.row_places(t, jnp.int32(s), num_rows, window, tile)
        got = jax.tree.map(np.asarray, tables.pieces(places, tile))
        count = int(got.count)
        want = pieces(places, s, tile)
        assert count == len(want)
        assert [
            (got.dest_p[i], got.round_p[i], got.tile_p[i], got.row_p[i], got.slot_p[i],
             got.size_p[i])
            for i in range(count)
        ] == [(p.dest, p.round, p.tile, p.row, p.slot, p.size) for p in want]  # fmt: skip
        assert (got.size_p[count:] == 0).all() and (got.dest_p[count:] == -1).all()


@given(protocol_cases())
def test_exchange_moves_go_there_and_back_and_zero_the_padding(case):
    """`exchange_moves` against the row places, per device and round: the dispatch's copies are
    the device's pieces; the return's copies to a source are exactly its pieces of the round,
    reversed (slot -> row), counted once each; each receiver's groups (`buffer_layout`) are
    whole tiles, and every slot of its buffer inside the groups and among the first
    TAIL_ZERO_ROWS past them is either filled by a row or in a zero range, never both; no
    slot after those is zeroed."""
    counts_se, _, num_rows, window, tile = case
    num_devices = counts_se.shape[0]
    t, places = all_places(*case)
    rounds = int(xp.window_rounds(t, window))
    for r in range(rounds):
        returned = {s: [] for s in range(num_devices)}
        for d in range(num_devices):
            moves = tables.exchange_moves(t, jnp.int32(d), jnp.int32(r), num_rows, window, tile)
            dispatch, back = jax.tree.map(np.asarray, moves)
            mine = jax.tree.map(np.asarray, tables.pieces(tables.row_places(
                t, jnp.int32(d), num_rows, window, tile), tile))  # fmt: skip
            for got, want in (
                (dispatch.src_p, mine.row_p),
                (dispatch.dst_p, mine.slot_p),
                (dispatch.size_p, mine.size_p),
                (dispatch.peer_p, mine.dest_p),
                (dispatch.round_p, mine.round_p),
                (dispatch.counter_p, mine.tile_p),
                (dispatch.count, mine.count),
                (
                    dispatch.arrivals_c,
                    tables.tile_arrivals(t, jnp.int32(d), jnp.int32(r), window, tile),
                ),
            ):
                chex.assert_trees_all_equal(got, np.asarray(want))
            # The return's tables hold every round's pieces to d, each with its round.
            for i in np.flatnonzero(back.round_p[: int(back.count)] == r):
                returned[int(back.peer_p[i])].append(
                    (d, int(back.src_p[i]), int(back.dst_p[i]), int(back.size_p[i]))
                )
            assert (back.size_p[int(back.count) :] == 0).all()
            # The receiver's buffer: filled slots and zero ranges tile its groups exactly.
            sizes_g, filled_s = (np.asarray(a) for a in tables.buffer_layout(
                t, jnp.int32(d), jnp.int32(r), window, tile))  # fmt: skip
            assert (sizes_g % tile == 0).all()
            planned = np.zeros_like(filled_s)
            for p in places:
                planned[p["slot_n"][(p["dest_n"] == d) & (p["round_n"] == r)]] = True
            np.testing.assert_array_equal(filled_s, planned)
            zeroed = np.zeros_like(filled_s)
            for a, n in zip(dispatch.zero_dst_z, dispatch.zero_size_z, strict=True):
                assert not zeroed[a : a + n].any() and not filled_s[a : a + n].any()
                zeroed[a : a + n] = True
            # Inside the groups and just past them every slot is filled or zeroed (the weight
            # gradients' last row block reads up to TAIL_ZERO_ROWS - 1 slots past the groups);
            # after that nothing is written.
            ends = int(np.sum(sizes_g))
            kept = min(ends + xp.TAIL_ZERO_ROWS, filled_s.shape[0])
            assert (filled_s | zeroed)[:kept].all()
            assert not (filled_s | zeroed)[kept:].any()
        for s in range(num_devices):
            sent = jax.tree.map(np.asarray, tables.pieces(tables.row_places(
                t, jnp.int32(s), num_rows, window, tile), tile))  # fmt: skip
            want = sorted(
                (int(sent.dest_p[i]), int(sent.slot_p[i]), int(sent.row_p[i]),
                 int(sent.size_p[i]))
                for i in range(int(sent.count)) if sent.round_p[i] == r
            )  # fmt: skip
            assert sorted(returned[s]) == want
            # Each returning piece counts once on the source's one counter.
            _, back_s = tables.exchange_moves(t, jnp.int32(s), jnp.int32(r), num_rows, window, tile)
            assert np.asarray(back_s.arrivals_c).tolist() == [len(want)]


def test_the_tables_trace_under_jit_with_traced_device_and_round():
    counts_se = np.array([[3, 0, 5, 2], [1, 4, 0, 6]], np.int32)
    t = xp.traffic(jnp.asarray(counts_se), 2)

    @jax.jit
    def tables(t, me, r):
        return (
            xp.row_places(t, me, 12, 8, 4),
            xp.tile_arrivals(t, me, r, 8, 4),
            xp.return_arrivals(t, me, r, 8, 4),
        )

    for me in range(2):
        for r in range(2):
            eager = (
                xp.row_places(t, jnp.int32(me), 12, 8, 4),
                xp.tile_arrivals(t, jnp.int32(me), jnp.int32(r), 8, 4),
                xp.return_arrivals(t, jnp.int32(me), jnp.int32(r), 8, 4),
            )
            jax.tree.map(np.testing.assert_array_equal, tables(t, me, r), eager)


@pytest.mark.parametrize(
    "start,stop", [(0, 0), (5, 5), (3, 40), (0, 1000), (37, 165), (990, 1000), (0, 3)]
)
def test_the_zeroed_tail_is_split_into_ranges_of_equal_size(start, stop):
    """The zeroed slots past the groups are TAIL_RANGES consecutive ranges, every one but the
    last (and the empty ones after it) of ceil(rows / TAIL_RANGES) rows: no copier zeroes
    more."""
    dst_r, size_r = (np.asarray(a) for a in xp._tail_ranges(jnp.int32(start), jnp.int32(stop)))
    assert dst_r.shape == size_r.shape == (xp.TAIL_RANGES,)
    part = -(-(stop - start) // xp.TAIL_RANGES)
    covered = np.zeros(stop, np.int64)
    for dst, size in zip(dst_r, size_r, strict=True):
        assert 0 <= size <= part and start <= dst <= stop
        covered[dst : dst + size] += 1
    np.testing.assert_array_equal(covered, (np.arange(stop) >= start).astype(np.int64))
    np.testing.assert_array_equal(dst_r[1:], dst_r[:-1] + size_r[:-1])


def test_the_zeroed_tail_covers_what_the_weight_gradients_read_past_a_group():
    """The weight gradients' kernel reads a group's rows in blocks of block_k rows from the
    group's first row rounded down to 8, so its last block takes up to block_k - 1 rows past
    the group (invariant 3 of mosaic_gpu_wgrad: finite there); every tgmm config of the
    tuning table must stay within the TAIL_ZERO_ROWS slots past the groups the dispatch
    zeroes."""
    from pallas_kernels.grouped_matmul import tuning

    block_k = [c.block_k for (kind, _), c in tuning.DEFAULT_CONFIGS.items() if kind == "tgmm"]
    assert block_k and max(block_k) - 1 <= xp.TAIL_ZERO_ROWS


@pytest.mark.parametrize("window,tile", [(0, 4), (8, 0), (-1, 1)])
def test_bad_window_or_tile_raises(window, tile):
    t = xp.traffic(jnp.asarray(np.array([[2, 1]], np.int32)), 2)
    with pytest.raises(ValueError, match="must be >= 1"):
        xp.row_places(t, jnp.int32(0), 3, window, tile)
    with pytest.raises(ValueError, match="must be >= 1"):
        xp.tile_arrivals(t, jnp.int32(0), jnp.int32(0), window, tile)
    with pytest.raises(ValueError, match="must be >= 1"):
        xp.return_arrivals(t, jnp.int32(0), jnp.int32(0), window, tile)


def test_a_worked_example():
    """Two devices, one expert each, window 4, tile 2: receiver 0 gets source 0's 3 rows and
    source 1's 2 rows of expert 0, so in round 0 slots 0-2 and 3; round 1 slot 0."""
    counts_se = np.array([[3, 1], [2, 0]], np.int32)
    t = xp.traffic(jnp.asarray(counts_se), 1)
    p0 = xp.row_places(t, jnp.int32(0), 4, 4, 2)
    p1 = xp.row_places(t, jnp.int32(1), 2, 4, 2)
    np.testing.assert_array_equal(p0.dest_n, [0, 0, 0, 1])
    np.testing.assert_array_equal(p0.round_n, [0, 0, 0, 0])
    np.testing.assert_array_equal(p0.slot_n, [0, 1, 2, 0])
    np.testing.assert_array_equal(p1.round_n, [0, 1])
    np.testing.assert_array_equal(p1.slot_n, [3, 0])
    # Receiver 0, round 0: tile 0 holds source 0's rows 0-1, tile 1 source 0's row 2 and
    # source 1's row 0 (two pieces); round 1: source 1's row 1.
    np.testing.assert_array_equal(xp.tile_arrivals(t, 0, 0, 4, 2), [1, 2, 0])
    np.testing.assert_array_equal(xp.tile_arrivals(t, 0, 1, 4, 2), [1, 0, 0])
    np.testing.assert_array_equal(xp.return_arrivals(t, 1, 1, 4, 2), [1, 0])


# ---------------------------------------------------------------------------------------------
# The protocol on a CPU model of remote copies and semaphores (8 fake devices, in a subprocess:
# a deadlock hangs, and the race detector's state is global to the process).


def simulate(variant: str, seed: int = 0, timeout: float = 240.0) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.pallas_kernels.exchange.protocol_sim", "--variant", variant,
         "--seed", str(seed)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_the_protocol_runs_without_races_and_delivers_every_row(seed):
    result = simulate("correct", seed)
    assert result["rounds"] >= 2  # the case exercises the credits between rounds
    assert not result["races_found"]
    assert result["buffers_as_planned"] and result["rows_back"]


@pytest.mark.parametrize("variant", ["overlap", pytest.param("no_credit", marks=pytest.mark.slow)])
def test_a_protocol_that_races_is_caught(variant):
    """Two sources writing the same slots, or a round overwriting a buffer still being read:
    the race detector reports it."""
    assert simulate(variant)["races_found"]


@pytest.mark.slow
def test_a_protocol_that_reads_too_soon_is_caught():
    """A tile computed one piece early reads slots whose copy has not landed (the model runs a
    copy only when it is waited for, so the read sees the buffer's NaN)."""
    result = simulate("early_read")
    assert not result["buffers_as_planned"] and not result["rows_back"]


@pytest.mark.slow
def test_a_protocol_that_waits_for_a_piece_never_sent_deadlocks():
    # Control: the correct protocol on the same case, timed here and now (a loaded machine slows
    # both); the broken one gets three times as long and must still not finish.
    start = time.monotonic()
    simulate("correct")
    took = time.monotonic() - start
    with pytest.raises(subprocess.TimeoutExpired):
        simulate("extra_wait", timeout=max(45.0, 3 * took))
