"""Test set-up: 8 fake CPU devices, a shared GPU's memory returned as freed, strict dtype
promotion, GPU interpret mode's matmul in a fixed order, hypothesis profiles, the gpu and slow
markers (slow tests run only with --all), one XLA compilation cache for the run, jax's compiled
programs released after each test module."""

import functools
import gc
import os
import shutil
import tempfile
import types

# The training command's compilation cache (on by default, in the user's cache folder) goes to a
# folder of the test run's own, for the commands the tests start too.
os.environ.setdefault("MOK_JAX_CACHE_DIR", tempfile.mkdtemp(prefix="mok_jax_test_cache_"))

# pytest-xdist's workers share one GPU: each returns the device memory it frees (the platform
# allocator) instead of keeping it in a pool of its own, where the other workers' real-size
# tests ran out of memory (4 workers on an H100).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")

# Before jax initializes its backends: 8 simulated CPU devices for the sharded tests.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Every implicit promotion is an error: the library states its dtypes.
jax.config.update("jax_numpy_dtype_promotion", "strict")


def _matmul_in_k_order(a, b, dtype=None):
    """a [M, K] @ b [K, N]: each output element adds its K products in order of k, in `dtype`.

    GPU interpret mode runs a WGMMA as `acc + np.matmul(a, b, dtype=...)` on the host, and the
    host's BLAS need not give a row the same bits wherever the row sits in its tile: OpenBLAS
    on an AVX2 AMD EPYC (CI, 2026-12-02) did not (12533 of 64 x 128 elements differed between
    shifted copies of the same rows), so the interpret twins of the grouped GEMM's invariant 1
    (a row's bits do not depend on where its group starts, which the GPU's WGMMA gives) failed
    on the host's arithmetic, not the kernel's. Here every element is computed alike, by
    elementwise products and sums that round the same on any CPU."""
    dtype = np.result_type(a, b) if dtype is None else np.dtype(dtype)
    a, b = np.asarray(a, dtype), np.asarray(b, dtype)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"expects [M, K] @ [K, N], got {a.shape} @ {b.shape}")
    out = np.zeros((a.shape[0], b.shape[1]), dtype)
    for k in range(a.shape[1]):
        out += a[:, k, None] * b[k]
    return out


def _interpret_wgmma_in_k_order() -> None:
    """GPU interpret mode's host matmul (its WGMMA) becomes `_matmul_in_k_order`: the module
    that runs it sees a copy of numpy whose matmul is that one."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    if getattr(gpu_callbacks, "np", None) is not np:
        raise RuntimeError(
            "jax's GPU interpret mode no longer runs its WGMMA through gpu_callbacks.np.matmul: "
            "the tests' host matmul (tests/conftest.py) must follow it"
        )
    k_ordered = types.ModuleType("numpy_with_matmul_in_k_order")
    k_ordered.__dict__.update(np.__dict__)
    k_ordered.matmul = _matmul_in_k_order
    gpu_callbacks.np = k_ordered


_interpret_wgmma_in_k_order()


def _import_what_interpret_mode_imports_on_its_first_run() -> None:
    """GPU interpret mode's first run imports jax's TPU interpret module, which registers a
    config option (`pallas_fuser_disable_nested_fuse`) that enters jax's trace context: a
    function jitted before that first run would be traced once more after it (a test that
    counts traces would see two). Imported here, the trace context is the same throughout."""
    import jax._src.pallas.mosaic.interpret.interpret_pallas_call  # noqa: F401


_import_what_interpret_mode_imports_on_its_first_run()

# Hypothesis profiles: "fast" for the fast tier (./test.sh), "ci" with --all, "thorough" on
# request (HYPOTHESIS_PROFILE names one and overrides both).
settings.register_profile("fast", max_examples=5, deadline=None, derandomize=True)
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("thorough", max_examples=500, deadline=None)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops jax's caches of compiled programs after each test module.

    XLA:CPU maps three memory regions (code, data, constants) for every kernel of a compiled
    program, and GPU interpret mode compiles many small programs; jax caches them all, so a
    pytest-xdist worker that runs half the suite reached Linux's limit of 65530 mappings a
    process (vm.max_map_count) near the end, and the next compile aborted the worker (CI on
    2026-11-30: "Fatal Python error: Aborted" in backend_compile_and_load, in
    tests/train/test_step.py). 14 interpret-mode tgmm tests leave 3040 mappings; after this,
    591. Programs shared between modules compile again."""
    yield
    _release()


# One module's tests can hold ~27k mappings in a worker on their own (measured: a worker went
# from 785 to 26841 in one module of the suite, then back to 1565 after it). Past this count,
# the programs are also released after each test: a guard that today's suite does not reach,
# since a release inside a module makes its module-scoped jitted functions trace again (which
# a test counting traces, as tests/train/test_step.py's, would see).
_MAPPINGS_LIMIT = 40_000


@pytest.fixture(autouse=True)
def _bound_memory_mappings():
    """Releases jax's compiled programs after a test that leaves the process holding more than
    _MAPPINGS_LIMIT memory mappings (see _release_compiled_programs; Linux only)."""
    yield
    if _memory_mappings() > _MAPPINGS_LIMIT:
        _release()


def _memory_mappings() -> int:
    """The process's memory mappings (lines of /proc/self/maps), 0 where there is no /proc."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


def _release() -> None:
    jax.clear_caches()
    gc.collect()


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_addoption(parser):
    parser.addoption(
        "--all",
        action="store_true",
        default=False,
        help="run the tests marked slow too (without it they are deselected: the fast tier)",
    )


def pytest_configure(config):
    default = "ci" if config.getoption("--all") else "fast"
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", default))
    _use_the_runs_compilation_cache(config)


# One persistent compilation cache (XLA's executables) for the test run, shared by its
# pytest-xdist workers: a program that several tests compile anew (each Trainer jits its own
# step, each module's programs are released after it, a module's tests may run on both
# workers) is compiled by XLA once, then read back (the micro model's train step: ~30 s on 2
# busy cores, then ~1 s). Every program is kept, however quickly it compiled: the many small
# programs of GPU interpret mode add up (tests/pallas_kernels/grouped_matmul with --all on 2
# workers: 245 s and 342 s of CPU keeping all, against 267 s and 411 s keeping only those that
# took a second or more).
_compilation_cache: str | None = None


def _use_the_runs_compilation_cache(config) -> None:
    global _compilation_cache
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # a pytest-xdist worker: its controller's folder
        _compilation_cache = workerinput["mok_jax_compilation_cache"]
    else:
        _compilation_cache = tempfile.mkdtemp(prefix="mok_jax_test_compilation_cache_")
        config.add_cleanup(functools.partial(shutil.rmtree, _compilation_cache, True))
    jax.config.update("jax_compilation_cache_dir", _compilation_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist's controller, starting a worker: the run's compilation cache."""
    node.workerinput["mok_jax_compilation_cache"] = _compilation_cache


def _deselected_as_slow(item) -> bool:
    """Marked slow and not gpu: a GPU test always runs (skipped without a GPU), so that
    `./test.sh -m gpu` runs every one of them."""
    return item.get_closest_marker("slow") is not None and item.get_closest_marker("gpu") is None


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--all"):
        slow = [item for item in items if _deselected_as_slow(item)]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not _deselected_as_slow(item)]
            if hasattr(config, "workeroutput"):  # a pytest-xdist worker: see below
                config.workeroutput["deselected_as_slow"] = [item.nodeid for item in slow]
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_reported_deselected = False


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller collects nothing: each worker collects and deselects the same
    slow tests, so the first worker's list is passed on once, for the summary's "N deselected"
    (as stand-ins that carry the node id: the controller has no items, and the terminal
    reporter only counts them)."""
    global _reported_deselected
    nodeids = getattr(node, "workeroutput", {}).get("deselected_as_slow")
    if nodeids and not _reported_deselected:
        _reported_deselected = True
        stand_ins = [types.SimpleNamespace(nodeid=nodeid) for nodeid in nodeids]
        node.config.hook.pytest_deselected(items=stand_ins)
