"""Tile configurations of the grouped-matmul kernels, their defaults and the persistent grid size.

A `TileConfig` is frozen, keyword-only and validates itself; `None` means "derive it". Defaults
come from `DEFAULT_CONFIGS`, keyed by (shape class, device kind); a caller's config is never
replaced. The persistent grid has one program per streaming multiprocessor: the device's own core
count when it reports one (a GPU does), else the per-device table (a CPU device that lowers or
interprets a kernel for CUDA reports none, and the kernel is built for `TARGET_DEVICE_KIND`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Literal

import jax

GridMinorDim = Literal["m", "n"]
ShapeClass = Literal["gmm", "gmm_out_f32", "gmm_transposed", "gmm_swiglu", "gmm_swiglu_bwd", "tgmm"]
SHAPE_CLASSES: tuple[ShapeClass, ...] = (
    "gmm",
    "gmm_out_f32",
    "gmm_transposed",
    "gmm_swiglu",
    "gmm_swiglu_bwd",
    "tgmm",
)

# Shared memory a block may use on sm90 (227 KiB), less a margin for barriers and scalars.
SMEM_BYTES_SM90 = 227 * 1024 - 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceInfo:
    """What a kernel needs to know of a device it may not be running on."""

    num_cores: int  # streaming multiprocessors
    smem_bytes: int  # shared memory one block may use
    # Clusters of each size (CTAs) that can be resident at once, one CTA an SM, where that is
    # fewer than num_cores // size: a cluster's CTAs must sit in one GPC, and GPCs hold uneven
    # numbers of SMs. A persistent grid larger than this runs its last clusters as a second
    # wave (1.8x the time). Measured with Nsight Compute's "Max Active Clusters".
    # (cluster size, clusters) pairs.
    resident_clusters: tuple[tuple[int, int], ...] = ()


# Device kinds as `jax.Device.device_kind` spells them.
DEVICES: dict[str, DeviceInfo] = {
    # 66 clusters of 2, but 30 of 4 (120 SMs): bench/results/2026-11-30_gmm_profile_h200/.
    "NVIDIA H200": DeviceInfo(
        num_cores=132, smem_bytes=SMEM_BYTES_SM90, resident_clusters=((4, 30),)
    ),
    "NVIDIA H100 80GB HBM3": DeviceInfo(num_cores=132, smem_bytes=SMEM_BYTES_SM90),
    "NVIDIA H100 PCIe": DeviceInfo(num_cores=114, smem_bytes=SMEM_BYTES_SM90),
    "NVIDIA H800": DeviceInfo(num_cores=132, smem_bytes=SMEM_BYTES_SM90),
}
# The device a kernel is built for when the current device is no GPU (CUDA lowering or GPU
# interpret mode on a CPU machine), or a GPU the tables do not know.
TARGET_DEVICE_KIND = "NVIDIA H200"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TileConfig:
    """Tiles of one persistent, warp-specialized grouped-matmul kernel.

    Attributes:
      block_m: rows of an output tile (each consumer warpgroup holds all of them).
      block_n: columns of an output tile (for gmm_swiglu: of the gate and of the up product).
      block_k: the reduction step of one pipeline stage.
      max_concurrent_steps: pipeline stages in shared memory.
      delay_release: 0 waits for each step's wgmma before its stage is released; 1 keeps one
        wgmma in flight and releases a stage one step later.
      epi_block_m, epi_block_n: the epilogue sub-tile a consumer stages in shared memory before
        its TMA store (None: the consumer's whole tile).
      grid_minor_dim, grid_tile_width: the order of output tiles over the persistent grid: bands
        of `grid_tile_width` tiles along `grid_minor_dim` (for L2 reuse).
      grid_size: programs of the persistent grid (None: one per streaming multiprocessor; with
        clusters, as many clusters as the device holds at once, `persistent_grid_size`).
      num_consumers: consumer warpgroups (1 or 2); one producer warpgroup issues the TMA loads.
      consumer_dim: the output-tile dimension split between the consumers: "n", each owns
        block_n // num_consumers columns of all block_m rows (wgmma m64 x n consumer_n); "m",
        each owns block_m // num_consumers rows of all block_n columns (wgmma m64 x n block_n:
        fewer, wider instructions, each reading its lhs rows once; gmm and gmm_swiglu only).
      cluster_n: CTAs per cluster along columns (1 or 2). With 2, the two CTAs of a cluster
        compute neighbouring column tiles of the same row tile, and each lhs tile is loaded
        once from L2 and multicast into both (half the lhs traffic); N must hold an even number
        of column tiles (gmm and gmm_swiglu only). With clusters, the persistent grid is
        grid_size // (cluster_m * cluster_n) clusters.
      cluster_m: CTAs per cluster along rows (1 or 2). With 2, the two CTAs of a cluster
        compute the two halves of a [2 * block_m, block_n] tile of one group, and each rhs
        tile (the group's weights) is loaded once from L2 and multicast into both (half the
        rhs traffic, the larger operand for block_n > block_m); a group's rows are then tiled
        in 2 * block_m rows, so a pair's second half may hold no rows of the group and compute
        rows it never stores. With cluster_n = 2 too, a cluster is 2 x 2 CTAs (both operands
        multicast; grid_size // 4 clusters). For tgmm, whose output rows are K, the
        two CTAs compute K tiles 2j and 2j + 1 of one (group, N tile) and the rhs row blocks
        are multicast; no group is padded (K must hold an even number of tiles).
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    max_concurrent_steps: int = 4
    delay_release: int = 1
    epi_block_m: int | None = 64
    epi_block_n: int | None = 64
    grid_minor_dim: GridMinorDim = "n"
    grid_tile_width: int = 1
    grid_size: int | None = None
    num_consumers: int = 2
    consumer_dim: GridMinorDim = "n"
    cluster_n: int = 1
    cluster_m: int = 1

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_tile_width"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        block_m, block_n, block_k = self.block_m, self.block_n, self.block_k
        if block_m % 64:
            raise ValueError(f"{block_m=} must be a multiple of 64 (the wgmma row count)")
        if block_k % 64:
            raise ValueError(f"{block_k=} must be a multiple of 64 (one 128-byte swizzle row)")
        if self.num_consumers not in (1, 2):
            raise ValueError(f"num_consumers={self.num_consumers!r} must be 1 or 2")
        for name in ("cluster_m", "cluster_n"):
            value = getattr(self, name)
            if value not in (1, 2) or isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be 1 or 2")
        if self.consumer_dim not in ("m", "n"):
            raise ValueError(f"consumer_dim={self.consumer_dim!r} must be 'm' or 'n'")
        split = block_m if self.consumer_dim == "m" else block_n
        if split % (64 * self.num_consumers):
            raise ValueError(
                f"block_{self.consumer_dim}={split} must be a multiple of 64 * "
                f"num_consumers={64 * self.num_consumers} (consumer_dim={self.consumer_dim!r})"
            )
        if self.consumer_n > 256:
            raise ValueError(
                f"a consumer's {self.consumer_n} columns must be <= 256 (the widest wgmma)"
            )
        if self.delay_release not in (0, 1):
            raise ValueError(f"delay_release={self.delay_release!r} must be 0 or 1")
        if self.max_concurrent_steps <= self.delay_release:
            raise ValueError(
                f"max_concurrent_steps={self.max_concurrent_steps} must exceed "
                f"delay_release={self.delay_release}"
            )
        if self.grid_minor_dim not in ("m", "n"):
            raise ValueError(f"grid_minor_dim={self.grid_minor_dim!r} must be 'm' or 'n'")
        if self.grid_size is not None and (
            not isinstance(self.grid_size, int) or self.grid_size < 1
        ):
            raise ValueError(f"grid_size={self.grid_size!r} must be None or a positive int")
        consumer_n = self.consumer_n
        epi_m, epi_n = self.epilogue_tile
        if epi_m % 64 or self.consumer_m % epi_m:
            raise ValueError(
                f"epi_block_m={self.epi_block_m} must be a multiple of 64 dividing the "
                f"consumer's {self.consumer_m} rows"
            )
        if epi_n < 8 or consumer_n % epi_n or epi_n % 8:
            raise ValueError(
                f"epi_block_n={self.epi_block_n} must be a multiple of 8 dividing the "
                f"consumer's {consumer_n} columns"
            )

    @property
    def consumer_m(self) -> int:
        """Rows of the output tile owned by one consumer warpgroup."""
        return self.block_m // self.num_consumers if self.consumer_dim == "m" else self.block_m

    @property
    def consumer_n(self) -> int:
        """Columns of the output tile owned by one consumer warpgroup."""
        return self.block_n // self.num_consumers if self.consumer_dim == "n" else self.block_n

    @property
    def cluster_size(self) -> int:
        """CTAs per cluster."""
        return self.cluster_m * self.cluster_n

    @property
    def epilogue_tile(self) -> tuple[int, int]:
        """(rows, columns) of one epilogue sub-tile."""
        return (self.epi_block_m or self.consumer_m, self.epi_block_n or self.consumer_n)

    def smem_bytes(
        self, *, itemsize: int, out_itemsize: int, num_rhs: int = 1, num_lhs: int = 1
    ) -> int:
        """Shared memory of the pipeline stages plus the epilogue buffers (2 per consumer); with
        two lhs (gmm_swiglu_bwd, the one such kernel) also its f32 row sums, a row a consumer."""
        stage = (
            num_lhs * self.block_m * self.block_k + num_rhs * self.block_k * self.block_n
        ) * itemsize
        epi_m, epi_n = self.epilogue_tile
        row_sums = self.num_consumers * self.consumer_m * 4 if num_lhs == 2 else 0
        return (
            self.max_concurrent_steps * stage
            + self.num_consumers * 2 * epi_m * epi_n * out_itemsize
            + row_sums
        )


def resolve_device_kind(device: jax.Device | None = None) -> str:
    """The device kind a kernel is built for: the device's own, or `TARGET_DEVICE_KIND` (a CPU
    lowering or interpreting the kernels; a GPU the tables do not know, with a warning)."""
    device = jax.devices()[0] if device is None else device
    if device.platform == "gpu" and device.device_kind in DEVICES:
        return device.device_kind
    if device.platform == "gpu":
        _warn_unknown_gpu(device.device_kind)
    return TARGET_DEVICE_KIND


@functools.cache
def _warn_unknown_gpu(kind: str) -> None:
    warnings.warn(
        f"the kernels have no tuning for {kind!r}: they use {TARGET_DEVICE_KIND!r}'s tiles and "
        "the device's own SM count (pallas_kernels/grouped_matmul/tuning.py's DEVICES and "
        "DEFAULT_CONFIGS take a measured entry)",
        stacklevel=3,
    )


def persistent_grid_size(device: jax.Device | None = None, *, cluster_size: int = 1) -> int:
    """Programs of the persistent grid: one per streaming multiprocessor of `device`, or with
    clusters of `cluster_size` CTAs, as many as can be resident at once (a multiple of it).

    A GPU reports its core count; a CPU device (CUDA lowering, GPU interpret mode) reports none,
    and the count comes from `DEVICES[resolve_device_kind(device)]`, as does the number of
    resident clusters (`DeviceInfo.resident_clusters`; where the table has none, every SM).
    """
    device = jax.devices()[0] if device is None else device
    info = DEVICES[resolve_device_kind(device)]
    core_count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    if not (isinstance(core_count, int) and core_count > 0):
        core_count = info.num_cores
    resident = dict(info.resident_clusters).get(cluster_size, core_count)
    clusters = min(core_count // cluster_size, resident)
    return max(1, clusters) * cluster_size


# Measured winners go here (bench/results/*_gmm_tuning_h200.json has the sweep behind them).
DEFAULT_CONFIGS: dict[tuple[ShapeClass, str], TileConfig] = {
    # Bands of 16 row tiles, all column tiles of a band before the next band (L2 reuse of the
    # lhs rows and of a group's weights): 628 -> 726 TFLOP/s on mixtral gate_up, 636 -> 700 on
    # dsv3 gate_up, 597 -> 681 on dsv3 down (H200, 2026-11-30).
    ("gmm", "NVIDIA H200"): TileConfig(grid_minor_dim="m", grid_tile_width=16),
    # An f32 output doubles the epilogue buffers: one stage fewer.
    ("gmm_out_f32", "NVIDIA H200"): TileConfig(
        max_concurrent_steps=3, grid_minor_dim="m", grid_tile_width=16
    ),
    ("gmm_transposed", "NVIDIA H200"): TileConfig(grid_minor_dim="m", grid_tile_width=16),
    # The consumers split the rows (each m64 x n128 wgmma for the gate and for the up product,
    # not m64 x n64): 1.034, 1.116, 1.012x the column split at qwen3, mixtral, dsv3 gate_up
    # (H200, 2026-11-30, bench/results/2026-11-30_gmm_sweep2_h200.md).
    ("gmm_swiglu", "NVIDIA H200"): TileConfig(
        block_n=128, epi_block_n=64, grid_minor_dim="m", grid_tile_width=16, consumer_dim="m"
    ),
    # gmm_swiglu_bwd: three f32 accumulators (gate, up, dy @ w_down.T) a consumer, so each
    # consumer holds 64 x 64 of them (96 registers a thread) where gmm_swiglu holds 64 x 128 of
    # two; two lhs tiles and three rhs tiles a stage: three stages fit. Measured once
    # (2026-12-01, qwen3's 131072 rows): 3.73 ms, 332 TFLOP/s, slower than three f32 gmm calls
    # and XLA's epilogue (3.03 ms), so ops.Recompute's default does not use it; block_n 128
    # (2 stages) took 7.43 ms. Other tiles not yet measured.
    ("gmm_swiglu_bwd", "NVIDIA H200"): TileConfig(
        block_n=64,
        max_concurrent_steps=3,
        epi_block_n=64,
        grid_minor_dim="m",
        grid_tile_width=16,
        consumer_dim="m",
    ),
    # tgmm (the weight gradient, in mosaic_gpu_wgrad.py): block_m tiles K, block_n tiles N and
    # block_k steps over a group's rows. Output tiles 128x256 with 3 stages beat 128x128 with 4
    # at all five DESIGN.md shapes, random and 8-aligned group sizes (e.g. 1.73 vs 1.95 ms at
    # qwen3 gate_up, 0.95 vs 1.16 at qwen3 down, aligned, f32 out; H200, 2026-11-30,
    # bench/results/2026-11-30_tgmm_tuning_h200.json); 3 stages leave room for an f32 epilogue.
    # The tiles were measured with the kernel's earlier form (a pipeline per unit, drained at
    # every unit); the ring over all of a CTA's units (one producer running ahead across units)
    # is not yet measured, nor is delay_release=1, which the ring allows.
    # Tile order (NOT YET MEASURED; bench/gmm_sweep.py's first wgrad candidates time it): bands
    # of 16 K tiles ("m" is K for tgmm), all N tiles of a band before the next. Chosen with a
    # model of HBM bytes: the 132 CTAs take 132 consecutive units at a time (a wave) and stream
    # the group's rows together, so a wave reads each group's K and N slice it touches once; the
    # slices stay in an LRU L2 of C bytes for the next wave only if the wave's slices fit in C.
    # MB read per group for C = 50 / 25 / 20 MiB at mixtral gate_up (2048 rows a group, 32 K x
    # 112 N tiles; ideal, every row read once: 134): the old order, each K tile's N tiles in a
    # row, 3236 (26 GB a call: ~6.8 ms at 3.8 TB/s, measured 6.94 ms); m/8 354 / 433 / 588;
    # m/16 216 / 242 / 263; m/32 (all of K: K tiles fastest) 134 / 146 / 610. The other four
    # shapes are at their ideal with m/16 for C >= 20 MiB. m/32 is least only while a group's
    # whole lhs slice (16.8 MB) stays in L2, and the L2 a wave can use is under 50 MiB (two
    # partitions; 8.6 MB of bf16 output tiles written a wave): m/16 stays within 2x of ideal.
    ("tgmm", "NVIDIA H200"): TileConfig(
        block_m=128,
        block_n=256,
        block_k=64,
        max_concurrent_steps=3,
        delay_release=0,
        grid_minor_dim="m",
        grid_tile_width=16,
    ),
}


def gmm_shape_class(*, transpose_rhs: bool, out_dtype) -> ShapeClass:
    """The shape class of a `gmm` call (an f32 output needs more epilogue buffers)."""
    if jax.numpy.dtype(out_dtype).itemsize == 4:
        return "gmm_out_f32"
    return "gmm_transposed" if transpose_rhs else "gmm"


# GPU interpret mode on a CPU: small tiles and a few programs, so that tests run in seconds.
INTERPRET = "interpret"
INTERPRET_CONFIG = TileConfig(
    block_m=64,
    block_n=128,
    block_k=64,
    max_concurrent_steps=2,
    epi_block_m=64,
    epi_block_n=64,
    grid_size=3,
)
for _shape_class in SHAPE_CLASSES:
    DEFAULT_CONFIGS[(_shape_class, INTERPRET)] = INTERPRET_CONFIG
# tgmm in interpret mode: delay_release=0, as its H200 default.
DEFAULT_CONFIGS[("tgmm", INTERPRET)] = dataclasses.replace(INTERPRET_CONFIG, delay_release=0)


def default_config(
    shape_class: ShapeClass, device: jax.Device | None = None, *, interpret: bool = False
) -> TileConfig:
    """The table's config for `shape_class` on `device` (the target device kind if unknown),
    or for GPU interpret mode."""
    if shape_class not in SHAPE_CLASSES:
        raise ValueError(f"{shape_class=} must be one of {SHAPE_CLASSES}")
    kind = INTERPRET if interpret else resolve_device_kind(device)
    config = DEFAULT_CONFIGS.get((shape_class, kind))
    if config is None:
        config = DEFAULT_CONFIGS[(shape_class, TARGET_DEVICE_KIND)]
    return config
