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
import warnings
from collections.abc import Mapping
from fractions import Fraction
from types import MappingProxyType
from typing import Literal

import jax.numpy as jnp
import numpy as np

from mok_jax.options import (
    AUTO,
    EXCHANGE_OPTIONS,
    FUSED_OPTIONS,
    Auto,
    MoEOptions,
)
from pallas_kernels.routing.reference import RouterSpec, ScoreFn

# "reference": the oracle (one device); "xla": XLA ops, any mesh; "pallas": the Mosaic GPU
# grouped GEMMs in the experts stage, any mesh; "fused": the rows read straight from the
# tokens and the routing weights applied inside the kernels (see layer._fused_experts), and
# under a mesh the rows moved between devices inside kernels too (layer._fused_exchange).
# "auto" (MoEConfig's default) picks one for the target: see `mok_jax.resolve`.
Implementation = Literal["reference", "xla", "pallas", "fused"]
# How rows travel between the devices of the `expert` mesh axis for `xla` and `pallas` (see
# exchange.py); `fused` moves them inside its kernels, as an all-to-all.
Exchange = Literal["ragged_all_to_all", "ring"]

IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(Implementation)
SCORE_FNS: tuple[str, ...] = typing.get_args(ScoreFn)
EXCHANGES: tuple[str, ...] = typing.get_args(Exchange)

# Fields of MoEConfig before the performance knobs moved into `MoEOptions`: old name -> the
# option's name. `MoEConfig.from_dict` still reads them (with a DeprecationWarning).
MOVED_FIELDS: Mapping[str, str] = MappingProxyType(
    {
        "exchange_tile": "exchange_tile",
        "exchange_programs": "exchange_programs",
        "exchange_fusion": "exchange_fusion",
        "exchange_on_one_device": "exchange_on_one_device",
        "fused_rows": "rows",
        "fused_residuals": "residuals",
        "fused_recompute": "recompute",
        "token_chunk": "token_chunk",
    }
)
# Their defaults then: a saved run that kept one gets "auto", which resolves to it (token_chunk
# None, 8 * row_tile, is kept as that number: "auto" may pick another chunk, other last bits).
_MOVED_DEFAULTS: Mapping[str, typing.Any] = MappingProxyType(
    {
        "exchange_tile": 64,
        "exchange_programs": 24,
        "exchange_fusion": "per_gemm",
        "exchange_on_one_device": False,
        "fused_rows": "copied",
        "fused_residuals": "inputs",
        "fused_recompute": "gmm",
    }
)

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
      implementation: which implementation computes the layer (`Implementation`), or "auto":
        `fused` on a Hopper GPU wherever it supports the config, else `pallas` there (the
        `ring` exchange), else `xla`; `mok_jax.resolve` says what it picks and why.
      exchange: how `xla` and `pallas` move rows to the devices that own their experts under a
        mesh with an `expert` axis: "ragged_all_to_all" (one collective per round; a dense
        all_to_all stands in on CPU) or "ring" (EP-1 `ppermute` hops, the GEMMs of one hop's
        chunk overlapping the next hop's transfer). Both give the same bits for y and dx.
        `fused` moves them inside its kernels, as an all-to-all: it rejects "ring".
      buffer_factor: the receive buffer, as a multiple of the balanced load (the rows a device
        would receive if routing were uniform). Rows beyond it travel in further rounds of the
        same exchange: memory stays bounded, nothing is dropped, imbalance costs rounds.
      row_tile: rows per tile: every routed row meets its expert's weights in a dot of
        [row_tile, D] (expert groups are padded to whole tiles), and every token its router and
        shared-expert weights in a dot of [row_tile, D], whatever the device count; this is
        what keeps y and dx the same bits for every expert-parallel degree. A multiple of 8.
      options: the performance knobs (`MoEOptions`), each "auto" by default.

    Example:
      >>> cfg = MoEConfig(d_model=2048, d_ff=768, num_experts=128, top_k=8)
      >>> cfg.implementation, cfg.options.residuals
      ('auto', 'auto')
      >>> cfg.with_options(residuals="inputs").options.residuals
      'inputs'
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
    implementation: Implementation | Auto = AUTO
    exchange: Exchange = "ragged_all_to_all"
    buffer_factor: float = 2.0
    row_tile: int = 64
    options: MoEOptions = dataclasses.field(default_factory=MoEOptions)

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
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"norm_topk_prob={self.norm_topk_prob!r} must be a bool")
        if self.score_fn not in SCORE_FNS:
            raise ValueError(f"score_fn={self.score_fn!r} must be one of {SCORE_FNS}")
        if self.implementation != AUTO and self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation={self.implementation!r} must be 'auto' or one of {IMPLEMENTATIONS}"
            )
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange={self.exchange!r} must be one of {EXCHANGES}")
        put("buffer_factor", _check_float("buffer_factor", self.buffer_factor, positive=True))
        put("row_tile", check_int("row_tile", self.row_tile, minimum=8))
        if self.row_tile % 8:
            raise ValueError(f"row_tile={self.row_tile} must be a multiple of 8")
        put("dtype", compute_dtype(self.dtype))
        if not isinstance(self.options, MoEOptions):
            raise ValueError(
                f"options={self.options!r} must be a MoEOptions (MoEConfig.from_dict reads a dict)"
            )
        if self.implementation in ("pallas", "fused"):
            reason = self.kernels_unsupported()
            if reason is not None:
                raise ValueError(f"implementation={self.implementation!r} {reason}")
        self._validate_options()

        top_k, num_experts = self.top_k, self.num_experts
        if top_k > num_experts:
            raise ValueError(f"{top_k=} must be <= {num_experts=}")
        self._validate_groups()

    def kernels_unsupported(self, implementation: str | None = None) -> str | None:
        """Why the Mosaic GPU kernels of `implementation` ("pallas" or "fused"; default this
        config's) cannot compute this config, or None: they compute in bfloat16 or float16, on
        d_model and d_ff multiples of 64; `fused` moves rows as an all-to-all, not a ring."""
        implementation = self.implementation if implementation is None else implementation
        if self.dtype.name not in ("bfloat16", "float16"):
            return f"computes in bfloat16 or float16, not dtype={self.dtype.name}"
        for name in ("d_model", "d_ff"):
            if getattr(self, name) % 64:
                value = getattr(self, name)
                return f"needs {name}={value} to be a multiple of 64 (the kernels' tiles)"
        if implementation == "fused" and self.exchange == "ring":
            return (
                "moves rows inside its kernels, as an all-to-all: exchange='ring' is for 'xla' "
                "and 'pallas'"
            )
        return None

    def _validate_options(self) -> None:
        """Options set for an implementation that does not read them."""
        impl, set_ = self.implementation, self.options.explicit()
        if impl in (AUTO, "fused"):
            return
        unused = [n for n in set_ if n in FUSED_OPTIONS or n in EXCHANGE_OPTIONS]
        unused += [n for n in set_ if n == "exchange_on_one_device"]
        if unused:
            raise ValueError(
                f"options {', '.join(unused)} are the 'fused' implementation's, not "
                f"implementation={impl!r}'s: leave them 'auto' (or set implementation 'auto', "
                "which uses them wherever it picks 'fused')"
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
    def router_spec(self) -> RouterSpec:
        """What this config's router computes, as the routing kernels take it."""
        return RouterSpec(
            num_experts=self.num_experts,
            top_k=self.top_k,
            score_fn=self.score_fn,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling=self.routed_scaling,
            num_groups=self.num_groups,
            topk_groups=self.topk_groups,
        )

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

    def with_options(self, **changes: typing.Any) -> MoEConfig:
        """This config with some options changed, e.g. `cfg.with_options(residuals="inputs")`."""
        return dataclasses.replace(self, options=dataclasses.replace(self.options, **changes))

    def to_dict(self) -> dict[str, typing.Any]:
        """The fields as JSON-ready values (dtype by name, options as a dict); `from_dict`
        reads them back."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**out, "dtype": self.dtype.name, "options": dataclasses.asdict(self.options)}

    @classmethod
    def from_dict(cls, data: Mapping[str, typing.Any]) -> MoEConfig:
        """A config from `to_dict`'s output, or from a dict saved before the performance knobs
        moved into `options` (flat fields such as `fused_residuals`; each is read into its
        option, with a DeprecationWarning naming the new place)."""
        data = dict(data)
        options = dict(data.pop("options", None) or {})
        moved = [name for name in MOVED_FIELDS if name in data]
        for name in moved:
            value = data.pop(name)
            if name == "token_chunk" and value is None:
                value = 8 * data.get("row_tile", 64)
            elif _MOVED_DEFAULTS.get(name, object()) == value and name != "exchange_on_one_device":
                value = AUTO
            options[MOVED_FIELDS[name]] = value
        if moved:
            places = ", ".join(f"{name} -> options.{MOVED_FIELDS[name]}" for name in moved)
            warnings.warn(
                f"this MoEConfig was saved with fields that moved into MoEConfig.options "
                f"(MoEOptions): {places}; read into their new places (a saved default reads as "
                "'auto', which resolves to it). Save it again to drop this warning.",
                DeprecationWarning,
                stacklevel=2,
            )
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"MoEConfig has no fields {unknown}")
        return cls(**data, options=MoEOptions(**options))


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
