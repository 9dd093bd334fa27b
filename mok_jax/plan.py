"""The plan: where each routed (token, slot) row goes, as a pure function of the routing.

Rows are the N = T*K (token, slot) pairs, pair n = t*K + j. The plan sorts them by expert with a
stable sort, so within an expert rows keep global (token, slot) order. Group sizes and starts come
from searches in the sorted expert ids (prefix sums, no scatter-add, no atomics, no host sync).

Invariants (tested as properties):
  1. `order_n` is a permutation of [0, N) and `inverse_n` is its inverse.
  2. expert_of(order_n) is non-decreasing, and rows of one expert are in increasing pair index.
  3. group_sizes_e sums to N and group_starts_e is its exclusive prefix sum.
  4. With a capacity C, a row is kept iff fewer than C rows of its expert precede it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import Array


def id_bounds(sorted_ids_n: Array, ids_i: Array) -> tuple[Array, Array]:
    """int32 (starts_i, ends_i): where each id's run begins and ends in the sorted ids.

    Binary searches with their steps unrolled (here and in exchange, routed): jnp's default
    runs them as a while loop, one GPU launch a step; the integer results are the same."""
    return tuple(
        jnp.searchsorted(sorted_ids_n, ids_i, side=side, method="scan_unrolled").astype(jnp.int32)
        for side in ("left", "right")
    )


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["order_n", "inverse_n", "group_sizes_e", "group_starts_e", "keep_n"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Plan:
    """A routing's row permutation. All int32 but keep_n.

    Attributes:
      order_n: [N] sorted position p holds pair order_n[p].
      inverse_n: [N] pair n sits at sorted position inverse_n[n].
      group_sizes_e: [E] rows per expert, before any capacity drop (the routed load).
      group_starts_e: [E] sorted position of each expert's first row.
      keep_n: bool [N] per pair (in pair order), False for rows beyond an expert's capacity;
        None when dropless.
    """

    order_n: Array
    inverse_n: Array
    group_sizes_e: Array
    group_starts_e: Array
    keep_n: Array | None

    @property
    def dropped(self) -> Array:
        """int32 []: rows dropped by the capacity (0 when dropless)."""
        if self.keep_n is None:
            return jnp.zeros((), jnp.int32)
        return jnp.sum(~self.keep_n, dtype=jnp.int32)


def make_plan(experts_tk: Array, num_experts: int, capacity: int | None = None) -> Plan:
    """Plans the rows of a routing: experts_tk int [T, K] -> `Plan` over N = T*K rows."""
    experts_n = experts_tk.reshape(-1).astype(jnp.int32)
    num_rows = experts_n.shape[0]
    order_n = jnp.argsort(experts_n, stable=True).astype(jnp.int32)
    # Each index is written once: a deterministic permutation scatter, not an accumulation.
    positions_n = jnp.arange(num_rows, dtype=jnp.int32)
    inverse_n = jnp.zeros_like(order_n).at[order_n].set(positions_n, unique_indices=True)
    sorted_experts_n = experts_n[order_n]
    expert_ids = jnp.arange(num_experts, dtype=jnp.int32)
    starts_e, ends_e = id_bounds(sorted_experts_n, expert_ids)
    keep_n = None
    if capacity is not None:
        rank_in_expert_n = inverse_n - starts_e[experts_n]
        keep_n = rank_in_expert_n < capacity
    return Plan(
        order_n=order_n,
        inverse_n=inverse_n,
        group_sizes_e=ends_e - starts_e,
        group_starts_e=starts_e,
        keep_n=keep_n,
    )
