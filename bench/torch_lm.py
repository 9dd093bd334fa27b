"""The byte-level MoE language model of train/model.py in PyTorch: the same shapes, the same
function, the same optimizer; the baseline of bench/train_step.py.

  tokens [B, S] -> embedding [B, S, D] -> L blocks: x += attn(norm(x)); x += ffn(norm(x))
    attention: causal, rotary positions (halves rotated), scaled_dot_product_attention
    ffn: the MoE in every `moe_every`-th block (f32 router, top-k of scores + bias, the rows
    sorted by expert through torch._grouped_mm, shared experts), dense SwiGLU in the others
  -> norm -> untied f32 head -> mean cross-entropy (+ the MoE blocks' aux and z losses)

It imports nothing from jax: the configs arrive as the dicts of `ModelConfig.to_json()` and
`dataclasses.asdict(TrainConfig)`. Parameters are f32 (master weights), cast to the compute
dtype where used. The blocks and the head are functions of (activations, weights), each
`torch.compile`d once however deep the model is. bench/torch_lm_check.py holds it against
the JAX model.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REMATS = ("none", "attention", "block")
# The standard deviation of a standard normal truncated to [-2, 2]: jax's variance_scaling
# (mok_jax.init_params) divides by it, train/model.py's `_param` does not.
TRUNC_STD = 0.87962566103423978


def model_spec(d: dict[str, Any]) -> SimpleNamespace:
    """`ModelConfig.to_json()`'s fields, dtypes as torch's, dense_width resolved."""
    moe = SimpleNamespace(**{**d["moe"], "dtype": DTYPES[d["moe"]["dtype"]]})
    if moe.capacity_factor is not None:
        raise ValueError(f"capacity_factor={moe.capacity_factor}: the torch layer is dropless")
    width = d["dense_d_ff"] or moe.top_k * moe.d_ff
    return SimpleNamespace(**{**d, "moe": moe, "dtype": DTYPES[d["dtype"]], "dense_width": width})


def learning_rate(opt, count: int) -> float:
    """train.step.make_schedule (optax's warmup_cosine_decay_schedule at count + 1)."""
    step, warmup = count + 1, opt.warmup_steps
    if step < warmup:
        return opt.peak_lr * step / warmup
    decay = max(opt.schedule_steps - warmup, 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min(step - warmup, decay) / decay))
    return opt.peak_lr * ((1 - opt.min_lr_ratio) * cosine + opt.min_lr_ratio)


# -- the model's functions ------------------------------------------------------------------


def rms_norm(x: Tensor, scale: Tensor, dtype: torch.dtype, eps: float = 1e-6) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) * scale, in f32, returned in `dtype`."""
    x = x.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale).to(dtype)


def rotary_tables(spec, device) -> tuple[Tensor, Tensor]:
    """cos, sin f32 [max_seq_len, H/2] of train/model.py's `rotary`."""
    half = spec.head_dim // 2
    freq = spec.rope_theta ** (-torch.arange(half, dtype=torch.float32, device=device) / half)
    positions = torch.arange(spec.max_seq_len, dtype=torch.float32, device=device)
    angle = positions[:, None] * freq[None, :]
    return torch.cos(angle), torch.sin(angle)


def rotary(x_bsnh: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary positions 0..S-1 of [B, S, N, H] (halves rotated, f32), in x's dtype."""
    x, half = x_bsnh.float(), x_bsnh.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[: x.shape[1], None, :], sin[: x.shape[1], None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x_bsnh.dtype)


def attention(x_bsd: Tensor, p: dict[str, Tensor], spec, rope) -> Tensor:
    """attn(norm(x)) [B, S, D]: qkv weight [D, 3, N, H], out weight [N, H, D]."""
    (b, s, d), n, h, dtype = x_bsd.shape, spec.n_heads, spec.head_dim, spec.dtype
    x = rms_norm(x_bsd, p["attn_norm.scale"], dtype)
    qkv = (x @ p["attn.w_qkv"].to(dtype).reshape(d, 3 * n * h)).view(b, s, 3, n, h)
    q, k = rotary(qkv[:, :, 0], *rope), rotary(qkv[:, :, 1], *rope)
    q, k, v = (t.transpose(1, 2) for t in (q, k, qkv[:, :, 2]))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    return out.reshape(b, s, n * h) @ p["attn.w_out"].to(dtype).reshape(n * h, d)


def top_k_stable(values: Tensor, k: int) -> Tensor:
    """int64 [..., k]: the k largest along the last axis, largest first, ties to the lower index
    (mok_jax.routing.top_k_indices)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def route(x_td: Tensor, router: Tensor, bias: Tensor, spec):
    """mok_jax.routing.route -> (logits f32 [T, E], scores [T, E], experts [T, K], weights
    f32 [T, K]): selection by scores + bias (group-limited if set), weights unbiased."""
    logits = x_td.float() @ router.float()
    scores = torch.softmax(logits, -1) if spec.score_fn == "softmax" else torch.sigmoid(logits)
    biased = scores.detach() + bias.float()
    if spec.num_groups is not None:
        grouped = biased.view(biased.shape[0], spec.num_groups, -1)
        chosen = top_k_stable(grouped.topk(2, dim=-1).values.sum(-1), spec.topk_groups)
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, chosen, True)
        keep = keep.repeat_interleave(grouped.shape[-1], dim=1)
        biased = biased.masked_fill(~keep, float("-inf"))
    experts = top_k_stable(biased, spec.top_k)
    weights = scores.gather(1, experts)
    if spec.norm_topk_prob:  # a sum that underflowed to 0 leaves the weights 0
        total = weights.sum(-1, keepdim=True)
        weights = torch.where(total > 0, weights / torch.where(total > 0, total, 1.0), 0.0)
    return logits, scores, experts, weights * spec.routed_scaling


def routed_experts(x_td: Tensor, experts_tk: Tensor, weights_tk: Tensor, p, spec):
    """Rows sorted by expert (stable argsort; offsets from the cumulative counts), grouped GEMMs
    for gate, up and down, rows back to their slots, the weighted sum over the K slots in f32.
    -> (y f32 [T, D], tokens per expert int32 [E])."""
    (num_tokens, top_k), dtype = experts_tk.shape, spec.dtype
    flat = experts_tk.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ids = torch.arange(spec.num_experts, device=flat.device)
    offs = torch.searchsorted(flat[order], ids, right=True, out_int32=True)
    rows = x_td.index_select(0, order // top_k)
    gate = torch._grouped_mm(rows, p["w_gate"].to(dtype), offs=offs)
    up = torch._grouped_mm(rows, p["w_up"].to(dtype), offs=offs)
    h = (F.silu(gate.float()) * up.float()).to(dtype)
    out = torch._grouped_mm(h, p["w_down"].to(dtype), offs=offs)
    slot = torch.arange(order.numel(), device=flat.device)
    inverse = torch.empty_like(order).scatter_(0, order, slot)
    slots = out.index_select(0, inverse).view(num_tokens, top_k, -1)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    return (slots.float() * weights_tk[..., None]).sum(1), counts


def moe_layer(x_td: Tensor, p: dict[str, Tensor], bias: Tensor, spec):
    """mok_jax.moe on x [T, D] -> (y [T, D] in x's dtype, aux_loss f32 [], z_loss f32 [],
    tokens per expert int32 [E]). p: router [D, E], w_gate and w_up [E, D, F], w_down [E, F, D]
    and with shared experts shared_w_gate, shared_w_up [D, S*F], shared_w_down [S*F, D]."""
    logits, scores, experts, weights = route(x_td, p["router"], bias, spec)
    y, counts = routed_experts(x_td, experts, weights, p, spec)
    if spec.num_shared_experts:
        w = {k: p[f"shared_w_{k}"].to(spec.dtype) for k in ("gate", "up", "down")}
        h = (F.silu((x_td @ w["gate"]).float()) * (x_td @ w["up"]).float()).to(spec.dtype)
        y = y + (h @ w["down"]).float()
    fraction = counts.float() / (x_td.shape[0] * spec.top_k)
    shares = (scores / scores.sum(-1, keepdim=True)).mean(0)
    aux = spec.aux_loss_coef * spec.num_experts * (fraction * shares).sum()
    z = spec.z_loss_coef * torch.logsumexp(logits, -1).pow(2).mean()
    return y.to(x_td.dtype), aux, z, counts


def block_fns(spec, rope, *, remat: str, compile: bool) -> SimpleNamespace:
    """The forward's functions of (activations, weights), `torch.compile`d when `compile`:
    dense(x, p) -> x and moe(x, p, bias) -> (x, aux + z loss, load [E]), a block each (x +
    attn(norm(x)), then + ffn(norm(x)), the dense SwiGLU in the compute dtype), and head(x,
    scale, w, targets) -> the mean cross-entropy of the final norm and the f32 head. remat
    (train.config.Remat): "block" recomputes a block in the backward, "attention" its
    attention, "none" nothing."""
    if remat not in REMATS:
        raise ValueError(f"remat={remat!r} must be one of {REMATS}")

    def attn(x, p):
        if remat == "attention":
            return x + checkpoint(attention, x, p, spec, rope, use_reentrant=False)
        return x + attention(x, p, spec, rope)

    def dense(x, p):
        x = attn(x, p)
        h = rms_norm(x, p["ffn_norm.scale"], spec.dtype)
        w = {k: p[f"ffn.w_{k}"].to(spec.dtype) for k in ("gate", "up", "down")}
        return x + (F.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]

    def moe(x, p, bias):
        x = attn(x, p)
        h = rms_norm(x, p["ffn_norm.scale"], spec.dtype).reshape(-1, spec.d_model)
        moe_p = {k.removeprefix("ffn."): v for k, v in p.items() if k.startswith("ffn.")}
        y, aux, z, counts = moe_layer(h, moe_p, bias, spec.moe)
        return x + y.view_as(x), aux + z, counts

    def head(x, scale, w, targets):
        logits = rms_norm(x, scale, spec.dtype).float() @ w
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    fns = {"dense": dense, "moe": moe, "head": head}
    if remat == "block":
        for k in ("dense", "moe"):
            fns[k] = lambda *a, f=fns[k]: checkpoint(f, *a, use_reentrant=False)
    if compile:
        fns = {k: torch.compile(f, dynamic=False) for k, f in fns.items()}
    return SimpleNamespace(**fns, compiled=compile)


# -- the module and the trainer -------------------------------------------------------------


def _weights(params: dict[str, Tensor], **buffers: Tensor) -> nn.ParameterDict:
    """Named f32 parameters, and buffers (the router bias)."""
    out = nn.ParameterDict(params)
    for name, value in buffers.items():
        out.register_buffer(name, value)
    return out


def _init(shape, fan_in: int, gen, device, scale: float = 1.0) -> Tensor:
    """Truncated normal at 2 sigma times scale / sqrt(fan_in), f32."""
    value = torch.empty(shape, dtype=torch.float32, device=device)
    nn.init.trunc_normal_(value, std=1.0, a=-2.0, b=2.0, generator=gen)
    return value.mul_(scale * fan_in**-0.5)


def _moe_weights(m, gen, device) -> nn.ParameterDict:
    """mok_jax.init_params: variance-scaling fan-in truncated normal, zero router bias."""
    d, f, sf, c = m.d_model, m.d_ff, m.num_shared_experts * m.d_ff, 1 / TRUNC_STD
    shapes = {"router": (d, m.num_experts), "w_gate": (m.num_experts, d, f)}
    shapes |= {"w_up": (m.num_experts, d, f), "w_down": (m.num_experts, f, d)}
    if sf:
        shapes |= {"shared_w_gate": (d, sf), "shared_w_up": (d, sf), "shared_w_down": (sf, d)}
    params = {k: _init(s, s[-2], gen, device, c) for k, s in shapes.items()}
    return _weights(params, router_bias=torch.zeros(m.num_experts, device=device))


class Block(nn.Module):
    """One block's weights, named as train/model.py's (attn.w_qkv, ffn.router, ...)."""

    def __init__(self, spec, *, moe: bool, gen, device):
        super().__init__()
        d, n, h, w = spec.d_model, spec.n_heads, spec.head_dim, spec.dense_width
        self.is_moe = moe
        self.attn_norm = _weights({"scale": torch.ones(d, device=device)})
        qkv, out = _init((d, 3, n, h), d, gen, device), _init((n, h, d), n * h, gen, device)
        self.attn = _weights({"w_qkv": qkv, "w_out": out})
        self.ffn_norm = _weights({"scale": torch.ones(d, device=device)})
        if moe:
            self.ffn = _moe_weights(spec.moe, gen, device)
        else:
            shapes = {"w_gate": (d, w), "w_up": (d, w), "w_down": (w, d)}
            self.ffn = _weights({k: _init(s, s[0], gen, device) for k, s in shapes.items()})


class LanguageModel(nn.Module):
    """forward(inputs, targets int [B, S]) -> (LM loss f32 [], the MoE blocks' aux + z losses
    f32 [], tokens per expert int32 [MoE blocks, E])."""

    def __init__(self, spec, fns: SimpleNamespace, *, seed: int = 0, device="cpu"):
        super().__init__()
        gen = torch.Generator(device=device).manual_seed(seed)
        self.spec, self.fns = spec, fns
        self.embed = nn.Parameter(_init((spec.vocab_size, spec.d_model), 1, gen, device))
        moe = [(l + 1) % spec.moe_every == 0 for l in range(spec.n_layers)]
        self.blocks = nn.ModuleList(Block(spec, moe=m, gen=gen, device=device) for m in moe)
        self.final_norm = _weights({"scale": torch.ones(spec.d_model, device=device)})
        self.head = nn.Parameter(_init((spec.d_model, spec.vocab_size), spec.d_model, gen, device))

    def forward(self, inputs: Tensor, targets: Tensor):
        x = F.embedding(inputs, self.embed.to(self.spec.dtype))
        aux, loads = [], []
        for block in self.blocks:
            p = dict(block.named_parameters())
            if block.is_moe:
                x, loss, load = self.fns.moe(x, p, block.ffn.router_bias)
                aux.append(loss)
                loads.append(load)
            else:
                x = self.fns.dense(x, p)
        lm = self.fns.head(x, self.final_norm.scale, self.head, targets)
        return lm, torch.stack(aux).sum(), torch.stack(loads)

    def router_biases(self) -> list[Tensor]:
        return [b.ffn.router_bias for b in self.blocks if b.is_moe]


def clip_grads_(grads: list[Tensor], max_norm: float) -> Tensor:
    """optax.clip_by_global_norm in place; returns the norm before clipping (f32 [])."""
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    torch._foreach_mul_(grads, torch.where(norm < max_norm, 1.0, max_norm / norm))
    return norm


class TorchTrainer:
    """train/step.py's update on `LanguageModel`: AdamW (b1 0.9, b2 0.95, eps 1e-8, decay on
    ndim >= 2), global-norm clipping, the warmup + cosine schedule, the router-bias update."""

    def __init__(self, spec, opt, fns: SimpleNamespace, device):
        self.opt, device = opt, torch.device(device)
        self.model = LanguageModel(spec, fns, seed=opt.seed, device=device)
        params = list(self.model.parameters())
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": opt.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        fused = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8, fused=fused)
        self.count = 0

    def train_step(self, inputs: Tensor, targets: Tensor) -> dict[str, Tensor]:
        """One update -> loss, total_loss, grad_norm (before clipping); no host sync."""
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.opt, self.count)
        lm, aux, loads = self.model(inputs, targets)
        (lm + aux).backward()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = clip_grads_(grads, self.opt.clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.opt.router_bias_rate > 0:  # mok_jax.update_router_bias
            with torch.no_grad():
                for bias, load in zip(self.model.router_biases(), loads.float(), strict=True):
                    bias.add_(self.opt.router_bias_rate * torch.sign(load.mean() - load))
        self.count += 1
        return {"loss": lm.detach(), "total_loss": (lm + aux).detach(), "grad_norm": norm}


class TorchRunner:
    """A candidate of bench/train_step.py: prepare (compile), info, start (a fresh state),
    place, step, sync, free, peak_bytes. Falls back to eager where `torch.compile` fails."""

    def __init__(self, model_json, train_json, *, remat: str = "none", compile: bool = True):
        self.spec, self.opt = model_spec(model_json), SimpleNamespace(**train_json)
        self.remat, self.compile_error, self.trainer = remat, None, None
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.rope = rotary_tables(self.spec, self.device)
        self.fns = block_fns(self.spec, self.rope, remat=remat, compile=compile)

    def prepare(self, batch_size: int, seq_len: int) -> dict[str, Any]:
        """Compiles: one forward + backward on zeros of the run's shape, timed; where that
        fails (but for running out of memory), records why and runs eager."""
        try:
            seconds = self._first_pass(batch_size, seq_len)
        except Exception as e:
            if not self.fns.compiled or isinstance(e, torch.OutOfMemoryError):
                raise
            self.compile_error = f"{type(e).__name__}: {e}"[:2000]
            self.fns = block_fns(self.spec, self.rope, remat=self.remat, compile=False)
            seconds = self._first_pass(batch_size, seq_len)
        self.free()  # the pass's memory back to the device, for the candidates after it
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        return {"total_s": seconds}

    def _first_pass(self, batch_size: int, seq_len: int) -> float:
        model = LanguageModel(self.spec, self.fns, seed=self.opt.seed, device=self.device)
        zeros = torch.zeros(batch_size, seq_len, dtype=torch.long, device=self.device)
        started = time.perf_counter()
        lm, aux, _ = model(zeros, zeros)
        (lm + aux).backward()
        self.sync(lm)
        return time.perf_counter() - started

    def info(self) -> dict[str, Any]:
        """The device and what ran (torch_mode compiled or eager, torch_remat)."""
        out = {"torch_mode": "compiled" if self.fns.compiled else "eager"}
        out |= {"torch_remat": self.remat, "torch_compile_error": self.compile_error}
        if self.device.type != "cuda":
            return {**out, "platform": "cpu", "device_kind": "cpu", "device_bytes": None}
        props = torch.cuda.get_device_properties(self.device)
        return {
            **out,
            "platform": "gpu",
            "device_kind": props.name,
            "device_bytes": props.total_memory,
        }

    def start(self) -> None:
        self.free()
        self.trainer = TorchTrainer(self.spec, self.opt, self.fns, self.device)

    def place(self, inputs: np.ndarray, targets: np.ndarray) -> tuple[Tensor, Tensor]:
        return tuple(torch.from_numpy(a).long().to(self.device) for a in (inputs, targets))

    def step(self, batch) -> Tensor:
        return self.trainer.train_step(*batch)["loss"]

    def sync(self, loss: Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def free(self) -> None:
        self.trainer = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def peak_bytes(self) -> int | None:
        return torch.cuda.max_memory_allocated() if self.device.type == "cuda" else None
