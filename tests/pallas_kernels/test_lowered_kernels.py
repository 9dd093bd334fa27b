"""Every kernel configuration of lowered_kernels.py, lowered for CUDA on this CPU machine, has
the hash that lowered_kernels.json holds: a change to pallas_kernels that changes no kernel
(a refactor) passes; one that changes a kernel, its launch or the XLA program around it fails
until the table is regenerated."""

from __future__ import annotations

import jax
import pytest

from tests.pallas_kernels import lowered_kernels

TABLE = lowered_kernels.read_table()


def _first_of_each_kernel() -> set[str]:
    """The first configuration of each kernel (the part of the name before "/"): the ones the
    fast tier lowers; ./test.sh --all lowers every one."""
    first: dict[str, str] = {}
    for name in lowered_kernels.NAMES:
        first.setdefault(name.split("/")[0], name)
    return set(first.values())


FIRST_OF_EACH_KERNEL = _first_of_each_kernel()


def _on_a_cpu() -> bool:
    return jax.devices()[0].platform == "cpu"


def test_the_table_has_one_hash_per_configuration():
    missing = sorted(set(lowered_kernels.NAMES) - set(TABLE))
    stale = sorted(set(TABLE) - set(lowered_kernels.NAMES))
    assert not missing and not stale, (
        f"{lowered_kernels.TABLE.name} lacks {missing} and has {stale}, which no configuration "
        f"names: regenerate it with `{lowered_kernels.COMMAND}`"
    )


@pytest.mark.skipif(
    not _on_a_cpu(), reason="the table is of the kernels a CPU machine builds (for the H200)"
)
@pytest.mark.parametrize(
    "name",
    [
        name if name in FIRST_OF_EACH_KERNEL else pytest.param(name, marks=pytest.mark.slow)
        for name in lowered_kernels.NAMES
    ],
)
def test_lowered_kernel_is_unchanged(name):
    got = lowered_kernels.lowered_hash(name)
    assert got == TABLE.get(name), (
        f"the lowering of {name!r} changed (sha256 {got}, the table has {TABLE.get(name)}). "
        f"A refactor must leave every kernel as it was: "
        f"`python -m tests.pallas_kernels.lowered_kernels --dump DIR {name}` before and after "
        f"the change shows what differs. If the change to the kernel is intended, regenerate "
        f"the table with `{lowered_kernels.COMMAND}` and say in the commit message why the "
        f"kernel changed."
    )
