"""How the MoE layer runs, never what it computes: `MoEOptions`, and the hardware it targets.

`MoEConfig.options` holds the performance knobs, each "auto" by default; `mok_jax.resolve`
turns them into concrete choices for a target (see resolve.py). Every name here is the name the
knob keeps down to the kernel call.

A `Target` is the hardware the layer is built for: by default the first device JAX runs on;
`targeting(...)` names another (e.g. to lower for CUDA on a CPU machine, or to check what the
automatic choices would be on an H100).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import numbers
import typing
from collections.abc import Iterator
from typing import Literal

import jax

Auto = Literal["auto"]
AUTO: Auto = "auto"

# Where the `fused` implementation's gate/up kernel gets its expert-sorted rows: "copied" (one
# gather of the tokens into a [N, D] copy, then the kernel on it) or "gathered" (the kernel loads
# each row from the tokens itself, one 1-row TMA per row and K step: no copy). The same bits.
Rows = Literal["copied", "gathered"]
# What the `fused` implementation's forward keeps for its backward: "inputs" (the tokens and
# weights; the backward recomputes the gate and up projections, 2 of its 8 GEMM passes) or
# "gate_up" (also h, gate and up, [T*K, F] each in the compute dtype: 6 passes).
Residuals = Literal["inputs", "gate_up"]
# How the `fused` implementation's backward recomputes what "inputs" did not keep: "gmm" (three
# f32 grouped GEMMs, then XLA's elementwise pass) or "kernel" (one kernel,
# mosaic_gpu.gmm_swiglu_bwd, no f32 [T*K, F] array in HBM; other last bits).
Recompute = Literal["gmm", "kernel"]
# Which kernels carry the `fused` implementation's exchange under an expert axis of several
# devices: "per_gemm" (each copy inside the kernel of the GEMM next to it) or "forward" (the
# round's whole forward, dispatch, gate/up, down and return, in one kernel).
ExchangeFusion = Literal["per_gemm", "forward"]

# How the `fused` implementation routes its tokens: "xla" (the router's stages as XLA operations
# over fixed-shape token chunks) or "kernel" (the router's forward and backward as one Mosaic GPU
# kernel each, pallas_kernels/routing, a program per 64 tokens).
Router = Literal["xla", "kernel"]

ROWS: tuple[str, ...] = typing.get_args(Rows)
ROUTERS: tuple[str, ...] = typing.get_args(Router)
RESIDUALS: tuple[str, ...] = typing.get_args(Residuals)
RECOMPUTES: tuple[str, ...] = typing.get_args(Recompute)
EXCHANGE_FUSIONS: tuple[str, ...] = typing.get_args(ExchangeFusion)

# The options that only the `fused` implementation reads, and those that only its in-kernel
# exchange reads (under a mesh whose expert axis has several devices, or with
# exchange_on_one_device).
FUSED_OPTIONS = ("rows", "residuals", "recompute", "router")
EXCHANGE_OPTIONS = ("exchange_tile", "exchange_programs", "exchange_fusion")


def _check_choice(name: str, value: typing.Any, choices: tuple[str, ...]) -> None:
    if value != AUTO and value not in choices:
        raise ValueError(f"{name}={value!r} must be 'auto' or one of {choices}")


def _check_count(name: str, value: typing.Any, *, minimum: int, multiple: int = 1) -> None:
    if value == AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}={value!r} must be 'auto' or an int >= {minimum}")
    if value % multiple:
        raise ValueError(f"{name}={value} must be a multiple of {multiple}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEOptions:
    """The layer's performance knobs. None changes what the layer computes beyond the last bits
    noted below; each defaults to "auto", resolved by `mok_jax.resolve` from the config, the
    tokens the layer sees and the target device (the rules are in resolve.py). Set one only to
    override the rule. A knob set for an implementation set explicitly that does not read it
    raises ValueError, as does one whose request cannot be honoured where the layer runs; the
    exchange's knobs apply wherever the in-kernel exchange runs, `fused`'s wherever `fused`
    does (with implementation "auto", a config stays portable).

    Attributes:
      token_chunk: tokens per step of the token-wise stages (routing, combine, shared experts),
        which run in fixed-shape chunks (zero-padded, at least two) so that a token's bits do
        not depend on how many tokens a device holds. A multiple of 8. y changes in its last
        bits with it, so "auto" depends on the target only: 2048 on a GPU (on the H200 at
        qwen3_30b_a3b, 16,384 tokens, `fused` forward+backward 12.3 ms against 14.5 at 512),
        8 * row_tile on a CPU (little padding for the small batches of CPU runs). Change it
        when a device holds far more tokens (fewer, larger chunks: fewer launches) or far
        fewer (less padding).
      rows: `fused` only: where the gate/up kernel's rows come from (`Rows`); the same bits.
        "auto": "copied" (on the H200 2.1 against 2.8 ms at qwen3_30b_a3b's gate/up).
        "gathered" saves the [T*K, D] copy; not under a mesh (the exchange sends the copy).
      residuals: `fused` only: what the forward keeps for the backward (`Residuals`); the same
        bits. "auto": "gate_up" where those 3*T*K*F values of the compute dtype take at most
        `RESIDUAL_SHARE` of the device's memory (one layer among many), else "inputs".
        Under an expert axis of several devices the backward recomputes each round's forward
        ("inputs"); "gate_up" there raises.
      recompute: `fused` only, with residuals "inputs": how the backward recomputes gate and up
        (`Recompute`). "auto": "gmm" (on the H200 3.03 against 3.73 ms at qwen3_30b_a3b).
        "kernel" keeps 12*K*F bytes a token of f32 intermediates out of HBM; other last bits.
      router: `fused` only: how the tokens are routed (`Router`). "kernel" selects experts from
        logits of another summation order than "xla"'s (a token whose two best-ranked experts
        are within f32 rounding of each other may be sent to the other one) and needs bf16
        tokens and at most 256 experts. "auto": "xla".
      exchange_tile: `fused` under a mesh, in-kernel exchange: rows per tile of the receive
        buffer (each local expert's rows of a round start on a tile boundary; the grain at
        which GEMMs can start on arrived rows). The same bits at any value. "auto": 64.
      exchange_programs: `fused` under a mesh, in-kernel exchange: the programs (one an SM) of
        a GEMM kernel that copy rows to and from the devices owning their experts while the
        others compute; 0 runs the copies as kernels of their own. The same bits. "auto": the
        device's entry in pallas_kernels/exchange/tuning.py.
      exchange_fusion: `fused` under a mesh, in-kernel exchange: which kernels carry the
        copies (`ExchangeFusion`); the same bits. "auto": "per_gemm" ("forward" was not
        reliably faster on one H200). "forward" needs exchange_programs > 0 and d_model a
        multiple of 128.
      exchange_on_one_device: `fused` under a mesh whose expert axis has one device: run the
        in-kernel exchange anyway (copies to the device itself), the way to run and time the
        exchange's kernels on one GPU. False: each device runs `fused` as without a mesh.
    """

    token_chunk: int | Auto = AUTO
    rows: Rows | Auto = AUTO
    residuals: Residuals | Auto = AUTO
    recompute: Recompute | Auto = AUTO
    router: Router | Auto = AUTO
    exchange_tile: int | Auto = AUTO
    exchange_programs: int | Auto = AUTO
    exchange_fusion: ExchangeFusion | Auto = AUTO
    exchange_on_one_device: bool = False

    def __post_init__(self) -> None:
        _check_count("token_chunk", self.token_chunk, minimum=8, multiple=8)
        _check_choice("rows", self.rows, ROWS)
        _check_choice("residuals", self.residuals, RESIDUALS)
        _check_choice("recompute", self.recompute, RECOMPUTES)
        _check_choice("router", self.router, ROUTERS)
        _check_count("exchange_tile", self.exchange_tile, minimum=1)
        _check_count("exchange_programs", self.exchange_programs, minimum=0)
        _check_choice("exchange_fusion", self.exchange_fusion, EXCHANGE_FUSIONS)
        if not isinstance(self.exchange_on_one_device, bool):
            raise ValueError(
                f"exchange_on_one_device={self.exchange_on_one_device!r} must be a bool"
            )
        for name in ("token_chunk", "exchange_tile", "exchange_programs"):
            value = getattr(self, name)
            if value != AUTO:
                object.__setattr__(self, name, int(value))
        if self.exchange_fusion == "forward" and self.exchange_programs == 0:
            raise ValueError(
                "exchange_fusion='forward' runs the copies inside the forward's kernel: it "
                "needs exchange_programs > 0"
            )

    def explicit(self) -> tuple[str, ...]:
        """The names of the knobs set to something other than their default."""
        default = MoEOptions()
        return tuple(
            f.name
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        )

    def is_resolved(self) -> bool:
        """No knob is "auto"."""
        return all(getattr(self, f.name) != AUTO for f in dataclasses.fields(self))


# What `resolve`'s "auto" rules may give the residuals of the `fused` implementation: this
# share of the target's memory for one layer's kept gate/up (a model holds many layers).
RESIDUAL_SHARE = 1 / 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """The hardware the layer is built for.

    Attributes:
      platform: JAX's platform name of the devices: "cpu", "gpu" or "tpu".
      device_kind: `jax.Device.device_kind` ("NVIDIA H100 80GB HBM3", "cpu", ...).
      compute_capability: a GPU's "major.minor" ("9.0" for Hopper), else None.
      memory_bytes: the memory a device gives JAX, where known, else None.
      run_interpreted: run the Mosaic GPU kernels in GPU interpret mode (on a CPU); None: on a
        CPU platform only. True with a GPU target makes its choices and runs them on a CPU
        (the tests of the GPU's automatic choices do).
    """

    platform: str
    device_kind: str
    compute_capability: str | None = None
    memory_bytes: int | None = None
    run_interpreted: bool | None = None

    @property
    def hopper(self) -> bool:
        """An sm90 GPU: what the Mosaic GPU kernels (`pallas`, `fused`) are written for."""
        return self.platform == "gpu" and self.compute_capability == "9.0"

    @property
    def interpret(self) -> bool:
        """Whether Mosaic GPU kernels run in GPU interpret mode (on a CPU)."""
        return self.platform == "cpu" if self.run_interpreted is None else self.run_interpreted

    @classmethod
    def of(cls, device: jax.Device) -> Target:
        """The target of a device JAX holds."""
        capability = getattr(device, "compute_capability", None)
        return cls(
            platform=device.platform,
            device_kind=device.device_kind,
            compute_capability=None if capability is None else str(capability),
            memory_bytes=device_memory(device),
        )


def device_memory(device: jax.Device) -> int | None:
    """The bytes the device's allocator may use, or None where it does not say (CPUs, and
    devices whose runtime does not implement memory statistics)."""
    if device.platform == "cpu":
        return None
    try:
        stats = device.memory_stats()
    except (NotImplementedError, RuntimeError):
        return None
    return None if not stats else stats.get("bytes_limit")


# GPUs a target may name without holding one (lowering for CUDA on a CPU, tests of the rules):
# device kind as `jax.Device.device_kind` spells it -> (compute capability, memory in bytes).
KNOWN_GPUS: dict[str, tuple[str, int]] = {
    "NVIDIA H100 80GB HBM3": ("9.0", 80 * 2**30),
    "NVIDIA H200": ("9.0", 141 * 2**30),
    "NVIDIA H800": ("9.0", 80 * 2**30),
    "NVIDIA A100-SXM4-80GB": ("8.0", 80 * 2**30),
}

_TARGET: contextvars.ContextVar[Target | None] = contextvars.ContextVar(
    "mok_jax_target", default=None
)


def current_target() -> Target:
    """The target set by `targeting`, else that of JAX's first device."""
    target = _TARGET.get()
    return Target.of(jax.devices()[0]) if target is None else target


def gpu_target(device_kind: str) -> Target:
    """The target of a GPU in `KNOWN_GPUS`, by its device kind."""
    if device_kind not in KNOWN_GPUS:
        raise ValueError(f"{device_kind=} is not one of the known GPUs {tuple(KNOWN_GPUS)}")
    capability, memory = KNOWN_GPUS[device_kind]
    return Target(
        platform="gpu",
        device_kind=device_kind,
        compute_capability=capability,
        memory_bytes=memory,
    )


@contextlib.contextmanager
def targeting(target: Target | str) -> Iterator[Target]:
    """Builds the layers traced inside for `target` (a `Target`, or a device kind of
    `KNOWN_GPUS`) instead of the device JAX runs on: the automatic choices and the kernels'
    interpret mode follow it.

    jit caches a trace by the Python function and its arguments, not by this context: trace
    a function defined for the target (not one already traced for another).

    Example:
      >>> with mok_jax.targeting("NVIDIA H100 80GB HBM3"):
      ...     f = lambda x, params: mok_jax.moe(x, params, cfg)[0]
      ...     text = jax.jit(f).trace(x, params).lower(lowering_platforms=("cuda",)).as_text()
    """
    target = gpu_target(target) if isinstance(target, str) else target
    if not isinstance(target, Target):
        raise ValueError(f"target={target!r} must be a Target or a known GPU's device kind")
    token = _TARGET.set(target)
    try:
        yield target
    finally:
        _TARGET.reset(token)
