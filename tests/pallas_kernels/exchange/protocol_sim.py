"""The in-kernel exchange's protocol (pallas_kernels/exchange/protocol.py) run on a CPU model
of remote copies and semaphores, with races reported: Pallas TPU interpret mode over fake CPU
devices, inside `jax.shard_map`.

    python -m tests.pallas_kernels.exchange.protocol_sim --variant correct --seed 0

prints one JSON line: whether the race detector found a race, whether each round's receive
buffers hold the rows the protocol says, and whether every row came back to its own place. A
deadlocked protocol hangs: run this in a subprocess under a timeout (test_protocol.py).

The program of each device follows the protocol's steps 1-5 with the copies as remote DMAs:
a piece's DMA signals the receiver's DMA semaphore of its tile, which the receiver waits on
once a piece it expects (its size known from the counts); credits are regular semaphores.
The "experts" copy each tile into a results buffer, reused from round to round like the
receive buffer, from which the rows go back (and into a log of each round's buffer, for the
check). Variants break one rule each, to show that the model catches it:
  overlap      one source's piece is written over another source's slots in the same tile
  early_read   a receiver waits for one piece fewer in a tile of two or more (reads too soon)
  extra_wait   a receiver waits for one piece more (waits forever: a deadlock)
  no_credit    sources do not wait for the receiver's credit before reusing its buffer
(A receiver that overwrites its results buffer before its returns have left was tried as a
variant and not caught in these cases, reason not investigated; the protocol's step 4 forbids
it, and the correct program waits for its returns to leave.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

# The fake devices must exist before jax starts (this file runs as its own process).
if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from pallas_kernels.exchange import protocol as xp

VARIANTS = ("correct", "overlap", "early_read", "extra_wait", "no_credit")
AXIS = "expert"


@dataclasses.dataclass(frozen=True)
class Piece:
    """One source's rows in one tile of one round: rows [row, row + size) of the source's
    sorted rows go to slots [slot, slot + size) of the receiver's buffer."""

    source: int
    dest: int
    round: int
    tile: int
    row: int
    slot: int
    size: int


def pieces(places: xp.RowPlaces, source: int, tile: int) -> list[Piece]:
    """The source's pieces, in row order: maximal runs of rows with one (receiver, round,
    tile) and consecutive slots."""
    dest, rnd, slot = (np.asarray(a) for a in (places.dest_n, places.round_n, places.slot_n))
    out: list[Piece] = []
    for n in np.flatnonzero(dest >= 0):
        key = (int(dest[n]), int(rnd[n]), int(slot[n]) // tile)
        last = out[-1] if out else None
        if last and (last.dest, last.round, last.tile) == key and last.slot + last.size == slot[n]:
            out[-1] = dataclasses.replace(last, size=last.size + 1)
        else:
            out.append(Piece(source, *key, row=int(n), slot=int(slot[n]), size=1))
    return out


@dataclasses.dataclass(frozen=True)
class Case:
    """A random routing: counts_se [EP, E] (each source's N rows over the E experts)."""

    counts_se: np.ndarray
    num_local: int
    num_rows: int
    window: int
    tile: int

    @property
    def num_devices(self) -> int:
        return self.counts_se.shape[0]

    def traffic(self) -> xp.Traffic:
        return xp.traffic(jnp.asarray(self.counts_se, jnp.int32), self.num_local)


def random_case(seed: int, num_devices: int = 8) -> Case:
    """Skewed routing over 8 devices x 2 local experts, so some receivers need several rounds,
    some experts get no rows, and pieces are cut by tile edges."""
    rng = np.random.default_rng(seed)
    num_local, num_rows = 2, 24
    weights = rng.dirichlet(np.full(num_devices * num_local, 0.5))
    counts_se = np.stack(
        [
            np.bincount(rng.choice(weights.size, num_rows, p=weights), minlength=weights.size)
            for _ in range(num_devices)
        ]
    )
    return Case(counts_se=counts_se, num_local=num_local, num_rows=num_rows, window=24, tile=4)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The protocol's tables for the simulated program (host values). Each side computes its
    own from the counts, so a variant can break one side: `sent` is what the sources do,
    `tiles` the pieces a receiver computes and returns per tile, `waits` the pieces it waits
    for before computing a tile (the protocol's count, `tile_arrivals`)."""

    sent: list[list[Piece]]  # [source]: its pieces, in row order
    tiles: list[list[list[list[Piece]]]]  # [receiver][round][tile]
    waits: list[list[list[list[Piece]]]]  # [receiver][round][tile]
    returns: np.ndarray  # [source, round, receiver]: pieces coming back (`return_arrivals`)
    rounds: int
    slots: int


def schedule(case: Case, variant: str) -> Schedule:
    t = case.traffic()
    rounds = int(xp.window_rounds(t, case.window))
    num_tiles = xp.num_tiles(case.window, case.tile, case.num_local)
    sent = [
        pieces(xp.row_places(t, jnp.int32(s), case.num_rows, case.window, case.tile), s, case.tile)
        for s in range(case.num_devices)
    ]
    tiles = [
        [
            [
                sorted(
                    (p for s in sent for p in s if (p.dest, p.round, p.tile) == (d, r, u)),
                    key=lambda p: p.slot,
                )
                for u in range(num_tiles)
            ]
            for r in range(rounds)
        ]
        for d in range(case.num_devices)
    ]
    for d, r in np.ndindex(case.num_devices, rounds):
        arrivals_u = np.asarray(xp.tile_arrivals(t, d, r, case.window, case.tile))
        if [len(ps) for ps in tiles[d][r]] != arrivals_u.tolist():
            raise AssertionError(
                f"tile_arrivals {arrivals_u} disagrees with the pieces ({d=} {r=})"
            )
    returns = np.stack(
        [
            [np.asarray(xp.return_arrivals(t, s, r, case.window, case.tile)) for r in range(rounds)]
            for s in range(case.num_devices)
        ]
    )
    waits = [[list(map(list, by_tile)) for by_tile in by_round] for by_round in tiles]
    if variant not in ("overlap", "early_read", "extra_wait"):
        return Schedule(sent, tiles, waits, returns, rounds, num_tiles * case.tile)
    # A tile of two sources' pieces, the second no larger than the first: what the variants
    # break.
    d, r, u = next(
        (d, r, u)
        for d, r, u in np.ndindex(case.num_devices, rounds, num_tiles)
        if len(tiles[d][r][u]) >= 2 and tiles[d][r][u][1].size <= tiles[d][r][u][0].size
    )
    first, second = tiles[d][r][u][:2]
    if variant == "overlap":  # the second source writes over the first one's slots
        sent[second.source] = [
            dataclasses.replace(p, slot=first.slot) if p == second else p
            for p in sent[second.source]
        ]
    elif variant == "early_read":  # the receiver waits for one piece fewer
        waits[d][r][u] = waits[d][r][u][1:]
    elif variant == "extra_wait":  # and here for one more
        waits[d][r][u] = waits[d][r][u] + [second]
    return Schedule(sent, tiles, waits, returns, rounds, num_tiles * case.tile)


def device_program(me: int, sched: Schedule, variant: str, refs) -> None:
    """Device `me`'s part of the protocol, every offset static."""
    x_ref, out_ref, log_ref, buf_ref, res_ref, send_sem, arrive_sems, back_sems, local_sem = refs[
        :9
    ]
    credits = refs[9]
    num_devices = len(sched.sent)
    mine = sched.sent[me]
    for r in range(sched.rounds):
        # 1. Credits for the buffers of round r - 1, then my pieces of round r.
        if r and variant != "no_credit":
            for d in range(num_devices):
                pl.semaphore_wait(credits.at[d], 1)
        copies = []
        for p in (p for p in mine if p.round == r):
            copy = pltpu.make_async_remote_copy(
                x_ref.at[pl.ds(p.row, p.size)],
                buf_ref.at[pl.ds(p.slot, p.size)],
                send_sem,
                arrive_sems.at[p.tile],
                device_id=(p.dest,),
            )
            copy.start()
            copies.append(copy)
        # 2-3. My tiles: wait for their pieces, "compute" (copy to the results), send them back.
        returning = []
        for u, tile_pieces in enumerate(sched.tiles[me][r]):
            for p in sched.waits[me][r][u]:
                _copy(x_ref, buf_ref, p, send_sem, arrive_sems.at[u], me).wait_recv()
            for p in tile_pieces:
                rows = pl.ds(p.slot, p.size)
                pltpu.async_copy(buf_ref.at[rows], res_ref.at[rows], local_sem).wait()
                pltpu.async_copy(res_ref.at[rows], log_ref.at[r, rows], local_sem).wait()
                back = pltpu.make_async_remote_copy(
                    res_ref.at[rows],
                    out_ref.at[pl.ds(p.row, p.size)],
                    send_sem,
                    back_sems.at[me],
                    device_id=(p.source,),
                )
                back.start()
                returning.append(back)
        # 4. My buffer is free again: a credit to every source.
        if r + 1 < sched.rounds:
            for s in range(num_devices):
                pl.semaphore_signal(credits.at[me], 1, device_id=(s,))
        # 5. My rows of round r come back.
        for d in range(num_devices):
            back_pieces = [p for p in mine if p.round == r and p.dest == d]
            for k in range(sched.returns[me, r, d]):
                p = back_pieces[min(k, len(back_pieces) - 1)]
                pltpu.make_async_remote_copy(
                    res_ref.at[pl.ds(p.slot, p.size)],
                    out_ref.at[pl.ds(p.row, p.size)],
                    send_sem,
                    back_sems.at[d],
                    device_id=(d,),
                ).wait_recv()
        # My returns have left before round r + 1 writes the results buffer (step 4).
        for copy in copies + returning:
            copy.wait_send()


def _copy(x_ref, buf_ref, p: Piece, send_sem, recv_sem, device: int):
    """The descriptor of piece p's copy, as its receiver sees it (for a wait)."""
    return pltpu.make_async_remote_copy(
        x_ref.at[pl.ds(p.row, p.size)],
        buf_ref.at[pl.ds(p.slot, p.size)],
        send_sem,
        recv_sem,
        device_id=(device,),
    )


def simulate(case: Case, variant: str) -> dict:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpret_state

    sched = schedule(case, variant)
    num_devices, dim = case.num_devices, 128
    mesh = jax.make_mesh((num_devices,), (AXIS,))

    def kernel(*refs):
        me = lax.axis_index(AXIS)
        for d in range(num_devices):
            pl.when(me == d)(lambda d=d: device_program(d, sched, variant, refs))

    tiles = sched.slots // case.tile

    def per_device(x):
        return pl.pallas_call(
            kernel,
            out_shape=(
                jax.ShapeDtypeStruct(x.shape, x.dtype),
                jax.ShapeDtypeStruct((sched.rounds, sched.slots, dim), x.dtype),
            ),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=(pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)),
            scratch_shapes=[
                pltpu.VMEM((sched.slots, dim), x.dtype),  # receive buffer
                pltpu.VMEM((sched.slots, dim), x.dtype),  # results buffer
                pltpu.SemaphoreType.DMA,
                pltpu.SemaphoreType.DMA((tiles,)),
                pltpu.SemaphoreType.DMA((num_devices,)),
                pltpu.SemaphoreType.DMA,
                pltpu.SemaphoreType.REGULAR((num_devices,)),
            ],
            compiler_params=pltpu.CompilerParams(collective_id=0),
            interpret=pltpu.InterpretParams(
                detect_races=True, dma_execution_mode="on_wait", uninitialized_memory="nan"
            ),
        )(x)

    # Row n of device s holds s * 1000 + n + 1 in every lane: each row is recognisable.
    x_snd = (
        np.arange(num_devices)[:, None, None] * 1000.0
        + np.arange(case.num_rows)[None, :, None]
        + 1.0
        + np.zeros((1, 1, dim))
    ).astype(np.float32)
    x = jax.device_put(
        jnp.asarray(x_snd.reshape(num_devices * case.num_rows, dim)),
        jax.NamedSharding(mesh, P(AXIS)),
    )
    run = jax.jit(
        jax.shard_map(
            per_device, mesh=mesh, in_specs=P(AXIS), out_specs=(P(AXIS), P(AXIS)), check_vma=False
        )
    )
    out, log = jax.block_until_ready(run(x))
    out = np.asarray(out).reshape(num_devices, case.num_rows, dim)
    log = np.asarray(log).reshape(num_devices, sched.rounds, sched.slots, dim)
    races = interpret_state.races
    return {
        "variant": variant,
        "races_found": bool(races is not None and races.races_found),
        "buffers_as_planned": _buffers_ok(case, log),
        "rows_back": bool(np.array_equal(out, x_snd)),
        "rounds": sched.rounds,
        "pieces": sum(len(s) for s in sched.sent),
    }


def _buffers_ok(case: Case, log: np.ndarray) -> bool:
    """Every row sits in the slot the (correct) protocol gives it, in its round's log."""
    t = case.traffic()
    for s in range(case.num_devices):
        places = xp.row_places(t, jnp.int32(s), case.num_rows, case.window, case.tile)
        for n in np.flatnonzero(np.asarray(places.dest_n) >= 0):
            d, r, q = (
                int(np.asarray(a)[n]) for a in (places.dest_n, places.round_n, places.slot_n)
            )
            if not np.all(log[d, r, q] == s * 1000.0 + n + 1.0):
                return False
    return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=VARIANTS, default="correct")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(json.dumps(simulate(random_case(args.seed), args.variant)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
