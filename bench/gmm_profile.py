"""Hardware counters of one forward grouped GEMM: ours against torch._grouped_mm (issue 4).

    bash bench/gmm_profile.sh SHAPE [LABELS]       # on the GPU: ncu around this script

The script builds one grouped_gemm_h200 shape's inputs, builds our forward `mosaic_gpu.gmm`
with each config of `--labels` (bench/gmm_sweep.py's forward candidates by label: `default`,
`cluster2`, `cluster_m2`, `split_m`, ...) and torch._grouped_mm, checks each against torch on
every element, warms each up, and then launches each once between cudaProfilerStart and
cudaProfilerStop, so that Nsight Compute (`--profile-from-start off`) profiles only those
launches: SM and memory throughput, the tensor pipes' activity, L2 hit rates, warp stall
reasons, the SM clock during the kernel, and for clusters how many can be resident at once.
Where a kernel spends its time shows there, not in the timings alone, which move by ~5% from run
to run and device to device.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.80")

import argparse
import functools
from collections.abc import Sequence

import jax

from bench import gmm_sweep
from bench import grouped_gemm_h200 as gg
from pallas_kernels.grouped_matmul import mosaic_gpu


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral_gate_up", help="a grouped_gemm_h200 shape")
    parser.add_argument(
        "--labels", default="default,cluster2", help="comma-separated gmm_sweep forward labels"
    )
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        parser.error("the profile needs the GPU: no GPU backend here")
    import torch  # the GPU image has it

    shapes = {s.name: s for s in gg.SHAPES}
    if args.shape not in shapes:
        parser.error(f"unknown shape {args.shape!r}; known: {sorted(shapes)}")
    shape = shapes[args.shape]
    configs = {t.label: t.config for t in gmm_sweep.candidates("forward", shape)}
    labels = args.labels.split(",")
    unknown = [label for label in labels if label not in configs]
    if unknown:
        parser.error(f"unknown labels {unknown}; known at {shape.name}: {sorted(configs)}")

    p = gg.make_problem(shape, torch)
    t = p.t

    def torch_call():
        return torch._grouped_mm(t["x"], t["w"], offs=t["offs"])

    expected = jax.dlpack.from_dlpack(torch_call().contiguous())
    runs = {"torch._grouped_mm": lambda _out: torch.cuda.synchronize()}
    calls = {"torch._grouped_mm": torch_call}
    for label in labels:
        fn = jax.jit(functools.partial(mosaic_gpu.gmm, config=configs[label]))
        out = fn(p.x, p.w, p.gs)
        check = gg.compare(out, expected)
        print(f"{label}: {configs[label]}\n  check against torch: {check}", flush=True)
        calls[label] = functools.partial(fn, p.x, p.w, p.gs)
        runs[label] = jax.block_until_ready
    for name, call in calls.items():  # warm-up, outside the profiled range
        for _ in range(2):
            runs[name](call())
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, call in calls.items():
        print(f"profiled launch: {name}", flush=True)
        runs[name](call())
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
