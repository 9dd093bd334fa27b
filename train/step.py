"""The optimizer, the training state and the jitted train and eval steps over a (data, expert)
mesh.

The state is one pytree (`TrainState`: step, parameters, router biases, optimizer state) of
plain dicts of arrays, so orbax saves and restores it as is. The train step is compiled once,
with explicit in/out shardings (parameters as their variables' `out_sharding` metadata says:
experts over `expert`, the rest replicated; the batch over (`data`, `expert`)), the state
donated, and mok_jax's compile options (`mok_jax.compiler_options()`: deterministic GEMM
choice on GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import Array, lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import mok_jax
from mok_jax.layer import resolution
from train import compile_cache, memory
from train.compile_cache import CompileTimes
from train.config import REMATS, ModelConfig, TrainConfig
from train.model import LanguageModel, cross_entropy

# The train step's metrics (see `Trainer.train_step`).
METRIC_KEYS = ("dropped", "grad_norm", "loss", "lr", "rounds", "tokens_per_expert", "total_loss")

# The batch's sharding: sequences over every device of the mesh.
BATCH_SPEC = PartitionSpec(("data", "expert"), None)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["step", "params", "model_state", "opt_state"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a run carries from step to step (a pytree; what a checkpoint holds).

    Attributes:
      step: int32 [] optimizer steps taken.
      params: the trained weights, a nested dict of f32 arrays (`nnx.to_pure_dict`).
      model_state: the non-trained variables (the MoE blocks' router biases), a nested dict.
      opt_state: the optax state of `make_optimizer`.
    """

    step: Array
    params: dict[str, Any]
    model_state: dict[str, Any]
    opt_state: optax.OptState


def make_schedule(cfg: TrainConfig) -> optax.Schedule:
    """The learning rate of update `count` (0-based): linear warmup reaching peak_lr at update
    warmup_steps, then a cosine decay to peak_lr * min_lr_ratio at update schedule_steps."""
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.peak_lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.schedule_steps,
        end_value=cfg.peak_lr * cfg.min_lr_ratio,
    )
    # Shifted by one so the first update does not have a learning rate of 0.
    return lambda count: base(count + 1)


def _decay_mask(params: dict[str, Any]) -> dict[str, Any]:
    """Weight decay on matrices only (not the norms' scales)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (b1 0.9, b2 0.95) on the schedule of `make_schedule`."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(
            make_schedule(cfg), b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=_decay_mask
        ),
    )


def make_train_mesh(cfg: TrainConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """The (data, expert) mesh of a run: the first `cfg.devices` devices (all by default)."""
    devices = list(jax.devices() if devices is None else devices)
    if cfg.devices is not None:
        if cfg.devices > len(devices):
            raise ValueError(f"devices={cfg.devices} but only {len(devices)} are available")
        devices = devices[: cfg.devices]
    if cfg.layout == "expert":
        return mok_jax.make_mesh("expert", devices=devices)
    data = cfg.data_parallel or 1
    if len(devices) % data:
        raise ValueError(
            f"data_parallel={data} must divide the {len(devices)} devices: layout='data_expert' "
            f"is data_parallel x expert, expert = devices / data_parallel"
        )
    return mok_jax.make_mesh("data_expert", data=data, devices=devices)


def _spec(a: jax.ShapeDtypeStruct) -> PartitionSpec:
    """The spec of an abstract array of the state (a scalar without one is replicated)."""
    return PartitionSpec() if a.sharding is None else a.sharding.spec


class Trainer:
    """The model's graph, the optimizer and the compiled steps for one mesh.

    Args:
      model_cfg: the `ModelConfig` (its MoE implementation is replaced by `train_cfg`'s).
      train_cfg: the `TrainConfig`.
      mesh: the (data, expert) mesh (see `make_train_mesh`), or None for one device without a
        mesh (any MoE implementation).
      max_traces: if set, the train step raises when traced more often (`chex.assert_max_traces`).
      check_memory: estimate the step's memory before compiling (`train.memory`) and raise
        `memory.DoesNotFit`, naming the flags that would make it fit, when it exceeds the
        device's (where the device says how much it has).

    Attributes:
      remat: the rematerialization policy the step runs under (`train_cfg.remat`, with "auto"
        resolved by the memory estimate).
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        mesh: Mesh | None,
        *,
        max_traces: int | None = None,
        check_memory: bool = True,
    ):
        moe_cfg = dataclasses.replace(model_cfg.moe, implementation=train_cfg.implementation)
        self.model_cfg = dataclasses.replace(model_cfg, moe=moe_cfg)
        self.train_cfg = train_cfg
        self.mesh = mesh
        self.tx = make_optimizer(train_cfg)
        self.schedule = make_schedule(train_cfg)
        self._check()
        self.moe_resolution = self._resolve_moe()
        with self.context():
            abstract = nnx.eval_shape(lambda: LanguageModel(self.model_cfg, rngs=nnx.Rngs(0)))
            self.graphdef, _, _ = nnx.split(abstract, nnx.Param, ...)
            self.abstract_state = jax.eval_shape(self._init)
        if mesh is None:
            self.state_shardings = None
            self.batch_sharding = None
        else:
            self.state_shardings = jax.tree.map(
                lambda a: NamedSharding(mesh, _spec(a)), self.abstract_state
            )
            self.batch_sharding = NamedSharding(mesh, BATCH_SPEC)
        self.device_bytes = memory.device_memory(self.devices[0])
        self.remat = self._choose_remat(check_memory)
        self._run = self._compiled = None
        self._init_jit = jax.jit(self._init, out_shardings=self.state_shardings)
        step_fn = self._train_step
        if max_traces is not None:
            step_fn = chex.assert_max_traces(step_fn, n=max_traces)
        self._step_fn = step_fn
        options = mok_jax.compiler_options()
        if mesh is None:
            self._step = jax.jit(step_fn, donate_argnums=0, compiler_options=options)
            self._eval = jax.jit(self._eval_loss, compiler_options=options)
        else:
            replicated = NamedSharding(mesh, PartitionSpec())
            batch = (self.batch_sharding, self.batch_sharding)
            self._step = jax.jit(
                step_fn,
                in_shardings=(self.state_shardings, *batch),
                out_shardings=(self.state_shardings, replicated),
                donate_argnums=0,
                compiler_options=options,
            )
            self._eval = jax.jit(
                self._eval_loss,
                in_shardings=(self.state_shardings, *batch),
                out_shardings=replicated,
                compiler_options=options,
            )

    def _check(self) -> None:
        cfg, mesh = self.train_cfg, self.mesh
        if cfg.seq_len > self.model_cfg.max_seq_len:
            raise ValueError(f"seq_len={cfg.seq_len} > max_seq_len={self.model_cfg.max_seq_len}")
        if mesh is None:
            return
        # The layer itself rejects the oracle under a mesh when traced: say it before
        # compiling anything.
        if cfg.implementation == "reference":
            raise ValueError(
                "implementation='reference' runs on one device without a mesh (--devices 1); "
                "under a mesh use 'xla', 'pallas' or 'fused'"
            )
        ep, devices = mesh.shape["expert"], mesh.size
        experts = self.model_cfg.moe.num_experts
        if experts % ep:
            raise ValueError(f"num_experts={experts} must be divisible by the expert degree {ep}")
        if cfg.batch_size % devices:
            raise ValueError(
                f"batch_size={cfg.batch_size} must be divisible by the {devices} devices"
            )
        if cfg.batch_size % (devices * cfg.grad_accum):
            raise ValueError(
                f"batch_size={cfg.batch_size} must be divisible by the {devices} devices times "
                f"grad_accum={cfg.grad_accum} (every microbatch spreads over every device)"
            )

    def _resolve_moe(self) -> mok_jax.Resolution:
        """What the MoE layers resolve their "auto" choices to inside the step (they do it
        themselves when traced, from the same facts: a microbatch's tokens, the mesh and the
        device); for the run's printout and config.json. Raises ValueError, before anything
        compiles, for a choice that cannot run."""
        cfg = self.train_cfg
        tokens = cfg.batch_size * cfg.seq_len // cfg.grad_accum
        return resolution(self.model_cfg.moe, tokens, self.mesh)

    @property
    def devices(self) -> list[jax.Device]:
        """The step's devices (the mesh's, or the default device)."""
        return [jax.devices()[0]] if self.mesh is None else list(self.mesh.devices.flat)

    def memory_estimate(self, remat: str | None = None) -> memory.MemoryEstimate:
        """The step's estimated memory on one device under `remat` (default: the step's)."""
        return memory.estimate_memory(
            self.model_cfg,
            self.train_cfg,
            self.abstract_state,
            self.mesh,
            self.remat if remat is None else remat,
        )

    def _choose_remat(self, check_memory: bool) -> str:
        """`train_cfg.remat`, "auto" resolved: the least recomputation whose estimate fits
        ("none" where the device does not say its memory); raises `memory.DoesNotFit` when
        `check_memory` and the chosen policy does not fit."""
        choice, device_bytes = self.train_cfg.remat, self.device_bytes
        if choice == "auto":
            if device_bytes is None:
                return "none"
            estimates = {r: self.memory_estimate(r) for r in REMATS}
            choice = memory.choose_remat(estimates, device_bytes)
        if check_memory and device_bytes is not None:
            estimate = self.memory_estimate(choice)
            if not estimate.fits(device_bytes):
                advice = memory.fit_advice(
                    self.model_cfg, self.train_cfg, self.abstract_state, self.mesh, device_bytes
                )
                memory.check_fits(estimate, device_bytes, advice)
        return choice

    @contextlib.contextmanager
    def context(self):
        """The mesh context the model runs under (nothing without a mesh)."""
        if self.mesh is None:
            yield
        else:
            with jax.set_mesh(self.mesh):
                yield

    # -- state -------------------------------------------------------------------------------

    def _init(self) -> TrainState:
        model = LanguageModel(self.model_cfg, rngs=nnx.Rngs(self.train_cfg.seed))
        _, params, rest = nnx.split(model, nnx.Param, ...)
        params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            model_state=rest,
            opt_state=self.tx.init(params),
        )

    def init_state(self) -> TrainState:
        """A fresh state (the seed's initialization), placed on the mesh."""
        with self.context():
            return self._init_jit()

    def model(self, state: TrainState) -> LanguageModel:
        """The NNX model holding `state`'s weights and router biases."""
        return nnx.merge(self.graphdef, state.params, state.model_state)

    # -- steps -------------------------------------------------------------------------------

    def _losses(self, params, model_state, inputs, targets, remat="none"):
        logits, aux = nnx.merge(self.graphdef, params, model_state)(inputs, remat)
        lm_loss = cross_entropy(logits, targets)
        return lm_loss + jnp.sum(aux.loss), (lm_loss, aux)

    def _gradients(self, state: TrainState, inputs: Array, targets: Array):
        """((total, (lm_loss, aux)), grads) of the batch, over `grad_accum` microbatches: each
        microbatch's gradients in f32, summed in microbatch order and averaged (a fixed order,
        so the same bits run after run); the losses averaged, the expert loads summed."""
        grad_fn = jax.value_and_grad(self._losses, has_aux=True)
        remat = self.remat
        accum = self.train_cfg.grad_accum
        if accum == 1:
            return grad_fn(state.params, state.model_state, inputs, targets, remat)
        micro_inputs, micro_targets = (self._microbatches(a, accum) for a in (inputs, targets))

        def step(grads_acc, batch):
            out, grads = grad_fn(state.params, state.model_state, *batch, remat)
            grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
            return grads_acc, out

        zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), state.params)
        grads, (total, (lm_loss, aux)) = lax.scan(step, zeros, (micro_inputs, micro_targets))
        grads = jax.tree.map(lambda g, p: (g / accum).astype(p.dtype), grads, state.params)
        aux = dataclasses.replace(
            jax.tree.map(lambda a: jnp.mean(a, axis=0), aux),
            tokens_per_expert=jnp.sum(aux.tokens_per_expert, axis=0),
            dropped=jnp.sum(aux.dropped, axis=0),
            rounds=jnp.max(aux.rounds, axis=0),
        )
        return (jnp.mean(total), (jnp.mean(lm_loss), aux)), grads

    def _microbatches(self, a: Array, accum: int) -> Array:
        """[B, S] -> [accum, B / accum, S]: microbatch i holds rows i, i + accum, ..., so each
        spreads over every device as the batch does."""
        rows, seq = a.shape
        shape = (rows // accum, accum, seq)
        if self.mesh is None:
            return jnp.swapaxes(a.reshape(shape), 0, 1)
        spec = PartitionSpec(BATCH_SPEC[0], None, None)
        split = lax.reshape(a, shape, out_sharding=NamedSharding(self.mesh, spec))
        return jnp.swapaxes(split, 0, 1)

    def _train_step(self, state: TrainState, inputs: Array, targets: Array):
        (total, (lm_loss, aux)), grads = self._gradients(state, inputs, targets)
        # optax computes Adam's bias correction as `decay**count` (float ** int32), which strict
        # dtype promotion (the test suite's) rejects: optax's promotion, scoped to it.
        with jax.numpy_dtype_promotion("standard"), jax.named_scope("optimizer"):
            updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
            lr = jnp.asarray(self.schedule(state.step), jnp.float32)
        params = optax.apply_updates(state.params, updates)
        model_state = state.model_state
        rate = self.train_cfg.router_bias_rate
        if rate > 0:
            model = nnx.merge(self.graphdef, params, model_state)
            moe = model.groups.moe.ffn
            update = jax.vmap(mok_jax.update_router_bias, in_axes=(0, 0, None))
            moe.router_bias[...] = update(moe.router_bias[...], aux.tokens_per_expert, rate)
            model_state = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
        metrics = {
            "loss": lm_loss,
            "total_loss": total,
            "grad_norm": optax.tree.norm(grads),
            "lr": lr,
            "tokens_per_expert": aux.tokens_per_expert,
            "dropped": jnp.sum(aux.dropped),
            "rounds": aux.rounds,
        }
        new_state = TrainState(
            step=state.step + 1, params=params, model_state=model_state, opt_state=opt_state
        )
        return new_state, metrics

    def _eval_loss(self, state: TrainState, inputs: Array, targets: Array) -> Array:
        return self._losses(state.params, state.model_state, inputs, targets)[1][0]

    def place_batch(self, local: np.ndarray) -> Array:
        """This process's rows of a global batch [B / processes, S] -> the global array [B, S]
        sharded over the mesh (one device without a mesh)."""
        if self.mesh is None:
            return jnp.asarray(local)
        return jax.make_array_from_process_local_data(self.batch_sharding, local)

    def compile(self) -> CompileTimes:
        """Gets the train step ready for the run's batch shape without running it (trace,
        lower, compile, through `train.compile_cache` when it is on) and keeps it for
        `train_step`; returns the seconds each stage took."""
        args = self._abstract_args()
        out_tree = jax.tree.structure((args[0], dict.fromkeys(METRIC_KEYS, 0)))
        out_shardings = None
        if self.mesh is not None:
            replicated = NamedSharding(self.mesh, PartitionSpec())
            out_shardings = (self.state_shardings, dict.fromkeys(METRIC_KEYS, replicated))
        with self.context():
            self._run, self._compiled, times = compile_cache.compile_step(
                self._step,
                self._step_fn,
                args,
                out_tree,
                out_shardings,
                donate_argnums=(0,),
                compiler_options=mok_jax.compiler_options(),
                key=self._step_key(args),
                exportable=self._why_not_exportable(),
            )
        return times

    def _abstract_args(self) -> tuple:
        """(state, inputs, targets) of the step as ShapeDtypeStructs with their shardings."""
        cfg = self.train_cfg
        batch = jax.ShapeDtypeStruct(
            (cfg.batch_size, cfg.seq_len), jnp.int32, sharding=self.batch_sharding
        )
        state = self.abstract_state
        if self.state_shardings is not None:
            state = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                state,
                self.state_shardings,
            )
        return state, batch, batch

    def _step_key(self, args: tuple) -> compile_cache.StepKey:
        """What the lowered step depends on, besides the sources and package versions."""
        mesh = self.mesh
        return compile_cache.StepKey(
            {
                "model": self.model_cfg.to_json(),
                "train": {
                    k: v
                    for k, v in dataclasses.asdict(self.train_cfg).items()
                    if k not in (*_RUN_ONLY_FIELDS, "seed")
                },
                "remat": self.remat,
                "devices": [(d.id, d.device_kind) for d in self.devices],
                "mesh": None if mesh is None else [mesh.axis_names, list(mesh.shape.values())],
                "args": [(a.shape, str(a.dtype), str(a.sharding)) for a in jax.tree.leaves(args)],
                "options": mok_jax.compiler_options(),
            }
        )

    def _why_not_exportable(self) -> str | None:
        """Why the step cannot be kept as a lowered program (None: it can)."""
        if jax.process_count() > 1:
            return "one lowered step per process"
        if importlib.util.find_spec("flatbuffers") is None:
            return "flatbuffers, which jax.export's serialization needs, is not installed"
        kernels = self.moe_resolution.config.implementation in ("pallas", "fused")
        if kernels and jax.default_backend() == "cpu":
            return "the kernels' interpret mode calls back to Python"
        return None

    @property
    def compiled(self) -> bool:
        """Whether `compile` has run (the step's executable is kept)."""
        return self._compiled is not None

    def compiled_memory(self) -> dict[str, int] | None:
        """XLA's memory analysis of the compiled step (bytes of arguments, outputs,
        temporaries; None before `compile` or where the backend gives none)."""
        if self._compiled is None:
            return None
        analysis = self._compiled.memory_analysis()
        if analysis is None:
            return None
        names = ("argument", "output", "temp", "alias", "generated_code")
        return {n: int(getattr(analysis, f"{n}_size_in_bytes", 0)) for n in names}

    def train_step(
        self, state: TrainState, inputs: Array, targets: Array
    ) -> tuple[TrainState, dict[str, Array]]:
        """One update: (state, inputs int32 [B, S], targets int32 [B, S]) -> (new state,
        metrics), dispatched without waiting for the device. `state` is donated: do not use it
        afterwards. Metrics: loss (LM cross-entropy), total_loss (plus the MoE aux and z
        losses), grad_norm (before clipping), lr, tokens_per_expert int32 [MoE layers, E],
        dropped, rounds [MoE layers]."""
        with self.context():
            step = self._step if self._run is None else self._run
            return step(state, inputs, targets)

    def eval_loss(self, state: TrainState, inputs: Array, targets: Array) -> Array:
        """The LM cross-entropy of one batch (f32 [])."""
        with self.context():
            return self._eval(state, inputs, targets)


# TrainConfig fields that do not change what the compiled programs compute.
_RUN_ONLY_FIELDS = (
    "steps",
    "eval_every",
    "eval_batches",
    "eval_fraction",
    "save_every",
    "data",
    "workdir",
)


@functools.lru_cache(maxsize=8)
def _cached_trainer(model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: Mesh | None) -> Trainer:
    return Trainer(model_cfg, train_cfg, mesh)


def get_trainer(model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: Mesh | None) -> Trainer:
    """A `Trainer`, shared with earlier calls whose configs differ only in run-only fields
    (steps, evaluation and save intervals, data, workdir): a run resumed in the same process
    reuses the compiled steps. The returned trainer's `train_cfg` has those fields reset."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    key = dataclasses.replace(
        train_cfg,
        steps=train_cfg.schedule_steps,
        **{name: defaults[name] for name in _RUN_ONLY_FIELDS if name != "steps"},
    )
    return _cached_trainer(model_cfg, key, mesh)
