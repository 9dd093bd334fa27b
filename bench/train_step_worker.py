"""The worker process of bench/train_step.py: runs one job (its JSON file names the entries,
the configs and what to measure) and writes its result JSON. It imports jax only for a JAX
candidate and torch only for torch, so a torch-only job runs under any Python with torch.

    python -m bench.train_step_worker JOB.json
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time
from typing import Any

import numpy as np

LN_256 = math.log(256)


def random_batches(batch_size: int, seq_len: int, count: int, seed: int = 0):
    """`count` (inputs, targets) int32 [B, S] of random bytes, targets shifted by one."""
    out = []
    for i in range(count):
        tokens = np.random.default_rng([seed, i]).integers(0, 256, (batch_size, seq_len + 1))
        out.append((tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32)))
    return out


def loss_problem(losses: list[float]) -> str | None:
    """Why the first losses are wrong (not finite, or more than 1.0 from ln 256), or None."""
    for i, loss in enumerate(losses):
        if not (math.isfinite(loss) and abs(loss - LN_256) <= 1.0):
            return f"the loss of step {i + 1} is {loss:.4f}, not within 1.0 of ln 256"
    return None


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:800]


def make_runner(entry: dict, job: dict):
    """The entry's candidate: bench.torch_lm.TorchRunner or bench.train_step.JaxRunner."""
    if entry["candidate"] == "torch":
        from bench.torch_lm import TorchRunner

        compile = job["torch_compile"]
        return TorchRunner(job["model"], job["train"], remat=entry["remat"], compile=compile)
    from bench.train_step import jax_runner

    return jax_runner(entry, job)


def timed_round(runner, batches, *, warmup: int, steps: int, check: bool) -> dict[str, Any]:
    """`warmup` steps, their losses read (with `check` the first two must pass `loss_problem`,
    else RuntimeError before anything is timed), then `steps` steps, each synchronized and
    timed; RuntimeError if the last loss is not finite."""
    losses = [float(runner.step(batches[i % len(batches)])) for i in range(warmup)]
    if check and (problem := loss_problem(losses[:2])):
        raise RuntimeError(problem)
    times = []
    for i in range(steps):
        started = time.perf_counter()
        loss = runner.step(batches[(warmup + i) % len(batches)])
        runner.sync(loss)
        times.append(time.perf_counter() - started)
    if not math.isfinite(last := float(loss)):
        raise RuntimeError(f"the loss became {last} while timed")
    return {"losses": losses, "last_loss": last, "step_times_s": times}


def worker(job_path: str) -> None:
    """Runs a job of `run_job`: prepares (compiles) every entry, then `rounds` rounds of timed
    steps alternating between the entries; saves its result after each stage, so a job
    stopped at its timeout still reports what it did."""
    job = json.loads(pathlib.Path(job_path).read_text())
    result: dict[str, Any] = {"entries": {}}

    def save():
        pathlib.Path(job["result"]).write_text(json.dumps(result, indent=1))

    if job.get("jax_cache"):
        from train import compile_cache

        compile_cache.enable(job["jax_cache"])
    runners = {}
    for entry in job["entries"]:
        rec = result["entries"][entry["key"]] = {k: entry[k] for k in ("candidate", "batch_size")}
        try:
            runner = make_runner(entry, job)
            rec["compile"] = runner.prepare(entry["batch_size"], job["train"]["seq_len"])
            rec.update(runner.info())
            runners[entry["key"]] = runner
        except Exception as e:
            rec["error"] = _error(e)
        save()
    placed = {}
    for r in range(job["rounds"] if job["steps"] else 0):
        for key, runner in list(runners.items()):
            rec = result["entries"][key]
            try:
                if r == 0 or not job["resident"]:
                    runner.start()
                if key not in placed:
                    batches = random_batches(rec["batch_size"], job["train"]["seq_len"], 4)
                    placed[key] = [runner.place(*b) for b in batches]
                warmup = job["warmup"] if r == 0 else 1
                out = timed_round(
                    runner, placed[key], warmup=warmup, steps=job["steps"], check=r == 0
                )
                rec.setdefault("rounds", []).append(out)
                rec.setdefault("first_losses", out["losses"][:2])
            except Exception as e:
                rec["error"] = _error(e)
                runners.pop(key).free()
            if not job["resident"] and key in runners:
                runner.free()
            save()
    if len(job["entries"]) == 1:
        for key, runner in runners.items():
            result["entries"][key]["peak_bytes"] = runner.peak_bytes()
    save()


if __name__ == "__main__":
    worker(sys.argv[1])
