"""bench/train_step.py end to end on CPU at toy size (the xla and reference candidates, fused
failing on f32, the subprocess compile measurements included), and bench/torch_lm.py held
against the JAX model on the same weights.

The torch tests run where torch imports, or with MOK_TORCH_PYTHON naming an interpreter that
has torch and numpy (jax need not be there); otherwise they are skipped.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import train_step as ts
from bench import train_step_worker
from mok_jax import init_params
from mok_jax.reference import moe_reference
from train.step import Trainer

LN_256 = math.log(256)


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("train_step")
    argv = ["--out", str(out), "--configs", "toy", "--candidates", "xla,fused,reference"]
    return out, ts.main([*argv, "--steps", "2", "--warmup", "2", "--rounds", "2"])


@pytest.mark.slow
def test_toy_run_measures_every_candidate(toy_run):
    out, results = toy_run
    record = json.loads((out / "train_step.json").read_text())["configs"]["toy"]
    assert record == json.loads(json.dumps(results["configs"]["toy"]))
    assert record["batch_size"] == 4 and record["seq_len"] == 32
    for name in ("xla", "reference"):
        rec = record["candidates"][name]
        assert rec["status"] == "ok", rec.get("error")
        assert len(rec["first_losses"]) == 2
        assert all(abs(loss - LN_256) < 1.0 for loss in rec["first_losses"]), rec["first_losses"]
        for times in (rec["compile_cold"], rec["compile_warm"]):
            assert times["lower_s"] > 0 and times["compile_s"] > 0
            parts = [times["trace_s"] or 0.0, times["lower_s"], times["compile_s"]]
            assert times["total_s"] == pytest.approx(sum(parts))
        assert len(rec["step_times_s"]) == 2
        assert rec["step_s"] == statistics.median(rec["step_times_s"])
        assert rec["tokens_per_s"] == pytest.approx(4 * 32 / rec["step_s"], rel=1e-12)
        assert rec["mfu"] is None and rec["platform"] == "cpu"
        assert rec["remat"] == "none" and rec["memory_estimate_bytes"] > 0
        assert set(rec["compiled_memory"]) >= {"argument", "output", "temp"}
    # The cold compile is XLA's; the warm one reads the caches.
    xla = record["candidates"]["xla"]
    assert xla["compile_warm"]["total_s"] < xla["compile_cold"]["total_s"]
    fused = record["candidates"]["fused"]
    assert fused["status"] == "failed" and "bfloat16" in fused["error"]


@pytest.mark.slow
def test_toy_run_pairs_and_writes_markdown(toy_run):
    out, results = toy_run
    paired = results["configs"]["toy"]["paired"]
    assert paired["candidates"] == ["xla", "reference"]
    assert paired["states"] == "resident"
    entries = paired["entries"]
    assert set(entries) == {"xla@4", "reference@4"}
    for entry in entries.values():
        assert entry["error"] is None
        assert len(entry["step_times_s"]) == 4 and len(entry["round_step_s"]) == 2
        assert entry["tokens_per_s"] == pytest.approx(4 * 32 / entry["step_s"], rel=1e-12)
    ratio = paired["ratios"]["xla/reference"]
    expected = entries["xla@4"]["tokens_per_s"] / entries["reference@4"]["tokens_per_s"]
    assert ratio == {"value": pytest.approx(expected), "batch_size": 4}
    text = (out / "train_step.md").read_text()
    assert "| candidate | batch | status |" in text and "| xla | 4 | ok |" in text
    assert "| fused | 4 | failed |" in text and "xla/reference" in text
    env = results["environment"]
    assert env["versions"]["jax"] == jax.__version__ and "--configs toy" in env["command"]
    assert env["git_commit"] is None or len(env["git_commit"]) == 40


@pytest.mark.slow
def test_toy_pairing_with_a_process_per_entry_and_round(toy_run, monkeypatch):
    """Where the states do not fit together, every round runs each candidate in a process of
    its own (with the caches of the solo runs): each entry gets its rounds, and a ratio."""
    out, results = toy_run
    records = json.loads(json.dumps(results["configs"]))
    monkeypatch.setattr(ts, "_memory_plan", lambda cands, entries: {"states": "processes"})
    argv = ["--out", str(out), "--configs", "toy", "--candidates", "xla,reference"]
    bench = ts.Bench(ts.parse_args([*argv, "--steps", "2", "--warmup", "2", "--rounds", "2"]),
                     records)  # fmt: skip
    bench.paired("toy")
    ts.finish(records["toy"])
    paired = records["toy"]["paired"]
    assert paired["states"] == "processes" and not paired["timed_out"]
    for key in ("xla@4", "reference@4"):
        entry = paired["entries"][key]
        assert entry["error"] is None
        assert len(entry["step_times_s"]) == 4 and len(entry["round_step_s"]) == 2
        for r in range(2):
            assert (out / "jobs" / "toy" / f"paired_{r}_{key}.log").exists()
    assert set(paired["ratios"]) == {"xla/reference"}
    text = ts.markdown({"environment": results["environment"], "configs": records})
    assert "each round a fresh process per entry" in text


def test_budget_skips_what_does_not_fit(tmp_path):
    results = ts.main(["--out", str(tmp_path), "--configs", "toy", "--candidates", "xla",
                       "--budget-s", "5"])  # fmt: skip
    rec = results["configs"]["toy"]["candidates"]["xla"]
    assert rec["status"] == "skipped" and "budget" in rec["error"]
    assert "not run" in (tmp_path / "train_step.md").read_text()


class _FakeRunner:
    """Steps that return the given losses."""

    def __init__(self, losses):
        self.losses, self.steps = iter(losses), 0

    def step(self, batch):
        self.steps += 1
        return next(self.losses)

    def sync(self, loss):
        pass


def test_first_losses_are_checked_before_anything_is_timed():
    far = _FakeRunner([5.9, 7.0, 5.0, 5.0])
    with pytest.raises(RuntimeError, match="loss of step 2 is 7"):
        train_step_worker.timed_round(far, [None], warmup=2, steps=2, check=True)
    assert far.steps == 2
    with pytest.raises(RuntimeError, match="step 1 is nan"):
        train_step_worker.timed_round(_FakeRunner([math.nan, 5.5]), [None], warmup=2, steps=0,
                                      check=True)  # fmt: skip
    with pytest.raises(RuntimeError, match="became inf"):
        train_step_worker.timed_round(_FakeRunner([5.9, 5.8, math.inf]), [None], warmup=2,
                                      steps=1, check=True)  # fmt: skip
    out = train_step_worker.timed_round(
        _FakeRunner([5.9, 5.8, 5.0, 4.0]), [None], warmup=2, steps=2, check=True
    )
    assert out["losses"] == [5.9, 5.8] and out["last_loss"] == 4.0
    assert len(out["step_times_s"]) == 2


def test_pairing_plan_and_ratios():
    """xla ran at a smaller batch: fused is paired with it there, and with torch at 64; the
    states stay resident only while the solo peaks fit together."""
    gib = 2**30
    cands = {
        "xla": {"status": "ok", "batch_size": 32, "peak_bytes": 40 * gib, "remat": "block"},
        "fused": {"status": "ok", "batch_size": 64, "peak_bytes": 50 * gib, "remat": "none"},
        "torch": {"status": "ok", "batch_size": 64, "peak_bytes": 15 * gib,
                  "torch_remat": "none", "device_bytes": 80 * gib},
    }  # fmt: skip
    ok = ["xla", "fused", "torch"]
    entries = ts._pair_entries(cands, ok)
    assert [e["key"] for e in entries] == ["xla@32", "fused@64", "torch@64", "fused@32"]
    assert [e["remat"] for e in entries] == [None, None, "none", None]
    assert ts._memory_plan(cands, entries)["states"] == "rebuilt"  # 50 + 15 <= 0.85 * 80
    cands["torch"]["peak_bytes"] = 30 * gib
    assert ts._memory_plan(cands, entries)["states"] == "processes"  # 50 + 30 > 0.85 * 80
    cands["fused"]["peak_bytes"] = cands["xla"]["peak_bytes"] = 10 * gib
    assert ts._memory_plan(cands, entries)["states"] == "resident"
    steps = {"xla@32": 0.2, "fused@64": 0.3, "torch@64": 0.4, "fused@32": 0.1}
    record = {
        "seq_len": 1024, "flops_per_token": 6e9, "candidates": {
            "torch": {"platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3"}},
        "paired": {"candidates": ok, "entries": {
            k: {"candidate": k.split("@")[0], "batch_size": int(k.split("@")[1]), "step_s": s}
            for k, s in steps.items()}},
    }  # fmt: skip
    ts.finish(record)
    ratios = record["paired"]["ratios"]
    assert ratios["fused/xla"] == {"value": pytest.approx(2.0), "batch_size": 32}
    assert ratios["fused/torch"] == {"value": pytest.approx(4 / 3), "batch_size": 64}
    fused = record["paired"]["entries"]["fused@64"]
    assert fused["mfu"] == pytest.approx(6e9 * 64 * 1024 / 0.3 / 989e12)


# -- torch ----------------------------------------------------------------------------------


def _torch_python() -> str:
    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    python = os.environ.get("MOK_TORCH_PYTHON")
    if not python:
        pytest.importorskip("torch")
    return python


@pytest.mark.slow
def test_torch_candidate_runs_in_the_harness(tmp_path):
    """torch's solo and warm jobs (under MOK_TORCH_PYTHON where this Python has no torch);
    the pairing where this Python has torch (it needs jax and torch in one process)."""
    python = _torch_python()
    argv = ["--out", str(tmp_path), "--configs", "toy", "--candidates", "xla,torch"]
    argv += ["--steps", "2", "--rounds", "1", "--torch-python", python]
    record = ts.main(argv)["configs"]["toy"]
    rec = record["candidates"]["torch"]
    assert rec["status"] == "ok", rec.get("error")
    assert rec["torch_remat"] == "none" and rec["platform"] in ("cpu", "gpu")
    # The toy is f32, which torch._grouped_mm compiles only in bf16: eager, and why.
    assert rec["torch_mode"] == "compiled" or rec["torch_compile_error"]
    assert all(abs(loss - LN_256) < 1.0 for loss in rec["first_losses"])
    assert rec["tokens_per_s"] == pytest.approx(4 * 32 / rec["step_s"], rel=1e-12)
    assert rec["compile_cold"]["total_s"] > 0 and rec["compile_warm"]["total_s"] > 0
    if python == sys.executable:
        assert "xla/torch" in record["paired"]["ratios"]


def torch_state(model_cfg, params, model_state) -> dict[str, np.ndarray]:
    """The JAX model's weights under bench/torch_lm.py's names (blocks.{l}.attn.w_qkv, ...)."""
    out = {"embed": params["embed"], "head": params["head"]}
    out["final_norm.scale"] = params["final_norm"]["scale"]
    groups, every = model_cfg.num_moe_layers, model_cfg.moe_every
    for layer in range(model_cfg.n_layers):
        g, i = divmod(layer, every)
        if g < groups:
            tree = params["groups"]["moe"] if i == every - 1 else params["groups"]["dense"][i]
            tree = jax.tree.map(lambda a, g=g: a[g], tree)
            if i == every - 1:
                bias = model_state["groups"]["moe"]["ffn"]["router_bias"][g]
                out[f"blocks.{layer}.ffn.router_bias"] = bias
        else:
            tree = params["tail"][layer - groups * every]
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            out[f"blocks.{layer}." + ".".join(str(k.key) for k in path)] = leaf
    return {k: np.array(v, np.float32) for k, v in out.items()}


def _moe_case(cfg):
    keys = jax.random.split(jax.random.key(1), 4)
    params = init_params(keys[0], cfg)
    bias = 0.05 * jax.random.normal(keys[1], (cfg.num_experts,))
    params = dataclasses.replace(params, router_bias=bias)
    x = jax.random.normal(keys[2], (64, cfg.d_model))
    dy = jax.random.normal(keys[3], (64, cfg.d_model))
    y, vjp, aux = jax.vjp(lambda x, p: moe_reference(x, p, cfg), x, params, has_aux=True)
    dx, dparams = vjp(dy)
    fields = [f.name for f in dataclasses.fields(params) if f.name != "router_bias"]
    weights = {k: getattr(params, k) for k in fields if getattr(params, k) is not None}
    inputs = {"moe.x": x, "moe.dy": dy, "moe.bias": bias}
    inputs.update({f"moe.w.{k}": v for k, v in weights.items()})
    expected = {"moe.y": y, "moe.dx": dx, "moe.aux": aux.aux_loss, "moe.z": aux.z_loss}
    expected["moe.counts"] = aux.tokens_per_expert
    expected.update({f"moe.d.{k}": getattr(dparams, k) for k in weights})
    return inputs, expected


def _lm_case(model_cfg, train_cfg):
    trainer = Trainer(model_cfg, train_cfg, None)
    state = trainer.init_state()
    inputs = {f"lm.w.{k}": v for k, v in torch_state(model_cfg, state.params,
                                                     state.model_state).items()}  # fmt: skip
    batches = train_step_worker.random_batches(train_cfg.batch_size, train_cfg.seq_len, 2, seed=3)
    inputs["lm.inputs"] = np.stack([b[0] for b in batches])
    inputs["lm.targets"] = np.stack([b[1] for b in batches])
    state, first = trainer.train_step(state, *map(jnp.asarray, batches[0]))
    state, second = trainer.train_step(state, *map(jnp.asarray, batches[1]))
    expected = {f"lm.{k}": first[k] for k in ("loss", "total_loss", "grad_norm")}
    expected["lm.second_loss"] = second["loss"]
    expected["lm.router_bias"] = state.model_state["groups"]["moe"]["ffn"]["router_bias"]
    counts = np.array([0, 1, 9, 10, 11, 50, 99, 150])
    inputs["lr_counts"] = counts
    with jax.numpy_dtype_promotion("standard"):  # optax's schedule promotes int counts
        expected["lr"] = np.array([trainer.schedule(jnp.int32(c)) for c in counts])
    return inputs, expected


@pytest.mark.slow
def test_torch_model_computes_the_jax_function(tmp_path):
    """The MoE layer against mok_jax's reference (output, losses, load, gradients) and the
    whole model against the JAX train step (losses, gradient norm, a second step's loss, the
    router biases, the learning rates), f32 on CPU, on the same weights."""
    python = _torch_python()
    model_cfg, train_cfg = ts.configs()["toy"]
    train_cfg = dataclasses.replace(train_cfg, implementation="xla")
    moe_in, moe_out = _moe_case(model_cfg.moe)
    lm_in, lm_out = _lm_case(model_cfg, train_cfg)
    inputs = {**moe_in, **lm_in, "model_json": json.dumps(model_cfg.to_json())}
    inputs["train_json"] = json.dumps(dataclasses.asdict(train_cfg))
    np.savez(tmp_path / "in.npz", **{k: np.asarray(v) for k, v in inputs.items()})
    env = {**os.environ, "PYTHONPATH": str(ts.REPO)}
    command = [
        python,
        "-m",
        "bench.torch_lm_check",
        *(str(tmp_path / f) for f in ("in.npz", "out.npz")),
    ]
    subprocess.run(command, check=True, env=env, cwd=ts.REPO, timeout=300)
    with np.load(tmp_path / "out.npz") as got:
        got = dict(got)
    np.testing.assert_array_equal(got["moe.counts"], moe_out.pop("moe.counts"))
    for name, want in {**moe_out, **lm_out}.items():
        want = np.asarray(want, np.float64)
        error = np.max(np.abs(got[name] - want)) / max(np.max(np.abs(want)), 1e-30)
        assert error < 2e-5, f"{name}: relative error {error:.2e}"
