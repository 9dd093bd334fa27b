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

--sustain-s S (run it without ncu): each candidate instead runs back to back for S seconds
while a thread reads `nvidia-smi` (SM clock, power, the reasons the clocks are held down) every
0.1 s: whether a kernel runs slower because the device lowers its clocks under it (power or
thermal limits differ from one H200 to another). Prints one JSON line a candidate and writes
them to --out.

--report CSV [CSV ...] (no GPU needed): a markdown table of the readings that matter here, one
column per profiled grouped GEMM (torch's CUTLASS kernel, then ours in --labels order), from
the files `ncu --import X.ncu-rep --csv --page details` writes (gmm_profile.sh makes them).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.80")

import argparse
import csv
import functools
import json
import pathlib
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from bench import gmm_sweep
from bench import grouped_gemm_h200 as gg
from pallas_kernels.grouped_matmul import mosaic_gpu

# nvidia-smi's field for the reasons clocks are held down, by its newer name, then its older.
SMI_FIELD_SETS = (
    "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active",
    "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active",
)


def _parse_smi(line: str) -> list[float]:
    """nvidia-smi's csv values: numbers, the reasons a hexadecimal bit mask."""
    values = [v.strip() for v in line.split(",")]
    return [float(int(v, 16)) if v.startswith("0x") else float(v) for v in values]


def _read_smi() -> list[float] | None:
    """[SM MHz, W, deg C, active clock-event reasons as a bit mask] now, or None."""
    for fields in SMI_FIELD_SETS:
        try:
            result = subprocess.run(
                ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=5,
                check=True,
            )
            return _parse_smi(result.stdout.splitlines()[0])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            continue
    return None


def sustain(name: str, call: Callable, sync: Callable, seconds: float) -> dict:
    """`call` back to back for `seconds` (a sync every 10 calls), nvidia-smi read every 0.1 s
    meanwhile: the median SM clock, power and temperature, the clock-event reasons seen, the
    mean time a call."""
    samples: list[list[float]] = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            reading = _read_smi()
            if reading is not None:
                samples.append(reading)
            done.wait(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            out = call()
        sync(out)
        calls += 10
    elapsed = time.perf_counter() - start
    done.set()
    watcher.join()
    table = np.asarray(samples) if samples else np.zeros((0, 4))
    reasons = sorted({int(r) for r in table[:, 3]}) if len(table) else []
    return {
        "candidate": name,
        "seconds": elapsed,
        "calls": calls,
        "ms_per_call": elapsed / calls * 1e3,
        "smi_samples": len(table),
        "sm_mhz_median": float(np.median(table[:, 0])) if len(table) else None,
        "sm_mhz_min": float(np.min(table[:, 0])) if len(table) else None,
        "power_w_median": float(np.median(table[:, 1])) if len(table) else None,
        "temperature_c_max": float(np.max(table[:, 2])) if len(table) else None,
        "clock_event_reasons_seen": [hex(r) for r in reasons],
    }


# (section, metric) of ncu's details page that the report shows, in this order.
REPORT_METRICS = (
    ("GPU Speed Of Light Throughput", "Duration"),
    ("GPU Speed Of Light Throughput", "SM Frequency"),
    ("GPU Speed Of Light Throughput", "Elapsed Cycles"),
    ("GPU Speed Of Light Throughput", "Compute (SM) Throughput"),
    ("GPU Speed Of Light Throughput", "L1/TEX Cache Throughput"),
    ("GPU Speed Of Light Throughput", "L2 Cache Throughput"),
    ("GPU Speed Of Light Throughput", "DRAM Throughput"),
    ("Memory Workload Analysis", "L2 Hit Rate"),
    ("Compute Workload Analysis", "Executed Ipc Active"),
    ("Instruction Statistics", "Executed Instructions"),
    ("Warp State Statistics", "Warp Cycles Per Issued Instruction"),
    ("Launch Statistics", "Cluster Size"),
    ("Launch Statistics", "Grid Size"),
    ("Occupancy", "Max Active Clusters"),
)


def _profiled_kernel(name: str) -> str | None:
    """ "torch" for torch._grouped_mm's GEMM, "ours" for a Mosaic GPU kernel, None for the rest
    (XLA's small fusions around our call, torch's argument-preparing kernel)."""
    if "mosaic_gpu" in name:
        return "ours"
    if "cutlass" in name and "prepare" not in name:
        return "torch"
    return None


def ncu_report(csv_paths: Sequence[pathlib.Path], labels: Sequence[str] = ()) -> str:
    """Markdown: REPORT_METRICS of each profiled grouped GEMM of each details CSV (one table a
    file). Our kernels are named by `labels` in launch order (gmm_profile launches torch first,
    then each label once), else "ours #i"."""
    lines = []
    for path in csv_paths:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        kernels: dict[str, dict[tuple[str, str], str]] = {}
        ours = 0
        for row in rows:
            kind = _profiled_kernel(row.get("Kernel Name", ""))
            if kind is None:
                continue
            key = row["ID"]
            if key not in kernels:
                if kind == "ours":
                    name = labels[ours] if ours < len(labels) else f"ours #{ours}"
                    ours += 1
                else:
                    name = "torch._grouped_mm"
                kernels[key] = {("", "name"): name}
            value = f"{row['Metric Value']} {row['Metric Unit']}".strip()
            kernels[key][(row["Section Name"], row["Metric Name"])] = value
        if not kernels:
            raise ValueError(f"{path}: no grouped GEMM launch (torch's or ours) in the file")
        columns = list(kernels.values())
        lines.append(f"### {pathlib.Path(path).name}\n")
        lines.append("| metric | " + " | ".join(c[("", "name")] for c in columns) + " |")
        lines.append("| --- |" + " --- |" * len(columns))
        for section, metric in REPORT_METRICS:
            if any((section, metric) in c for c in columns):
                cells = [c.get((section, metric), "-") for c in columns]
                lines.append(f"| {metric} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="mixtral_gate_up", help="a grouped_gemm_h200 shape")
    parser.add_argument(
        "--labels", default="default,cluster2", help="comma-separated gmm_sweep forward labels"
    )
    parser.add_argument(
        "--sustain-s",
        type=float,
        default=0.0,
        help="run each candidate this long under nvidia-smi readings instead of profiling",
    )
    parser.add_argument("--out", type=pathlib.Path, help="--sustain-s: the JSON file to write")
    parser.add_argument(
        "--report",
        type=pathlib.Path,
        nargs="+",
        help="ncu details CSVs to summarize as markdown (no GPU needed); --labels names ours",
    )
    args = parser.parse_args(argv)
    if args.report:
        print(ncu_report(args.report, args.labels.split(",")))
        return
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
    runners = {
        "torch._grouped_mm": gg.torch_runner(
            torch, lambda: torch._grouped_mm(t["x"], t["w"], offs=t["offs"]), on_gpu=True
        )
    }
    expected = runners["torch._grouped_mm"].to_jax(runners["torch._grouped_mm"].call())[0]
    for label in labels:
        gmm = functools.partial(mosaic_gpu.gmm, config=configs[label])
        runners[label] = gg.jax_runner(gmm, p.x, p.w, p.gs)
        check = gg.compare(runners[label].to_jax(runners[label].call())[0], expected)
        print(f"{label}: {configs[label]}\n  check against torch: {check}", flush=True)
    for runner in runners.values():  # warm-up, outside the profiled range
        for _ in range(2):
            runner.sync(runner.call())
    if args.sustain_s > 0:
        rows = []
        for name, runner in runners.items():
            rows.append(sustain(name, runner.call, runner.sync, args.sustain_s))
            rows[-1]["shape"] = shape.name
            print(json.dumps(rows[-1]), flush=True)
            time.sleep(2.0)  # let the device settle between candidates
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1))
        return
    torch.cuda.profiler.start()
    for name, runner in runners.items():
        print(f"profiled launch: {name}", flush=True)
        runner.sync(runner.call())
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
