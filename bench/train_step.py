"""One benchmark of the training step: the JAX step (`train.step.Trainer` on one device, no
mesh, MoE implementation `xla` or `fused`) beside the same model in PyTorch (bench/torch_lm.py).

    PYTHONPATH=. python3 -m bench.train_step --out DIR [--configs gpu,small_gpu]
        [--candidates xla,fused,torch] [--steps 10] [--budget-s 540]

Writes DIR/train_step.json and DIR/train_step.md (configs measured into DIR before are kept)
and prints the markdown last. bench/README.md describes the stages; each runs in a fresh
subprocess (bench/train_step_worker.py; torch's jobs under `--torch-python`):

  solo    per candidate, empty compilation caches (JAX's in DIR/cache, torch's inductor and
          triton caches): compile time cold, the first two losses, `--steps` synchronized steps,
          the peak memory (JAX: `peak_bytes_in_use`; torch: `max_memory_allocated`).
  paired  the candidates that passed, alternating `--rounds` rounds. In one process with JAX not
          preallocating where the solo peaks fit together in 85% of the device (states
          resident), or JAX's largest and torch's do (each state built and freed every round);
          else every round runs each candidate in a fresh process, with the solo run's
          allocators and the caches warm, one after the other.
  warm    per candidate, with the solo run's caches: the compile time warm.

MFU is `train.model.model_flops_per_token` times tokens/s over `train.model.peak_flops`. Where
xla's memory estimate does not fit the batch, xla and fused run at the largest batch whose
estimate fits. Torch recomputes what the JAX step does (`--torch-remat match`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import time
import types
from typing import Any

import jax
import numpy as np

from bench import harness as h
from mok_jax import MoEConfig
from train import memory
from train.config import PRESETS, ModelConfig, TrainConfig
from train.model import model_flops_per_token, peak_flops
from train.step import Trainer

# mok_jax's implementations, then torch (last: it matches their remat policy).
CANDIDATES = ("xla", "pallas", "fused", "reference", "torch")
JAX_CANDIDATES = CANDIDATES[:-1]
GIB = 1024**3
REPO = h.ROOT


def configs() -> dict[str, tuple[ModelConfig, TrainConfig]]:
    """`gpu`: the preset; `small_gpu`: its first 4 blocks at batch 16; `toy`: a CPU-sized f32
    model with every routing feature (sigmoid, groups, a shared expert, bias balancing)."""
    gpu = PRESETS["gpu"]
    moe = MoEConfig(
        d_model=64, d_ff=64, num_experts=8, top_k=2, score_fn="sigmoid", norm_topk_prob=True,
        num_groups=4, topk_groups=2, num_shared_experts=1, aux_loss_coef=1e-2,
        z_loss_coef=1e-3, dtype="float32", row_tile=8,
    )  # fmt: skip
    toy = ModelConfig(
        d_model=64, n_layers=2, n_heads=2, head_dim=32, max_seq_len=32, moe=moe, moe_every=2
    )
    toy_train = TrainConfig(
        steps=100, schedule_steps=100, warmup_steps=10, peak_lr=3e-3, batch_size=4, seq_len=32,
        router_bias_rate=1e-3, data="synthetic",
    )  # fmt: skip
    small = dataclasses.replace(gpu.model, n_layers=4)
    return {
        "gpu": (gpu.model, gpu.train),
        "small_gpu": (small, dataclasses.replace(gpu.train, batch_size=16)),
        "toy": (toy, toy_train),
    }


# -- the JAX candidates (bench/train_step_worker.py runs them) -----------------------------


class JaxRunner:
    """The JAX train step of one implementation (the interface of torch_lm.TorchRunner)."""

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, *, fit_batch: bool):
        self.batch_note, self.state, started = None, None, time.perf_counter()
        try:
            self.trainer = Trainer(model_cfg, train_cfg, None, check_memory=True)
        except memory.DoesNotFit as e:
            if not fit_batch:
                raise
            batch = fitting_batch(model_cfg, train_cfg)
            self.batch_note = f"{e}; ran at batch {batch}, the largest whose estimate fits"
            train_cfg = dataclasses.replace(train_cfg, batch_size=batch)
            self.trainer = Trainer(model_cfg, train_cfg, None, check_memory=True)
        self.setup_s = time.perf_counter() - started  # model graph and memory estimates

    def prepare(self, batch_size: int, seq_len: int) -> dict[str, Any]:
        times = self.trainer.compile()
        return {**dataclasses.asdict(times), "total_s": times.total_s}

    def info(self) -> dict[str, Any]:
        trainer, device = self.trainer, jax.devices()[0]
        estimate = trainer.memory_estimate()
        return {
            "batch_size": trainer.train_cfg.batch_size, "batch_note": self.batch_note,
            "remat": trainer.remat, "memory_estimate_bytes": estimate.total,
            "memory_estimate": estimate.report(trainer.device_bytes),
            "compiled_memory": trainer.compiled_memory(), "platform": device.platform,
            "device_kind": device.device_kind, "device_bytes": trainer.device_bytes,
            "compile_peak_bytes": self.peak_bytes(),  # the peak below counts the compile's too
            "setup_s": self.setup_s,
        }  # fmt: skip

    def start(self) -> None:
        self.state = None
        self.state = self.trainer.init_state()

    def place(self, inputs: np.ndarray, targets: np.ndarray):
        return self.trainer.place_batch(inputs), self.trainer.place_batch(targets)

    def step(self, batch):
        self.state, metrics = self.trainer.train_step(self.state, *batch)
        return metrics["loss"]

    def sync(self, loss) -> None:
        loss.block_until_ready()  # one executable: its outputs are ready together

    def free(self) -> None:
        self.state = None

    def peak_bytes(self) -> int | None:
        stats = jax.devices()[0].memory_stats()
        return stats.get("peak_bytes_in_use") if stats else None


def jax_runner(entry: dict, job: dict) -> JaxRunner:
    """The entry's JAX candidate at its batch, under its remat policy ("auto" where unset)."""
    train = TrainConfig(**job["train"] | {"batch_size": entry["batch_size"]})
    remat = entry.get("remat") or "auto"
    train = dataclasses.replace(train, implementation=entry["candidate"], remat=remat)
    model = ModelConfig.from_json(job["model"])
    return JaxRunner(model, train, fit_batch=entry.get("fit_batch", False))


def fitting_batch(model_cfg: ModelConfig, train_cfg: TrainConfig) -> int:
    """The largest batch below train_cfg's whose memory estimate fits the device under remat
    "block" (the least memory), by bisection."""
    trainer = Trainer(model_cfg, train_cfg, None, check_memory=False)

    def fits(batch: int) -> bool:
        cfg = dataclasses.replace(train_cfg, batch_size=batch)
        args = (trainer.model_cfg, cfg, trainer.abstract_state, None, "block")
        return memory.estimate_memory(*args).fits(trainer.device_bytes)

    low, high = 0, train_cfg.batch_size
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    if low == 0:
        raise memory.DoesNotFit("not even batch 1 fits the device")
    return low


# -- the orchestrating process --------------------------------------------------------------


def run_job(job: dict, folder: pathlib.Path, env: dict, timeout: float, python: str) -> dict:
    """Runs `job` in a fresh `python -m bench.train_step_worker` process (its own process
    group, killed at `timeout`); returns its result, an error on every entry it left
    unfinished, and returncode, timed_out, wall_s."""
    folder.mkdir(parents=True, exist_ok=True)
    job = {**job, "result": str(folder / f"{job['name']}.result.json")}
    job_path, log_path = folder / f"{job['name']}.job.json", folder / f"{job['name']}.log"
    job_path.write_text(json.dumps(job, indent=1))
    pathlib.Path(job["result"]).unlink(missing_ok=True)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    command = [python, "-m", "bench.train_step_worker", str(job_path)]
    started, timed_out = time.monotonic(), False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, env={**os.environ, "PYTHONPATH": path, **env}, cwd=REPO, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            timed_out = True
    result_path = pathlib.Path(job["result"])
    result = json.loads(result_path.read_text()) if result_path.exists() else {"entries": {}}
    result.update(returncode=proc.returncode, timed_out=timed_out)
    result["wall_s"] = time.monotonic() - started
    if timed_out or proc.returncode:
        why = f"timed out after {timeout:.0f} s" if timed_out else f"exit code {proc.returncode}"
        tail = log_path.read_text(errors="replace")[-600:]
        for entry in job["entries"]:
            rec = result["entries"].setdefault(entry["key"], {"candidate": entry["candidate"]})
            if "error" not in rec and (job["steps"] == 0 or "rounds" not in rec):
                rec["error"] = f"the process stopped ({why}): {tail}"
    return result


class Bench:
    """The phases of one run over `records` (config name -> its record)."""

    def __init__(self, args, records: dict):
        self.args, self.records, self.cfgs = args, records, configs()
        self.deadline = None if args.budget_s is None else time.monotonic() + args.budget_s

    def _run(self, config: str, job: dict, candidates) -> dict | None:
        """Runs a job within the budget (None: skipped, too little time left)."""
        timeout = self.args.job_timeout_s
        if self.deadline is not None:
            left = self.deadline - time.monotonic() - 10.0  # 10 s to write the results
            if left < self.args.min_job_s:
                return None
            timeout = min(timeout, left)
        model_cfg, train_cfg = self.cfgs[config]
        job = {
            "model": model_cfg.to_json(), "train": dataclasses.asdict(train_cfg),
            "steps": self.args.steps, "warmup": self.args.warmup, "rounds": 1,
            "resident": True, "torch_compile": self.args.torch_compile, **job,
        }  # fmt: skip
        env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"} if job["name"] == "paired" else {}
        if "torch" in candidates:
            root = self._cache(config, "torch")
            env |= {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}
            env |= {"TRITON_CACHE_DIR": str(root / "triton")}
            if candidates == ["torch"]:  # no JAX backend should start; if one does, small
                env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        python = self.args.torch_python if candidates == ["torch"] else sys.executable
        return run_job(job, self.args.out / "jobs" / config, env, timeout, python)

    def _cache(self, config: str, candidate: str) -> pathlib.Path:
        return self.args.out / "cache" / config / candidate

    def single(self, config: str, candidate: str, *, cold: bool) -> None:
        """The solo run (cold: empty caches, then steps) or the warm compile of a candidate."""
        rec = self.records[config]["candidates"][candidate]
        if not cold and rec.get("status") != "ok":
            return
        batch = rec.get("batch_size", self.cfgs[config][1].batch_size)
        remat = rec.get("torch_remat") or self._torch_remat(config)
        entry = {"key": candidate, "candidate": candidate, "batch_size": batch}
        entry["remat"] = remat if candidate == "torch" else None  # JAX: "auto"
        entry["fit_batch"] = cold and candidate == "xla"
        cache = self._cache(config, candidate)
        if cold:
            shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir(parents=True)
        job = {"name": f"{'solo' if cold else 'warm'}_{candidate}", "entries": [entry]}
        job["jax_cache"] = str(cache) if candidate in JAX_CANDIDATES else None
        result = self._run(config, {**job, **({} if cold else {"steps": 0})}, [candidate])
        got = {"error": "skipped: the time budget was spent"} if result is None else None
        got = got or result["entries"].get(candidate, {})
        rec[f"{'solo' if cold else 'warm'}_job_s"] = result and result["wall_s"]  # with start-up
        if not cold:
            rec["compile_warm"] = got.get("compile")
            rec["compile_warm_error"] = got.get("error")
            return
        rec.update({k: v for k, v in got.items() if k not in ("rounds", "compile")})
        times = [t for r in got.get("rounds", []) for t in r["step_times_s"]]
        rec.update(compile_cold=got.get("compile"), step_times_s=times)
        rec["step_s"] = statistics.median(times) if times else None
        rec["status"] = ("skipped" if result is None else "failed") if "error" in got else "ok"

    def _torch_remat(self, config: str) -> str:
        if self.args.torch_remat != "match":
            return self.args.torch_remat
        cands = self.records[config]["candidates"]
        ok = [c for c in ("fused", "xla") if cands.get(c, {}).get("status") == "ok"]
        return cands[ok[0]]["remat"] if ok else "none"

    def paired(self, config: str) -> None:
        cands = self.records[config]["candidates"]
        ok = [c for c in CANDIDATES if cands.get(c, {}).get("status") == "ok"]
        rec = self.records[config]["paired"] = {"candidates": ok}
        if len(ok) < 2:
            rec["skipped"] = "fewer than two candidates passed their solo run"
            return
        entries = _pair_entries(cands, ok)
        rec.update(_memory_plan(cands, entries))
        cache = self._cache(config, "paired")
        shutil.rmtree(cache, ignore_errors=True)
        for c in set(ok) & set(JAX_CANDIDATES):
            shutil.copytree(self._cache(config, c), cache, dirs_exist_ok=True)
        base = {"jax_cache": str(cache), "resident": rec["states"] == "resident"}
        if rec["states"] == "processes":
            results = self._paired_processes(config, entries, base)
        else:
            job = {**base, "name": "paired", "entries": entries, "rounds": self.args.rounds}
            results = [r for r in [self._run(config, job, ok)] if r is not None]
        if not results:
            rec["skipped"] = "the time budget was spent"
            return
        rec.update(timed_out=any(r["timed_out"] for r in results))
        rec.update(wall_s=sum(r["wall_s"] for r in results), entries={})
        for entry in entries:
            got = [r["entries"][entry["key"]] for r in results if entry["key"] in r["entries"]]
            rounds = [
                r["step_times_s"] for g in got for r in g.get("rounds", []) if r["step_times_s"]
            ]
            times = [t for r in rounds for t in r]
            error = next((g["error"] for g in got if g.get("error")), None)
            rec["entries"][entry["key"]] = {
                "candidate": entry["candidate"], "batch_size": entry["batch_size"],
                "error": error, "step_times_s": times,
                "round_step_s": [statistics.median(r) for r in rounds],
                "step_s": statistics.median(times) if times and error is None else None,
            }  # fmt: skip

    def _paired_processes(self, config: str, entries: list[dict], base: dict) -> list[dict]:
        """`--rounds` rounds, each running every entry in a fresh process of its own (one
        round of timed steps after the warm-up); stops where the budget is spent."""
        results = []
        for r in range(self.args.rounds):
            for entry in entries:
                job = {**base, "name": f"paired_{r}_{entry['key']}", "entries": [entry]}
                result = self._run(config, job, [entry["candidate"]])
                if result is None:
                    return results
                results.append(result)
        return results


def _subject(candidates) -> str:
    """The candidate the ratios are of: fused where it ran, else the first."""
    return "fused" if "fused" in candidates else candidates[0]


def _pair_entries(cands: dict, ok: list[str]) -> list[dict]:
    """Each candidate at its solo batch, and the subject also at every other batch that ran
    (xla's, where its estimate did not fit the config's). JAX chooses its remat policy as in
    the solo run ("auto": the same program, read from the caches)."""
    entries, subject = {}, _subject(ok)
    for c in ok:
        b = cands[c]["batch_size"]
        entries[f"{c}@{b}"] = {"key": f"{c}@{b}", "candidate": c, "batch_size": b}
    for b in sorted({e["batch_size"] for e in entries.values()}):
        entries.setdefault(f"{subject}@{b}", {"key": f"{subject}@{b}", "candidate": subject,
                                              "batch_size": b})  # fmt: skip
    for e in entries.values():
        e["remat"] = cands[e["candidate"]].get("torch_remat")
    return list(entries.values())


def _memory_plan(cands: dict, entries: list[dict]) -> dict[str, Any]:
    """states "resident" (one process) where the solo peaks fit together in 85% of the
    device; "rebuilt" (one process, each state built and freed every round) where JAX's
    largest peak plus torch's do; else "processes" (a fresh process per entry and round)."""
    peaks = {e["key"]: cands[e["candidate"]].get("peak_bytes") for e in entries}
    sizes = [cands[c].get("device_bytes") for c in ("torch", *JAX_CANDIDATES) if c in cands]
    total = next((s for s in sizes if s), None)
    if not total or None in peaks.values():
        return {"states": "resident", "peaks": peaks}
    jax_peak = max((p for k, p in peaks.items() if not k.startswith("torch@")), default=0)
    torch_peak = sum(p for k, p in peaks.items() if k.startswith("torch@"))
    if sum(peaks.values()) <= 0.85 * total:
        return {"states": "resident", "peaks": peaks}
    states = "processes" if jax_peak + torch_peak > 0.85 * total else "rebuilt"
    return {"states": states, "peaks": peaks}


# -- results --------------------------------------------------------------------------------


def finish(record: dict) -> None:
    """Adds tokens/s and MFU to every timed entry of a config's record, and the paired ratios
    of the subject (`_subject`) to each other candidate, at that candidate's batch."""
    seq, flops = record["seq_len"], record["flops_per_token"]
    cands = record["candidates"]
    device = next((c for c in cands.values() if c.get("device_kind")), {})
    paired = record.get("paired", {})
    entries = paired.get("entries", {})
    for rec in [*cands.values(), *entries.values()]:
        if rec.get("step_s"):
            rec["tokens_per_s"] = rec["batch_size"] * seq / rec["step_s"]
            kind = {k: device.get(k) for k in ("platform", "device_kind")}
            peak = peak_flops(types.SimpleNamespace(**kind)) if device else None
            rec["mfu"] = flops * rec["tokens_per_s"] / peak if peak else None
    if not entries:
        return
    subject, ratios = _subject(paired["candidates"]), {}
    for other in entries.values():
        mine = entries.get(f"{subject}@{other['batch_size']}") or {}
        if other["candidate"] != subject and mine.get("tokens_per_s") and other.get("step_s"):
            value = mine["tokens_per_s"] / other["tokens_per_s"]
            name = f"{subject}/{other['candidate']}"
            ratios[name] = {"value": value, "batch_size": mine["batch_size"]}
    paired["ratios"] = ratios


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "" if value is None else format(value * scale, spec)


def _compile(c: dict | None) -> str:
    """total (trace / lower / compile, how the lowered step was had)."""
    if not c or "compile_s" not in c:
        return _fmt((c or {}).get("total_s"), ".1f")
    parts = " / ".join(_fmt(c.get(k), ".1f") or "-" for k in ("trace_s", "lower_s", "compile_s"))
    return f"{c['total_s']:.1f} ({parts}{', ' + c['lowered'] if c.get('lowered') else ''})"


def _pair_cell(entry: dict) -> str:
    """batch, median step ms (round medians), tokens/s of a paired entry."""
    if not entry.get("step_s"):
        return f"{entry['batch_size']}, failed"
    rounds = ", ".join(_fmt(t, ".1f", 1e3) for t in entry["round_step_s"])
    ms, tps = _fmt(entry["step_s"], ".1f", 1e3), _fmt(entry["tokens_per_s"], ",.0f")
    return f"{entry['batch_size']}, {ms} ({rounds}), {tps}"


def _note(what: str, text: str | None) -> str | None:
    """One line of the notes under a table (the JSON has the whole text)."""
    if not text:
        return None
    text = " ".join(text.split())
    return f"- {what}: {text if len(text) <= 400 else text[:400] + ' ...'}"


def markdown(results: dict) -> str:
    env = results["environment"]
    changes = " with uncommitted changes" if env["git_uncommitted"] else ""
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    lines = ["# Training step: JAX (`xla`, `fused`) and PyTorch", ""]
    lines.append(
        f"`{env['command']}` at {env['date']}, git {env['git_commit']}{changes}; {versions}"
    )
    for name, record in results["configs"].items():
        lines += ["", *_config_markdown(name, record)]
    return "\n".join(lines) + "\n"


def _config_markdown(name: str, record: dict) -> list[str]:
    m, paired = record["model"], record.get("paired", {})
    entries = paired.get("entries", {})
    lines = [
        f"## {name}: B {record['batch_size']} x S {record['seq_len']}, D {m['d_model']}, "
        f"{m['n_layers']} blocks, E {m['moe']['num_experts']} top-{m['moe']['top_k']} "
        f"F {m['moe']['d_ff']}, {m['dtype']}; {record['flops_per_token'] / 1e9:.3g} GFLOP/token; "
        f"{record.get('device_kind') or '?'}; run {record['run']['date']}",
        "",
        "| candidate | batch | status | compile cold s (trace / lower / compile) | compile warm "
        "s | step ms | tokens/s | MFU | peak GiB | estimate GiB | XLA args + temp GiB | remat "
        "| paired: batch, step ms (round medians), tokens/s |",
        "|" + " --- |" * 13,
    ]
    notes = []
    for cand, rec in record["candidates"].items():
        xla = rec.get("compiled_memory") or {}
        args_temp = xla.get("argument", 0) + xla.get("temp", 0) if xla else None
        remat = rec.get("remat") or rec.get("torch_remat") or ""
        remat += f"; {rec['torch_mode']}" if rec.get("torch_mode") else ""
        mine = [e for e in entries.values() if e["candidate"] == cand]
        pairs = "; ".join(_pair_cell(e) for e in mine)
        lines.append(
            f"| {cand} | {rec.get('batch_size', '')} | {rec.get('status', '')} "
            f"| {_compile(rec.get('compile_cold'))} | {_compile(rec.get('compile_warm'))} "
            f"| {_fmt(rec.get('step_s'), '.1f', 1e3)} | {_fmt(rec.get('tokens_per_s'), ',.0f')} "
            f"| {_fmt(rec.get('mfu'), '.1%')} | {_fmt(rec.get('peak_bytes'), '.2f', 1 / GIB)} "
            f"| {_fmt(rec.get('memory_estimate_bytes'), '.2f', 1 / GIB)} "
            f"| {_fmt(args_temp, '.2f', 1 / GIB)} | {remat} | {pairs} |"
        )
        for key in ("error", "batch_note", "torch_compile_error", "compile_warm_error"):
            notes.append(_note(f"{cand}, {key.replace('_', ' ')}", rec.get(key)))
        notes += [_note(f"{cand} paired at batch {e['batch_size']}", e["error"]) for e in mine]
    notes = [n for n in notes if n]
    if "skipped" in paired or not paired:
        return [*lines, "", f"Paired: not run ({paired.get('skipped', 'no candidates')}).", *notes]
    ratios = paired.get("ratios", {}).items()
    said = ", ".join(f"**{k} {v['value']:.2f}x** (batch {v['batch_size']})" for k, v in ratios)
    how = {
        "resident": "in one process, states resident",
        "rebuilt": "in one process, states built and freed each round",
        "processes": "each round a fresh process per entry",
    }[paired["states"]]
    stopped = ", a process timed out" if paired.get("timed_out") else ""
    summary = f"Paired ({len(entries)} entries, {how}{stopped}): {said or 'no ratio'}."
    return [*lines, "", summary, *notes]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=pathlib.Path, help="folder of train_step.md/.json and caches")
    p.add_argument("--configs", default="gpu,small_gpu", help=f"of {sorted(configs())}")
    p.add_argument("--candidates", default="xla,fused,torch", help=f"of {CANDIDATES}")
    p.add_argument("--steps", type=int, default=10, help="timed steps (a round's, paired)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before (>= 2)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the pairing")
    p.add_argument("--budget-s", type=float, help="end the whole run within this many seconds")
    p.add_argument("--job-timeout-s", type=float, default=600.0, help="one subprocess at most")
    p.add_argument("--min-job-s", type=float, default=20.0, help="skip a job with less left")
    p.add_argument(
        "--torch-remat", default="match", choices=("match", "none", "attention", "block"),
        help="what torch recomputes in the backward; match: the JAX step's (fused's, else xla's)",
    )  # fmt: skip
    p.add_argument("--no-torch-compile", dest="torch_compile", action="store_false")
    p.add_argument("--torch-python", default=sys.executable, help="runs torch's own jobs")
    args = p.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    args.candidates = [c for c in CANDIDATES if c in args.candidates.split(",")]
    if args.out is None or set(args.configs) - set(configs()) or not args.candidates:
        p.error(f"needs --out, --configs of {sorted(configs())}, --candidates of {CANDIDATES}")
    if args.warmup < 2 or args.steps < 1 or args.rounds < 1:
        p.error("--warmup must be >= 2 (the loss check reads 2 steps), --steps, --rounds >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "train_step.json"
    results = json.loads(json_path.read_text()) if json_path.exists() else {"configs": {}}
    # No device: this process starts none, so that the jobs' processes have the GPU.
    results["environment"] = env = h.environment("train_step", argv, device=False)
    bench = Bench(args, results["configs"])
    for name in args.configs:
        model_cfg, train_cfg = bench.cfgs[name]
        results["configs"][name] = {
            "run": env, "model": model_cfg.to_json(), "train": dataclasses.asdict(train_cfg),
            "batch_size": train_cfg.batch_size, "seq_len": train_cfg.seq_len,
            "flops_per_token": model_flops_per_token(model_cfg, train_cfg.seq_len),
            "candidates": {c: {} for c in args.candidates},
        }  # fmt: skip
    # Solo runs first, then the pairings, then the warm compiles: a budget cuts the least
    # important last.
    for name in args.configs:
        for cand in args.candidates:
            bench.single(name, cand, cold=True)
    for name in args.configs:
        bench.paired(name)
    for name in args.configs:
        for cand in args.candidates:
            bench.single(name, cand, cold=False)
    for record in (results["configs"][n] for n in args.configs):
        kinds = {c.get("device_kind") for c in record["candidates"].values()} - {None}
        record["device_kind"] = ", ".join(sorted(kinds)) or None
        finish(record)
    text = markdown(results)
    h.write_files(
        args.out, {"train_step.json": json.dumps(results, indent=1), "train_step.md": text}
    )
    print(text)
    return results


if __name__ == "__main__":
    main()
