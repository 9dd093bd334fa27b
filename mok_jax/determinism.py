"""Compile options for the jit that holds the layer: deterministic GEMM choice, fast exchange.

Every mok_jax formulation is deterministic for a given compiled executable: no scatter-add, no
atomics, fixed reduction orders. On GPU, XLA's autotuner picks each GEMM's algorithm by timing
candidates while it compiles, so two processes can compile different algorithms, with different
accumulation orders, and the `xla` implementation's bits can differ between them (seen on the
H200 on 2026-11-30). Turning the autotuner off for that one executable makes the choice a
function of the shapes. Untimed, XLA's own Triton GEMMs fall back to one default tiling that ran
the training step's dense projections at a few percent of an H100's bf16 rate, so the options
also send XLA's GEMMs to cuBLAS, whose heuristics pick an algorithm from the shapes alone (and
whose results are bitwise repeatable on one GPU model, by its documentation). The XLA code
around the layer (cuDNN's fused attention backward, XLA's own reductions) may also add in
arrival order unless XLA is asked for deterministic operations: on one H100 the `gpu` training
preset's step, with the layer on `fused`, gave other losses at its second step when run twice
in one process, and the same bits with `xla_gpu_deterministic_ops`, at 216,049 tokens/s
(bench/results/2026-12-07_train_determinism_h100/). These are per-executable options, not
process-wide flags:

    step = jax.jit(train_step, compiler_options=mok_jax.compiler_options())

`compiler_options()` adds XLA's dense decomposition of `ragged_all_to_all` (the exchange
"ragged_all_to_all" on GPUs): on two NVLink-connected H200s (EP 2, 2026-11-30) XLA's default
one-shot kernel moved 67 MB per device at 2.6 GB/s (25 ms, against 0.55 ms for a dense
`all_to_all` of the same bytes), and the layer's forward+backward at qwen3 shapes went from 361
to 218 ms with the decomposition alone (120 ms once empty tiles were skipped too), with y and dx
still bitwise equal to one GPU (bench/results/multi_gpu_h200x2.md). The decomposition pads every
peer's chunk to the whole input's rows, so the bytes it moves, and its transient [EP, N, D] send
and receive buffers, grow with EP: measured at EP 2 only. On CPU neither option changes
anything.
"""

from __future__ import annotations


def deterministic_compiler_options() -> dict[str, int | bool]:
    """Compile options that make XLA:GPU's results a function of the program and its inputs:
    GEMM algorithms picked without timing them (no autotuner; XLA's GEMMs on cuBLAS, chosen by
    its heuristics, rather than untuned Triton tilings) and XLA's deterministic operations (no
    arrival-order additions in its reductions, scatters or cuDNN's attention backward)."""
    return {
        "xla_gpu_autotune_level": 0,
        "xla_gpu_enable_triton_gemm": False,
        "xla_gpu_deterministic_ops": True,
    }


def compiler_options() -> dict[str, int | bool]:
    """The options for a jit holding the layer: `deterministic_compiler_options()` and XLA's
    dense decomposition of `ragged_all_to_all` (see the module docstring)."""
    return {
        **deterministic_compiler_options(),
        "xla_gpu_unsupported_enable_ragged_all_to_all_decomposer": True,
    }
