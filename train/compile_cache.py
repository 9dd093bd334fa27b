"""What a second run of the same training step reuses: the lowered step and XLA's executable.

    compile_cache.enable()              # the default folder (see `default_dir`)
    compile_cache.enable("/scratch/c")  # a folder of your own
    compile_cache.enable(None)          # off

Getting a step ready to run takes three stages: tracing (Python to a jaxpr), lowering (to
StableHLO, which for the MoE layer's Mosaic GPU kernels means running their compiler in
Python, about 3 s a kernel) and XLA's compile. With the cache on:
  - `<folder>/xla` is JAX's persistent compilation cache: XLA's executables, keyed by the
    lowered program;
  - `<folder>/steps` keeps each lowered train step (`jax.export`, serialized), keyed by
    everything that could change it (`StepKey`: the sources of this project's packages, the
    versions of jax, jaxlib, flax and optax, the backend and devices, the mesh, the configs,
    the argument shapes and shardings, the compile options, XLA_FLAGS). A second run with the
    same key skips tracing and lowering; its compile is then a read of the first cache.
A lowered step that cannot be exported (a step with host callbacks, such as the kernels'
interpret mode on a CPU) is traced and lowered every run, and the reason is reported.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import tempfile
import time
from importlib import metadata
from typing import Any

import jax
from jax import export

# The environment variable that overrides the default folder.
ENV_VAR = "MOK_JAX_CACHE_DIR"
# The packages whose sources a lowered step depends on.
_PACKAGES = ("mok_jax", "pallas_kernels", "train")
_VERSIONED = ("jax", "jaxlib", "flax", "optax")


# Custom calls that jax.export does not promise to read back in another jax version (cuDNN's
# fused attention). A kept step is read back only by the versions it was lowered with (its key
# holds them), so the promise is not needed.
_UNVERSIONED_CALLS = [
    export.DisabledSafetyCheck.custom_call(f"__cudnn${kind}{direction}")
    for kind in (
        "fmhaSoftmax",
        "fmhaScaleBiasSoftmax",
        "fmhaSoftmaxDropout",
        "fmhaScaleBiasSoftmaxDropout",
    )
    for direction in ("", "Backward")
]


def default_dir() -> pathlib.Path:
    """$MOK_JAX_CACHE_DIR, else $XDG_CACHE_HOME/mok_jax, else ~/.cache/mok_jax."""
    if os.environ.get(ENV_VAR):
        return pathlib.Path(os.environ[ENV_VAR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base).expanduser() / "mok_jax"


_steps_dir: pathlib.Path | None = None


def enable(cache_dir: str | os.PathLike | None = "") -> pathlib.Path | None:
    """Turns both caches on in `cache_dir` ("" for `default_dir()`) or off (None); returns
    the folder in use. XLA keeps every program that took at least a second to compile."""
    global _steps_dir
    if cache_dir is None:
        jax.config.update("jax_enable_compilation_cache", False)
        _steps_dir = None
        return None
    root = default_dir() if cache_dir == "" else pathlib.Path(cache_dir).expanduser()
    for sub in ("xla", "steps"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(root / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    _steps_dir = root / "steps"
    return root


def steps_dir() -> pathlib.Path | None:
    """Where lowered steps are kept, or None when the cache is off."""
    return _steps_dir


@functools.cache
def _sources_digest() -> str:
    """A digest of every Python source of this project's packages, as installed."""
    digest = hashlib.sha256()
    for package in _PACKAGES:
        folder = pathlib.Path(__import__(package).__file__).parent
        for path in sorted(folder.rglob("*.py")):
            digest.update(str(path.relative_to(folder.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _versions() -> dict[str, str]:
    return {name: metadata.version(name) for name in _VERSIONED}


@dataclasses.dataclass(frozen=True)
class StepKey:
    """What a lowered step depends on beyond the sources and versions: a JSON-able dict."""

    parts: dict[str, Any]

    def digest(self) -> str:
        payload = {
            "sources": _sources_digest(),
            "versions": _versions(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "backend": jax.default_backend(),
            **self.parts,
        }
        text = json.dumps(payload, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def load(key: StepKey) -> export.Exported | None:
    """The lowered step kept under `key`, or None (cache off, nothing kept, or a file that
    does not read back, which is then ignored)."""
    if _steps_dir is None:
        return None
    path = _steps_dir / f"{key.digest()}.jax_exported"
    if not path.is_file():
        return None
    try:
        return export.deserialize(bytearray(path.read_bytes()))
    except Exception:  # a damaged or foreign file: lower again and overwrite it
        return None


def store(key: StepKey, exported: export.Exported) -> pathlib.Path | None:
    """Keeps `exported` under `key` (written to a temporary file, then renamed: a reader
    never sees half a file); returns its path, None when the cache is off."""
    if _steps_dir is None:
        return None
    path = _steps_dir / f"{key.digest()}.jax_exported"
    with tempfile.NamedTemporaryFile(dir=_steps_dir, delete=False, suffix=".tmp") as f:
        f.write(exported.serialize())
    os.replace(f.name, path)
    return path


@dataclasses.dataclass(frozen=True)
class CompileTimes:
    """Seconds to get a step ready to run.

    Attributes:
      trace_s: Python to a jaxpr; None where it was timed with the lowering (through
        `jax.export`) or skipped (the lowered step read from the cache).
      lower_s: the jaxpr to StableHLO (the Mosaic GPU kernels' own compiler included), with
        the tracing where `trace_s` is None; or the read of the lowered step from the cache.
      compile_s: XLA's compile, or the read of its executable from the persistent cache.
      lowered: "traced", "traced and kept" (in the step cache) or "read" (from it), with the
        reason where a step could not be kept.
    """

    trace_s: float | None
    lower_s: float
    compile_s: float
    lowered: str

    @property
    def total_s(self) -> float:
        return (self.trace_s or 0.0) + self.lower_s + self.compile_s


def compile_step(
    jitted,
    step_fn,
    args: tuple,
    out_tree,
    out_shardings,
    *,
    donate_argnums: tuple[int, ...],
    compiler_options: dict[str, Any],
    key: StepKey,
    exportable: str | None,
):
    """Gets jax.jit(step_fn) ready to run on arguments shaped like `args` (ShapeDtypeStructs
    carrying their shardings), through the step cache when it is on.

    Args:
      jitted: jax.jit(step_fn) with the shardings, donations and compile options below (what
        runs where the step cache is not used).
      step_fn: the step, a function of `args`' pytrees to pytrees of arrays.
      args: the abstract arguments.
      out_tree: the treedef of step_fn's output (checked against the lowered step's).
      out_shardings: the outputs' shardings, a pytree of `out_tree`'s structure, or None.
      donate_argnums: the arguments whose buffers the step takes over.
      compiler_options: XLA's compile options.
      key: what the lowered step depends on besides sources and versions.
      exportable: None if the step can go through `jax.export`, else why not.

    Returns:
      (run, compiled, CompileTimes): run(*args) -> the step's output pytree; compiled: the
      `jax.stages.Compiled` (for its memory analysis).
    """
    leaves, in_tree = jax.tree.flatten(args)
    flat_donated = _flat_indices(args, donate_argnums)
    if _steps_dir is None or exportable is not None:
        return _compile_traced(jitted, args, exportable or "cache off")
    shardings = tuple(getattr(a, "sharding", None) for a in leaves)
    flat_out = None if out_shardings is None else tuple(out_tree.flatten_up_to(out_shardings))

    def flat_step(*flat):
        return tuple(jax.tree.leaves(step_fn(*jax.tree.unflatten(in_tree, flat))))

    started = time.perf_counter()
    exported, lowered = load(key), "read"
    if exported is None or len(exported.out_avals) != out_tree.num_leaves:
        flat_jit = jax.jit(
            flat_step,
            in_shardings=shardings,
            out_shardings=flat_out,
            donate_argnums=flat_donated,
        )
        try:
            exported = export.export(flat_jit, disabled_checks=_UNVERSIONED_CALLS)(*leaves)
            store(key, exported)
        except Exception as e:  # a step jax.export refuses still trains, uncached
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return _compile_traced(jitted, args, f"not kept: {first_line[:160]}")
        lowered = "traced and kept"
    lowered_at = time.perf_counter()
    call = jax.jit(
        exported.call,
        in_shardings=shardings,
        out_shardings=flat_out,
        donate_argnums=flat_donated,
        compiler_options=compiler_options,
    )
    compiled = call.lower(*leaves).compile()
    times = CompileTimes(
        trace_s=None,
        lower_s=lowered_at - started,
        compile_s=time.perf_counter() - lowered_at,
        lowered=lowered,
    )

    def run(*args):
        return jax.tree.unflatten(out_tree, compiled(*jax.tree.leaves(args)))

    return run, compiled, times


def _flat_indices(args: tuple, argnums: tuple[int, ...]) -> tuple[int, ...]:
    """The positions, among args' leaves, of the leaves of the arguments `argnums`."""
    indices, start = [], 0
    for i, arg in enumerate(args):
        count = len(jax.tree.leaves(arg))
        if i in argnums:
            indices.extend(range(start, start + count))
        start += count
    return tuple(indices)


def _compile_traced(jitted, args, why: str):
    """compile_step without the step cache: trace, lower and compile, each timed."""
    started = time.perf_counter()
    traced = jitted.trace(*args)
    traced_at = time.perf_counter()
    lowered = traced.lower()
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    times = CompileTimes(
        trace_s=traced_at - started,
        lower_s=lowered_at - traced_at,
        compile_s=time.perf_counter() - lowered_at,
        lowered=f"traced ({why})",
    )
    return compiled, compiled, times
