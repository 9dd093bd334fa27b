"""The pieces both grouped-matmul kernels build their producer/consumer ring from.

A kernel program has one producer warpgroup, which TMA-loads every step of every work item
(output tile) of the program into a ring of shared-memory stages, and one or two consumer
warpgroups, which run wgmma on the stages and release them. The producer runs ahead across
item boundaries; both sides walk the same items in the same order and count the same steps,
so step s always uses stage s % stages (each kernel's invariants say how it keeps that).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# Registers per thread the producer keeps (it only issues TMA copies and scalar loads).
PRODUCER_REGISTERS = 40


def consumer_registers(num_consumers: int) -> int:
    """Registers per thread of a consumer warpgroup: the 64K-register file (512 per thread of
    one warpgroup) less the producer's, split between the consumers, at most 256 and a
    multiple of 8 (setmaxnreg's rules)."""
    return min(256, (512 - PRODUCER_REGISTERS) // num_consumers) // 8 * 8


def prefetching_loop(
    num_items: int,
    fetch: Callable[[Any], tuple],
    *,
    axis: str,
    programs: int | None = None,
    first_program: int = 0,
) -> Callable[[Callable[..., Any]], Any]:
    """A loop over this program's items that loads each item's scalars one item ahead.

    Decorates `body(item, steps, values) -> steps`: it runs item `item` after `steps` ring
    steps and returns the count after it; `values = fetch(item)` (a tuple of scalar GMEM
    loads). Program p of P gets the items p, p + P, p + 2P, ...; at the top of each item the
    next one's values are loaded and carried to it. A GPU load stalls only at the first use of
    its value, one item later, so only the first item's load is waited for. Indices past the
    last item are clamped (the values are then unused). Returns the program's step count
    after its last item.

    P is the size of `axis` (nd_loop deals the items), or `programs`: then only programs
    [first_program, first_program + programs) of the axis take items, as programs 0, 1, ...
    (a kernel whose other programs do other work, such as the exchange's copies); the other
    programs must not enter the loop.
    """

    def clamped_fetch(item):
        return fetch(jnp.minimum(item, num_items - 1))

    def decorator(body):
        if programs is None:
            first = (jnp.int32(0), clamped_fetch(lax.axis_index(axis)))

            def step(loop_info: plgpu.NDLoopInfo, carry):
                steps, values = carry
                (item,) = loop_info.index
                upcoming = clamped_fetch(item + lax.axis_size(axis))
                return body(item, steps, values), upcoming

            steps, _ = plgpu.nd_loop((num_items,), collective_axes=axis, init_carry=first)(step)
            return steps

        program = lax.axis_index(axis) - first_program
        trips = jnp.maximum(num_items - program + programs - 1, 0) // programs
        first = (jnp.int32(0), clamped_fetch(program))

        def dealt_step(i, carry):
            steps, values = carry
            item = program + i * programs
            upcoming = clamped_fetch(item + programs)
            return body(item, steps, values), upcoming

        steps, _ = lax.fori_loop(0, trips, dealt_step, first)
        return steps

    return decorator


def observe_last_releases(consumed, num_steps, stages: int) -> None:
    """The producer's last act: wait for the releases of the last `stages` steps it loaded (it
    waited for every earlier one before refilling its stage), so that no barrier is left with
    a phase its waiter never saw (the GPU interpreter checks this at deallocation)."""

    @pl.loop(jnp.maximum(num_steps - stages, 0), num_steps)
    def _wait(step):
        plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])


def release_after_wgmma(
    consumed, *, step, first_of_item, delay: int, groups_per_step: int, stages: int
) -> None:
    """A consumer's release after issuing the wgmmas of ring step `step` (its stage is
    step % stages): a stage is released only once every wgmma reading it completed.

    delay 0: wait for all wgmmas, release this step's stage. delay 1: keep this step's
    `groups_per_step` wgmma groups in flight (each `plgpu.wgmma` commits one), so the previous
    step's are done: release the previous stage, if it belongs to the same item (the last stage
    of an item is released by `release_last`)."""
    plgpu.wgmma_wait(delay * groups_per_step)
    if delay:

        @pl.when(jnp.logical_not(first_of_item))
        def _release_the_previous_stage():
            plgpu.barrier_arrive(consumed.at[lax.rem(step - 1, stages)])

    else:
        plgpu.barrier_arrive(consumed.at[lax.rem(step, stages)])


def release_last(consumed, *, last_step, delay: int, stages: int) -> None:
    """After an item's last ring step `last_step`: with delay 1 its stage is still held;
    wait for every wgmma, then release it (delay 0 released it already)."""
    if delay:
        plgpu.wgmma_wait(0)
        plgpu.barrier_arrive(consumed.at[lax.rem(last_step, stages)])


def acquire_stage(consumed, *, step, stages: int):
    """The producer's first act for ring step `step`: its stage, once free. A stage used
    before (step >= stages) is free when every consumer released it; the producer waits for
    each release in order, once (the barrier's phases stay in step with its own count)."""
    slot = lax.rem(step, stages)

    @pl.when(step >= stages)
    def _wait_for_the_stage():
        plgpu.barrier_wait(consumed.at[slot])

    return slot
