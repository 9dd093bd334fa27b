"""The language model's and the training run's configuration, and the presets.

Shape vocabulary (mok_jax's, plus the model's own): B batch, S sequence positions, V vocabulary
(256 bytes), D model width, N attention heads, H head width, L layers.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import typing
from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

import jax.numpy as jnp

from mok_jax.config import (
    IMPLEMENTATIONS,
    Implementation,
    MoEConfig,
    canonical_dtype,
    check_int,
)
from mok_jax.options import MoEOptions

MeshLayout = Literal["expert", "data_expert"]
MESH_LAYOUTS: tuple[str, ...] = typing.get_args(MeshLayout)
# What the backward recomputes instead of keeping (the rematerialization policy of each block),
# from the most memory and least time to the least memory and most time: "none" keeps every
# residual autodiff asks for; "attention" keeps a block's input to the attention and recomputes
# the attention (norm, projections, rotary, scores) in the backward, keeping everything else
# (the MoE layer's residuals among it); "block" keeps only each block group's input and
# recomputes the whole group, its MoE layer included.
Remat = Literal["none", "attention", "block"]
REMATS: tuple[str, ...] = typing.get_args(Remat)
# The run's choice: one of `Remat`, or "auto": the first of them that fits the device's memory
# (train.memory.choose_remat).
RematChoice = Literal["auto", "none", "attention", "block"]
REMAT_CHOICES: tuple[str, ...] = typing.get_args(RematChoice)
# How the attention computes softmax(q k^T) v: "xla" (jax.nn.dot_product_attention's XLA
# implementation: the [B, N, S, S] scores in memory), "cudnn" (cuDNN's fused flash attention,
# GPUs only, bf16/f16), or "auto": "cudnn" on a GPU where it applies, else "xla".
AttentionImpl = Literal["auto", "xla", "cudnn"]
ATTENTION_IMPLS: tuple[str, ...] = typing.get_args(AttentionImpl)


def _float(name: str, value: typing.Any, *, low: float, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r} must be a real number")
    value = float(value)
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{name}={value!r} must be finite, in [{low}, {high}]")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only byte-level MoE language model.

    Attributes:
      vocab_size: V, 256 for bytes.
      d_model: D, the residual width (must equal `moe.d_model`).
      n_layers: L, transformer blocks.
      n_heads: N, attention heads.
      head_dim: H, the width of one head (N*H need not equal D).
      max_seq_len: the longest sequence the model is used on (rotary tables and sampling buffer).
      moe: the MoE feed-forward block's `mok_jax.MoEConfig`.
      moe_every: 1: every block's feed-forward is the MoE; 2: every other block (blocks 1, 3,
        ...), with a dense SwiGLU of width `dense_d_ff` in the others; and so on.
      dense_d_ff: the width of the dense SwiGLU blocks; None derives it as top_k * moe.d_ff
        (the routed experts' active width).
      rope_theta: the rotary embeddings' base.
      attention: the attention's implementation (see `AttentionImpl`); the same function.
      dtype: the compute dtype of the dense parts (embeddings, attention, dense SwiGLU); the
        logits and the loss are f32, and the MoE block computes in `moe.dtype`.
    """

    vocab_size: int = 256
    d_model: int
    n_layers: int
    n_heads: int
    head_dim: int
    max_seq_len: int
    moe: MoEConfig
    moe_every: int = 1
    dense_d_ff: int | None = None
    rope_theta: float = 10_000.0
    attention: AttentionImpl = "auto"
    dtype: typing.Any = jnp.float32

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "moe_every"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=1))
        head_dim = check_int("head_dim", self.head_dim, minimum=2)
        if head_dim % 2:
            raise ValueError(f"{head_dim=} must be even (rotary embeddings rotate pairs)")
        object.__setattr__(self, "head_dim", head_dim)
        if self.dense_d_ff is not None:
            object.__setattr__(
                self, "dense_d_ff", check_int("dense_d_ff", self.dense_d_ff, minimum=1)
            )
        object.__setattr__(self, "rope_theta", _float("rope_theta", self.rope_theta, low=1.0))
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention={self.attention!r} must be one of {ATTENTION_IMPLS}")
        if not isinstance(self.moe, MoEConfig):
            raise ValueError(f"moe={self.moe!r} must be a mok_jax.MoEConfig")
        if self.moe.d_model != self.d_model:
            raise ValueError(f"moe.d_model={self.moe.d_model} must equal d_model={self.d_model}")
        if self.moe_every > self.n_layers:
            raise ValueError(
                f"moe_every={self.moe_every} > n_layers={self.n_layers} leaves no MoE block"
            )

    def is_moe(self, layer: int) -> bool:
        """Whether block `layer` (0-based) has the MoE feed-forward (the last of each group of
        `moe_every` blocks)."""
        return (layer + 1) % self.moe_every == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe(l) for l in range(self.n_layers))

    @property
    def dense_width(self) -> int:
        """The width of the dense SwiGLU blocks."""
        return self.dense_d_ff or self.moe.top_k * self.moe.d_ff

    def to_json(self) -> dict[str, typing.Any]:
        """A JSON-able dict (dtypes by name); `from_json` inverts it."""
        out = dataclasses.asdict(self)
        out["dtype"] = self.dtype.name
        out["moe"] = self.moe.to_dict()
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, typing.Any]) -> ModelConfig:
        """The config `to_json` wrote; an MoE config saved with the flat performance fields of
        earlier versions loads with a DeprecationWarning (`MoEConfig.from_dict`)."""
        return cls(**{**data, "moe": MoEConfig.from_dict(data["moe"])})


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run.

    Attributes:
      steps: optimizer steps to run to (a resumed run continues up to this step).
      schedule_steps: the learning-rate schedule's length (warmup + cosine decay); independent
        of `steps`, so stopping at n and resuming to m gives the same run as m steps at once.
      warmup_steps: linear warmup from 0 (the first step uses peak_lr / warmup_steps).
      peak_lr: the learning rate after warmup.
      min_lr_ratio: the cosine decays to peak_lr * min_lr_ratio at `schedule_steps`.
      weight_decay: AdamW's decoupled decay, on matrices only (not norms, not the router bias).
      clip_norm: gradients are clipped to this global norm.
      batch_size: B, sequences per step (global, over all devices and processes).
      seq_len: S, tokens per sequence.
      eval_every: evaluate every this many steps (and at the end); 0 turns evaluation off.
      eval_batches: batches of the held-out split per evaluation.
      eval_fraction: the share of the data held out for evaluation, in (0, 0.5].
      save_every: save a checkpoint every this many steps (and always at the end); 0: at the end.
      seed: the seed of the initialization and of the batch order.
      implementation: the MoE layer's implementation (it replaces the model's), "auto" by
        default: `mok_jax.resolve` picks it for the device and says why (the run prints it).
      devices: devices to use (the first ones of the default backend); None: all.
      layout: the mesh layout: "expert" (1 x devices, EP = devices) or "data_expert".
      data_parallel: the data-parallel degree of "data_expert" (EP = devices / data_parallel).
      data: the text: "stdlib", "synthetic", or a path to a text file or a folder.
      workdir: where metrics, checkpoints, the plot and the samples go.
      router_bias_rate: the auxiliary-loss-free balancing's bias step after each update
        (`MoE.update_router_bias`); 0 turns it off.
      remat: the backward's rematerialization policy (see `Remat`), or "auto": the policy
        with the least recomputation whose memory estimate fits the device
        (`train.memory`). It changes memory and time, not values.
      grad_accum: microbatches per step: the batch's gradients are the mean of this many
        microbatches' (of batch_size / grad_accum sequences each), computed one after the
        other, so activations take 1 / grad_accum of the memory. The MoE's balancing losses
        and capacity apply per microbatch.
    """

    steps: int
    schedule_steps: int
    warmup_steps: int
    peak_lr: float
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    batch_size: int
    seq_len: int
    eval_every: int = 50
    eval_batches: int = 4
    eval_fraction: float = 0.05
    save_every: int = 100
    seed: int = 0
    implementation: Implementation | Literal["auto"] = "auto"
    devices: int | None = None
    layout: MeshLayout = "expert"
    data_parallel: int | None = None
    data: str = "stdlib"
    workdir: str = "runs/tiny"
    router_bias_rate: float = 0.0
    remat: RematChoice = "auto"
    grad_accum: int = 1

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "schedule_steps",
            "batch_size",
            "seq_len",
            "eval_batches",
            "grad_accum",
        ):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=1))
        for name in ("warmup_steps", "eval_every", "save_every", "seed"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=0))
        if self.warmup_steps >= self.schedule_steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} must be < schedule_steps={self.schedule_steps}"
            )
        object.__setattr__(self, "peak_lr", _float("peak_lr", self.peak_lr, low=0.0))
        object.__setattr__(
            self, "min_lr_ratio", _float("min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)
        )
        fraction = _float("eval_fraction", self.eval_fraction, low=0.0, high=0.5)
        if fraction == 0:
            raise ValueError(f"eval_fraction={fraction} must be > 0 (a held-out split)")
        object.__setattr__(self, "eval_fraction", fraction)
        for name in ("weight_decay", "router_bias_rate"):
            object.__setattr__(self, name, _float(name, getattr(self, name), low=0.0))
        object.__setattr__(self, "clip_norm", _float("clip_norm", self.clip_norm, low=1e-12))
        if self.implementation != "auto" and self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation={self.implementation!r} must be 'auto' or one of {IMPLEMENTATIONS}"
            )
        if self.devices is not None:
            object.__setattr__(self, "devices", check_int("devices", self.devices, minimum=1))
        if self.layout not in MESH_LAYOUTS:
            raise ValueError(f"layout={self.layout!r} must be one of {MESH_LAYOUTS}")
        if self.remat not in REMAT_CHOICES:
            raise ValueError(f"remat={self.remat!r} must be one of {REMAT_CHOICES}")
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"batch_size={self.batch_size} must be divisible by grad_accum={self.grad_accum}"
            )
        if self.data_parallel is not None:
            dp = check_int("data_parallel", self.data_parallel, minimum=1)
            object.__setattr__(self, "data_parallel", dp)
            if self.layout != "data_expert":
                raise ValueError(f"data_parallel={dp} needs layout='data_expert'")
        if not isinstance(self.data, str) or not self.data:
            raise ValueError(f"data={self.data!r} must be 'stdlib', 'synthetic' or a path")
        if not isinstance(self.workdir, str) or not self.workdir:
            raise ValueError(f"workdir={self.workdir!r} must be a path")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preset:
    model: ModelConfig
    train: TrainConfig


def _moe(**kw) -> MoEConfig:
    return MoEConfig(aux_loss_coef=1e-2, z_loss_coef=1e-3, **kw)


PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        # The default: 8 simulated CPU devices, EP = 8, a few minutes on 2 cores. f32 (XLA:CPU
        # emulates bf16 dots slowly); 32-row tiles keep the expert GEMMs' padding small at 256
        # tokens per device.
        "tiny": Preset(
            model=ModelConfig(
                d_model=128,
                n_layers=2,
                n_heads=4,
                head_dim=32,
                max_seq_len=128,
                moe=_moe(
                    d_model=128, d_ff=256, num_experts=8, top_k=2, dtype="float32", row_tile=32
                ),
            ),
            train=TrainConfig(
                steps=500,
                schedule_steps=500,
                warmup_steps=25,
                peak_lr=3e-3,
                batch_size=16,
                seq_len=128,
                eval_every=50,
                save_every=100,
                workdir="runs/tiny",
            ),
        ),
        # A larger CPU/GPU run: 16 experts top-2, a dense block every other layer.
        "small": Preset(
            model=ModelConfig(
                d_model=256,
                n_layers=4,
                n_heads=8,
                head_dim=32,
                max_seq_len=256,
                moe=_moe(
                    d_model=256, d_ff=256, num_experts=16, top_k=2, dtype="float32", row_tile=64
                ),
                moe_every=2,
            ),
            train=TrainConfig(
                steps=2000,
                schedule_steps=2000,
                warmup_steps=100,
                peak_lr=2e-3,
                batch_size=32,
                seq_len=256,
                eval_every=100,
                save_every=500,
                workdir="runs/small",
            ),
        ),
        # One H200 (or a few): bf16, 64 fine-grained experts top-4 plus a shared expert, sigmoid
        # routing with aux-loss-free bias balancing (DeepSeek-V3 style).
        "gpu": Preset(
            model=ModelConfig(
                d_model=1024,
                n_layers=12,
                n_heads=16,
                head_dim=64,
                max_seq_len=1024,
                moe=MoEConfig(
                    d_model=1024,
                    d_ff=512,
                    num_experts=64,
                    top_k=4,
                    score_fn="sigmoid",
                    norm_topk_prob=True,
                    num_shared_experts=1,
                    aux_loss_coef=1e-4,
                    z_loss_coef=1e-3,
                    dtype="bfloat16",
                    row_tile=128,
                    # One device holds 65,536 tokens a step: the token-wise stages (routing,
                    # combine, shared expert) in 4 chunks instead of 32 of the GPU's automatic
                    # 2048 (each chunk costs its kernels' launches: ~0.09 ms a layer, forward +
                    # backward, on one H200 at the qwen3 layer's shape).
                    options=MoEOptions(token_chunk=16384),
                ),
                dtype="bfloat16",
            ),
            train=TrainConfig(
                steps=5000,
                schedule_steps=5000,
                warmup_steps=200,
                peak_lr=1e-3,
                batch_size=64,
                seq_len=1024,
                eval_every=250,
                save_every=1000,
                workdir="runs/gpu",
                router_bias_rate=1e-3,
            ),
        ),
    }
)
