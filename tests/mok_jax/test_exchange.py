"""The exchange's protocol as pure functions: every row moves once, to the slot its counts say,
in (source, position) order; simulated in numpy for every device and round."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from mok_jax import exchange
from pallas_kernels.exchange import protocol


@st.composite
def traffic_cases(draw):
    num_devices = draw(st.sampled_from([1, 2, 3, 4]))
    num_local = draw(st.integers(1, 3))
    counts = draw(
        st.lists(
            st.integers(0, 9),
            min_size=num_devices * num_devices * num_local,
            max_size=num_devices * num_devices * num_local,
        )
    )
    buffer_rows = draw(st.integers(1, 12))
    return np.array(counts, np.int32).reshape(num_devices, -1), num_local, buffer_rows


# The window's transfer as the layer runs it, traced (window static, device and round traced):
# a hypothesis example compiles it once for its sizes, where op by op each of its operations
# compiled for them.
window_transfer = jax.jit(exchange.window_transfer, static_argnums=(3,))


def expert_of_rows(counts_e: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(counts_e.shape[0]), counts_e)


@given(traffic_cases())
def test_window_rounds_deliver_every_row_once_in_source_order(case):
    counts_se, num_local, window = case
    num_devices = counts_se.shape[0]
    t = protocol.traffic(jnp.asarray(counts_se), num_local)
    rounds = int(protocol.window_rounds(t, window))
    # What each destination must end up with: (source, row) in source order, by expert.
    expected = {d: [] for d in range(num_devices)}
    for s in range(num_devices):
        experts = expert_of_rows(counts_se[s])
        for i, e in enumerate(experts):
            expected[e // num_local].append((s, i, e % num_local))
    delivered = {d: [] for d in range(num_devices)}
    returned = {s: np.zeros(counts_se[s].sum(), int) for s in range(num_devices)}
    for r in range(rounds):
        views = [
            window_transfer(t, jnp.int32(me), jnp.int32(r), window) for me in range(num_devices)
        ]
        windows = {d: [None] * window for d in range(num_devices)}
        for s, view in enumerate(views):
            for d in range(num_devices):
                size = int(view.send_sizes[d])
                # Sender and receiver agree on the chunk (invariant 2 needs both views).
                assert size == int(views[d].recv_sizes[s])
                assert int(view.remote_offsets[d]) == int(views[d].recv_offsets[s])
                assert int(view.send_offsets[d]) == int(views[d].source_offsets[s])
                for lane in range(size):
                    row = int(view.send_offsets[d]) + lane
                    slot = int(view.remote_offsets[d]) + lane
                    assert windows[d][slot] is None, "two rows in one slot"
                    windows[d][slot] = (s, row)
            ends = np.asarray(view.send_offsets + view.send_sizes)
            assert np.all(np.diff(np.asarray(view.send_offsets)) >= 0) and np.all(
                np.diff(ends) >= 0
            )
            ends = np.asarray(view.recv_offsets + view.recv_sizes)
            assert np.all(np.diff(np.asarray(view.recv_offsets)) >= 0) and np.all(
                np.diff(ends) >= 0
            )
        for d in range(num_devices):
            experts = np.asarray(exchange.window_experts(t, jnp.int32(d), jnp.int32(r), window))
            for slot, item in enumerate(windows[d]):
                if item is None:
                    assert experts[slot] == num_local
                    continue
                s, row = item
                assert experts[slot] == expert_of_rows(counts_se[s])[row] % num_local
                delivered[d].append((s, row, int(experts[slot])))
                returned[s][row] += 1
    for d in range(num_devices):
        assert delivered[d] == expected[d]
    for s in range(num_devices):
        assert np.all(returned[s] == 1), "a row was lost or sent twice"


@given(traffic_cases())
def test_ring_chunks_cover_every_block_once(case):
    counts_se, num_local, chunk = case
    num_devices = counts_se.shape[0]
    t = protocol.traffic(jnp.asarray(counts_se), num_local)
    rounds = int(exchange.chunk_rounds(t, chunk))
    for s in range(num_devices):
        experts = expert_of_rows(counts_se[s])
        seen = np.zeros(experts.shape[0], int)
        for d in range(num_devices):
            for r in range(rounds):
                index_c, experts_c = exchange.chunk_rows(
                    t, jnp.int32(s), jnp.int32(d), jnp.int32(r), chunk
                )
                for row, e in zip(np.asarray(index_c), np.asarray(experts_c), strict=True):
                    if row < 0:
                        assert e == num_local
                        continue
                    assert experts[row] // num_local == d and experts[row] % num_local == e
                    seen[row] += 1
        assert np.all(seen == 1)


def test_reversed_transfer_swaps_roles():
    t = protocol.traffic(jnp.asarray([[1, 2], [3, 0]], jnp.int32), 1)
    forward = exchange.window_transfer(t, jnp.int32(0), jnp.int32(0), 8)
    back = forward.reversed()
    np.testing.assert_array_equal(back.send_sizes, forward.recv_sizes)
    np.testing.assert_array_equal(back.recv_offsets, forward.send_offsets)
    np.testing.assert_array_equal(back.reversed().send_offsets, forward.send_offsets)
