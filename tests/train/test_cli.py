"""`python -m train` as a user runs it (subprocesses): a smoke run with a tiny budget, sampling
from its checkpoint, clear one-line errors with exit code 2, and two processes x 4 devices
giving the losses of one process x 8."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from train.metrics import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The tiny preset at a small budget: 8 sequences of 32 bytes per step.
SMALL = ["--batch-size", "8", "--seq-len", "32", "--data", "synthetic", "--no-progress"]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)  # the command sets its own device count
    return env


def slow(*values):
    """A parametrization that only ./test.sh --all runs."""
    return pytest.param(*values, marks=pytest.mark.slow)


def _train(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "train", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_smoke_run_and_sample(tmp_path):
    workdir = tmp_path / "run"
    out = _train(
        *SMALL, "--steps", "3", "--eval-every", "2", "--save-every", "2", "--workdir", str(workdir)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = read_metrics(workdir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    keys = {
        "loss",
        "total_loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "mfu",
        "expert_load",
        "load_max_over_mean",
        "rounds",
        "dropped",
        "time_s",
    }
    assert keys <= set(records[0])
    assert records[0]["mfu"] is None  # no peak FLOP/s for CPUs
    assert [("eval_loss" in r) for r in records] == [False, True, True]
    assert len(records[0]["expert_load"]) == 2 and len(records[0]["expert_load"][0]) == 8
    assert all(r >= 1 for r in records[0]["rounds"]) and len(records[0]["rounds"]) == 2
    np.testing.assert_allclose(np.sum(records[0]["expert_load"], axis=1), 1.0, rtol=1e-6)
    assert (workdir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (workdir / "samples.txt").read_text().startswith("--- prompt")
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "3"]
    assert list((workdir / "tensorboard").iterdir())
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["final_loss"] == records[-1]["loss"]

    sampled = _train(
        "sample",
        "--workdir",
        str(workdir),
        "--prompt",
        "ab",
        "--max-new-bytes",
        "8",
        "--temperature",
        "0",
    )
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert "step 3 of" in sampled.stdout and "--- prompt 'ab'" in sampled.stdout


@pytest.mark.slow
def test_second_run_reads_the_lowered_step_from_the_cache(tmp_path):
    """Two runs of the same step with one cache folder: the first traces, lowers and keeps the
    step, the second reads it back instead; both train to the same losses, bit for bit."""
    cache = ["--cache-dir", str(tmp_path / "cache"), "--steps", "2", "--no-sample"]
    runs = [_train(*SMALL, *cache, "--workdir", str(tmp_path / name)) for name in ("a", "b")]
    for out in runs:
        assert out.returncode == 0, out.stderr[-3000:]
    ready = [
        next(line for line in out.stdout.splitlines() if "train step ready" in line) for out in runs
    ]
    assert "kept in the cache" in ready[0], ready[0]
    assert "lowered step read from the cache" in ready[1], ready[1]
    losses = [[r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl")] for name in "ab"]
    assert losses[0] == losses[1]
    assert list((tmp_path / "cache" / "steps").glob("*.jax_exported"))


# Each case starts the command (~2 s); the fast tier runs one of each kind: the parser's, the
# configuration's and the work folder's.
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        slow(["--remat", "some"], "invalid choice: 'some'"),
        slow(["--grad-accum", "3"], "batch_size=16 must be divisible by grad_accum=3"),
        slow(["--preset", "huge"], "invalid choice: 'huge'"),
        (["--steps", "0"], "steps=0 must be >= 1"),
        slow(["--lr", "nan"], "peak_lr=nan must be finite"),
        slow(["--data", "/no/such/file.txt"], "data path '/no/such/file.txt' does not exist"),
        slow(["--batch-size", "12"], "batch_size=12 must be divisible by the 8 devices"),
        slow(
            ["--num-processes", "2"], "--coordinator, --num-processes and --process-id go together"
        ),
        slow(["sample", "--workdir", "/no/such/run"], "/no/such/run/config.json does not exist"),
        (["--workdir", "{tmp}/file"], "workdir='{tmp}/file' is not a folder"),
        slow(["--workdir", "{tmp}/file/run"], "is not a folder: {tmp}/file is a file"),
        slow(
            ["--layout", "data_expert", "--data-parallel", "3"],
            "data_parallel=3 must divide the 8 devices",
        ),
        slow(["--resume-from", "3"], "--resume-from 3: no checkpoint in {tmp}/w/checkpoints"),
        slow(["--resume-from", "2", "--overwrite"], "--resume-from 2 and --overwrite exclude"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, args, message):
    """Each bad input: one line naming the value, exit code 2, and nothing made on disk."""
    (tmp_path / "file").write_text("not a folder\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    message = message.replace("{tmp}", str(tmp_path))
    if args[0] != "sample" and "--workdir" not in args:
        args = [*args, "--workdir", str(tmp_path / "w")]
    before = sorted(tmp_path.rglob("*"))
    out = _train(*args, timeout=120)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], out.stderr[-2000:]
    assert sorted(tmp_path.rglob("*")) == before


def test_sample_without_checkpoints_makes_no_folder(tmp_path):
    import dataclasses

    from train.checkpoint import write_config
    from train.config import PRESETS

    tiny = PRESETS["tiny"]
    write_config(tmp_path, tiny.model, {"train": dataclasses.asdict(tiny.train)})
    out = _train("sample", "--workdir", str(tmp_path), timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"error: no finished checkpoint in {tmp_path}/checkpoints" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


@pytest.mark.slow
def test_damaged_latest_step_falls_back(tmp_path):
    """The data files of the latest step truncated, then deleted: `sample` and `--resume` each
    report it in one line (no traceback) and use the step before; the resumed run redoes the
    lost steps with the first run's losses, bit for bit."""
    workdir = tmp_path / "run"
    common = [*SMALL, "--eval-every", "0", "--no-sample", "--workdir", str(workdir)]
    first = _train(*common, "--steps", "4", "--save-every", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    first_losses = [r["loss"] for r in read_metrics(workdir / "metrics.jsonl")]
    # Every data file (OCDBT groups the arrays into files differently from run to run, and
    # half of one file may hold nothing that is read).
    step_4 = workdir / "checkpoints" / "4"
    data_files = sorted((step_4 / "default" / "ocdbt.process_0" / "d").iterdir())
    for path in data_files:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    damaged = f"checkpoint step 4 is damaged: {data_files[0].relative_to(step_4)}: "

    sample = ["sample", "--workdir", str(workdir), "--max-new-bytes", "4"]
    sampled = _train(*sample)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    report, chosen_line = sampled.stdout.splitlines()[:2]
    assert report.startswith(damaged) and " bytes, " in report and " when saved; " in report
    assert report.endswith(f"; skipped, not deleted (rm -r {step_4} removes it)"), report
    assert chosen_line == f"step 2 of {workdir}, the newest good checkpoint"
    assert "Traceback" not in sampled.stderr and len(sampled.stderr.splitlines()) < 20
    chosen = _train(*sample, "--step", "4")  # chosen by hand: refused, in one line
    assert chosen.returncode == 2 and "Traceback" not in chosen.stderr
    error = chosen.stderr.splitlines()[-1]
    assert error.startswith(f"python -m train sample: error: --step 4: {damaged}"), error
    assert error.endswith(f" (its folder: {step_4})"), error

    for path in data_files:
        path.unlink()
    resumed = _train("--steps", "5", "--resume", "--no-progress", "--workdir", str(workdir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr and len(resumed.stderr.splitlines()) < 20
    moved = workdir / "checkpoints_set_aside" / "4"
    (report,) = [line for line in resumed.stdout.splitlines() if line.startswith(damaged)]
    assert ": missing; " in report, report
    assert report.endswith(f"; moved to {moved}, not deleted (rm -r {moved} removes it)")
    assert (
        f"resumed from {workdir}/checkpoints at step 2, the newest good checkpoint: steps 3-4 "
        "are redone (2 steps)" in resumed.stdout.splitlines()
    )
    records = read_metrics(workdir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in records[:4]] == first_losses
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "4", "5"]


@pytest.mark.slow
def test_killed_during_a_save_loses_at_most_one_interval(tmp_path):
    """SIGKILL while orbax writes a checkpoint (its temporary folder exists), then --resume:
    the run continues from the step saved before (at most one save interval lost), and the
    redone step has the killed run's loss, bit for bit."""
    workdir = tmp_path / "run"
    checkpoints = workdir / "checkpoints"
    args = [*SMALL, "--steps", "1000", "--save-every", "1", "--eval-every", "0", "--no-sample"]
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "train", *args, "--workdir", str(workdir)],
            cwd=ROOT,
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            saving = _kill_during_a_save(proc, checkpoints, after_steps=3)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed_losses = {r["step"]: r["loss"] for r in read_metrics(workdir / "metrics.jsonl")}
    assert saving in killed_losses  # a step is logged before it is saved

    resumed = _train(
        "--steps", str(saving + 1), "--resume", "--no-progress", "--workdir", str(workdir)
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    start = json.loads(resumed.stdout.strip().splitlines()[-1])["start_step"]
    print(f"killed while saving step {saving}; resumed from step {start}")
    assert saving - 1 <= start <= saving, (saving, start)
    records = read_metrics(workdir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, saving + 2))
    for r in records[:saving]:
        assert r["loss"] == killed_losses[r["step"]], r["step"]
    assert not list(checkpoints.glob("*.orbax-checkpoint-tmp*"))  # the half save is cleared


def _kill_during_a_save(proc, checkpoints: pathlib.Path, *, after_steps: int) -> int:
    """SIGKILLs `proc` once orbax's temporary folder of a step past `after_steps` exists;
    returns that step."""
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and proc.poll() is None:
        names = os.listdir(checkpoints) if checkpoints.is_dir() else []
        for name in names:
            step, _, rest = name.partition(".")
            if rest.startswith("orbax-checkpoint-tmp") and int(step) > after_steps:
                proc.send_signal(signal.SIGKILL)
                return int(step)
        time.sleep(0.0005)
    raise AssertionError("the run ended (or timed out) before a save could be interrupted")


def test_help_lists_the_flags():
    out = _train("--help", timeout=60)
    assert out.returncode == 0
    for flag in (
        "--preset",
        "--schedule-steps",
        "--resume",
        "--resume-from",
        "--devices",
        "--check-determinism",
        "--coordinator",
        "--remat",
        "--grad-accum",
        "--cache-dir",
    ):
        assert flag in out.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    """2 processes x 4 CPU devices (jax.distributed, gloo) and 1 process x 8: one 1 x 8 mesh,
    the same batches; the losses agree to f32 rounding (measured: equal or 1 ulp apart: the
    dense layers' gradient sums across devices run in another order through gloo)."""
    common = [*SMALL, "--steps", "3", "--eval-every", "2", "--no-sample"]
    one = _train(*common, "--devices", "8", "--workdir", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-3000:]

    port = _free_port()
    workdir = str(tmp_path / "two")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "train",
                *common,
                "--devices",
                "4",
                "--workdir",
                workdir,
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "--coordinator",
                f"localhost:{port}",
            ],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=400))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    assert "2 processes" in outputs[0][0]
    # Process 1 prints nothing of its own. gloo's C++ connection message aside, which is written
    # in pieces from several threads and so arrives cut and interleaved (a line "0" of its own,
    # one cut after "[Gloo] Rank "): a line is ours when it holds a word that message lacks.
    gloo = (
        "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
    )
    gloo_words = set(re.findall(r"[A-Za-z]+", gloo))
    ours = [
        line
        for line in outputs[1][0].splitlines()
        if set(re.findall(r"[A-Za-z]+", line)) - gloo_words
    ]
    assert ours == []

    one_records = read_metrics(tmp_path / "one" / "metrics.jsonl")
    two_records = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert [r["step"] for r in two_records] == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(
            [r[key] for r in two_records], [r[key] for r in one_records], rtol=1e-6
        )
    assert two_records[-1]["expert_load"] == one_records[-1]["expert_load"]
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["3"]


@pytest.mark.parametrize(
    ("before", "devices", "after"),
    [
        ("", None, "--xla_force_host_platform_device_count=8"),
        ("--xla_cpu_foo=1", 4, "--xla_cpu_foo=1 --xla_force_host_platform_device_count=4"),
        (
            "--xla_force_host_platform_device_count=8 --xla_cpu_foo=1",
            2,
            "--xla_cpu_foo=1 --xla_force_host_platform_device_count=2",
        ),
        (
            "--xla_force_host_platform_device_count=16",
            None,
            "--xla_force_host_platform_device_count=16",
        ),
    ],
)
def test_device_count_keeps_other_xla_flags(monkeypatch, before, devices, after):
    from train.__main__ import _set_devices, _train_parser

    monkeypatch.setenv("XLA_FLAGS", before)
    _set_devices(devices, _train_parser())
    assert os.environ["XLA_FLAGS"] == after


@pytest.mark.parametrize(
    "flags",
    [
        ["--distributed"],  # the process count comes from jax.distributed's auto-detection
        ["--num-processes", "2", "--process-id", "1", "--coordinator", "localhost:1"],
    ],
)
def test_devices_counts_one_process(monkeypatch, flags):
    """--devices 4 on each of 2 processes is a run on all 8 devices, not on the first 4 (which
    are process 0's alone)."""
    import jax

    from train.__main__ import _configs, _train_parser

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    _, train_cfg = _configs(_train_parser().parse_args([*flags, "--devices", "4"]))
    assert train_cfg.devices == 8


def test_resume_continues_the_saved_settings(tmp_path):
    """--resume without --preset starts from the run's config.json; flags given still win."""
    import dataclasses

    from train.__main__ import _configs, _train_parser
    from train.checkpoint import write_config
    from train.config import PRESETS

    preset = PRESETS["tiny"]
    saved = dataclasses.replace(
        preset.train, schedule_steps=50, warmup_steps=5, peak_lr=1e-3, seed=3, workdir=str(tmp_path)
    )
    # A mesh layout other than the default, which a flag's default must not override.
    saved = dataclasses.replace(saved, devices=4, layout="data_expert", data_parallel=2)
    write_config(tmp_path, preset.model, {"train": dataclasses.asdict(saved)})
    parse = _train_parser().parse_args
    _, train_cfg = _configs(parse(["--workdir", str(tmp_path), "--steps", "9", "--resume"]))
    assert train_cfg == dataclasses.replace(saved, steps=9)
    _, train_cfg = _configs(parse(["--workdir", str(tmp_path), "--resume", "--seed", "4"]))
    assert (train_cfg.seed, train_cfg.schedule_steps) == (4, 50)
    # A preset named explicitly is the base, as without --resume.
    _, train_cfg = _configs(parse(["--workdir", str(tmp_path), "--resume", "--preset", "tiny"]))
    assert train_cfg.schedule_steps == preset.train.schedule_steps
