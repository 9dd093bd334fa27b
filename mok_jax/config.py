"""The MoE layer's configuration, its presets, and the shape vocabulary of mok_jax.

Shape vocabulary, used as suffixes in names (`logits_te`, `w_gate_edf`) everywhere in mok_jax:

  T  tokens: every leading dimension of the input, flattened
  D  model width (`d_model`)
  E  routed experts
  K  top-k: slots per token
  F  expert width (`d_ff`)
  S  shared experts; together they are one SwiGLU of width S*F
  N  routed rows, N = T*K: one per (token, slot) pair; pair index n = t*K + j
  G  local experts (E on one device)
  R  received rows (the rows a device runs through its experts)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import typing
from collections.abc import Mapping
from fractions import Fraction
from types import MappingProxyType
from typing import Literal

import jax.numpy as jnp
import numpy as np

# "reference": the oracle (one device); "xla": XLA ops, any mesh; "pallas": the Mosaic GPU
# grouped GEMMs in the experts stage, any mesh; "fused": the rows read straight from the
# tokens and the routing weights applied inside the kernels (see layer._fused_experts), and
# under a mesh the rows moved between devices inside kernels too (layer._fused_exchange).
Implementation = Literal["reference", "xla", "pallas", "fused"]
ScoreFn = Literal["softmax", "sigmoid"]
# How rows travel between the devices of the `expert` mesh axis (see exchange.py).
Exchange = Literal["ragged_all_to_all", "ring"]
# How the `fused` implementation's gate/up kernel gets its expert-sorted rows: "copied" (one
# gather of the tokens into a [N, D] copy, then the kernel on it) or "gathered" (the kernel
# loads each row from the tokens itself, one 1-row TMA per row and K step: no copy, slower on
# the H200; see layer._fused_experts).
FusedRows = Literal["copied", "gathered"]
# Which kernels carry the `fused` implementation's exchange under a mesh: "per_gemm" (each
# copy inside the kernel of the GEMM next to it: the forward's dispatch with gate/up, its
# return with the down projection, the backward's likewise) or "forward" (the round's whole
# forward, dispatch, gate/up, down and return, in one kernel; the backward as "per_gemm").
ExchangeFusion = Literal["per_gemm", "forward"]
# What the `fused` implementation's forward keeps for its backward: "inputs" (the tokens and
# weights: the backward recomputes the gate and up projections, 2 of its 8 GEMM passes) or
# "gate_up" (also h, gate and up, [T*K, F] each in the compute dtype: 6 passes).
FusedResiduals = Literal["inputs", "gate_up"]
# How the `fused` implementation's backward recomputes what "inputs" did not keep (gate, up and
# dy @ w_down.T, then h, [d_gate | d_up] and the routing weights' gradient from them): "gmm"
# (three f32 grouped GEMMs, then XLA's elementwise pass) or "kernel" (one kernel,
# mosaic_gpu.gmm_swiglu_bwd, no f32 [T*K, F] array in HBM). See pallas_kernels' ops.Recompute.
# The `pallas` implementation's backward always recomputes with "gmm" (ops.Recompute's
# default); it ran the kernel from session 8's 32f407a to ea58fad.
FusedRecompute = Literal["gmm", "kernel"]

IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(Implementation)
SCORE_FNS: tuple[str, ...] = typing.get_args(ScoreFn)
EXCHANGES: tuple[str, ...] = typing.get_args(Exchange)
EXCHANGE_FUSIONS: tuple[str, ...] = typing.get_args(ExchangeFusion)
FUSED_ROWS: tuple[str, ...] = typing.get_args(FusedRows)
FUSED_RESIDUALS: tuple[str, ...] = typing.get_args(FusedResiduals)
FUSED_RECOMPUTES: tuple[str, ...] = typing.get_args(FusedRecompute)

# Short dtype names a command line or a config file may use, besides numpy's own names.
_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "f16": "float16",
    "fp16": "float16",
    "f32": "float32",
    "fp32": "float32",
}


# The compute dtypes the layer implements (f32 accumulation throughout).
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")


def canonical_dtype(dtype: typing.Any) -> np.dtype:
    """A floating dtype from a jnp/np dtype, a scalar type or a name ('bfloat16', 'bf16', ...)."""
    if dtype is None:
        raise ValueError("dtype=None is not a dtype: name one, e.g. 'bfloat16' or 'float32'")
    if isinstance(dtype, str):
        dtype = _DTYPE_ALIASES.get(dtype, dtype)
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"{dtype=} is not a dtype") from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"{dtype=} must be a floating dtype such as bfloat16 or float32")
    return dt


def compute_dtype(dtype: typing.Any) -> np.dtype:
    """`canonical_dtype`, restricted to the dtypes the expert GEMMs compute in."""
    dt = canonical_dtype(dtype)
    if dt.name not in COMPUTE_DTYPES:
        raise ValueError(f"dtype={dt.name} is not a compute dtype; use one of {COMPUTE_DTYPES}")
    return dt


def check_int(name: str, value: typing.Any, *, minimum: int) -> int:
    """`value` as an int >= minimum, else a ValueError naming it (bools are not ints)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r} must be an int")
    if value < minimum:
        raise ValueError(f"{name}={value!r} must be >= {minimum}")
    return int(value)


def _check_float(name: str, value: typing.Any, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r} must be a real number")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name}={value!r} must be finite and {'> 0' if positive else '>= 0'}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Everything that defines an MoE layer's function and how it is computed.

    Frozen, hashable (usable as a static argument of `jax.jit`) and validated on construction:
    bad values raise `ValueError` naming them. Change a field with `dataclasses.replace`.

    Attributes:
      d_model: D, the model width.
      d_ff: F, the width of each expert's SwiGLU.
      num_experts: E, the routed experts.
      top_k: K, the experts each token is sent to.
      score_fn: "softmax" or "sigmoid" over the router logits.
      norm_topk_prob: divide the chosen experts' weights by their sum.
      routed_scaling: factor applied to the routing weights after normalization.
      num_groups: group-limited routing: experts form `num_groups` equal groups (>= 2 experts
        each); None turns it off. Set together with `topk_groups`.
      topk_groups: the number of groups whose experts stay eligible for each token.
      num_shared_experts: S, experts every token goes through, as one SwiGLU of width S*F.
      aux_loss_coef: coefficient of the load-balancing loss (0 turns it off).
      z_loss_coef: coefficient of the router z-loss (0 turns it off).
      capacity_factor: None for dropless; else each expert keeps at most
        ceil(capacity_factor * T * K / E) rows, Switch style, and the rest are dropped and counted.
      dtype: the compute dtype of the expert GEMMs (inputs cast to it, f32 accumulation):
        bfloat16, float16 or float32, as a jnp/np dtype or a name ('bfloat16', 'bf16', ...);
        stored as a numpy dtype.
      implementation: which implementation computes the layer (see `Implementation`).
      exchange: how rows travel to the devices that own their experts under a mesh with an
        `expert` axis: "ragged_all_to_all" (one collective per round; a dense all_to_all
        stands in on CPU) or "ring" (EP-1 `ppermute` hops, the GEMMs of one hop's chunk
        overlapping the next hop's transfer). Both give the same bits for y and dx.
      buffer_factor: the receive buffer, as a multiple of the balanced load (the rows a device
        would receive if routing were uniform). Rows beyond it travel in further rounds of the
        same exchange: memory stays bounded, nothing is dropped, imbalance costs rounds.
      row_tile: rows per tile: every routed row meets its expert's weights in a dot of
        [row_tile, D] (expert groups are padded to whole tiles), and every token its router and
        shared-expert weights in a dot of [row_tile, D], whatever the device count; this is
        what keeps y and dx the same bits for every expert-parallel degree. A multiple of 8.
      exchange_tile: with implementation 'fused' under a mesh, rows per tile of the in-kernel
        exchange's receive buffer: each local expert's rows of a round start on a tile
        boundary (the grouped GEMMs also compute the padding, fewer than exchange_tile rows an
        expert a round) and a receiver counts its rows' arrival tile by tile (the grain at
        which the GEMMs can start on arrived rows, once overlapped). y and dx do not depend on
        it (a row's result does not depend on its tile): tested at 3 and 4 on the CPU and at
        16, 64 and 128 on one H200.
      exchange_programs: with implementation 'fused' under a mesh, the share of the GPU given
        to the exchange's copies: the programs (one a streaming multiprocessor, of 132 on the
        H200) of the first expert GEMMs' kernel that copy the round's rows to the devices that
        own their experts, while the others run each GEMM tile as soon as its rows are in; and
        of the down projection's kernel, that send each piece of results back as soon as its
        rows are stored; and (with fused_recompute "gmm") of the backward's first GEMM's
        kernel, that copy the results' cotangent, the rows and their weights to the buffers
        while the others run g = dy @ w_down.T tile by tile; and of the input gradient's
        kernel, that send each piece of it back as soon as its rows are stored. 0: these
        copies run as kernels of their own, on every SM. y and dx do not depend on it.
        Default 24: on one H200, at qwen3_30b_a3b's round with an EP > 1 buffer, the
        forward's two kernels took 1.53 ms at 24, 1.66 at 16 and 1.71 as separate kernels
        (bench/results/2026-12-01_exchange_tail_h200_s13/); the layer's backward (with the
        routing) on a 1-device mesh, 5.92 ms at 24 and 6.22 separate (one call, session 15,
        bench/results/2026-12-01_exchange_backward_h200_s15/); across GPUs, where the copies
        cost more, not yet timed.
      exchange_fusion: with implementation 'fused' under a mesh and exchange_programs > 0,
        which kernels carry the exchange's copies (see `ExchangeFusion`); y and dx do not
        depend on it. "per_gemm" (the default) has run on one H200 and, in its session-12
        form, on two. "forward" (MoK's design: one kernel a round for the forward, each down
        tile starting once its rows of h are stored, each piece of results leaving once its
        rows of y are) gives the same bits on one H200, at one round and at several (the
        layer's GPU test, session 20), but is not reliably faster there: on a 1-device mesh at
        qwen3_30b_a3b, 4096 tokens, one round, forward / forward+backward took 2.81 / 6.99
        ms against per_gemm's 2.85 / 7.21 with f32 parameters (session 19) and 2.13 / 6.04
        against 1.97 / 5.75 with bf16 ones (session 20; bench/results/
        2026-12-02_exchange_h200_s19/ and _s20/, one call each). What it is for, the return
        starting while the first GEMM still runs across GPUs, has not been measured. Its down
        tiles must split between consumers as the gate/up ones do (on the H200's tiles,
        d_model a multiple of 128), else the layer raises ValueError.
      exchange_on_one_device: with implementation 'fused' under a mesh whose `expert` axis
        has one device (data parallel only), whether the rows still go through the in-kernel
        exchange (copies to the device itself). False (the default): they are already on the
        device that owns their experts, so each device runs `fused` as without a mesh (no
        rounds; fused_residuals applies, and the rows are copied as under any mesh), the
        same y and dx bits; on one H200 the exchange's copies cost 15-19 % of the layer's
        forward+backward there (bench/results/2026-12-01_exchange_h200_s16/). True: the way
        to run and time the exchange's kernels on one GPU (the tests and benchmarks do).
        'xla' and 'pallas' never run a collective on a 1-device expert axis.
      token_chunk: tokens per step of the token-wise stages (routing, combine, shared experts),
        which run in fixed-shape chunks of this many tokens (zero-padded, at least two) so that
        a token's bits do not depend on how many tokens a device holds; None: 8 * row_tile
        (512). A multiple of 8. Larger chunks take fewer loop steps (each costs launches) and
        pad more when a device holds few tokens; y changes in its last bits with it. On the
        H200, `fused` at qwen3_30b_a3b (16384 tokens): 2048 took its forward+backward from
        14.5 to 12.3 ms (bench/results/2026-12-01_layer_profile_h200/); at mixtral_8x7b and
        the deepseek-v3 slice (16 and 8 steps at 512) the gain was within the noise.
      fused_rows: with implementation 'fused', where the gate/up kernel's rows come from (see
        `FusedRows`); both give the same bits. "gathered" saves the [T*K, D] copy of the
        tokens; "copied" is faster on the H200 (2.1 against 2.8 ms at qwen3_30b_a3b's gate/up,
        bench/results/2026-11-30_fused_probe_h200/). Under a mesh the rows are copied
        (the exchange sends the copy).
      fused_residuals: with implementation 'fused', what its forward keeps for the backward
        (see `FusedResiduals`): "inputs" is lean, "gate_up" skips recomputing the gate and up
        projections (2 of a forward+backward's 11 GEMM passes) for 3 * K * F more values per
        token. On the H200 "gate_up" alone ran mixtral_8x7b's forward+backward in 30.3 ms
        against 37.0-38.1 for the defaults, and the deepseek-v3 slice's in 21.9 against
        24.3-24.8, for 176 KiB of activations a token against 8 KiB at mixtral
        (bench/results/moe_layer_h200.md, bench/results/2026-11-30_activation_memory.md).
        Under a mesh it does not apply: the backward recomputes each round's forward.
      fused_recompute: with implementation 'fused' and residuals "inputs", how the backward
        recomputes gate and up (see `FusedRecompute`); the same values (h to the bit, the rest
        to their f32 rounding). "gmm" is faster on the H200 (3.03 against 3.73 ms at
        qwen3_30b_a3b, bench/results/2026-12-01_fused_probe_h200/); "kernel" keeps
        3 * 4 * K * F bytes per token of f32 intermediates out of HBM. Under a mesh too.
    """

    d_model: int
    d_ff: int
    num_experts: int
    top_k: int
    score_fn: ScoreFn = "softmax"
    norm_topk_prob: bool = False
    routed_scaling: float = 1.0
    num_groups: int | None = None
    topk_groups: int | None = None
    num_shared_experts: int = 0
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    capacity_factor: float | None = None
    dtype: typing.Any = jnp.bfloat16
    implementation: Implementation = "xla"
    exchange: Exchange = "ragged_all_to_all"
    buffer_factor: float = 2.0
    row_tile: int = 64
    exchange_tile: int = 64
    exchange_programs: int = 24
    exchange_fusion: ExchangeFusion = "per_gemm"
    exchange_on_one_device: bool = False
    fused_rows: FusedRows = "copied"
    fused_residuals: FusedResiduals = "inputs"
    fused_recompute: FusedRecompute = "gmm"
    token_chunk: int | None = None

    def __post_init__(self) -> None:
        def put(name: str, value: typing.Any) -> None:
            object.__setattr__(self, name, value)

        for name in ("d_model", "d_ff", "num_experts", "top_k"):
            put(name, check_int(name, getattr(self, name), minimum=1))
        put(
            "num_shared_experts",
            check_int("num_shared_experts", self.num_shared_experts, minimum=0),
        )
        put("routed_scaling", _check_float("routed_scaling", self.routed_scaling, positive=True))
        put("aux_loss_coef", _check_float("aux_loss_coef", self.aux_loss_coef, positive=False))
        put("z_loss_coef", _check_float("z_loss_coef", self.z_loss_coef, positive=False))
        if self.capacity_factor is not None:
            put(
                "capacity_factor",
                _check_float("capacity_factor", self.capacity_factor, positive=True),
            )
        for name in ("norm_topk_prob", "exchange_on_one_device"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.score_fn not in SCORE_FNS:
            raise ValueError(f"score_fn={self.score_fn!r} must be one of {SCORE_FNS}")
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation={self.implementation!r} must be one of {IMPLEMENTATIONS}"
            )
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange={self.exchange!r} must be one of {EXCHANGES}")
        if self.exchange_fusion not in EXCHANGE_FUSIONS:
            raise ValueError(
                f"exchange_fusion={self.exchange_fusion!r} must be one of {EXCHANGE_FUSIONS}"
            )
        if self.token_chunk is not None:
            put("token_chunk", check_int("token_chunk", self.token_chunk, minimum=8))
            if self.token_chunk % 8:
                raise ValueError(f"token_chunk={self.token_chunk} must be a multiple of 8")
        if self.fused_rows not in FUSED_ROWS:
            raise ValueError(f"fused_rows={self.fused_rows!r} must be one of {FUSED_ROWS}")
        if self.fused_residuals not in FUSED_RESIDUALS:
            raise ValueError(
                f"fused_residuals={self.fused_residuals!r} must be one of {FUSED_RESIDUALS}"
            )
        if self.fused_recompute not in FUSED_RECOMPUTES:
            raise ValueError(
                f"fused_recompute={self.fused_recompute!r} must be one of {FUSED_RECOMPUTES}"
            )
        put("buffer_factor", _check_float("buffer_factor", self.buffer_factor, positive=True))
        put("row_tile", check_int("row_tile", self.row_tile, minimum=8))
        if self.row_tile % 8:
            raise ValueError(f"row_tile={self.row_tile} must be a multiple of 8")
        put("exchange_tile", check_int("exchange_tile", self.exchange_tile, minimum=1))
        put(
            "exchange_programs",
            check_int("exchange_programs", self.exchange_programs, minimum=0),
        )
        put("dtype", compute_dtype(self.dtype))
        if self.implementation in ("pallas", "fused"):
            self._validate_pallas()

        top_k, num_experts = self.top_k, self.num_experts
        if top_k > num_experts:
            raise ValueError(f"{top_k=} must be <= {num_experts=}")
        self._validate_groups()

    def _validate_pallas(self) -> None:
        """The kernels' limits ('pallas' and 'fused')."""
        impl = self.implementation
        if self.dtype.name not in ("bfloat16", "float16"):
            raise ValueError(
                f"implementation={impl!r} computes in bfloat16 or float16, not "
                f"dtype={self.dtype.name}"
            )
        for name in ("d_model", "d_ff"):
            if getattr(self, name) % 64:
                raise ValueError(
                    f"implementation={impl!r} needs {name}={getattr(self, name)} to be a "
                    "multiple of 64 (the kernels' tiles)"
                )

    def _validate_groups(self) -> None:
        num_groups, topk_groups, num_experts = self.num_groups, self.topk_groups, self.num_experts
        if (num_groups is None) != (topk_groups is None):
            raise ValueError(
                f"{num_groups=} and {topk_groups=} must be set together "
                "(both None turns group-limited routing off)"
            )
        if num_groups is None:
            return
        num_groups = check_int("num_groups", num_groups, minimum=1)
        topk_groups = check_int("topk_groups", topk_groups, minimum=1)
        object.__setattr__(self, "num_groups", num_groups)
        object.__setattr__(self, "topk_groups", topk_groups)
        if num_experts % num_groups:
            raise ValueError(f"{num_groups=} must divide {num_experts=}")
        if num_experts // num_groups < 2:
            raise ValueError(
                f"each group needs >= 2 experts: {num_experts=} / {num_groups=} "
                f"= {num_experts // num_groups}"
            )
        if topk_groups > num_groups:
            raise ValueError(f"{topk_groups=} must be <= {num_groups=}")
        eligible = topk_groups * (num_experts // num_groups)
        if self.top_k > eligible:
            raise ValueError(
                f"top_k={self.top_k} must be <= the {eligible} experts of the "
                f"{topk_groups=} best groups"
            )

    @property
    def experts_per_group(self) -> int:
        """Experts in one routing group (E when group-limited routing is off)."""
        return self.num_experts // (self.num_groups or 1)

    @property
    def shared_width(self) -> int:
        """S*F: the width of the shared experts' combined SwiGLU (0 without shared experts)."""
        return self.num_shared_experts * self.d_ff

    def capacity(self, num_tokens: int) -> int | None:
        """Rows each expert keeps for `num_tokens` global tokens: ceil(c * T * K / E), or None.

        Computed in exact rational arithmetic from the factor as written (1.1 is 11/10), so a
        product that is an integer on paper is not rounded up by float error.
        """
        if self.capacity_factor is None:
            return None
        factor = Fraction(repr(self.capacity_factor))
        return math.ceil(factor * num_tokens * self.top_k / self.num_experts)


def scale_down(
    cfg: MoEConfig, *, d_model: int = 64, d_ff: int = 64, max_experts: int = 32
) -> MoEConfig:
    """A small config with `cfg`'s routing, for tests and CPU runs.

    Keeps the score function, normalization, scaling, group structure (number of groups and
    groups kept), shared experts, losses, capacity factor, dtype and implementation. Sets D and F
    (multiples of 64, as the GPU kernels need) and caps E at `max_experts`, rounded so the groups
    still divide it with >= 2 experts each; K is capped at the experts that stay eligible.

    Example:
      >>> small = scale_down(PRESETS["deepseek_v3"])
      >>> small.num_experts, small.top_k, small.num_groups, small.topk_groups
      (32, 8, 8, 4)
    """
    for name, value in (("d_model", d_model), ("d_ff", d_ff)):
        check_int(name, value, minimum=64)
        if value % 64:
            raise ValueError(f"{name}={value} must be a multiple of 64")
    check_int("max_experts", max_experts, minimum=1)
    num_experts = min(cfg.num_experts, max_experts)
    if cfg.num_groups is not None:
        num_experts = max(2 * cfg.num_groups, num_experts - num_experts % cfg.num_groups)
        eligible = cfg.topk_groups * (num_experts // cfg.num_groups)
    else:
        eligible = num_experts
    return dataclasses.replace(
        cfg, d_model=d_model, d_ff=d_ff, num_experts=num_experts, top_k=min(cfg.top_k, eligible)
    )


PRESETS: Mapping[str, MoEConfig] = MappingProxyType(
    {
        # A few hundred thousand parameters: the quickstart's and the tests' default.
        "tiny": MoEConfig(
            d_model=64, d_ff=128, num_experts=8, top_k=2, aux_loss_coef=1e-2, z_loss_coef=1e-3
        ),
        # Switch Transformer (Fedus et al. 2021), Switch-Base-128: top-1, capacity factor 1.25.
        "switch": MoEConfig(
            d_model=768,
            d_ff=3072,
            num_experts=128,
            top_k=1,
            capacity_factor=1.25,
            aux_loss_coef=1e-2,
        ),
        # Mixtral 8x7B: softmax over the chosen two (= normalized top-2 probabilities).
        "mixtral_8x7b": MoEConfig(
            d_model=4096,
            d_ff=14336,
            num_experts=8,
            top_k=2,
            norm_topk_prob=True,
            aux_loss_coef=2e-2,
        ),
        # DeepSeek-V3: 256 routed + 1 shared, sigmoid, 8 groups of which 4 stay, top-8, scaling 2.5.
        "deepseek_v3": MoEConfig(
            d_model=7168,
            d_ff=2048,
            num_experts=256,
            top_k=8,
            score_fn="sigmoid",
            norm_topk_prob=True,
            routed_scaling=2.5,
            num_groups=8,
            topk_groups=4,
            num_shared_experts=1,
            aux_loss_coef=1e-4,
        ),
        # Qwen3-30B-A3B: 128 experts, top-8, normalized.
        "qwen3_30b_a3b": MoEConfig(
            d_model=2048,
            d_ff=768,
            num_experts=128,
            top_k=8,
            norm_topk_prob=True,
            aux_loss_coef=1e-3,
        ),
        # Cursor's MoK benchmark layer: 384 experts, top-6, D 7168, F 3072.
        "mok_bench": MoEConfig(
            d_model=7168, d_ff=3072, num_experts=384, top_k=6, norm_topk_prob=True
        ),
    }
)
