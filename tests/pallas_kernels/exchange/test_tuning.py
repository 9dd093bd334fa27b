"""The exchange's tuning table: the exchange programs a device kind gets (its own, or the target
kind's for a CPU or a GPU the table lacks), each leaving programs for the GEMMs; and the
knobs' validation at `ops.dispatch_mlp`'s entry."""

from __future__ import annotations

import types

import jax
import pytest

from pallas_kernels.exchange import mosaic_gpu, ops, tuning
from pallas_kernels.grouped_matmul import tuning as gmm_tuning


def gpu(device_kind: str) -> types.SimpleNamespace:
    """A stand-in for a GPU `jax.Device` of `device_kind` (all `resolve_device_kind` reads)."""
    return types.SimpleNamespace(platform="gpu", device_kind=device_kind)


TARGET_VALUE = tuning.EXCHANGE_PROGRAMS[gmm_tuning.TARGET_DEVICE_KIND]


def test_the_h200_value_is_the_measured_one():
    # Measured: bench/results/2026-12-01_exchange_tail_h200/ (the forward) and
    # bench/results/2026-12-01_exchange_backward_return_h200/ (the backward). Change the table, and
    # this number, with a new measurement.
    assert tuning.EXCHANGE_PROGRAMS["NVIDIA H200"] == 24


@pytest.mark.parametrize("kind", sorted(tuning.EXCHANGE_PROGRAMS))
def test_a_known_kind_gets_its_own_value_and_leaves_programs_for_the_gemms(kind):
    programs = tuning.default_exchange_programs(gpu(kind))
    assert programs == tuning.EXCHANGE_PROGRAMS[kind]
    assert 0 < programs < gmm_tuning.DEVICES[kind].num_cores


def test_the_h100_carries_the_h200_value():
    h100, h200 = (tuning.default_exchange_programs(gpu(k)) for k in ("NVIDIA H100 80GB HBM3",
                                                                      "NVIDIA H200"))  # fmt: skip
    assert h100 == h200


@pytest.mark.parametrize(
    "device",
    [
        pytest.param(jax.devices("cpu")[0], id="cpu"),
        # In grouped_matmul's DEVICES, not in the exchange's table. (A GPU neither knows
        # resolves to the target kind as the CPU does: grouped_matmul's tests hold that.)
        pytest.param(gpu("NVIDIA H100 PCIe"), id="kind_without_an_entry"),
    ],
)
def test_other_devices_get_the_target_kinds_value(device):
    assert tuning.default_exchange_programs(device) == TARGET_VALUE


def test_the_default_device_is_the_first():
    assert tuning.default_exchange_programs() == tuning.default_exchange_programs(jax.devices()[0])


def test_the_kernels_resolve_none_to_the_table():
    """The overlapped kernels' None is the table's value for this device (this CPU machine:
    the target kind's), next to the persistent grid's programs."""
    assert mosaic_gpu._programs(None) == (TARGET_VALUE, gmm_tuning.persistent_grid_size())
    assert mosaic_gpu._programs(16) == (16, gmm_tuning.persistent_grid_size())


# `ops.dispatch_mlp` validates its static knobs before it reads any operand.
NO_OPERANDS = (None,) * 9


def test_a_bad_exchange_fusion_is_refused_with_its_value():
    with pytest.raises(ValueError, match=r"exchange_fusion='one_kernel' must be one of "
                                         r"\('per_gemm', 'forward'\)"):  # fmt: skip
        ops.dispatch_mlp(*NO_OPERANDS, out_rows=8, tile=4, axis_name="expert",
                         exchange_fusion="one_kernel")  # fmt: skip
    assert ops.EXCHANGE_FUSIONS == ("per_gemm", "forward")


@pytest.mark.parametrize("programs", [dict(exchange_programs=-1),
                                      dict(grad_exchange_programs=-1)])  # fmt: skip
def test_negative_exchange_programs_are_refused_with_their_values(programs):
    with pytest.raises(ValueError, match=r"grad_exchange_programs=-?\d+ must be >= 0"):
        ops.dispatch_mlp(*NO_OPERANDS, out_rows=8, tile=4, axis_name="expert", **programs)
