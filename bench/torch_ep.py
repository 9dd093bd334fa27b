"""The PyTorch baseline of the expert-parallel layer: torch._grouped_mm experts
with the tokens exchanged by NCCL's all-to-all, one process a GPU, on every GPU of the host.

    PYTHONPATH=. python3 -m bench.torch_ep --out DIR [--case qwen3_30b_a3b] [--eps 1,2]
    PYTHONPATH=. python3 -m bench.torch_ep --out DIR --smoke     # CPU: gloo, tiny, 2 processes

For each EP degree P (default 1 and every GPU there is) it spawns P processes (NCCL; gloo on the
CPU). Rank r holds `tokens_per_device` tokens and experts [r E / P, (r + 1) E / P). Its layer,
per step, as the usual PyTorch expert-parallel MoE does it:

  route       bench.moe_layer's torch routing (mok_jax's rule), argsort(stable) by expert
  counts      an all_to_all_single of the per-expert counts, then the split sizes to the host
  dispatch    torch.distributed.nn.functional.all_to_all_single of the rows (differentiable)
  experts     rows reordered source-major -> expert-major, three torch._grouped_mm (SwiGLU)
  return      the reverse reorder and all_to_all_single, unsort, weighted sum over the k slots

Check: every rank also runs the single-device layer (`moe_layer.torch_layer`) on the whole
global batch with all the experts, and compares its own tokens' y and dx (relative Frobenius
error; the two differ in summation order only). Time: forward+backward (autograd.grad of
sum(y * cotangent) w.r.t. x and the rank's weights), CUDA events, the median of --timed steps
after two warm-ups, each step opened by a barrier; the slowest rank's median. Writes
DIR/torch_ep.json after each EP degree.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.multiprocessing as mp

import mok_jax
from bench.moe_layer import torch_layer, torch_route

CASES = {"qwen3_30b_a3b": 4096, "mixtral_8x7b": 2048, "tiny": 64}
SEED = 0


def global_tensors(cfg, num_tokens: int, device, dtype) -> dict:
    """The global batch and every weight, the same on every rank (one seed)."""
    gen = torch.Generator(device="cpu").manual_seed(SEED)
    d, f, e = cfg.d_model, cfg.d_ff, cfg.num_experts

    def normal(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    t = {
        "x": normal(num_tokens, d),
        "cot": normal(num_tokens, d),
        "router": normal(d, e, scale=d**-0.5),
        "w_gate": normal(e, d, f, scale=d**-0.5),
        "w_up": normal(e, d, f, scale=d**-0.5),
        "w_down": normal(e, f, d, scale=f**-0.5),
    }
    if cfg.num_shared_experts:
        fs = cfg.num_shared_experts * f
        t |= {
            "shared_w_gate": normal(d, fs, scale=d**-0.5),
            "shared_w_up": normal(d, fs, scale=d**-0.5),
            "shared_w_down": normal(fs, d, scale=fs**-0.5),
        }
    return t


def grouped_mm(rows, w, offs):
    """torch._grouped_mm on CUDA; a loop of matmuls elsewhere (the CPU smoke run)."""
    if rows.is_cuda:
        return torch._grouped_mm(rows, w, offs=offs)
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    return torch.cat([rows[a:b] @ w[g] for g, (a, b) in enumerate(zip(starts, ends, strict=True))])


def ep_layer(cfg, w: dict, bias, world: int):
    """This rank's y [T, D] (x's dtype): its tokens through every rank's experts."""
    silu = torch.nn.functional.silu
    x, top_k = w["x"], cfg.top_k
    num_tokens, d_model = x.shape
    local = cfg.num_experts // world
    # Sorted by expert, so by the rank that owns it.
    experts, weights, order, rows = torch_route(torch, cfg, x, w["router"], bias)
    flat = experts.reshape(-1)
    counts_e = torch.bincount(flat, minlength=cfg.num_experts)
    counts_in = torch.empty_like(counts_e)  # [source, my expert], flattened
    dist.all_to_all_single(counts_in, counts_e)
    counts_sl = counts_in.view(world, local)
    send = counts_e.view(world, local).sum(1).tolist()
    recv = counts_sl.sum(1).tolist()
    got = dist_nn.all_to_all_single(rows.new_empty(sum(recv), d_model), rows, recv, send)
    # Received source-major (each source's rows expert-major): expert-major for the GEMMs.
    source = torch.repeat_interleave(torch.arange(world, device=x.device), counts_sl.sum(1))
    expert = torch.repeat_interleave(
        torch.arange(local, device=x.device).repeat(world), counts_sl.reshape(-1)
    )
    perm = torch.argsort(expert * world + source, stable=True)
    grouped = got.index_select(0, perm)
    offs = torch.cumsum(counts_sl.sum(0), 0).to(torch.int32)
    gate = grouped_mm(grouped, w["w_gate"], offs)
    up = grouped_mm(grouped, w["w_up"], offs)
    out = grouped_mm(silu(gate) * up, w["w_down"], offs)
    out = out.index_select(0, torch.argsort(perm))
    back = dist_nn.all_to_all_single(out.new_empty(rows.shape[0], d_model), out, send, recv)
    slots = back.index_select(0, torch.argsort(order)).view(num_tokens, top_k, -1)
    y = (slots.float() * weights[..., None]).sum(1)
    if cfg.num_shared_experts:
        h = silu(x @ w["shared_w_gate"]) * (x @ w["shared_w_up"])
        y = y + (h @ w["shared_w_down"]).float()
    return y.to(x.dtype)


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b).clamp_min(1e-30))


def _rank(rank: int, world: int, case: str, tokens: int, timed: int, port: int, queue) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    cfg = mok_jax.presets[case]
    dtype = torch.bfloat16 if cuda else torch.float32
    g = global_tensors(cfg, tokens * world, device, dtype)
    bias = torch.zeros(cfg.num_experts, device=device)
    local = cfg.num_experts // world
    mine = slice(rank * tokens, (rank + 1) * tokens)
    experts = slice(rank * local, (rank + 1) * local)
    w = {k: (v[experts] if k.startswith("w_") else v) for k, v in g.items()}
    w["x"], w["cot"] = g["x"][mine], g["cot"][mine]
    names = ["x", "router", "w_gate", "w_up", "w_down"]
    names += [n for n in w if n.startswith("shared_")]

    def step(weights: dict, layer):
        leaves = {n: weights[n].detach().requires_grad_(True) for n in names}
        y = layer({**weights, **leaves})
        loss = (y.float() * weights["cot"].float()).sum()
        return (y.detach(), *torch.autograd.grad(loss, list(leaves.values())))

    def ours(weights):
        return ep_layer(cfg, weights, bias, world)

    # Check against the single-device layer on the global batch.
    y, dx, *_ = step(w, ours)
    y_ref, dx_ref, *_ = step(g, lambda t: torch_layer(torch, cfg, t, bias))
    check = {"y_rel_err": rel_err(y, y_ref[mine]), "dx_rel_err": rel_err(dx, dx_ref[mine])}
    del g, y_ref, dx_ref

    def timed_step() -> float:
        dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(w, ours)
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        begin = time.perf_counter()
        step(w, ours)
        return 1e3 * (time.perf_counter() - begin)

    for _ in range(2):
        timed_step()
    times = [timed_step() for _ in range(timed)]
    median = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    errs = torch.tensor([check["y_rel_err"], check["dx_rel_err"]], dtype=torch.float64,
                        device=device)  # fmt: skip
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put(
            {
                "ep": world,
                "case": case,
                "tokens_per_device": tokens,
                "backend": dist.get_backend(),
                "fwd_bwd_ms_slowest_rank_median": round(float(median.item()), 3),
                "rank0_fwd_bwd_ms": [round(t, 3) for t in times],
                "max_rel_err_vs_one_device": {"y": float(errs[0]), "dx": float(errs[1])},
            }
        )
    dist.destroy_process_group()


def run(world: int, case: str, tokens: int, timed: int, port: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(
        _rank, args=(world, case, tokens, timed, port, queue), nprocs=world, join=True,
        start_method="spawn",
    )  # fmt: skip
    return queue.get()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--case", default="qwen3_30b_a3b", choices=sorted(CASES))
    ap.add_argument("--tokens", type=int, help="tokens per device (default: the case's)")
    ap.add_argument("--eps", default="", help="comma-separated EP degrees (default: 1 and all)")
    ap.add_argument("--timed", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo: tiny at EP 1 and 2")
    args = ap.parse_args()
    if args.smoke:
        args.case, args.eps, args.timed = "tiny", args.eps or "1,2", min(args.timed, 3)
    gpus = torch.cuda.device_count()
    eps = [int(e) for e in args.eps.split(",")] if args.eps else sorted({1, max(gpus, 1)})
    cfg = mok_jax.presets[args.case]
    if gpus and max(eps) > gpus:
        raise SystemExit(f"EP {max(eps)} needs {max(eps)} GPUs, this host has {gpus}")
    if any(cfg.num_experts % ep for ep in eps):
        raise SystemExit(f"{cfg.num_experts} experts do not split over EP {eps}")
    tokens = args.tokens or CASES[args.case]
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": "PYTHONPATH=. python3 -m bench.torch_ep " + " ".join(os.sys.argv[1:]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "devices": [torch.cuda.get_device_name(i) for i in range(gpus)] or ["cpu"],
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
        "config": dataclasses.asdict(cfg) | {"dtype": str(cfg.dtype)},
        "rows": [],
    }
    for i, ep in enumerate(eps):
        row = run(ep, args.case, tokens, args.timed, port=29500 + i)
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
        (args.out / "torch_ep.json").write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
