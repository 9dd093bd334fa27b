"""The training step's device memory, estimated before anything is compiled.

    estimate = estimate_memory(model_cfg, train_cfg, abstract_state, mesh, remat="none")
    print(estimate.report(device_bytes))

What one device holds at the step's peak, from shapes alone (abstract evaluation: no compile,
no device memory touched):

  state        the parameters, the router biases and the optimizer's state (their shards on
               this device), held across steps;
  gradients    one f32 copy of the parameters' shards (two with gradient accumulation: the
               microbatch's and the running sum);
  activations  what the forward keeps for the backward, for every block group of the scan
               under the rematerialization policy (`Remat`), measured by tracing one group's
               forward and counting the residuals its VJP holds (its parameters not counted);
  workspace    the backward's transients: one group's residuals under "none" (what a group's
               backward rebuilds or holds while it runs), its cotangents, and the logits, their
               softmax and their cotangent ([B, S, V] f32 each).

The figure is an estimate, not XLA's allocation: XLA may fuse some residuals away or keep
temporaries this does not count. `bench/train_step.py` records it beside XLA's own
`memory_analysis()` and the device's measured peak.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from mok_jax.options import device_memory as device_memory  # the step's fit check reads it here
from train.config import REMATS, ModelConfig, Remat, TrainConfig
from train.model import Block, Group

GIB = 1024**3

# The share of the device's memory limit an estimate may fill: the rest is left for what it
# does not count (XLA's temporaries beyond the workspace, fragmentation).
FIT_FRACTION = 0.9


class DoesNotFit(ValueError):
    """The step's estimated memory exceeds the device's; the message names the flags that
    would make it fit."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes on one device at the train step's peak (see the module docstring).

    Attributes:
      remat: the rematerialization policy the activations are counted under.
      grad_accum: microbatches per step.
      state: parameters, router biases and optimizer state.
      gradients: f32 gradients (and their running sum with gradient accumulation).
      activations_per_group: residuals one block group keeps for the backward.
      groups: the block groups the scan runs (and the dense blocks after them, as groups).
      workspace: the backward's transients.
    """

    remat: str
    grad_accum: int
    state: int
    gradients: int
    activations_per_group: int
    groups: int
    workspace: int

    @property
    def activations(self) -> int:
        return self.activations_per_group * self.groups

    @property
    def total(self) -> int:
        return self.state + self.gradients + self.activations + self.workspace

    def report(self, device_bytes: int | None) -> str:
        """One line: each part in GiB and the total against the device's memory."""
        parts = (
            f"state {self.state / GIB:.2f} GiB + gradients {self.gradients / GIB:.2f} + "
            f"activations {self.activations / GIB:.2f} ({self.groups} x "
            f"{self.activations_per_group / GIB:.3f}, remat {self.remat!r}"
            f"{f', {self.grad_accum} microbatches' if self.grad_accum > 1 else ''}) + "
            f"workspace {self.workspace / GIB:.2f} = {self.total / GIB:.2f} GiB"
        )
        if device_bytes is None:
            return f"memory estimate: {parts}"
        return (
            f"memory estimate: {parts} of the device's {device_bytes / GIB:.1f} GiB "
            f"({self.total / device_bytes:.0%})"
        )

    def fits(self, device_bytes: int | None) -> bool:
        return device_bytes is None or self.total <= FIT_FRACTION * device_bytes


def _shard_size(leaf: Any) -> int:
    """Elements of one device's shard of an abstract array (a ShapeDtypeStruct, its sharding
    if it has one)."""
    sharding = getattr(leaf, "sharding", None)
    return math.prod(leaf.shape if sharding is None else sharding.shard_shape(leaf.shape))


def _shard_bytes(tree: Any) -> int:
    """Bytes of one device's shards of an abstract pytree."""
    return sum(_shard_size(a) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def residual_bytes(fn, *args) -> int:
    """Bytes of what `jax.vjp(fn, *args)` keeps for the backward, its arguments not counted
    (they are held anyway), by abstract evaluation."""
    leaves, tree = jax.tree.flatten(args)

    def flat(*leaves):
        return jax.vjp(lambda *a: fn(*jax.tree.unflatten(tree, a)), *leaves)

    closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*leaves)
    jaxpr = closed.jaxpr
    num_res = len(jax.tree.leaves(out_shape[1]))
    inputs = set(jaxpr.invars)
    seen, total = set(), 0
    for var in jaxpr.outvars[len(jaxpr.outvars) - num_res :]:
        if isinstance(var, jax.extend.core.Literal) or var in inputs or var in seen:
            continue
        seen.add(var)
        total += math.prod(var.aval.shape) * jnp.dtype(var.aval.dtype).itemsize
    return total


@functools.lru_cache(maxsize=16)
def _group_residuals(model_cfg: ModelConfig, batch: int, seq_len: int) -> tuple[int, int, int]:
    """(residual bytes of one block group under remat "none", of its attention sublayers
    alone, bytes of one [batch, seq_len, D] activation) for `batch` sequences on one device
    without a mesh."""
    x = jax.ShapeDtypeStruct((batch, seq_len, model_cfg.d_model), model_cfg.dtype)
    group = nnx.eval_shape(lambda: Group(model_cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(group)

    def run_group(x, state):
        return nnx.merge(graphdef, state)(x)

    block = nnx.eval_shape(lambda: Block(model_cfg, moe=False, rngs=nnx.Rngs(0)))
    attn_def, attn_state = nnx.split((block.attn_norm, block.attn))

    def run_attention(x, state):
        norm, attn = nnx.merge(attn_def, state)
        return attn(norm(x))

    carry = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
    return (
        residual_bytes(run_group, x, state),
        residual_bytes(run_attention, x, attn_state) * model_cfg.moe_every,
        carry,
    )


def estimate_memory(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    abstract_state: Any,
    mesh: Mesh | None,
    remat: Remat,
) -> MemoryEstimate:
    """The step's memory on one device under `remat` (see the module docstring).

    Args:
      model_cfg: the model (its MoE implementation as the step runs it).
      train_cfg: the run: batch, sequence length, gradient accumulation.
      abstract_state: the `TrainState` as ShapeDtypeStructs carrying their shardings.
      mesh: the step's mesh, or None for one device.
      remat: the rematerialization policy.
    """
    if remat not in REMATS:
        raise ValueError(f"remat={remat!r} must be one of {REMATS}")
    devices = 1 if mesh is None else mesh.size
    accum = train_cfg.grad_accum
    batch = max(1, train_cfg.batch_size // (devices * accum))
    group_none, attention, carry = _group_residuals(model_cfg, batch, train_cfg.seq_len)
    per_group = {
        "none": group_none,
        # The attention sublayers keep their input instead of their residuals.
        "attention": max(group_none - attention + model_cfg.moe_every * carry, carry),
        "block": carry,
    }[remat]
    tail = model_cfg.n_layers - model_cfg.num_moe_layers * model_cfg.moe_every
    groups = model_cfg.num_moe_layers + math.ceil(tail / model_cfg.moe_every)
    f32_params = 4 * sum(_shard_size(a) for a in jax.tree.leaves(abstract_state.params))
    state = _shard_bytes(abstract_state)
    logits = batch * train_cfg.seq_len * model_cfg.vocab_size * 4
    return MemoryEstimate(
        remat=remat,
        grad_accum=accum,
        state=state,
        gradients=f32_params * (2 if accum > 1 else 1),
        activations_per_group=per_group,
        groups=groups,
        workspace=2 * group_none + 3 * logits,
    )


def choose_remat(estimates: dict[str, MemoryEstimate], device_bytes: int | None) -> str:
    """The first policy of `REMATS` (least recomputation first) whose estimate fits."""
    for remat in REMATS:
        if estimates[remat].fits(device_bytes):
            return remat
    return REMATS[-1]


def fit_advice(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    abstract_state: Any,
    mesh: Mesh | None,
    device_bytes: int,
) -> list[str]:
    """Flag settings that fit the device: the lightest remat policy that fits at this batch,
    else the fewest microbatches (`--grad-accum`) that fit under "block", else the largest
    batch that fits."""
    for remat in REMATS:
        est = estimate_memory(model_cfg, train_cfg, abstract_state, mesh, remat)
        if est.fits(device_bytes):
            return [f"--remat {remat}"]
    devices = 1 if mesh is None else mesh.size
    per_device = train_cfg.batch_size // devices
    advice = []
    for accum in range(2, per_device + 1):
        if per_device % accum:
            continue
        cfg = dataclasses.replace(train_cfg, grad_accum=accum)
        for remat in REMATS:
            est = estimate_memory(model_cfg, cfg, abstract_state, mesh, remat)
            if est.fits(device_bytes):
                advice.append(f"--grad-accum {accum} --remat {remat}")
                break
        if advice:
            break
    return advice


def check_fits(estimate: MemoryEstimate, device_bytes: int | None, advice: list[str]) -> None:
    """Raises `DoesNotFit` naming `advice` when the estimate exceeds the device's memory."""
    if estimate.fits(device_bytes):
        return
    assert device_bytes is not None
    fix = (
        f"try {' or '.join(advice)}"
        if advice
        else "nothing at this model size fits one device: use more devices (--devices) or "
        "a smaller model"
    )
    raise DoesNotFit(
        f"the train step will not fit: {estimate.report(device_bytes)}, above "
        f"{FIT_FRACTION:.0%} of it; {fix}"
    )
