"""Shared small configs for the training tests: compile in seconds on 2 CPU cores."""

from __future__ import annotations

import dataclasses

from mok_jax import MoEConfig
from train.config import ModelConfig, TrainConfig

# Two blocks: a dense one, then an MoE one (8 experts, so EP 8 on the 8 simulated devices).
MICRO_MODEL = ModelConfig(
    d_model=32,
    n_layers=2,
    n_heads=2,
    head_dim=16,
    max_seq_len=32,
    moe=MoEConfig(
        d_model=32,
        d_ff=32,
        num_experts=8,
        top_k=2,
        aux_loss_coef=1e-2,
        z_loss_coef=1e-3,
        dtype="float32",
        row_tile=8,
    ),
    moe_every=2,
)

MICRO_TRAIN = TrainConfig(
    steps=6,
    schedule_steps=20,
    warmup_steps=2,
    peak_lr=1e-2,
    batch_size=8,
    seq_len=32,
    eval_every=3,
    eval_batches=2,
    save_every=2,
    data="synthetic",
)


def micro_train(tmp_path, **changes) -> TrainConfig:
    """MICRO_TRAIN writing into tmp_path, with `changes`."""
    return dataclasses.replace(MICRO_TRAIN, workdir=str(tmp_path), **changes)
