"""Run-to-run determinism across processes: the compile options for the jit holding the layer.

Every mok_jax formulation is deterministic for a given compiled executable: no scatter-add, no
atomics, fixed reduction orders. On GPU, XLA's autotuner picks each GEMM's algorithm by timing
candidates while it compiles, so two processes can compile different algorithms, with different
accumulation orders, and the `xla` implementation's bits can differ between them (seen on the
H200 on 2026-11-30). Turning the autotuner off for that one executable makes the choice a
function of the shapes. This is a per-executable option, not a process-wide flag:

    step = jax.jit(train_step, compiler_options=mok_jax.deterministic_compiler_options())

On CPU the option changes nothing.
"""

from __future__ import annotations


def deterministic_compiler_options() -> dict[str, int]:
    """Compile options that make XLA:GPU pick GEMM algorithms without timing them."""
    return {"xla_gpu_autotune_level": 0}
