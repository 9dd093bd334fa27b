"""What a run records beside its numbers (the environment), how its files are written, and the
optional libraries its baselines need (torch, tokamax)."""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import logging
import os
import pathlib
import shlex
import subprocess
import sys
import threading
import types
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = (
    "jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "numpy", "flax", "optax", "torch",
    "tokamax", "triton",
)  # fmt: skip


def git(*cmd: str) -> str | None:
    try:
        run = subprocess.run(
            ["git", *cmd], cwd=ROOT, capture_output=True, text=True, check=False, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout.strip() if run.returncode == 0 else None


def environment(module: str, argv: Sequence[str] | None = None, *, device: bool = True) -> dict:
    """The command (`python -m bench.<module> ...`), date, Python and package versions, git
    commit (and whether the tracked files differ from it), XLA's environment variables and,
    with `device`, JAX's backend and first device (which starts the backend)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    versions = {}
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    env = {
        "command": shlex.join(["python3", "-m", f"bench.{module}", *argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "versions": versions,
        "git_commit": git("rev-parse", "HEAD"),
        "git_uncommitted": bool(git("status", "--porcelain", "--untracked-files=no")),
        "xla_env": {k: v for k, v in os.environ.items() if k.startswith("XLA_")},
    }
    if device:
        import jax

        env |= {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind}
    return env


def versions_line(env: dict) -> str:
    """One line: device, versions, git commit."""
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    changes = " with uncommitted changes" if env.get("git_uncommitted") else ""
    return f"{env.get('device', '?')}; {versions}; git {env['git_commit']}{changes}"


_WRITE_LOCK = threading.Lock()


def write_files(out_dir: pathlib.Path, texts: dict[str, str]) -> None:
    """Each {name: text} into out_dir, replaced whole (a run killed while writing leaves the
    previous complete file), one writer at a time."""
    with _WRITE_LOCK:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            tmp = out_dir / f".{name}.tmp"
            tmp.write_text(text)
            tmp.replace(out_dir / name)


def save(out_dir: pathlib.Path, name: str, results: dict, markdown: str) -> None:
    """name.json and name.md in out_dir (`write_files`)."""
    text = json.dumps(results, indent=1, default=str)
    write_files(out_dir, {f"{name}.json": text, f"{name}.md": markdown})


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """A markdown table's lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def import_torch() -> tuple[types.ModuleType | None, str]:
    """(torch, "") where it imports and, on a GPU backend, sees the GPU; else (None, why)."""
    import jax

    try:
        import torch  # optional: GPU images have it, CI does not
    except Exception as e:
        return None, f"import torch: {e!r}"
    if jax.default_backend() == "gpu" and not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    return torch, ""


def import_tokamax():
    """tokamax and its ragged_dot `base` module, with an empty stand-in for its optional
    `xprof` import; raises NotAvailable without a GPU or without tokamax."""
    import jax

    from bench.harness.timing import NotAvailable

    if jax.default_backend() != "gpu":
        raise NotAvailable(f"needs a CUDA GPU (JAX backend is {jax.default_backend()})")
    for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
        sys.modules.setdefault(name, types.ModuleType(name))
    tools = sys.modules["xprof.cli.tools"]
    if not hasattr(tools, "get_kernel_stats_tool"):
        tools.get_kernel_stats_tool = None
    try:
        import tokamax  # optional: `pip install tokamax`
        from tokamax._src.ops.ragged_dot import base
    except Exception as e:
        raise NotAvailable(f"import tokamax: {e!r}") from e
    # One "autotuning cache miss" warning per call otherwise.
    logging.getLogger("absl").setLevel(logging.ERROR)
    return tokamax, base
