"""bench/train_profile.py on CPU: each op_name goes to its model part, and a profile of the
tiny preset's step charges its kernels (the host's XLA thunks here) to those parts."""

from __future__ import annotations

import dataclasses

import pytest

from bench import train_profile
from train.config import PRESETS
from train.step import Trainer


@pytest.mark.parametrize(
    ("op_name", "part"),
    [
        ("jit(_train_step)/optimizer/mul", "optimizer"),
        ("jit(_train_step)/jvp()/while/body/eval_jaxpr/attention/dot_general", "attention"),
        ("jit(_train_step)/transpose(jvp())/while/body/moe/transpose(route)/exp", "moe/route"),
        ("jit(_train_step)/jvp()/while/body/moe/experts/custom_call", "moe/experts"),
        ("jit(_train_step)/jvp()/while/body/moe/add", "moe/other"),
        ("jit(_train_step)/jvp()/while/body/dense_ffn/dot_general", "dense_ffn"),
        ("jit(_train_step)/jvp()/dot_general", "other"),
    ],
)
def test_part_of(op_name, part):
    assert train_profile.part_of(op_name) == part


@pytest.mark.parametrize(
    ("op_name", "kind"),
    [
        ("jit(_train_step)/transpose(jvp())/while/body/eval_jaxpr/moe/reduce_sum", "reduce_sum"),
        ("jit(_train_step)/add", "add"),
        ("", "(unnamed)"),
    ],
)
def test_op_kind(op_name, kind):
    assert train_profile.op_kind(op_name) == kind


@pytest.mark.slow
def test_profile_of_the_tiny_step():
    preset = PRESETS["tiny"]
    cfg = dataclasses.replace(preset.train, batch_size=4, seq_len=32)
    result = train_profile.profile(Trainer(preset.model, cfg, None), iters=1, warmup=1)
    parts = result["parts"]
    for part in ("attention", "optimizer", "moe/route", "moe/experts"):
        assert parts[part]["ms"] > 0, (part, parts)
    assert result["kernel_ms_per_step"] == pytest.approx(sum(p["ms"] for p in parts.values()))
    assert "| attention |" in train_profile.render(result)
    ops = result["ops"]
    assert ops and sum(o["ms"] for o in ops) <= result["kernel_ms_per_step"] * (1 + 1e-9)
    assert {o["part"] for o in ops} <= set(parts)
