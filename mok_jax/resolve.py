"""The automatic choices: `resolve(cfg, ...)` turns a config's "auto" implementation and options
into concrete ones for a target, and says why.

The rules (each unit-tested on CPU with named targets, tests/mok_jax/test_resolve.py):

  implementation  `fused` on a Hopper GPU (sm90) where the kernels support the config
                  (`MoEConfig.kernels_unsupported`: bf16/f16, d_model and d_ff multiples of 64,
                  the all-to-all exchange); `pallas` there with exchange "ring"; `xla`
                  elsewhere (a CPU, another GPU, f32).
  token_chunk     2048 on a GPU, 8 * row_tile on a CPU (MoEOptions.token_chunk says why).
  rows            "copied".
  residuals       "gate_up" where one layer's kept h, gate and up (3*T*K*F values of the
                  compute dtype, T the tokens this device's layer sees) take at most
                  RESIDUAL_SHARE of the target's memory and the layer runs without the
                  in-kernel exchange and recompute is left "auto"; else "inputs". Both give
                  the same bits (the recomputed gate and up are rounded as the kept ones are).
  recompute       "gmm".
  router          "xla" (the router kernel is chosen explicitly, `router="kernel"`).
  exchange_tile   64;  exchange_programs: the target's entry of the exchange's tuning table;
  exchange_fusion "per_gemm".

The bits contract: y and dx are the same bits on every mesh and expert-parallel degree for a
given config. The choices that change last bits (implementation, token_chunk, recompute, router)
depend on the config and the target only, never on the mesh or the token count; residuals
depends on both, and its choices are the same bits.

An explicit implementation that cannot run raises ValueError naming the reason, and so does
an option whose request cannot be honoured where the layer runs (gathered rows under a mesh,
kept gate/up with the in-kernel exchange). An option for a part that does not run here (the
exchange's on one device, `fused`'s where "auto" picks `xla`) is a choice for where it does:
the config stays portable between a laptop and a GPU, one device and many; the resolution's
report lists the options that apply. Options for an implementation set explicitly that does
not read them are rejected by `MoEConfig` itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from mok_jax.config import MoEConfig
from mok_jax.options import (
    AUTO,
    EXCHANGE_OPTIONS,
    FUSED_OPTIONS,
    RESIDUAL_SHARE,
    MoEOptions,
    Target,
    current_target,
)
from mok_jax.tiles import TILES_PER_STEP
from pallas_kernels.routing.mosaic_gpu import MAX_EXPERTS as ROUTER_MAX_EXPERTS

# The token chunk on a GPU: the measured best at qwen3_30b_a3b on the H200 (MoEOptions).
GPU_TOKEN_CHUNK = 2048
# Rows per tile of the in-kernel exchange's receive buffer (tested at 3 and 4 on the CPU and at
# 16, 64 and 128 on one H200; the same bits at each).
EXCHANGE_TILE = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class Context:
    """Where a layer runs: what the rules may look at besides the config.

    Attributes:
      num_tokens: T, the tokens each device's layer sees.
      meshed: under a mesh (`shard_map`).
      expert_devices: the devices of the mesh's `expert` axis (1 without a mesh).
      target: the hardware (`mok_jax.current_target()` by default).
    """

    num_tokens: int
    meshed: bool = False
    expert_devices: int = 1
    target: Target = dataclasses.field(default_factory=current_target)

    @property
    def exchange_in_kernels(self) -> bool:
        """Whether `fused` runs its in-kernel exchange here (see `_fused_path`)."""
        return self.meshed and self.expert_devices > 1


@dataclasses.dataclass(frozen=True)
class Resolution:
    """A config with every "auto" resolved, and why each choice was made.

    Attributes:
      config: the concrete `MoEConfig` (no "auto" left) the layer runs.
      reasons: field -> one line saying why (for "auto" choices) or "set" (explicit ones).
    """

    config: MoEConfig
    reasons: Mapping[str, str]

    def choices(self) -> dict[str, tuple[object, str]]:
        """name -> (value, why) of the implementation and of each option that applies."""
        values = {"implementation": self.config.implementation}
        values.update(dataclasses.asdict(self.config.options))
        return {name: (values[name], why) for name, why in self.reasons.items()}

    def report(self) -> str:
        """The choices, one line each: `name = value: why`."""
        return "\n".join(f"{n} = {v!r}: {why}" for n, (v, why) in self.choices().items())

    def summary(self) -> str:
        """One line: the implementation and the options that apply, with their values."""
        choices = self.choices()
        fields = [f.name for f in dataclasses.fields(MoEOptions) if f.name in choices]
        parts = ", ".join(f"{name}={choices[name][0]!r}" for name in fields)
        return f"MoE {self.config.implementation!r} ({parts})"


def resolve_implementation(cfg: MoEConfig, target: Target | None = None) -> tuple[str, str]:
    """(implementation, why) for `cfg` on `target` (default: `current_target()`).

    An explicit implementation is checked: `pallas` and `fused` need a Hopper GPU, or a CPU
    (GPU interpret mode, for tests); ValueError otherwise.
    """
    target = current_target() if target is None else target
    impl = cfg.implementation
    if impl != AUTO:
        if impl in ("pallas", "fused") and not (target.hopper or target.interpret):
            raise ValueError(
                f"implementation={impl!r} runs Mosaic GPU kernels, written for Hopper (sm90) "
                f"GPUs; this target is {_describe(target)}: use 'xla' or 'auto'"
            )
        return impl, "set"
    if not target.hopper:
        return "xla", f"{_describe(target)} is no Hopper GPU (the kernels are written for sm90)"
    reason = cfg.kernels_unsupported("pallas")
    if reason is None and cfg.exchange == "ring":
        return "pallas", "Hopper GPU; exchange='ring' is for 'xla' and 'pallas', not 'fused'"
    if reason is not None:
        return "xla", f"Hopper GPU, but the kernels {reason}"
    return "fused", f"Hopper GPU ({target.device_kind}) and the kernels support the config"


def _describe(target: Target) -> str:
    if target.platform == "gpu":
        return f"{target.device_kind} (compute capability {target.compute_capability})"
    return f"a {target.platform.upper()} device"


def residual_bytes(cfg: MoEConfig, num_tokens: int) -> int:
    """Bytes of the kept h, gate and up (residuals "gate_up") of one layer over `num_tokens`
    tokens: 3 * T * K * F values of the compute dtype."""
    return 3 * num_tokens * cfg.top_k * cfg.d_ff * cfg.dtype.itemsize


def _check_applies(cfg: MoEConfig, impl: str, ctx: Context) -> None:
    """Options whose request cannot be honoured here raise. (`MoEConfig` rejects options set
    for an explicit implementation that does not read them; the exchange's options tune the
    in-kernel exchange wherever it runs and the `fused` ones `fused` wherever "auto" picks it.)"""
    options = cfg.options
    if impl != "fused":
        return
    in_kernels = ctx.exchange_in_kernels or (ctx.meshed and options.exchange_on_one_device)
    if options.rows == "gathered" and ctx.meshed:
        raise ValueError(
            "rows='gathered' cannot run under a mesh: the exchange sends a copy of the rows "
            "(the gathered rows' kernel takes no operand that varies over mesh axes)"
        )
    if options.residuals == "gate_up" and in_kernels:
        raise ValueError(
            "residuals='gate_up' cannot run with the in-kernel exchange (a mesh whose expert "
            "axis has several devices): its backward recomputes each round's forward"
        )
    if options.recompute != AUTO and options.residuals == "gate_up":
        raise ValueError(
            f"recompute={options.recompute!r} applies to residuals 'inputs' only: with "
            "'gate_up' the backward recomputes nothing"
        )
    if options.router == "kernel" and cfg.num_experts > ROUTER_MAX_EXPERTS:
        raise ValueError(
            f"router='kernel' takes at most {ROUTER_MAX_EXPERTS} experts "
            f"(num_experts={cfg.num_experts}): use router 'xla'"
        )
    if in_kernels and options.exchange_fusion == "forward" and cfg.d_model % 128:
        raise ValueError(
            f"exchange_fusion='forward' needs d_model={cfg.d_model} to be a multiple of 128 "
            "(its down tiles split between two consumers)"
        )


def _exchange_programs(target: Target) -> int:
    """The exchange's tuning table's entry for the target's device kind (the table's default
    kind's where it has none)."""
    from pallas_kernels.exchange import tuning
    from pallas_kernels.grouped_matmul.tuning import TARGET_DEVICE_KIND

    table = tuning.EXCHANGE_PROGRAMS
    return table.get(target.device_kind, table[TARGET_DEVICE_KIND])


def _resolve_options(cfg: MoEConfig, impl: str, ctx: Context) -> tuple[MoEOptions, dict]:
    """The options with every "auto" resolved, and the reasons of those that apply."""
    options, target = cfg.options, ctx.target
    chosen: dict[str, tuple[object, str]] = {}

    def pick(name: str, value: object, why: str) -> None:
        explicit = getattr(options, name)
        chosen[name] = (value, why) if explicit == AUTO else (explicit, "set")

    if impl != "reference":
        if target.platform == "gpu":
            pick("token_chunk", GPU_TOKEN_CHUNK, "GPU: fewer chunk steps of the token-wise stages")
        else:
            pick("token_chunk", TILES_PER_STEP * cfg.row_tile, "CPU: 8 row tiles, little padding")
    if impl == "fused":
        in_kernels = ctx.exchange_in_kernels or (ctx.meshed and options.exchange_on_one_device)
        pick("rows", "copied", "faster than 'gathered' on the H200")
        pick("recompute", "gmm", "faster than 'kernel' on the H200")
        pick("router", "xla", "the chunked XLA stages; set 'kernel' for the router's kernel")
        kept = residual_bytes(cfg, ctx.num_tokens)
        memory = target.memory_bytes
        if in_kernels:
            pick("residuals", "inputs", "the in-kernel exchange's backward recomputes each round")
        elif options.recompute != AUTO:
            pick("residuals", "inputs", f"recompute={options.recompute!r} was set")
        elif memory is not None and kept <= RESIDUAL_SHARE * memory:
            pick("residuals", "gate_up", f"{_gib(kept)} kept, <= 1/16 of {_gib(memory)}")
        else:
            room = "memory unknown" if memory is None else f"> 1/16 of {_gib(memory)}"
            pick("residuals", "inputs", f"{_gib(kept)} to keep, {room}")
        if in_kernels:
            pick("exchange_tile", EXCHANGE_TILE, "the tested default; the same bits at any tile")
            pick(
                "exchange_programs",
                _exchange_programs(target),
                f"the exchange's tuning table for {target.device_kind}",
            )
            pick("exchange_fusion", "per_gemm", "'forward' was not reliably faster")
    # Knobs that do not apply here keep their value ("auto" or set for where they apply), but
    # for another implementation than `fused`, whose config takes none of `fused`'s.
    values = {name: value for name, (value, _) in chosen.items()}
    if impl != "fused":
        values.update(dict.fromkeys(FUSED_OPTIONS + EXCHANGE_OPTIONS, AUTO))
        values["exchange_on_one_device"] = False
    return dataclasses.replace(options, **values), {n: why for n, (_, why) in chosen.items()}


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def resolve(
    cfg: MoEConfig,
    *,
    num_tokens: int,
    meshed: bool = False,
    expert_devices: int = 1,
    target: Target | None = None,
) -> Resolution:
    """Resolves `cfg`'s "auto" implementation and options for where the layer runs.

    Args:
      cfg: the layer's `MoEConfig`.
      num_tokens: T, the tokens each device's layer sees (the global count / the token-sharding
        devices under a mesh).
      meshed: whether the layer runs under a mesh (`shard_map`).
      expert_devices: the devices of the mesh's `expert` axis (1 without a mesh).
      target: the hardware (default: `mok_jax.current_target()`).

    Returns:
      A `Resolution`: the concrete config and the reason of each choice.

    Raises:
      ValueError: an explicit implementation the target cannot run, or an option whose request
        cannot be honoured here.

    Example:
      >>> cfg = mok_jax.MoEConfig(d_model=2048, d_ff=768, num_experts=128, top_k=8)
      >>> res = mok_jax.resolve(cfg, num_tokens=16384,
      ...                       target=mok_jax.gpu_target("NVIDIA H100 80GB HBM3"))
      >>> res.config.implementation, res.config.options.residuals
      ('fused', 'gate_up')
    """
    if not isinstance(cfg, MoEConfig):
        raise ValueError(f"cfg must be a MoEConfig, got {type(cfg).__name__}")
    ctx = Context(
        num_tokens=num_tokens,
        meshed=meshed,
        expert_devices=expert_devices,
        target=current_target() if target is None else target,
    )
    impl, why = resolve_implementation(cfg, ctx.target)
    _check_applies(cfg, impl, ctx)
    options, reasons = _resolve_options(cfg, impl, ctx)
    config = dataclasses.replace(cfg, implementation=impl, options=options)
    return Resolution(config=config, reasons=MappingProxyType({"implementation": why, **reasons}))
