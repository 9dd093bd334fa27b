"""Tile configs: validation with the offending values, defaults, the persistent grid size."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.grouped_matmul import tuning
from pallas_kernels.grouped_matmul.tuning import TileConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_m": 96}, "block_m=96 must be a multiple of 64"),
        ({"block_m": 0}, "block_m=0 must be a positive int"),
        ({"block_k": 32}, "block_k=32 must be a multiple of 64"),
        ({"block_n": 64}, "block_n=64 must be a multiple of 64 * num_consumers=128"),
        ({"block_n": 1.5}, "block_n=1.5 must be a positive int"),
        ({"num_consumers": 3}, "num_consumers=3 must be 1 or 2"),
        ({"delay_release": 2}, "delay_release=2 must be 0 or 1"),
        ({"max_concurrent_steps": 1}, "max_concurrent_steps=1 must exceed delay_release=1"),
        ({"grid_minor_dim": "k"}, "grid_minor_dim='k' must be 'm' or 'n'"),
        ({"grid_size": 0}, "grid_size=0 must be None or a positive int"),
        ({"epi_block_m": 32}, "epi_block_m=32 must be a multiple of 64 dividing the consumer's"),
        ({"consumer_dim": "k"}, "consumer_dim='k' must be 'm' or 'n'"),
        ({"cluster_n": 3}, "cluster_n=3 must be 1 or 2"),
        ({"cluster_m": True}, "cluster_m=True must be 1 or 2"),
        (
            {"consumer_dim": "m", "block_m": 64},
            "block_m=64 must be a multiple of 64 * num_consumers=128",
        ),
        ({"consumer_dim": "m", "block_n": 512}, "consumer's 512 columns must be <= 256"),
        ({"consumer_dim": "m", "epi_block_m": 128}, "epi_block_m=128 must be a multiple of 64"),
        ({"epi_block_n": 48}, "epi_block_n=48 must be a multiple of 8 dividing"),
    ],
)
def test_invalid_config_names_the_values(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("(", r"\(")):
        TileConfig(**kwargs)


def test_config_is_frozen_and_keyword_only():
    config = TileConfig()
    with pytest.raises(AttributeError):
        config.block_m = 64  # type: ignore[misc]
    with pytest.raises(TypeError):
        TileConfig(128)  # type: ignore[misc]


def test_derived_sizes():
    config = TileConfig(block_m=128, block_n=256, block_k=64, max_concurrent_steps=4)
    assert config.consumer_n == 128
    assert config.epilogue_tile == (64, 64)
    assert TileConfig(epi_block_m=None, epi_block_n=None).epilogue_tile == (128, 128)
    stages = 4 * (128 * 64 + 64 * 256) * 2
    assert config.smem_bytes(itemsize=2, out_itemsize=2) == stages + 2 * 2 * 64 * 64 * 2


def test_grid_size_on_a_cpu_device_comes_from_the_table():
    cpu = jax.devices("cpu")[0]
    assert tuning.resolve_device_kind(cpu) == tuning.TARGET_DEVICE_KIND
    expected = tuning.DEVICES[tuning.TARGET_DEVICE_KIND].num_cores
    assert tuning.persistent_grid_size(cpu) == expected


def test_grid_size_with_clusters_is_the_resident_clusters_of_the_table():
    # H200: 66 clusters of 2 fit at once, 30 of 4 (Nsight Compute); a 132-CTA grid of 4-CTA
    # clusters ran its last 3 clusters as a second wave (9.47 vs 5.2 ms at mixtral gate_up).
    cpu = jax.devices("cpu")[0]
    assert tuning.resolve_device_kind(cpu) == "NVIDIA H200"
    assert tuning.persistent_grid_size(cpu, cluster_size=1) == 132
    assert tuning.persistent_grid_size(cpu, cluster_size=2) == 132
    assert tuning.persistent_grid_size(cpu, cluster_size=4) == 120
    assert tuning.persistent_grid_size(cpu, cluster_size=8) == 128  # not in the table: every SM


class _FakeGpu:
    platform = "gpu"
    core_count = 78

    def __init__(self, kind: str):
        self.device_kind = kind


def test_an_unknown_gpu_is_named_in_a_warning_once():
    with pytest.warns(UserWarning, match="no tuning for 'NVIDIA H20'.*'NVIDIA H200'"):
        assert tuning.resolve_device_kind(_FakeGpu("NVIDIA H20")) == tuning.TARGET_DEVICE_KIND
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tuning.resolve_device_kind(_FakeGpu("NVIDIA H20"))  # once per kind
        assert tuning.resolve_device_kind(_FakeGpu("NVIDIA H200")) == "NVIDIA H200"
    with pytest.warns(UserWarning):
        assert tuning.persistent_grid_size(_FakeGpu("NVIDIA GH200 480GB")) == 78  # its own SMs


@pytest.mark.gpu
def test_grid_size_on_a_gpu_is_its_core_count():
    gpu = jax.devices("gpu")[0]
    assert tuning.persistent_grid_size(gpu) == gpu.core_count


@pytest.mark.parametrize("shape_class", tuning.SHAPE_CLASSES)
def test_defaults_exist_and_fit_shared_memory(shape_class):
    config = tuning.default_config(shape_class, jax.devices("cpu")[0])
    assert isinstance(config, TileConfig)
    out_itemsize = 4 if shape_class == "gmm_out_f32" else 2
    num_rhs, num_lhs = {"gmm_swiglu": (2, 1), "gmm_swiglu_bwd": (3, 2)}.get(shape_class, (1, 1))
    limit = tuning.DEVICES[tuning.TARGET_DEVICE_KIND].smem_bytes
    smem = config.smem_bytes(
        itemsize=2, out_itemsize=out_itemsize, num_rhs=num_rhs, num_lhs=num_lhs
    )
    assert smem <= limit


def test_shape_class_of_gmm_calls():
    assert tuning.gmm_shape_class(transpose_rhs=False, out_dtype=jnp.bfloat16) == "gmm"
    assert tuning.gmm_shape_class(transpose_rhs=False, out_dtype=jnp.float32) == "gmm_out_f32"
    assert tuning.gmm_shape_class(transpose_rhs=True, out_dtype=jnp.bfloat16) == "gmm_transposed"
    assert tuning.gmm_shape_class(transpose_rhs=True, out_dtype=jnp.float32) == "gmm_out_f32"
    with pytest.raises(ValueError, match="shape_class='dense'"):
        tuning.default_config("dense")  # type: ignore[arg-type]
