"""bench/torch_lm.py's values on inputs made by JAX, for tests/test_train_step_bench.py's
comparison (f32, CPU); runs in a process with torch and without jax:

    python -m bench.torch_lm_check IN.npz OUT.npz
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import numpy as np
import torch

from bench.torch_lm import (
    TorchTrainer,
    block_fns,
    learning_rate,
    model_spec,
    moe_layer,
    rotary_tables,
)


def check(inp: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What tests/test_train_step_bench.py holds against JAX (f32, CPU): the MoE layer on
    `moe.*` (output, losses, load, gradients); two train steps of the LM from the weights
    `lm.w.*` (losses, gradient norm, the second loss, router biases); learning rates."""
    spec = model_spec(json.loads(str(inp["model_json"])))
    opt = SimpleNamespace(**json.loads(str(inp["train_json"])))
    x = torch.from_numpy(inp["moe.x"]).requires_grad_()
    p = {k[6:]: torch.from_numpy(v).requires_grad_() for k, v in inp.items() if k[:6] == "moe.w."}
    y, aux, z, counts = moe_layer(x, p, torch.from_numpy(inp["moe.bias"]), spec.moe)
    (y * torch.from_numpy(inp["moe.dy"])).sum().backward()
    out = {"moe.y": y, "moe.aux": aux, "moe.z": z, "moe.counts": counts, "moe.dx": x.grad}
    out |= {f"moe.d.{n}": t.grad for n, t in p.items()}
    fns = block_fns(spec, rotary_tables(spec, "cpu"), remat="none", compile=False)
    trainer = TorchTrainer(spec, opt, fns, "cpu")
    state = trainer.model.state_dict()
    with torch.no_grad():
        for name, value in state.items():
            value.copy_(torch.from_numpy(inp[f"lm.w.{name}"]))
    inputs, targets = (torch.from_numpy(inp[f"lm.{n}"]).long() for n in ("inputs", "targets"))
    out |= {f"lm.{k}": v for k, v in trainer.train_step(inputs[0], targets[0]).items()}
    out["lm.second_loss"] = trainer.train_step(inputs[1], targets[1])["loss"]
    out["lm.router_bias"] = torch.stack(trainer.model.router_biases())
    out["lr"] = torch.tensor([learning_rate(opt, int(c)) for c in inp["lr_counts"]])
    return {k: v.detach().numpy() for k, v in out.items()}


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m bench.torch_lm_check IN.npz OUT.npz")
    with np.load(sys.argv[1]) as data:
        np.savez(sys.argv[2], **check(dict(data)))
