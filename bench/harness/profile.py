"""Kernel events of a compiled program from a JAX profile: which HLO instruction each kernel
ran, when and how long, read back from the trace of a few calls."""

from __future__ import annotations

import pathlib
import re
import tempfile
import time
import warnings
from collections.abc import Callable

import jax

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]*)\"", re.MULTILINE)


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its op_name (the jax operations and named scopes it came from)."""
    return dict(_INSTRUCTION.findall(hlo_text))


def module_name(hlo_text: str) -> str:
    return re.search(r"^HloModule ([\w.\-]+)", hlo_text, re.MULTILINE).group(1)


def device_events(xspace_path: str, module: str) -> list[tuple[str, int, int]]:
    """(hlo_op, start_ns, duration_ns) of every event of `module`'s kernels: on the first GPU's
    plane if there is one (with several GPUs, one device's kernels), else the host's XLA
    thunks."""
    from jax._src.lib import _profile_data

    profile = _profile_data.ProfileData.from_file(xspace_path)
    planes = [p for p in profile.planes if p.name == "/device:GPU:0"]
    planes = planes or [p for p in profile.planes if p.name.startswith("/host:CPU")]
    events = []
    for plane in planes:
        for line in plane.lines:
            for event in line.events:
                with warnings.catch_warnings():  # the bindings' stats type lacks __module__
                    warnings.simplefilter("ignore", DeprecationWarning)
                    stats = dict(event.stats)
                if stats.get("hlo_module") == module and "hlo_op" in stats:
                    events.append((str(stats["hlo_op"]), event.start_ns, event.duration_ns))
    return events


def traced_events(call: Callable[[], object], module: str, iters: int) -> tuple[list, float]:
    """Runs `call` (one synchronized call of the program) `iters` times under jax.profiler:
    (the events of `module`'s kernels, wall ms per call)."""
    with tempfile.TemporaryDirectory() as trace_dir:
        started = time.perf_counter()
        with jax.profiler.trace(trace_dir):
            for _ in range(iters):
                call()
        wall_ms = (time.perf_counter() - started) * 1e3 / iters
        (path,) = pathlib.Path(trace_dir).rglob("*.xplane.pb")
        events = device_events(str(path), module)
    if not events:
        raise RuntimeError(f"no kernel events of module {module} in the profile")
    return events, wall_ms
