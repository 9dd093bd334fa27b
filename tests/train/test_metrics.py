"""train/metrics.py: JSON lines, resume truncation, NaN handling, TensorBoard events, the bar."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

from train import metrics as M


def read_events(folder) -> list[event_pb2.Event]:
    """Every event of the TFRecord event files under `folder`, in file-name order.

    TFRecord framing: uint64 length, uint32 masked CRC-32C of the length, the data, uint32 masked
    CRC-32C of the data (all little-endian). No TensorFlow needed: tensorboardX ships the protos.
    """
    events = []
    files = sorted(folder.rglob("events.out.tfevents.*"))
    assert files, f"no event files under {folder}"
    for path in files:
        raw = path.read_bytes()
        pos = 0
        while pos < len(raw):
            header = raw[pos : pos + 8]
            (length,) = struct.unpack("<Q", header)
            (header_crc,) = struct.unpack("<I", raw[pos + 8 : pos + 12])
            assert header_crc == masked_crc32c(header), f"bad length CRC in {path}"
            data = raw[pos + 12 : pos + 12 + length]
            (data_crc,) = struct.unpack("<I", raw[pos + 12 + length : pos + 16 + length])
            assert data_crc == masked_crc32c(data), f"bad data CRC in {path}"
            events.append(event_pb2.Event.FromString(data))
            pos += 16 + length
    return events


def scalars(events) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for event in events:
        for value in event.summary.value:
            if value.WhichOneof("value") == "simple_value":
                out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


def histogram_tags(events) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for event in events:
        for value in event.summary.value:
            if value.WhichOneof("value") == "histo":
                out.setdefault(value.tag, []).append(event.step)
    return out


def record(step: int, **extra):
    return {
        "step": step,
        "loss": 5.0 - 0.25 * step,
        "lr": 1e-3,
        "grad_norm": np.float32(0.5),
        "tokens_per_s": 1000.0 + step,
        "mfu": None,
        "expert_load": [[0.5, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25]],
        "load_max_over_mean": [2.0, 1.0],
        "dropped": np.int64(0),
        "time_s": 0.1 * step,
        **extra,
    }


def test_records_round_trip(tmp_path):
    with M.RunLogger(tmp_path, total_steps=4, progress=False) as log:
        for step in (1, 2, 3):
            log.log(record(step, **({"eval_loss": 4.0} if step == 2 else {})))
        # Each line is on disk as soon as it is logged.
        assert len(M.read_metrics(tmp_path / "metrics.jsonl")) == 3
    records = M.read_metrics(tmp_path / M.METRICS_FILE)
    assert [r["step"] for r in records] == [1, 2, 3]
    first = records[0]
    assert first["loss"] == 4.75 and first["grad_norm"] == 0.5 and first["mfu"] is None
    assert first["dropped"] == 0 and isinstance(first["dropped"], int)
    assert first["expert_load"] == [[0.5, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25]]
    assert "eval_loss" not in first and records[1]["eval_loss"] == 4.0
    assert "nonfinite" not in first


def test_arrays_become_lists(tmp_path):
    import jax.numpy as jnp

    with M.RunLogger(tmp_path, total_steps=1, progress=False) as log:
        log.log(
            {
                "step": np.int32(1),
                "loss": jnp.asarray(2.5, jnp.bfloat16),
                "load_max_over_mean": np.array([1.5, 2.0], np.float32),
                "expert_load": jnp.asarray([[0.5, 0.5]], jnp.float32),
            }
        )
    [r] = M.read_metrics(tmp_path / M.METRICS_FILE)
    assert r == {
        "step": 1,
        "loss": 2.5,
        "load_max_over_mean": [1.5, 2.0],
        "expert_load": [[0.5, 0.5]],
    }


def test_nonfinite_values_keep_valid_json(tmp_path):
    with M.RunLogger(tmp_path, total_steps=2, progress=False) as log:
        log.log(record(1, loss=float("nan"), load_max_over_mean=[float("inf"), 1.0]))
        log.log(record(2))
    lines = (tmp_path / M.METRICS_FILE).read_text().splitlines()
    assert "NaN" not in lines[0] and "Infinity" not in lines[0]
    first = json.loads(lines[0])  # plain JSON: no NaN/Infinity tokens
    assert first["loss"] is None and first["load_max_over_mean"] == [None, 1.0]
    assert first["nonfinite"] == ["loss", "load_max_over_mean/0"]
    assert "nonfinite" not in json.loads(lines[1])
    # TensorBoard gets the finite values only.
    tags = scalars(read_events(tmp_path / M.TENSORBOARD_DIR))
    assert tags["loss"] == {2: 4.5}
    assert tags["load_max_over_mean/0"] == {2: 2.0} and set(tags["load_max_over_mean/1"]) == {1, 2}


def test_resume_truncates_later_records(tmp_path):
    with M.RunLogger(tmp_path, total_steps=5, progress=False) as log:
        for step in range(1, 6):
            log.log(record(step))
    # A crash mid-write leaves a partial last line; it is dropped too.
    with (tmp_path / M.METRICS_FILE).open("a") as f:
        f.write('{"step": 6, "lo')
    with M.RunLogger(tmp_path, total_steps=5, start_step=3, progress=False) as log:
        assert [r["step"] for r in M.read_metrics(tmp_path / M.METRICS_FILE)] == [1, 2, 3]
        log.log(record(4, loss=9.0))
    records = M.read_metrics(tmp_path / M.METRICS_FILE)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[-1]["loss"] == 9.0
    assert not list(tmp_path.glob(".metrics.jsonl.*"))  # no temporary file left behind
    # The rewritten file has the permissions of any new file (not a temporary file's 0600).
    (tmp_path / "plain.txt").write_text("")
    mode = (tmp_path / M.METRICS_FILE).stat().st_mode
    assert mode == (tmp_path / "plain.txt").stat().st_mode
    # The resumed writer marks a purge from step 4 on, so TensorBoard hides the old 4 and 5.
    events = read_events(tmp_path / M.TENSORBOARD_DIR)
    starts = [e.step for e in events if e.HasField("session_log")]
    assert 4 in starts
    # A fresh run (start_step 0) starts an empty file.
    with M.RunLogger(tmp_path, total_steps=5, progress=False) as log:
        log.log(record(1))
    assert [r["step"] for r in M.read_metrics(tmp_path / M.METRICS_FILE)] == [1]


def test_tensorboard_tags(tmp_path):
    with M.RunLogger(tmp_path, total_steps=3, progress=False) as log:
        log.log(record(1))
        log.log(record(2, eval_loss=4.25))
    events = read_events(tmp_path / M.TENSORBOARD_DIR)
    tags = scalars(events)
    assert tags["loss"] == {1: 4.75, 2: 4.5}
    assert tags["eval_loss"] == {2: 4.25}
    assert tags["load_max_over_mean/0"] == {1: 2.0, 2: 2.0}
    assert tags["load_max_over_mean/1"] == {1: 1.0, 2: 1.0}
    assert {"lr", "grad_norm", "tokens_per_s", "dropped", "time_s"} <= set(tags)
    assert "mfu" not in tags and "step" not in tags
    assert not any(tag.startswith("expert_load") for tag in tags)  # not as scalars
    assert histogram_tags(events) == {"expert_load/0": [1, 2], "expert_load/1": [1, 2]}


def test_disabled_writes_nothing(tmp_path, capsys):
    workdir = tmp_path / "run"
    with M.RunLogger(workdir, total_steps=3, enabled=False) as log:
        log.log(record(1))
    assert not workdir.exists()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_progress_bar(tmp_path, capsys):
    with M.RunLogger(tmp_path, total_steps=4, start_step=1) as log:
        log.log(record(2, eval_loss=3.5))
        log.log(record(4))
    err = capsys.readouterr().err
    assert "4/4" in err and "loss=4.0000" in err and "eval=3.5000" in err
    assert "tok/s=1,004" in err
    with M.RunLogger(tmp_path, total_steps=4, progress=False) as log:
        log.log(record(1))
    assert capsys.readouterr().err == ""


def test_bad_records_and_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"total_steps=-1 must be an int >= 0"):
        M.RunLogger(tmp_path, total_steps=-1)
    with pytest.raises(ValueError, match=r"start_step=1.5 must be an int >= 0"):
        M.RunLogger(tmp_path, total_steps=2, start_step=1.5)
    log = M.RunLogger(tmp_path, total_steps=2, progress=False)
    with pytest.raises(ValueError, match=r"needs 'step' and 'loss'"):
        log.log({"step": 1})
    with pytest.raises(ValueError, match=r"step=1.0 must be an int"):
        log.log({"step": 1.0, "loss": 1.0})
    with pytest.raises(TypeError, match=r"metric 'when' has a value of type object"):
        log.log({"step": 1, "loss": 1.0, "when": object()})
    log.close()
    log.close()
    with pytest.raises(RuntimeError, match=r"after close"):
        log.log(record(1))
    (tmp_path / "bad.jsonl").write_text('{"step": 1, "loss": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl' line 2 is not valid JSON"):
        M.read_metrics(tmp_path / "bad.jsonl")


def test_without_tensorboardx_one_warning_and_the_json_lines(tmp_path, monkeypatch):
    """Where tensorboardX is not installed the run still logs its JSON lines, writes no event
    files and says so once."""
    monkeypatch.setattr(M, "SummaryWriter", None)
    with pytest.warns(RuntimeWarning, match="tensorboardX is not installed"):
        logger = M.RunLogger(tmp_path, total_steps=2, progress=False)
    with logger:
        logger.log({"step": 1, "loss": 5.0, "expert_load": [[0.5, 0.5]]})
        logger.log({"step": 2, "loss": 4.0})
    assert [r["loss"] for r in M.read_metrics(tmp_path / "metrics.jsonl")] == [5.0, 4.0]
    assert not (tmp_path / "tensorboard").exists()
