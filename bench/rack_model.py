"""A performance model of the expert-parallel MoE layer on a rack: forward and
backward time per device from the shapes, the routing imbalance, the GPU's GEMM rate and HBM
bandwidth and the link bandwidth, for the exchanges `ragged_all_to_all`, `ring` and `fused`.

    python -m bench.rack_model --out DIR

The model (per device, per direction; the device that receives the most rows sets the time):

    R          = rho * T * K                        rows the busiest device computes
    C_gemm     = max(FLOPs / (peak * eta_gemm),     expert, shared-expert and router GEMMs,
                     n * W / (hbm * eta_stream))    FLOPs on tile-padded groups; W the local
                                                    weights, streamed n times (ring: n = P)
    C_mem      = bytes / (hbm * eta_hbm)            permutations, combine, SwiGLU, MXFP8
    C_over     = max(ceil(T / C), 2) * c_chunk      steps of the token-wise loops (tiles.py)
    d, r       = T*K*(P-1)/P * D * bytes            rows sent out and back, balanced; the
                                                    backward sends x rows again, then dy
    ragged_all_to_all: C + rounds * n_c * lat + rho * (d + r) * a / (link * eta_link)
    ring:      C_tok + c + (P-1) * max(c, hop) + return hop    (c = C_row / P)
    fused:     C_tok + rounds * (fill + drain) + max(G_row / (1 - s), X') + M_row
                                                    (X': the busiest link's bytes less the
                                                    exposed fills and drains; G_row, M_row:
                                                    C_row's GEMMs and memory passes)

C_tok: the token-side work (route, combine, shared expert, loop steps); C_row: the row-side
work (routed GEMMs G_row and their memory passes M_row, scaling with rho). rounds = ceil(rho /
buffer_factor); n_c the collectives a round (2 forward, 3 backward); a the collective's time
over the rows' bytes at the link's rate; hop: one ring hop's fixed-shape chunks out and back
plus n_c latencies; s: the share of the SMs the fused kernels' copy programs hold. eta_gemm,
eta_hbm and c_chunk are fitted to the fused layer's single-H200 times (in sample), eta_link
comes from the two-H200 bandwidth rows, the rest is published (SOURCES) or assumed
(ASSUMPTIONS); docs/performance.md summarizes the model and its results.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import pathlib
import shlex
import sys
from collections.abc import Sequence
from typing import Literal

import numpy as np
from scipy import optimize

import mok_jax
from bench.harness import table, write_files
from bench.multi_gpu import SCALING
from mok_jax import tiles
from mok_jax.config import MoEConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYER_RESULTS = ROOT / "bench" / "results" / "moe_layer_h200.json"
MULTI_GPU_RESULTS = ROOT / "bench" / "results" / "multi_gpu_h200x2.json"

Dtype = Literal["bf16", "fp8"]
Exchange = Literal["ragged_all_to_all", "ring", "fused"]
Direction = Literal["forward", "backward"]
Residuals = Literal["inputs", "gate_up"]
DTYPES: tuple[Dtype, ...] = ("bf16", "fp8")
EXCHANGES: tuple[Exchange, ...] = ("ragged_all_to_all", "ring", "fused")
DIRECTIONS: tuple[Direction, ...] = ("forward", "backward")
RESIDUALS: tuple[Residuals, ...] = ("inputs", "gate_up")


def _config_default(name: str):
    """MoEConfig's default for field `name` (so the model cannot drift from the library)."""
    return next(f.default for f in dataclasses.fields(MoEConfig) if f.name == name)


DEFAULT_ROW_TILE: int = _config_default("row_tile")
DEFAULT_BUFFER_FACTOR: float = _config_default("buffer_factor")
# The options of the measured fused runs (bench/results: moe_layer_h200.json,
# multi_gpu_h200x2.json) where they set none: MoEConfig's defaults then, fused_residuals "inputs"
# and exchange_programs 24. MoEOptions' "auto" may resolve otherwise (residuals "gate_up" on one
# H200 where they fit; exchange_programs from the exchange's tuning table).
RECORDED_FUSED_RESIDUALS: Residuals = "inputs"
RECORDED_EXCHANGE_PROGRAMS = 24
# The fused kernels' copy programs over the H200's streaming multiprocessors (132).
H200_SMS = 132
DEFAULT_COMM_SM_SHARE: float = RECORDED_EXCHANGE_PROGRAMS / H200_SMS


BF16_BYTES = 2.0
F32_BYTES = 4.0
# MXFP8: one 8-bit element plus one 8-bit (E8M0) scale per block of 32 elements (OCP
# Microscaling Formats (MX) v1.0).
MXFP8_BYTES = 1.0 + 1.0 / 32.0

SOURCES = {
    "h200_peak": (
        "H200 SXM: 1,979 TFLOP/s BF16 and 3,958 FP8 with 2:4 sparsity, half that dense; HBM3e "
        "4.8 TB/s (NVIDIA's figures as quoted by https://lzwjava.github.io/nvidia-h200-gpu-"
        "specs-en, which marks the FP8 figure as 'with sparsity', and https://ai-hpc.github.io/"
        "ai-hardware-engineer-roadmap/, which gives 4.8 TB/s)"
    ),
    "h200_link": (
        "two H200s linked by NV18: 18 NVLinks of 26.562 GB/s = 478 GB/s per direction "
        "(bench/results/multi_gpu_h200x2/topology.txt, nvidia-smi)"
    ),
    "gb300": (
        "GB300 NVL72 (Blackwell Ultra), per GPU dense: BF16 2.5 PFLOP/s, FP8 5 PFLOP/s, HBM3e "
        "8 TB/s, NVLink 5 1.8 TB/s total = 900 GB/s per direction (https://verda.com/blog/"
        "gb300-nvl72-architecture, 'numbers without sparsity'); the rack's 180 PF BF16 / 360 PF "
        "FP8 dense, 576 TB/s HBM and 130 TB/s NVLink over 72 GPUs give the same "
        "(https://glennklockwood.com/garden/processors/B300 quotes the rack's FP8, HBM and "
        "NVLink figures). NVIDIA's own spec page was not in the searchable corpus."
    ),
    "mok": (
        "MoK (Cursor's Mixture-of-Kittens) on one GB300 NVL72: up to 2.37x (MXFP8 forward), "
        "1.78x (MXFP8 backward), 1.92x / 1.58x (BF16 forward / backward) over the fastest of "
        "DeepEP + PyTorch, DeepEP + Transformer Engine, NCCL + PyTorch and HybridEP + Megatron "
        "(as quoted in DESIGN.md)"
    ),
}

ASSUMPTIONS = {
    "collective_latency": (
        "10 us per collective or ring hop (launch and synchronization), on both machines: "
        "not measured here (the two-H200 bandwidth rows are at one size only)"
    ),
    "comm_sm_share": (
        "the fused kernels' copy programs hold their SMs for the whole kernel: 24 of the "
        "H200's 132 (MoEOptions.exchange_programs), s = 0.18, and the same share on the GB300; "
        "the routed GEMMs run on the rest, and the row-side memory passes (XLA kernels) do not "
        "overlap the transfer. On one H200 (a 1-device mesh, 16384 tokens of qwen3) the "
        "forward's two overlapped kernels took 2.82 ms against the bare GEMMs' 1.97: this "
        "rule gives 2.41 (bench/results/2026-12-01_exchange_fwd_bwd_h200/)"
    ),
    "efficiency_transfer": (
        "the GB300 reaches the same fractions of its published peaks (GEMM, HBM) as the fused "
        "layer reached on the H200, and FP8 GEMMs the same fraction of the FP8 peak as BF16"
    ),
    "link_fraction": (
        "GB300 link fraction: 0.28 as XLA's dense all_to_all reached on two H200s (measured "
        "here), and 0.80 as an assumed well-tuned exchange; which one a fused kernel reaches "
        "on NVLink 5 is not known"
    ),
    "imbalance": (
        "rho = 1 in the main tables (uniform random routing gives slightly more: "
        "uniform_imbalance, a normal approximation); rho > 1 in the sensitivity table"
    ),
    "fp8": (
        "MXFP8: dispatched rows and the GEMMs' weights and activations in MXFP8 (1 + 1/32 "
        "bytes), returned rows and the combine in BF16, one quantization pass (read BF16, "
        "write MXFP8) per GEMM input the layer produces"
    ),
    "padding": (
        "each expert group (each (source, expert) chunk in the ring) is padded to whole tiles "
        f"of row_tile = {DEFAULT_ROW_TILE} rows (MoEConfig's default), half a tile "
        "on average"
    ),
    "fused_tiles": (
        "the fused kernel cuts tiles over the receive buffer in (source, position) order, so "
        "it computes whole expert groups like ragged_all_to_all, and starts a tile once its "
        "rows have arrived: one tile's dispatch before the first GEMM and one tile's return "
        "after the last are not hidden. Every transfer is modelled overlapped; the kernels "
        "overlap the forward's dispatch and return, the backward's dispatch of x and dy (one "
        "kernel) and its dx return with the routing weights' gradient (one kernel)"
    ),
    "backward_transfer": (
        "the backward sends the x rows out again, then dy, and gets dx back (3 transfers a "
        "round): mok_jax/routed.py's backward recomputes each round's forward under jax.vjp, "
        "and the fused implementation keeps the tokens, not the received rows (it sends x with "
        "dy rounded, in one kernel, and forms dy times the routing weight at the receiver, "
        "rather than sending that product as a third row array); the re-run forward's "
        "outputs are read by nothing, dead code that XLA drops, and are not modelled"
    ),
    "same_compute": (
        "every exchange gets the fused implementation's single-GPU compute (its GEMM passes); "
        "at the rack, fused_residuals 'inputs': under a mesh every implementation recomputes "
        "gate and up in the backward (8 passes; 'gate_up', the faster on one H200, applies "
        "only without a mesh); the tables isolate the exchange"
    ),
    "rounds": (
        "rounds = ceil(rho / buffer_factor) for every exchange (the ring's count follows its "
        "largest (source, destination) block, so this is a lower bound there); fused's "
        "kernels run a round at a time, each round exposing its first tile's arrival and its "
        "last tile's return"
    ),
    "ring_bytes": (
        "the ring's ppermute moves fixed-shape chunks of buffer_factor x the balanced rows "
        "per hop (mok_jax/layer.py: _buffer_rows), a ragged collective and the fused kernel "
        "move only the rows"
    ),
}


def _number(name: str, value, lo: float, hi: float = math.inf, *, open_lo: bool = False):
    """Raises ValueError unless `value` is a finite number in [lo, hi] ((lo, hi] if open_lo)."""
    ok = isinstance(value, (int, float)) and math.isfinite(value) and lo <= value <= hi
    if not ok or (open_lo and value == lo):
        raise ValueError(f"{name}={value!r} must be a finite number in {'(' if open_lo else '['}"
                         f"{lo}, {hi}]")  # fmt: skip


def _count(name: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


# --- inputs -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """One GPU and its link to the others of its NVLink domain: published peaks (TFLOP/s, TB/s,
    GB/s per direction) and the shares of them reached (efficiencies in (0, 1])."""

    name: str
    peak_tflops_bf16: float  # dense
    peak_tflops_fp8: float | None  # dense; None where the GPU has none
    gemm_efficiency: float = 1.0  # the forward grouped GEMMs'
    gemm_efficiency_bwd: float = 1.0  # the backward's (dgrad and wgrad)
    hbm_tbps: float
    hbm_efficiency: float = 1.0  # the memory-bound passes' (gathers, permutations, elementwise)
    stream_efficiency: float = 1.0  # a GEMM streaming its weights (a plain copy's)
    link_gbps: float  # out of (and into) one GPU, per direction
    link_efficiency: float = 1.0  # an exchange's
    collective_latency_us: float = 0.0  # fixed cost of one collective or ring hop
    chunk_overhead_us: float = 0.0  # one token chunk of the token-wise loops per direction

    def __post_init__(self):
        for name in ("peak_tflops_bf16", "peak_tflops_fp8", "hbm_tbps", "link_gbps"):
            if getattr(self, name) is not None:
                _number(name, getattr(self, name), 0, open_lo=True)
        for name in ("gemm_efficiency", "gemm_efficiency_bwd", "hbm_efficiency",
                     "stream_efficiency", "link_efficiency"):  # fmt: skip
            _number(name, getattr(self, name), 0, 1, open_lo=True)
        for name in ("collective_latency_us", "chunk_overhead_us"):
            _number(name, getattr(self, name), 0)

    def gemm_flops_per_s(self, dtype: Dtype, direction: Direction) -> float:
        """Achieved grouped-GEMM rate, FLOP/s."""
        peak = self.peak_tflops_bf16 if dtype == "bf16" else self.peak_tflops_fp8
        if peak is None:
            raise ValueError(f"{self.name} has no {dtype} rate (peak_tflops_fp8=None)")
        eff = self.gemm_efficiency if direction == "forward" else self.gemm_efficiency_bwd
        return peak * 1e12 * eff

    hbm_bytes_per_s = property(lambda self: self.hbm_tbps * 1e12 * self.hbm_efficiency)
    stream_bytes_per_s = property(lambda self: self.hbm_tbps * 1e12 * self.stream_efficiency)
    link_bytes_per_s = property(lambda self: self.link_gbps * 1e9 * self.link_efficiency)
    latency_s = property(lambda self: self.collective_latency_us * 1e-6)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerShape:
    """The MoE layer per device (mok_jax/config.py's vocabulary: T tokens a device, D, F, E, K,
    S shared experts of width F each); expert groups are padded to whole `row_tile`s."""

    name: str
    tokens: int
    d_model: int
    d_ff: int
    num_experts: int
    top_k: int
    num_shared_experts: int = 0
    row_tile: int = DEFAULT_ROW_TILE

    def __post_init__(self):
        for name in ("tokens", "d_model", "d_ff", "num_experts", "top_k", "row_tile"):
            _count(name, getattr(self, name))
        _count("num_shared_experts", self.num_shared_experts, minimum=0)
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be <= num_experts={self.num_experts}")

    @classmethod
    def from_config(cls, name: str, cfg: MoEConfig, tokens: int) -> LayerShape:
        """The dimensions of `cfg` (e.g. `mok_jax.presets[...]`) at `tokens` tokens a device."""
        fields = ("d_model", "d_ff", "num_experts", "top_k", "num_shared_experts", "row_tile")
        return cls(name=name, tokens=tokens, **{f: getattr(cfg, f) for f in fields})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """The devices: `data` replicas of an `expert`-parallel group of EP devices."""

    data: int = 1
    expert: int = 1

    def __post_init__(self):
        _count("data", self.data)
        _count("expert", self.expert)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """One layer call. imbalance: rho, the busiest device's received rows over the mean (1 at
    EP 1). token_chunk: MoEOptions.token_chunk (None: 8 * row_tile, the measured runs' default;
    "auto" is 2048 on a GPU). fused_residuals: MoEOptions.residuals ("inputs": the backward
    recomputes gate and up, 2 more GEMM passes; the measured runs' default)."""

    shape: LayerShape
    layout: Layout = dataclasses.field(default_factory=Layout)
    dtype: Dtype = "bf16"
    imbalance: float = 1.0
    token_chunk: int | None = None
    fused_residuals: Residuals = RECORDED_FUSED_RESIDUALS

    def __post_init__(self):
        ep = self.layout.expert
        if self.shape.num_experts % ep:
            raise ValueError(
                f"num_experts={self.shape.num_experts} must divide by the expert axis ({ep})"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {DTYPES}")
        if self.fused_residuals not in RESIDUALS:
            raise ValueError(f"fused_residuals={self.fused_residuals!r} must be in {RESIDUALS}")
        if self.token_chunk is not None:
            _count("token_chunk", self.token_chunk)
        _number("imbalance", self.imbalance, 1, ep)

    ep = property(lambda self: self.layout.expert)
    local_experts = property(lambda self: self.shape.num_experts // self.ep)

    @property
    def chunk(self) -> int:
        """C, tokens a step of the token-wise loops (the library's rule for None)."""
        return tiles.token_chunk(self.token_chunk, self.shape.row_tile)

    @property
    def chunk_steps(self) -> int:
        """Steps of one token-wise loop: T padded to whole chunks, at least tiles.MIN_STEPS
        (mok_jax/tiles.py: _token_chunks)."""
        return max(math.ceil(self.shape.tokens / self.chunk), tiles.MIN_STEPS)

    @property
    def padded_tokens(self) -> int:
        """Tokens the token-wise loops (route, shared experts) compute on, padding included."""
        return self.chunk_steps * self.chunk


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExchangeConfig:
    """How the exchanges run. buffer_factor: the receive buffer (and ring chunk) over the
    balanced load (MoEConfig's): rho beyond it costs rounds. comm_sm_share: the SMs the fused
    kernels' copy programs hold, in [0, 1). a2a_bytes_factor: ragged_all_to_all's time over
    the rows' bytes at the link's rate (1: ideal; XLA's took 2.15x the dense all_to_all's on
    two H200s)."""

    buffer_factor: float = DEFAULT_BUFFER_FACTOR
    comm_sm_share: float = DEFAULT_COMM_SM_SHARE
    a2a_bytes_factor: float = 1.0

    def __post_init__(self):
        _number("buffer_factor", self.buffer_factor, 0, open_lo=True)
        _number("comm_sm_share", self.comm_sm_share, 0, 1)
        if self.comm_sm_share == 1:
            raise ValueError("comm_sm_share=1 leaves no SM to the GEMMs: it must be < 1")
        _number("a2a_bytes_factor", self.a2a_bytes_factor, 1)


# --- outputs ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Components:
    """Where one direction's time goes, seconds. total = gemm + memory + overhead +
    exposed_transfer; transfer is how long the busiest link is busy (hidden or not)."""

    gemm: float
    memory: float
    overhead: float
    transfer: float
    exposed_transfer: float

    @property
    def total(self) -> float:
        return self.gemm + self.memory + self.overhead + self.exposed_transfer

    def as_ms(self) -> dict[str, float]:
        names = ("gemm", "memory", "overhead", "transfer", "exposed_transfer", "total")
        return {name: 1e3 * getattr(self, name) for name in names}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prediction:
    exchange: Exchange
    forward: Components
    backward: Components

    @property
    def total(self) -> float:
        return self.forward.total + self.backward.total


# --- what the layer does: FLOPs and bytes ---------------------------------------------------


def activation_bytes(dtype: Dtype) -> float:
    """Bytes per element of what the GEMMs read and the dispatch moves."""
    return BF16_BYTES if dtype == "bf16" else MXFP8_BYTES


def padded_rows(rows: float, groups: int, row_tile: int) -> float:
    """Rows after padding each of `groups` groups to whole tiles: half a tile a group on
    average, at least one tile a group."""
    return groups * row_tile * max(1.0, rows / (groups * row_tile) + 0.5)


def swiglu_passes(residuals: Residuals, direction: Direction) -> int:
    """[rows, D] x [D, F] GEMM passes of a SwiGLU: gate, up, down forward; dgrad and wgrad of
    each backward, plus gate and up again when the backward recomputes them ("inputs")."""
    if direction == "forward":
        return 3
    return 6 + (2 if residuals == "inputs" else 0)


def token_gemm_flops(w: Workload, direction: Direction) -> float:
    """Router and shared-expert GEMM FLOPs (token-side, not scaled by rho), on the token-wise
    loops' padded tokens. The router: 1 pass forward, dgrad and wgrad backward; the shared
    experts' backward recomputes gate and up (mok_jax/tiles.py: _token_swiglu_bwd)."""
    s, t = w.shape, w.padded_tokens
    router = 2.0 * t * s.d_model * s.num_experts * (1 if direction == "forward" else 2)
    shared_pass = 2.0 * t * s.d_model * s.num_shared_experts * s.d_ff
    return router + shared_pass * swiglu_passes("inputs", direction)


def routed_gemm_flops(w: Workload, direction: Direction, chunks_per_expert: int = 1) -> float:
    """Routed-expert GEMM FLOPs on the busiest device, padded tiles included; the ring splits
    each expert's rows into one chunk per source."""
    s = w.shape
    rows = w.imbalance * s.tokens * s.top_k
    rows = padded_rows(rows, w.local_experts * chunks_per_expert, s.row_tile)
    return 2.0 * rows * s.d_model * s.d_ff * swiglu_passes(w.fused_residuals, direction)


def weight_bytes(w: Workload, direction: Direction) -> float:
    """HBM bytes of the local experts' weights for one grouped GEMM over all of them: read
    once forward; backward read for dgrad (and for the recomputation of gate and up) and
    the gradients written in BF16 (the parameters' dtype in the benchmarks)."""
    s, e = w.shape, activation_bytes(w.dtype)
    per_matrix = w.local_experts * s.d_model * s.d_ff
    if direction == "forward":
        return 3 * per_matrix * e
    recompute = 2 * per_matrix * e if w.fused_residuals == "inputs" else 0.0
    return 3 * per_matrix * (e + BF16_BYTES) + recompute


def token_memory_bytes(w: Workload, direction: Direction) -> float:
    """HBM bytes of the token-side passes: route (read x, write and read the [T, E] f32
    scores, on the padded tokens), the sorted row copy (read a BF16 row, write it in the
    activation dtype: with MXFP8 this copy is the quantization pass), the combine (read K
    rows, write a token); backward the same passes on the gradients."""
    s, e = w.shape, activation_bytes(w.dtype)
    t, d, k = s.tokens, s.d_model, s.top_k
    route = w.padded_tokens * (d * BF16_BYTES + 2 * s.num_experts * F32_BYTES)
    rows = t * k * d * (BF16_BYTES + e)
    combine = t * k * d * BF16_BYTES + t * d * BF16_BYTES
    return route + rows + combine


def row_memory_bytes(w: Workload, direction: Direction) -> float:
    """HBM bytes of the row-side passes on the busiest device (scale with rho): h written and
    read, y written; backward the saved rows, dh, d(gate, up) and dx rows; gate and up
    written and read again (recomputed or kept); MXFP8 quantization passes."""
    s = w.shape
    rows = w.imbalance * s.tokens * s.top_k
    d, f, e = s.d_model, s.d_ff, activation_bytes(w.dtype)
    if direction == "forward":
        per_row = 2 * f * BF16_BYTES + d * BF16_BYTES
        per_row += 2 * f * BF16_BYTES if w.fused_residuals == "gate_up" else 0.0
        per_row += f * (BF16_BYTES + e) if w.dtype == "fp8" else 0.0
    else:
        per_row = 2 * d * e + 2 * f * BF16_BYTES  # x and dy rows; gate and up (either way)
        per_row += 2 * f * BF16_BYTES + 2 * 2 * f * BF16_BYTES  # dh; d(gate, up)
        per_row += d * BF16_BYTES  # dx rows
        per_row += (2 * d + 5 * f) * (BF16_BYTES + e) if w.dtype == "fp8" else 0.0
    return rows * per_row


def weight_quantize_ms(hw: Hardware, layout: Layout, shape: LayerShape) -> float:
    """MXFP8 only, once a step, outside the layer's time (with the optimizer's update): the
    local experts' weights read in BF16 and written in MXFP8 twice (the copy the forward
    reads, the transposed one the backward's dgrad reads), at a copy's bandwidth, ms."""
    matrices = 3 * (shape.num_experts // layout.expert) * shape.d_model * shape.d_ff
    return 1e3 * 2 * matrices * (BF16_BYTES + MXFP8_BYTES) / hw.stream_bytes_per_s


def token_chunks(w: Workload) -> int:
    """Loop steps of the token-wise stages per direction (the fitted overhead's unit)."""
    return w.chunk_steps


def exchange_bytes(w: Workload, direction: Direction) -> tuple[float, float]:
    """(dispatch, return): bytes one device sends to the others at the balanced load, per
    direction. Forward: x rows out, y rows back. Backward: x rows out again, dy rows out, dx
    rows back: mok_jax/routed.py's backward recomputes each round's forward under jax.vjp
    (its dispatch included), and the fused implementation keeps the tokens, not the rows (it
    forms dy times the routing weight at the receiver, so dy crosses once)."""
    s = w.shape
    remote_rows = s.tokens * s.top_k * (w.ep - 1) / w.ep
    row_out = remote_rows * s.d_model * activation_bytes(w.dtype)
    outbound = 1 if direction == "forward" else 2
    return outbound * row_out, remote_rows * s.d_model * BF16_BYTES


def collectives(direction: Direction) -> int:
    """Collectives (or ring transfers) per round and direction: x out and y back forward; x
    out, dy out and dx back backward (see exchange_bytes)."""
    return 2 if direction == "forward" else 3


# --- time ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Compute:
    """Token-side and row-side (routed, rho-scaled, overlappable) compute, seconds."""

    token_gemm: float
    token_memory: float
    overhead: float
    row_gemm: float
    row_memory: float

    @property
    def row(self) -> float:
        return self.row_gemm + self.row_memory


def compute(hw: Hardware, w: Workload, direction: Direction, chunks: int = 1) -> _Compute:
    """The compute of one direction; `chunks` grouped GEMMs (one per ring hop) each stream
    every local expert's weights. The routed GEMMs' roofline: their FLOPs at the achieved rate
    or their weights streamed at a copy's bandwidth, whichever is longer."""
    rate, hbm = hw.gemm_flops_per_s(w.dtype, direction), hw.hbm_bytes_per_s
    streamed = chunks * weight_bytes(w, direction) / hw.stream_bytes_per_s
    return _Compute(
        token_gemm=token_gemm_flops(w, direction) / rate,
        token_memory=token_memory_bytes(w, direction) / hbm,
        overhead=token_chunks(w) * hw.chunk_overhead_us * 1e-6,
        row_gemm=max(routed_gemm_flops(w, direction, chunks) / rate, streamed),
        row_memory=row_memory_bytes(w, direction) / hbm,
    )


def _components(c: _Compute, transfer: float, exposed: float) -> Components:
    return Components(gemm=c.token_gemm + c.row_gemm, memory=c.token_memory + c.row_memory,
                      overhead=c.overhead, transfer=transfer, exposed_transfer=exposed)  # fmt: skip


def rounds(w: Workload, cfg: ExchangeConfig) -> int:
    """Rounds of the windowed exchange: rho beyond the buffer costs another round."""
    return max(1, math.ceil(w.imbalance / cfg.buffer_factor - 1e-12))


def ragged_all_to_all(hw, w: Workload, cfg: ExchangeConfig, direction: Direction):
    """Dispatch, experts, return, one after the other, `rounds` times over."""
    c = compute(hw, w, direction)
    if w.ep == 1:
        return _components(c, 0.0, 0.0)
    dispatch, back = exchange_bytes(w, direction)
    link = w.imbalance * (dispatch + back) * cfg.a2a_bytes_factor / hw.link_bytes_per_s
    latency = rounds(w, cfg) * collectives(direction) * hw.latency_s
    return _components(c, link, link + latency)


def ring(hw, w: Workload, cfg: ExchangeConfig, direction: Direction):
    """EP-1 hops; hop h carries my chunk for me+h and the results of the chunk from me-h
    back, while the chunk of the hop before is computed; the last return is not hidden."""
    c = compute(hw, w, direction, chunks=w.ep)
    if w.ep == 1:
        return _components(c, 0.0, 0.0)
    dispatch, back = exchange_bytes(w, direction)
    n, lat = rounds(w, cfg), hw.latency_s
    padded = ring_chunk_factor(w, cfg) * n  # bytes moved over the balanced rows' bytes
    per_hop = padded / (w.ep - 1)
    hop = per_hop * (dispatch + back) / hw.link_bytes_per_s + n * collectives(direction) * lat
    tail = per_hop * back / hw.link_bytes_per_s + n * lat
    chunk = c.row / w.ep
    routed = chunk + (w.ep - 1) * max(chunk, hop) + tail
    link = padded * (dispatch + back) / hw.link_bytes_per_s
    return _components(c, link, routed - c.row)


def ring_chunk_factor(w: Workload, cfg: ExchangeConfig) -> float:
    """The ring's fixed-shape chunk over the balanced (source, destination) block:
    buffer_factor, capped where one source cannot send more (mok_jax/layer.py's
    _buffer_rows: min(buffer_factor * N / EP, T * min(K, G)) rows, N = T * K)."""
    s = w.shape
    return min(cfg.buffer_factor, w.ep * min(s.top_k, w.local_experts) / s.top_k)


def fused(hw, w: Workload, cfg: ExchangeConfig, direction: Direction):
    """Rows move tile by tile from inside the routed GEMMs' kernels while the other SMs run
    the GEMMs on arrived tiles: the busiest link's time and those GEMMs (on 1 - s of the
    SMs) overlap, but for each round's first tile's arrival and last tile's return (the
    kernels run a round at a time, `rounds`); the row-side memory passes run outside the
    kernels."""
    c = compute(hw, w, direction)
    if w.ep == 1:
        return _components(c, 0.0, 0.0)
    dispatch, back = exchange_bytes(w, direction)
    rho = w.imbalance
    # Busiest direction of the busiest device's link: it receives rho x the dispatch and
    # sends rho x the returns, while sending its own rows and receiving its own results.
    link = max(rho * dispatch + back, dispatch + rho * back) / hw.link_bytes_per_s
    rows = w.shape.tokens * w.shape.top_k * (w.ep - 1) / w.ep
    tile = min(1.0, w.shape.row_tile / rows)
    fill = tile * dispatch / hw.link_bytes_per_s + hw.latency_s
    drain = tile * back / hw.link_bytes_per_s + hw.latency_s
    n = rounds(w, cfg)
    body = link - n * (fill + drain - 2 * hw.latency_s)
    gemms = c.row_gemm / (1 - cfg.comm_sm_share)
    routed = n * (fill + drain) + max(gemms, body) + c.row_memory
    return _components(c, link, routed - c.row)


EXCHANGE_FNS = {"ragged_all_to_all": ragged_all_to_all, "ring": ring, "fused": fused}


def predict(hw: Hardware, w: Workload, exchange: Exchange, cfg: ExchangeConfig) -> Prediction:
    """Forward and backward time of one layer call on the busiest device."""
    if exchange not in EXCHANGE_FNS:
        raise ValueError(f"exchange={exchange!r} must be one of {EXCHANGES}")
    fn = EXCHANGE_FNS[exchange]
    return Prediction(exchange=exchange, forward=fn(hw, w, cfg, "forward"),
                      backward=fn(hw, w, cfg, "backward"))  # fmt: skip


# --- calibration on one H200 ----------------------------------------------------------------

PRODUCT_DIRECTIONS: dict[str, tuple[Direction, ...]] = {
    "forward": ("forward",),
    "fwd_bwd": ("forward", "backward"),
}

H200_PUBLISHED = dict(
    name="H200",
    peak_tflops_bf16=989.5,  # 1,979 with sparsity (SOURCES["h200_peak"])
    peak_tflops_fp8=1979.0,  # 3,958 with sparsity
    hbm_tbps=4.8,
    stream_efficiency=3.8 / 4.8,  # DESIGN.md: an elementwise copy measured 3.8 TB/s
    link_gbps=18 * 26.562,  # NV18 (SOURCES["h200_link"])
    collective_latency_us=10.0,  # ASSUMPTIONS["collective_latency"]
)
GB300_PUBLISHED = dict(
    name="GB300 (NVL72)",
    peak_tflops_bf16=2500.0,  # SOURCES["gb300"]
    peak_tflops_fp8=5000.0,
    hbm_tbps=8.0,
    link_gbps=900.0,  # 1.8 TB/s both directions
    collective_latency_us=10.0,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measured:
    """One measured time of the `fused` layer on one H200."""

    run: str
    product: str
    workload: Workload
    ms: float

    @property
    def label(self) -> str:
        w = self.workload
        return f"{w.shape.name} {self.product} ({w.fused_residuals}, chunk {w.chunk})"


def _layer_shape(record: dict) -> LayerShape:
    """A results file's shape: its mok_jax preset, with its expert count where it sets one
    (bench/moe_layer.py: LayerShape.config)."""
    cfg = mok_jax.presets[record["preset"]]
    if record.get("num_experts") is not None:
        cfg = dataclasses.replace(cfg, num_experts=record["num_experts"])
    return LayerShape.from_config(record["name"], cfg, record["tokens"])


def load_layer_measurements(path: pathlib.Path = LAYER_RESULTS) -> list[Measured]:
    """Every timed `fused` candidate of bench/results/moe_layer_h200.json (each run's own
    median, not the paired ones); checks the file's GEMM FLOPs against the model's count."""
    points = []
    for run_name, run in json.loads(path.read_text())["runs"].items():
        options = run["args"].get("fused_options") or {}
        for entry in run["shapes"]:
            shape = _layer_shape(entry["shape"])
            for product, record in entry["products"].items():
                fused_rows = [c for c in record["candidates"] if c["key"] == "fused"]
                ms = fused_rows[0].get("timing", {}).get("median_ms") if fused_rows else None
                if ms is None or not math.isfinite(ms):
                    continue
                w = Workload(shape=shape, **_fused_options(options))
                _check_flops(w, record["gemm_flops"], product)
                points.append(Measured(run=run_name, product=product, workload=w, ms=ms))
    if not points:
        raise ValueError(f"no timed fused layer in {path}")
    return points


def _fused_options(options: dict) -> dict:
    """The Workload fields a run's `fused_options` set (MoEConfig's field names of then; the
    runs predate MoEOptions); the rest stay the Workload's defaults, the runs' defaults."""
    return {k: options[k] for k in ("token_chunk", "fused_residuals") if k in options}


def _check_flops(w: Workload, flops: float, product: str) -> None:
    s = w.shape
    ours = 2.0 * s.tokens * s.top_k * s.d_model * s.d_ff * 3
    if product == "forward" and not math.isclose(ours, flops, rel_tol=1e-9):
        raise ValueError(f"{s.name}: the file counts {flops:.4g} forward GEMM FLOPs, we {ours:.4g}")


def _features(w: Workload, product: str, hw: Hardware) -> np.ndarray:
    """Seconds at the published peaks: forward GEMMs, backward GEMMs, memory passes, and the
    token chunks (per microsecond of chunk overhead); the time is their dot with
    (1/eta_gemm, 1/eta_gemm_bwd, 1/eta_hbm, c_chunk in us)."""
    out = np.zeros(4)
    for direction in PRODUCT_DIRECTIONS[product]:
        flops = token_gemm_flops(w, direction) + routed_gemm_flops(w, direction)
        peak = hw.peak_tflops_bf16 * 1e12
        out[0 if direction == "forward" else 1] += flops / peak
        memory = token_memory_bytes(w, direction) + row_memory_bytes(w, direction)
        out[2] += memory / (hw.hbm_tbps * 1e12)
        out[3] += token_chunks(w) * 1e-6
    return out


def calibrate(points: Sequence[Measured], published: dict = H200_PUBLISHED) -> Hardware:
    """Fits the H200's efficiencies and chunk overhead to the measured times: non-negative
    least squares on the relative error (each row divided by its measurement)."""
    base = Hardware(**published)
    a = np.stack([_features(p.workload, p.product, base) / (p.ms * 1e-3) for p in points])
    x, _ = optimize.nnls(a, np.ones(len(points)))
    if np.any(x[:3] <= 0):
        raise ValueError(f"calibration failed: a zero coefficient in {x} (too few points?)")
    return dataclasses.replace(base, gemm_efficiency=1 / x[0], gemm_efficiency_bwd=1 / x[1],
                               hbm_efficiency=1 / x[2], chunk_overhead_us=float(x[3]))  # fmt: skip


def model_ms(hw: Hardware, point: Measured) -> float:
    """The model's time of a single-GPU measurement (EP 1: every exchange is the same)."""
    p = predict(hw, point.workload, "fused", ExchangeConfig())
    return 1e3 * sum(getattr(p, d).total for d in PRODUCT_DIRECTIONS[point.product])


def calibration_rows(hw: Hardware, points: Sequence[Measured]) -> list[dict]:
    return [dict(run=p.run, point=p.label, measured_ms=p.ms, model_ms=model_ms(hw, p),
                 error=model_ms(hw, p) / p.ms - 1) for p in points]  # fmt: skip


# --- the check on two H200s -----------------------------------------------------------------


def _final_rows(path: pathlib.Path) -> list[dict]:
    """The rows of the runs with the final code: the results file's entries 3 (qwen3,
    bandwidth) and 4."""
    calls = json.loads(path.read_text())["calls"]
    return [row for c in calls if c["call"] in (3, 4) for row in c["result"]["rows"]]


def link_measurements(path: pathlib.Path = MULTI_GPU_RESULTS) -> dict[str, float]:
    """GB/s leaving each device, per collective, from the bandwidth rows."""
    rows = [r for r in _final_rows(path) if r["part"] == "bandwidth"]
    return {r["collective"]: r["gb_per_s_per_device"] for r in rows}


def ep2_check(hw: Hardware, path: pathlib.Path = MULTI_GPU_RESULTS) -> list[dict]:
    """Measured exchange time (forward+backward minus the same program with local copies
    instead of collectives) against the model's exposed transfer, at EP 2."""
    gbps = link_measurements(path)
    configs = {
        "ragged_all_to_all": (
            gbps["all_to_all"] / hw.link_gbps,
            ExchangeConfig(a2a_bytes_factor=gbps["all_to_all"] / gbps["ragged_all_to_all"]),
        ),
        "ring": (gbps["ppermute_one_hop"] / hw.link_gbps, ExchangeConfig()),
    }
    rows = [r for r in _final_rows(path) if r["part"] == "scaling" and "skipped" not in r]
    ep1_ms = {r["case"]: r["fwd_bwd_ms"] for r in rows if r["ep"] == 1}
    out = []
    for row in (r for r in rows if r["ep"] == 2):
        cfg = SCALING[row["case"]][0]  # bench/multi_gpu.py's case: its MoEConfig
        shape = LayerShape.from_config(row["case"], cfg, row["tokens_per_device"])
        w = Workload(shape=shape, layout=Layout(expert=2))
        fraction, cfg = configs[row["exchange"]]
        slow = _as_slow_as(hw, dataclasses.replace(w, layout=Layout()), ep1_ms[row["case"]])
        p = predict(dataclasses.replace(slow, link_efficiency=fraction), w, row["exchange"], cfg)
        out.append(dict(
            **_row_keys(row, "case", "tokens_per_device", "exchange"), link_fraction=fraction,
            measured_fwd_bwd_ms=row["fwd_bwd_ms"],
            measured_exchange_ms=row["fwd_bwd_ms"] - row["no_exchange_fwd_bwd_ms"],
            **_transfer_ms(p),
        ))  # fmt: skip
    return out


def _row_keys(row: dict, *keys: str) -> dict:
    return {k: row[k] for k in keys}


def _transfer_ms(p: Prediction) -> dict[str, float]:
    f, b = p.forward, p.backward
    return dict(model_transfer_ms=1e3 * (f.transfer + b.transfer),
                model_exposed_ms=1e3 * (f.exposed_transfer + b.exposed_transfer))  # fmt: skip


def fused_check(hw: Hardware, path: pathlib.Path = MULTI_GPU_RESULTS) -> list[dict]:
    """`fused`'s measured forward+backward on two H200s (its exchange in our own kernels; the
    scaling rows of run 3) against the model's, at the link fraction the dense all_to_all
    reached, and the link fraction at which the model would take the measured time."""
    calls = json.loads(path.read_text())["calls"]
    rows = [
        r
        for c in calls
        for r in c["result"]["rows"]
        if r["part"] == "scaling" and r.get("implementation") == "fused" and "fwd_bwd_ms" in r
    ]
    fraction = link_measurements(path)["all_to_all"] / hw.link_gbps
    out = []
    for row in rows:
        cfg = SCALING[row["case"]][0]
        shape = LayerShape.from_config(row["case"], cfg, row["tokens_per_device"])
        w = Workload(shape=shape, layout=Layout(expert=row["ep"]))
        ex = fused_exchange_config(row["exchange"])

        def model_ms(link_fraction: float, w: Workload = w, ex: ExchangeConfig = ex) -> float:
            hw_at = dataclasses.replace(hw, link_efficiency=link_fraction)
            return 1e3 * predict(hw_at, w, "fused", ex).total

        p = predict(dataclasses.replace(hw, link_efficiency=fraction), w, "fused", ex)
        measured = row["fwd_bwd_ms"]
        # The model's time falls as the link fraction grows: bisect for the measured time.
        lo, hi = 1e-4, 1.0
        implied = None
        if model_ms(lo) >= measured >= model_ms(hi):
            for _ in range(60):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if model_ms(mid) > measured else (lo, mid)
            implied = 0.5 * (lo + hi)
        out.append(dict(
            **_row_keys(row, "case", "tokens_per_device", "ep", "exchange"),
            link_fraction=fraction, measured_fwd_bwd_ms=measured, model_fwd_bwd_ms=1e3 * p.total,
            **_transfer_ms(p), implied_link_fraction=implied,
        ))  # fmt: skip
    return out


def fused_exchange_config(exchange: str) -> ExchangeConfig:
    """The exchange config of a measured `fused` row: "fused@P" ran P copy programs of the
    H200's SMs (bench/multi_gpu.py's label); plain "fused", the default."""
    _, _, programs = exchange.partition("@")
    if not programs:
        return ExchangeConfig()
    return ExchangeConfig(comm_sm_share=int(programs) / H200_SMS)


def _as_slow_as(hw: Hardware, w: Workload, fwd_bwd_ms: float) -> Hardware:
    """`hw` with its GEMM efficiencies scaled so that the model's forward+backward of `w`
    takes `fwd_bwd_ms` (the `xla` implementation's measured time at EP 1), so that the ring
    overlaps its hops with compute as slow as the measured one."""
    p = predict(hw, w, "fused", ExchangeConfig())
    gemm = p.forward.gemm + p.backward.gemm
    scale = gemm / (gemm + fwd_bwd_ms * 1e-3 - p.total)
    if not 0 < scale <= 1:
        raise ValueError(f"measured {fwd_bwd_ms} ms is faster than the model's {1e3 * p.total}")
    return dataclasses.replace(hw, gemm_efficiency=hw.gemm_efficiency * scale,
                               gemm_efficiency_bwd=hw.gemm_efficiency_bwd * scale)  # fmt: skip


# --- the rack -------------------------------------------------------------------------------

# MoK's benchmark layer: mok_jax's "mok_bench" preset at 2048 tokens per rank (DESIGN.md).
MOK_SHAPE = LayerShape.from_config("mok_bench", mok_jax.presets["mok_bench"], tokens=2048)
RACK_LAYOUTS = {"EP 64": Layout(data=1, expert=64), "9 x 8": Layout(data=9, expert=8)}
MOK_CLAIMS = {"fp8": (2.37, 1.78), "bf16": (1.92, 1.58)}  # (forward, backward), SOURCES["mok"]
ASSUMED_LINK_FRACTION = 0.8  # ASSUMPTIONS["link_fraction"]
# token_chunk 2048: the fastest on the H200 (MoEOptions' "auto" on a GPU). fused_residuals
# "inputs": under a mesh every implementation recomputes gate and up in the backward ("gate_up"
# applies only without one).
RACK_OPTIONS = dict(token_chunk=2048, fused_residuals="inputs")
IMBALANCES = (1.0, 1.25, 1.5, 2.0, 3.0)


def rack_hardware(h200: Hardware, link_fraction: float) -> Hardware:
    """The GB300 at the H200's fitted efficiencies (ASSUMPTIONS["efficiency_transfer"])."""
    kept = ("gemm_efficiency", "gemm_efficiency_bwd", "hbm_efficiency", "stream_efficiency",
            "chunk_overhead_us")  # fmt: skip
    return Hardware(**GB300_PUBLISHED, **{k: getattr(h200, k) for k in kept},
                    link_efficiency=link_fraction)  # fmt: skip


def rack_predictions(h200: Hardware, measured_fraction: float) -> list[dict]:
    rows = []
    for link, fraction in (("measured", measured_fraction), ("assumed", ASSUMED_LINK_FRACTION)):
        hw = rack_hardware(h200, fraction)
        for (name, layout), dtype, exchange in itertools.product(
            RACK_LAYOUTS.items(), DTYPES, EXCHANGES
        ):
            w = Workload(shape=MOK_SHAPE, layout=layout, dtype=dtype, **RACK_OPTIONS)
            p = predict(hw, w, exchange, ExchangeConfig())
            rows.append(dict(link=link, link_fraction=fraction, layout=name, dtype=dtype,
                             exchange=exchange, forward_ms=p.forward.as_ms(),
                             backward_ms=p.backward.as_ms()))  # fmt: skip
    return rows


def speedups(rows: Sequence[dict]) -> list[dict]:
    """Fused over the faster of ragged_all_to_all and ring, per direction."""
    out = []
    keys = sorted({(r["link"], r["layout"], r["dtype"]) for r in rows}, key=str)
    for key in keys:
        group = {r["exchange"]: r for r in rows if (r["link"], r["layout"], r["dtype"]) == key}
        entry = dict(link=key[0], link_fraction=group["fused"]["link_fraction"])
        entry.update(layout=key[1], dtype=key[2], mok_claim=MOK_CLAIMS[key[2]])
        for direction in DIRECTIONS:
            col = f"{direction}_ms"
            best = min(("ragged_all_to_all", "ring"), key=lambda e: group[e][col]["total"])
            fused_ms = group["fused"][col]["total"]
            other_ms = group[best][col]["total"]
            entry[direction] = dict(fused_ms=fused_ms, best_other=best, best_other_ms=other_ms,
                                    speedup=other_ms / fused_ms)  # fmt: skip
        out.append(entry)
    return out


def imbalance_sensitivity(h200: Hardware) -> list[dict]:
    """EP 64, BF16, the assumed link fraction: forward+backward per exchange against rho."""
    hw = rack_hardware(h200, ASSUMED_LINK_FRACTION)
    out = []
    for rho in IMBALANCES:
        w = Workload(shape=MOK_SHAPE, layout=RACK_LAYOUTS["EP 64"], imbalance=rho, **RACK_OPTIONS)
        totals = {e: 1e3 * predict(hw, w, e, ExchangeConfig()).total for e in EXCHANGES}
        out.append(dict(imbalance=rho, rounds=rounds(w, ExchangeConfig()), fwd_bwd_ms=totals))
    return out


def uniform_imbalance(shape: LayerShape, ep: int) -> float:
    """Expected max/mean load over EP devices under uniform random routing: each device's
    load is about normal with mean T*K and variance T*K*(EP-1)/EP (a binomial of the EP*T*K
    rows), and the largest of EP normals sits about sqrt(2 ln EP) deviations above the mean."""
    if ep == 1:
        return 1.0
    rows = shape.tokens * shape.top_k
    return 1.0 + math.sqrt(2 * math.log(ep)) * math.sqrt((ep - 1) / ep / rows)


def data_parallel_allreduce_ms(hw: Hardware, layout: Layout, shape: LayerShape) -> float:
    """Ring all-reduce of the local experts' BF16 weight gradients over the data axis, ms:
    once per step, outside the layer's forward and backward (not in the tables' times)."""
    if layout.data == 1:
        return 0.0
    grads = shape.num_experts // layout.expert * 3 * shape.d_model * shape.d_ff * BF16_BYTES
    return 1e3 * 2 * (layout.data - 1) / layout.data * grads / hw.link_bytes_per_s


# --- report ---------------------------------------------------------------------------------


def _hardware_dict(hw: Hardware) -> dict:
    return {
        k: (float(v) if isinstance(v, (float, np.floating)) else v)
        for k, v in dataclasses.asdict(hw).items()
    }


def _shown(path: pathlib.Path) -> str:
    """A path relative to the repository where it is inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def build_report(
    layer_results: pathlib.Path = LAYER_RESULTS, multi_gpu: pathlib.Path = MULTI_GPU_RESULTS
) -> dict:
    points = load_layer_measurements(layer_results)
    h200 = calibrate(points)
    calibration = calibration_rows(h200, points)
    errors = np.array([r["error"] for r in calibration])
    measured_fraction = link_measurements(multi_gpu)["all_to_all"] / h200.link_gbps
    rack = rack_predictions(h200, measured_fraction)
    allreduce = {
        f"{name}, link fraction {fraction:.2f}": data_parallel_allreduce_ms(
            rack_hardware(h200, fraction), layout, MOK_SHAPE
        )
        for name, layout in RACK_LAYOUTS.items()
        for fraction in (measured_fraction, ASSUMED_LINK_FRACTION)
    }
    quantize = {
        name: weight_quantize_ms(rack_hardware(h200, 1.0), layout, MOK_SHAPE)
        for name, layout in RACK_LAYOUTS.items()
    }
    g = dict(
        hardware=_hardware_dict(rack_hardware(h200, ASSUMED_LINK_FRACTION)),
        shape=dataclasses.asdict(MOK_SHAPE), options=RACK_OPTIONS,
        link_fractions=dict(measured=measured_fraction, assumed=ASSUMED_LINK_FRACTION),
        predictions=rack, speedups=speedups(rack), imbalance=imbalance_sensitivity(h200),
        uniform_imbalance={name: uniform_imbalance(MOK_SHAPE, layout.expert)
                           for name, layout in RACK_LAYOUTS.items()},
        expert_grad_allreduce_ms=allreduce, fp8_weight_quantize_ms=quantize,
    )  # fmt: skip
    report = dict(
        issue=7, inputs=dict(layer=_shown(layer_results), multi_gpu=_shown(multi_gpu)),
        h200=_hardware_dict(h200),
        calibration=dict(points=calibration, max_abs_error=float(np.max(np.abs(errors))),
                         rms_error=float(np.sqrt(np.mean(errors**2)))),
        ep2_check=ep2_check(h200, multi_gpu), fused_check=fused_check(h200, multi_gpu), gb300=g,
        exchange_config=dataclasses.asdict(ExchangeConfig()), sources=SOURCES,
        assumptions=ASSUMPTIONS,
    )  # fmt: skip
    return json.loads(json.dumps(report, default=float))


def _ms(x: float) -> str:
    return f"{x:.2f}"


def markdown_speedups(report: dict) -> list[str]:
    """The headline table: fused against the faster non-fused exchange, beside MoK's claims."""
    rows = []
    for s in report["gb300"]["speedups"]:
        f, b = s["forward"], s["backward"]
        rows.append([
            s["layout"], s["dtype"].upper(), f"{s['link']} {s['link_fraction']:.2f}",
            f"{_ms(f['fused_ms'])} / {_ms(f['best_other_ms'])} ({f['best_other']})",
            f"{f['speedup']:.2f}x", f"{_ms(b['fused_ms'])} / {_ms(b['best_other_ms'])}",
            f"{b['speedup']:.2f}x", f"{s['mok_claim'][0]}x / {s['mok_claim'][1]}x",
        ])  # fmt: skip
    header = ["layout", "dtype", "link fraction", "fwd ms: fused / best other", "fwd speedup",
              "bwd ms: fused / best other", "bwd speedup", "MoK claims fwd / bwd"]  # fmt: skip
    return table(header, rows)


def _md_calibration(report: dict, command: str) -> list[str]:
    h = report["h200"]
    cal = report["calibration"]
    out = [
        "# Rack performance model of the MoE layer",
        "",
        f"Command: `{command}` (CPU, no device). Inputs: `{report['inputs']['layer']}` (every "
        f"timed `fused` layer on one H200) and `{report['inputs']['multi_gpu']}` (two H200s). "
        "The model and its equations: `bench/rack_model.py`'s docstring.",
        "",
        "## Calibration on one H200",
        "",
        f"Fitted (non-negative least squares on the relative error, {len(cal['points'])} "
        f"points): forward grouped GEMMs at {h['gemm_efficiency']:.3f} of the dense BF16 peak "
        f"({h['gemm_efficiency'] * h['peak_tflops_bf16']:.0f} TFLOP/s), backward at "
        f"{h['gemm_efficiency_bwd']:.3f} ({h['gemm_efficiency_bwd'] * h['peak_tflops_bf16']:.0f}"
        f" TFLOP/s); memory-bound passes at {h['hbm_efficiency']:.3f} of 4.8 TB/s "
        f"({h['hbm_efficiency'] * h['hbm_tbps']:.2f} TB/s); {h['chunk_overhead_us']:.1f} us per "
        "token chunk per direction. Not fitted: weights stream at a copy's "
        f"{h['stream_efficiency'] * h['hbm_tbps']:.1f} TB/s (DESIGN.md). Error: max "
        f"{100 * cal['max_abs_error']:.1f}%, RMS {100 * cal['rms_error']:.1f}%.",
        "",
    ]
    rows = [[r["run"], r["point"], _ms(r["measured_ms"]), _ms(r["model_ms"]),
             f"{100 * r['error']:+.1f}%"] for r in cal["points"]]  # fmt: skip
    return out + table(["run", "point", "measured ms", "model ms", "error"], rows)


def _md_check(report: dict) -> list[str]:
    out = [
        "",
        "## Check on two H200s (EP 2)",
        "",
        "Measured: forward+backward of the `xla` implementation minus the same program with the "
        "collectives replaced by local copies (bench/results/multi_gpu_h200x2.md). Model: the "
        "exposed transfer of forward+backward, at the link fraction the collectives reached alone "
        "(dense all_to_all for ragged_all_to_all, times ragged_all_to_all's measured slowdown "
        "over it at equal bytes; one ppermute hop for the ring). What this checks: the transfer "
        "term and the ring's unhidden last hop, in absolute ms. What it cannot: the overlap "
        "of `fused` (the next table), and the compute terms (these rows are the slow `xla` "
        "implementation, 120-450 ms a step; the local copies that replace the collectives cost "
        "time too).",
        "",
    ]
    ms_keys = ("measured_fwd_bwd_ms", "measured_exchange_ms", "model_transfer_ms",
               "model_exposed_ms")  # fmt: skip
    rows = [[r["case"], r["tokens_per_device"], r["exchange"], f"{r['link_fraction']:.3f}",
             *(_ms(r[k]) for k in ms_keys)] for r in report["ep2_check"]]  # fmt: skip
    header = ["case", "tokens/device", "exchange", "link fraction", "measured fwd+bwd ms",
              "measured exchange ms", "model transfer ms", "model exposed ms"]  # fmt: skip
    out += table(header, rows)
    out += [
        "",
        "`fused`, its exchange in our own kernels (two H200s, run 3): the measured forward+backward"
        " (bench/multi_gpu.py's step) against the model's, at the dense all_to_all's link "
        "fraction, and the link fraction at which the model would take the measured time (the "
        "rate the exchange's copies would have reached if the model's other terms held).",
        "",
    ]
    ms_keys = ("measured_fwd_bwd_ms", "model_fwd_bwd_ms", "model_transfer_ms", "model_exposed_ms")
    rows = [[r["case"], r["tokens_per_device"], r["ep"], r["exchange"],
             f"{r['link_fraction']:.3f}", *(_ms(r[k]) for k in ms_keys),
             "-" if r["implied_link_fraction"] is None else f"{r['implied_link_fraction']:.3f}"]
            for r in report["fused_check"]]  # fmt: skip
    out += table(["case", "tokens/device", "EP", "exchange", "link fraction",
                   "measured fwd+bwd ms", "model fwd+bwd ms", "model transfer ms",
                   "model exposed ms", "implied link fraction"], rows)  # fmt: skip
    return out


def _md_rack(report: dict) -> list[str]:
    g = report["gb300"]
    shape = g["shape"]
    out = [
        "",
        "## GB300 NVL72 at MoK's shape",
        "",
        f"T {shape['tokens']} tokens per GPU, D {shape['d_model']}, F {shape['d_ff']}, "
        f"{shape['num_experts']} experts, top-{shape['top_k']}; rho 1; "
        f"token_chunk {g['options']['token_chunk']}, fused_residuals "
        f"{g['options']['fused_residuals']} (token_chunk the fastest on the H200; gate and up "
        "recomputed, as every implementation does under a mesh); EP 64 (64 of the "
        "72 GPUs) and 9 x 8 (data 9 x expert 8). Fused speedup = the faster of "
        "ragged_all_to_all and ring over fused. MoK's claims are over other libraries "
        "(DeepEP, Transformer Engine, NCCL, HybridEP), not over our exchanges: the columns "
        "sit side by side, they do not measure the same thing.",
        "",
    ]
    out += markdown_speedups(report)
    out += ["", "Where the time goes (ms; exposed = transfer not hidden by compute):", ""]
    parts = ("gemm", "memory", "transfer", "exposed", "total")
    header = [
        "link",
        "layout",
        "dtype",
        "exchange",
        *(f"{d} {k}" for d in ("fwd", "bwd") for k in parts),
    ]
    keys = ("gemm", "memory", "transfer", "exposed_transfer", "total")
    rows = [[f"{r['link']} {r['link_fraction']:.2f}", r["layout"], r["dtype"].upper(),
             r["exchange"], *(_ms(r[f"{d}_ms"][k]) for d in ("forward", "backward") for k in keys)]
            for r in g["predictions"]]  # fmt: skip
    out += table(header, rows)
    return out


def _md_extras(report: dict) -> list[str]:
    g = report["gb300"]
    uniform = ", ".join(f"{k} {v:.3f}" for k, v in g["uniform_imbalance"].items())
    out = [
        "",
        f"Imbalance (EP 64, BF16, link fraction {ASSUMED_LINK_FRACTION}), forward+backward ms; "
        f"uniform random routing would give rho about {uniform}:",
        "",
    ]
    factor = report["exchange_config"]["buffer_factor"]
    rows = [[r["imbalance"], r["rounds"], *(_ms(r["fwd_bwd_ms"][e]) for e in EXCHANGES)]
            for r in g["imbalance"]]  # fmt: skip
    out += table(["rho", f"rounds (buffer_factor {factor:g})", *EXCHANGES], rows)
    allreduce = ", ".join(f"{k} {_ms(v)} ms" for k, v in g["expert_grad_allreduce_ms"].items() if v)
    quantize = ", ".join(f"{k} {_ms(v)} ms" for k, v in g["fp8_weight_quantize_ms"].items())
    dp = RACK_LAYOUTS["9 x 8"]
    out += [
        "",
        "Once a step, outside the layer's forward and backward (not in the tables): the 9 x 8 "
        f"layout all-reduces its {g['shape']['num_experts'] // dp.expert} experts' BF16 weight "
        f"gradients over the {dp.data} replicas (ring "
        f"all-reduce: {allreduce}); MXFP8 quantizes the local experts' weights twice "
        f"(forward copy and transposed copy: {quantize}).",
        "",
    ]
    out += ["## Sources", ""] + [f"- {k}: {v}" for k, v in report["sources"].items()]
    out += ["", "## Assumptions", ""] + [f"- {k}: {v}" for k, v in report["assumptions"].items()]
    return out


def markdown(report: dict, command: str) -> str:
    """The report as markdown: calibration, EP-2 check, GB300 tables, sources, assumptions."""
    out = _md_calibration(report, command) + _md_check(report)
    out += _md_rack(report) + _md_extras(report)
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, help="folder for rack_model.{json,md}")
    parser.add_argument("--layer-results", type=pathlib.Path, default=LAYER_RESULTS)
    parser.add_argument("--multi-gpu-results", type=pathlib.Path, default=MULTI_GPU_RESULTS)
    args = parser.parse_args(argv)
    report = build_report(args.layer_results.resolve(), args.multi_gpu_results.resolve())
    command = "python -m bench.rack_model " + shlex.join(sys.argv[1:] if argv is None else argv)
    report["command"] = command
    report["date"] = datetime.date.today().isoformat()
    text = markdown(report, command)
    if args.out is not None:
        write_files(args.out, {"rack_model.json": json.dumps(report, indent=1) + "\n",
                               "rack_model.md": text})  # fmt: skip
    print(text)
    return report


if __name__ == "__main__":
    main()
