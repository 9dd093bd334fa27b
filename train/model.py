"""A decoder-only byte-level language model with `mok_jax.MoE` feed-forward blocks (Flax NNX).

  tokens [B, S] int32
  -> embedding (a one-hot matmul: its gradient is a dot, not a scatter-add)      [B, S, D]
  -> L blocks: x += attention(rmsnorm(x)); x += ffn(rmsnorm(x))
       attention: causal, rotary positions, `jax.nn.dot_product_attention`
       ffn: `mok_jax.MoE` in every `moe_every`-th block, a dense SwiGLU in the others
       (stored stacked by group of `moe_every` blocks and applied by one `lax.scan`)
  -> rmsnorm -> output head (untied from the embedding)                          [B, S, V] f32

Every variable carries its `out_sharding` (dense weights replicated; the MoE's experts over the
`expert` mesh axis), so the training step reads the state's shardings off the model. Under
`jax.set_mesh(mesh)` the MoE blocks run expert parallel; the dense parts follow the batch's
sharding (batch over (`data`, `expert`)).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array, lax

import mok_jax
from mok_jax import MoEAux
from train.config import REMATS, ModelConfig, Remat


def _eager() -> bool:
    """Place variables at creation when a mesh with the MoE's axes is set (as `mok_jax.MoE`)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and {"data", "expert"} <= set(mesh.axis_names)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], *, fan_in: int | None = None) -> nnx.Param:
    """A replicated f32 weight: truncated normal (at 2 sigma) scaled by 1 / sqrt(fan_in)
    (fan_in: shape[0] by default)."""
    fan_in = shape[0] if fan_in is None else fan_in
    value = jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)
    value = value * jnp.float32(fan_in**-0.5)
    return nnx.Param(value, out_sharding=(None,) * len(shape), eager_sharding=_eager())


class RMSNorm(nnx.Module):
    """x * rsqrt(mean(x^2) + eps) * scale, computed in f32, returned in `dtype`."""

    def __init__(self, dim: int, *, dtype: jnp.dtype, eps: float = 1e-6):
        self.scale = nnx.Param(
            jnp.ones((dim,), jnp.float32), out_sharding=(None,), eager_sharding=_eager()
        )
        self.dtype = dtype
        self.eps = eps

    def __call__(self, x_bsd: Array) -> Array:
        x = x_bsd.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * self.scale[...]).astype(self.dtype)


def rotary(x_bsnh: Array, theta: float) -> Array:
    """Rotary position embedding of [B, S, N, H] at positions 0..S-1 (halves rotated, f32)."""
    seq_len, head_dim = x_bsnh.shape[1], x_bsnh.shape[3]
    half = head_dim // 2
    freq_h = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_sh = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * freq_h[None, :]
    cos, sin = jnp.cos(angle_sh)[None, :, None, :], jnp.sin(angle_sh)[None, :, None, :]
    x = x_bsnh.astype(jnp.float32)
    x1, x2 = x[..., :half], x[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bsnh.dtype)


class Attention(nnx.Module):
    """Causal multi-head self-attention with rotary positions: [B, S, D] -> [B, S, D]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, nh = cfg.d_model, cfg.n_heads * cfg.head_dim
        self.w_qkv = _param(rngs, (d, 3, cfg.n_heads, cfg.head_dim), fan_in=d)
        self.w_out = _param(rngs, (cfg.n_heads, cfg.head_dim, d), fan_in=nh)
        self.cfg = cfg

    def __call__(self, x_bsd: Array) -> Array:
        cfg = self.cfg
        w_qkv = self.w_qkv[...].astype(cfg.dtype)
        # One product per projection, each [B, S, N, H] as the attention reads it: one product
        # into [3, B, S, N, H] made the backward transpose its cotangent twice (into the input
        # gradient's and the weights' layouts), ~1.1 ms a block on an H100 at the gpu preset.
        q, k, v = (jnp.einsum("bsd,dnh->bsnh", x_bsd, w_qkv[:, i]) for i in range(3))
        q, k = rotary(q, cfg.rope_theta), rotary(k, cfg.rope_theta)
        # jax's XLA attention promotes bf16 logits to f32 implicitly (`promote_types`), which
        # strict dtype promotion (the test suite's) rejects: jax's promotion, scoped to it.
        with jax.numpy_dtype_promotion("standard"):
            out_bsnh = jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation=attention_impl(cfg)
            )
        return jnp.einsum("bsnh,nhd->bsd", out_bsnh, self.w_out[...].astype(cfg.dtype))


def attention_impl(cfg: ModelConfig) -> str:
    """The attention implementation `cfg.attention` resolves to on the default backend:
    "auto" is cuDNN's fused attention on a GPU for bf16/f16 heads of at most 128 (a multiple of
    8), XLA's otherwise."""
    if cfg.attention != "auto":
        return cfg.attention
    fits_cudnn = cfg.dtype.name in ("bfloat16", "float16") and cfg.head_dim <= 128
    fits_cudnn = fits_cudnn and cfg.head_dim % 8 == 0
    return "cudnn" if jax.default_backend() == "gpu" and fits_cudnn else "xla"


class SwiGLU(nnx.Module):
    """A dense SwiGLU feed-forward: silu(x W_gate) * (x W_up) W_down."""

    def __init__(self, d_model: int, d_ff: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.w_gate = _param(rngs, (d_model, d_ff))
        self.w_up = _param(rngs, (d_model, d_ff))
        self.w_down = _param(rngs, (d_ff, d_model))
        self.dtype = dtype

    def __call__(self, x_bsd: Array) -> Array:
        def w(p: nnx.Param) -> Array:
            return p[...].astype(self.dtype)

        h = jax.nn.silu(x_bsd @ w(self.w_gate)) * (x_bsd @ w(self.w_up))
        return h @ w(self.w_down)


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + ffn(norm(x)), the feed-forward an
    MoE (`moe=True`, returning its `MoEAux` too) or a dense SwiGLU."""

    def __init__(self, cfg: ModelConfig, *, moe: bool, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, dtype=cfg.dtype)
        self.attn = Attention(cfg, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, dtype=cfg.dtype)
        self.is_moe = moe
        if moe:
            self.ffn = mok_jax.MoE(cfg.moe, rngs=rngs)
        else:
            self.ffn = SwiGLU(cfg.d_model, cfg.dense_width, dtype=cfg.dtype, rngs=rngs)

    def __call__(self, x_bsd: Array, remat: Remat = "none") -> tuple[Array, MoEAux | None]:
        with jax.named_scope("attention"):
            x_bsd = x_bsd + _attention(self.attn_norm, self.attn, x_bsd, remat)
        with jax.named_scope("moe" if self.is_moe else "dense_ffn"):
            h = self.ffn_norm(x_bsd)
            if self.is_moe:
                y, aux = self.ffn(h)
                return x_bsd + y.astype(x_bsd.dtype), aux
            return x_bsd + self.ffn(h), None


def _attention(norm: RMSNorm, attn: Attention, x_bsd: Array, remat: Remat) -> Array:
    """attn(norm(x)); under remat "attention" only its input is kept for the backward."""
    if remat != "attention":
        return attn(norm(x_bsd))
    return nnx.remat(lambda norm, attn, x: attn(norm(x)), prevent_cse=False)(norm, attn, x_bsd)


class Group(nnx.Module):
    """One repeat of the block pattern: `moe_every - 1` dense blocks, then an MoE block."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.dense = nnx.List([Block(cfg, moe=False, rngs=rngs) for _ in range(cfg.moe_every - 1)])
        self.moe = Block(cfg, moe=True, rngs=rngs)

    def __call__(self, x_bsd: Array, remat: Remat = "none") -> tuple[Array, MoEAux]:
        for block in self.dense:
            x_bsd, _ = block(x_bsd, remat)
        return self.moe(x_bsd, remat)


def _stacked(make, count: int, rngs: nnx.Rngs):
    """`count` modules `make(rngs)`, each from its own split of the keys, as one module whose
    variables have a leading [count] axis (replicated over the mesh)."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def build(rngs: nnx.Rngs):
        return make(rngs)

    return build(rngs)


def scan_groups(
    groups: Group, x_bsd: Array, remat: Remat, *, unroll: bool = False
) -> tuple[Array, MoEAux]:
    """Applies the stacked groups in order with one `lax.scan`: the group (and the MoE layer's
    kernels in it) is traced, lowered and compiled once, however many there are. Returns the
    last group's output and the MoE blocks' `MoEAux`, each field with a leading [G] axis.
    `unroll=True` unrolls the scan (one copy of the group per group in the program: what the
    scan costs is measured against it, `bench/scan_cost.py`)."""
    graphdef, state = nnx.split(groups)

    def body(x, group_state):
        return nnx.merge(graphdef, group_state)(x, remat)

    if remat == "block":
        body = jax.checkpoint(body, prevent_cse=False)
    return lax.scan(body, x_bsd, state, unroll=unroll)


class LanguageModel(nnx.Module):
    """The byte-level MoE language model.

    The blocks repeat a pattern of `moe_every` blocks (`Group`: dense blocks, then an MoE
    block); the G = n_layers // moe_every groups are stored stacked (every variable of
    `groups` has a leading [G] axis) and applied by `scan_groups`, so each kind of block is
    traced and compiled once. Blocks left over when `moe_every` does not divide `n_layers`
    are dense and follow the groups (`tail`).

    Args:
      cfg: the `ModelConfig`.
      rngs: `nnx.Rngs` whose `params` stream initializes every weight.

    Example:
      >>> model = LanguageModel(PRESETS["tiny"].model, rngs=nnx.Rngs(0))
      >>> logits, aux = model(jnp.zeros((2, 16), jnp.int32))
      >>> logits.shape, aux.tokens_per_expert.shape
      ((2, 16, 256), (2, 8))
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), fan_in=1)
        self.groups = _stacked(lambda r: Group(cfg, rngs=r), cfg.num_moe_layers, rngs)
        tail = cfg.n_layers - cfg.num_moe_layers * cfg.moe_every
        self.tail = nnx.List([Block(cfg, moe=False, rngs=rngs) for _ in range(tail)])
        self.final_norm = RMSNorm(cfg.d_model, dtype=cfg.dtype)
        self.head = _param(rngs, (cfg.d_model, cfg.vocab_size))

    def __call__(self, tokens_bs: Array, remat: Remat = "none") -> tuple[Array, MoEAux]:
        """tokens int32 [B, S] -> (logits f32 [B, S, V], the MoE blocks' `MoEAux` with a
        leading [G] axis on every field). `remat` is the rematerialization policy of the
        backward (see `Remat`); it changes memory and time, not values."""
        cfg = self.cfg
        if tokens_bs.ndim != 2 or not jnp.issubdtype(tokens_bs.dtype, jnp.integer):
            raise ValueError(f"tokens must be int [B, S], got {tokens_bs.dtype}{tokens_bs.shape}")
        if tokens_bs.shape[1] > cfg.max_seq_len:
            raise ValueError(f"S={tokens_bs.shape[1]} > max_seq_len={cfg.max_seq_len}")
        if remat not in REMATS:
            raise ValueError(f"remat={remat!r} must be one of {REMATS}")
        onehot_bsv = jax.nn.one_hot(tokens_bs, cfg.vocab_size, dtype=cfg.dtype)
        x_bsd = onehot_bsv @ self.embed[...].astype(cfg.dtype)
        x_bsd, aux = scan_groups(self.groups, x_bsd, remat)
        for block in self.tail:
            x_bsd, _ = block(x_bsd, remat)
        x_bsd = self.final_norm(x_bsd)
        logits_bsv = jnp.dot(
            x_bsd.astype(jnp.float32), self.head[...], preferred_element_type=jnp.float32
        )
        return logits_bsv, aux


def cross_entropy(logits_bsv: Array, targets_bs: Array) -> Array:
    """Mean next-byte cross-entropy, f32 [] (targets selected by a one-hot product: no gather,
    so no scatter-add in the gradient)."""
    logits = logits_bsv.astype(jnp.float32)
    target_logit = jnp.sum(
        logits * jax.nn.one_hot(targets_bs, logits.shape[-1], dtype=jnp.float32), axis=-1
    )
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target_logit)


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward; 2 FLOPs per multiply-add).

    Counts the active parameters' matmuls: attention projections, the attention scores and
    values at the full sequence length (PaLM's convention, no causal halving), the router, the
    K routed experts and the shared experts of each MoE block, the dense SwiGLU blocks and the
    output head; not the embedding lookup, norms or softmaxes.
    """
    d, nh, moe = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.moe
    attention = 2 * d * 3 * nh + 2 * nh * d + 2 * 2 * seq_len * nh
    moe_ffn = 2 * d * moe.num_experts + (moe.top_k + moe.num_shared_experts) * 3 * 2 * d * moe.d_ff
    dense_ffn = 3 * 2 * d * cfg.dense_width
    forward = cfg.n_layers * attention + 2 * d * cfg.vocab_size
    forward += cfg.num_moe_layers * moe_ffn + (cfg.n_layers - cfg.num_moe_layers) * dense_ffn
    return 3.0 * forward


# Dense bf16 peak FLOP/s per device (no sparsity), from the vendors' data sheets; matched
# against `jax.Device.device_kind`.
PEAK_FLOPS: dict[str, float] = {
    r"H200": 989e12,
    r"H100": 989e12,
    r"A100": 312e12,
}


def peak_flops(device: jax.Device) -> float | None:
    """The device's dense bf16 peak FLOP/s, or None where unknown (CPUs)."""
    if device.platform == "cpu":
        return None
    for pattern, flops in PEAK_FLOPS.items():
        if re.search(pattern, device.device_kind):
            return flops
    return None


def count_params(model: LanguageModel) -> tuple[int, int]:
    """(total parameters, active parameters per token): routed experts count K of E."""
    total = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    moe = model.cfg.moe
    per_expert = 3 * moe.d_model * moe.d_ff
    inactive = model.cfg.num_moe_layers * (moe.num_experts - moe.top_k) * per_expert
    return int(total), int(total - inactive)
