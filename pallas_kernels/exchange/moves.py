"""`Moves`: one device's copies in one direction of the exchange, as int32 tables."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import Array
from jax.tree_util import register_dataclass


@functools.partial(
    register_dataclass,
    data_fields=[
        "src_p",
        "dst_p",
        "size_p",
        "peer_p",
        "round_p",
        "counter_p",
        "count",
        "arrivals_c",
        "zero_dst_z",
        "zero_size_z",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Moves:
    """One device's copies (int32 [P] each; the first `count` are real, the rest have size 0):
    in round round_p[p], rows [src_p[p], + size_p[p]) of this device's array go to rows
    [dst_p[p], + size_p[p]) of device peer_p[p]'s output (its index along the exchange's mesh
    axis), and count once on that device's counter counter_p[p]. arrivals_c (int32 [C]) is the
    copies each of this device's C counters gets in the round being run: the device's output
    is complete once every counter has counted them. zero_dst_z, zero_size_z (int32 [Z], Z >= 1,
    size 0 for none): rows [zero_dst_z[z], + zero_size_z[z]) of this device's own output are
    set to zero in the round (rows no copy lands in: a buffer's padding).

    Built by the protocol (`protocol.exchange_moves`), which also guarantees that
    the destination rows of one round are distinct on every device.
    """

    src_p: Array
    dst_p: Array
    size_p: Array
    peer_p: Array
    round_p: Array
    counter_p: Array
    count: Array
    arrivals_c: Array
    zero_dst_z: Array
    zero_size_z: Array

    def check(self) -> None:
        """Raises ValueError unless the tables are int32: [P] each, count [], arrivals [C], the
        zero ranges [Z] each."""
        tables = (self.src_p, self.dst_p, self.size_p, self.peer_p, self.round_p, self.counter_p)
        if any(a.ndim != 1 or a.shape != self.src_p.shape for a in tables):
            raise ValueError("the move tables must be of one shape [P]")
        if self.count.shape != () or self.arrivals_c.ndim != 1:
            raise ValueError(
                f"count must be [] and arrivals_c [C]; got {self.count.shape} and "
                f"{self.arrivals_c.shape}"
            )
        zeros = (self.zero_dst_z, self.zero_size_z)
        if any(a.ndim != 1 or a.shape != self.zero_dst_z.shape or a.shape[0] < 1 for a in zeros):
            raise ValueError("the zero ranges must be of one shape [Z], Z >= 1")
        scalars = (self.count, self.arrivals_c, *zeros)
        if any(a.dtype != jnp.int32 for a in (*tables, *scalars)):
            raise ValueError("the move tables must be int32")
