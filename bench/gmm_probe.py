"""Where a forward grouped GEMM's time goes, and whether a change moved it (issue 4).

    PYTHONPATH=[KERNELS:]. python3 -m bench.gmm_probe --out FILE [--label L] [--shapes ...]
        [--k-scales 1,2] [--no-store]

Times our `mosaic_gpu.gmm` forward (its default tiles) against torch._grouped_mm at the DESIGN.md
shapes of bench/grouped_gemm_h200.py, in alternated samples (`grouped_gemm_h200.time_paired`:
torch, ours, torch, ...; each sample >= 5 ms of back-to-back calls), after checking ours
against torch on every element. x torch is the median of the per-pair ratios, so clock drift
between the two cancels.

- K scaling: each shape again with K times each factor of --k-scales (same M, N, G, routing).
  A program's time is its tiles x (fixed + per-step x K / block_k), so the fixed cost of a
  tile (ring fill and drain, epilogue, scheduling) shows as 2 t(K) - t(2K), for ours and for
  torch alike: the `fixed_share` of the report.
- --no-store: ours again with the epilogue's TMA stores removed (`mosaic_gpu._store_rows`
  patched to do nothing; the output is then wrong and not checked): what the stores cost.
- An A/B of two versions of the kernels: a directory holding another commit's
  `pallas_kernels/` first on PYTHONPATH makes this script time that version; torch is the
  common yardstick of the two runs (`git archive COMMIT pallas_kernels | tar -x -C DIR`).

Writes FILE (JSON: one record per run, each with the kernels' source directory) and prints one
line per run.
"""

from __future__ import annotations

import os

# torch shares the GPU with JAX in this process (as in grouped_gemm_h200, set before jax starts).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.80")

import argparse
import dataclasses
import datetime
import json
import pathlib
from collections.abc import Sequence

import jax

from bench import grouped_gemm_h200 as gg
from pallas_kernels.grouped_matmul import mosaic_gpu

WARMUP, TIMED, TARGET_SAMPLE_S = 3, 15, 0.005


def _no_store(*args, **kwargs) -> None:
    """Stands in for mosaic_gpu._store_rows: the epilogue issues no TMA store."""
    del args, kwargs


def probe(shape: gg.Shape, torch_mod, *, no_store: bool) -> list[dict]:
    """Our default forward (and with --no-store, the same without stores) against torch."""
    p = gg.make_problem(shape, torch_mod)
    t = p.t
    torch_run = gg.torch_runner(
        torch_mod, lambda: torch_mod._grouped_mm(t["x"], t["w"], offs=t["offs"]), on_gpu=True
    )
    variants = [("ours", False)] + ([("ours_no_store", True)] if no_store else [])
    flops, _ = gg.product_cost(shape, "forward")
    records = []
    for name, patched in variants:
        original = mosaic_gpu._store_rows
        if patched:
            mosaic_gpu._store_rows = _no_store
        try:
            ours = gg.jax_runner(lambda x, w, s: mosaic_gpu.gmm(x, w, s), p.x, p.w, p.gs)
        finally:
            mosaic_gpu._store_rows = original
        check = None
        if not patched:
            expected = torch_run.to_jax(torch_run.call())[0]
            check = gg.compare(ours.to_jax(ours.call())[0], expected)
        mine, theirs, ratios = gg.time_paired(
            torch_run, ours, warmup=WARMUP, timed=TIMED, target_sample_s=TARGET_SAMPLE_S
        )
        records.append(
            {
                "shape": shape.name,
                "m": shape.m,
                "k": shape.k,
                "n": shape.n,
                "g": shape.g,
                "variant": name,
                "ours_ms": mine["median_ms"],
                "torch_ms": theirs["median_ms"],
                "x_torch": ratios["median"],
                "x_torch_p25_p75": [ratios["p25"], ratios["p75"]],
                "ours_tflops": flops / mine["median_ms"] / 1e9,
                "torch_tflops": flops / theirs["median_ms"] / 1e9,
                "check": check,
            }
        )
    return records


def fixed_shares(records: list[dict]) -> list[dict]:
    """For each shape timed at K and 2K: the share of t(K) that does not scale with K,
    (2 t(K) - t(2K)) / t(K), for ours and torch."""
    out = []
    by_key = {(r["shape"], r["variant"], r["k"]): r for r in records}
    for (name, variant, k), r in by_key.items():
        twice = by_key.get((name, variant, 2 * k))
        if twice is None:
            continue
        out.append(
            {
                "shape": name,
                "variant": variant,
                "k": k,
                "ours_fixed_share": (2 * r["ours_ms"] - twice["ours_ms"]) / r["ours_ms"],
                "torch_fixed_share": (2 * r["torch_ms"] - twice["torch_ms"]) / r["torch_ms"],
            }
        )
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True, help="the JSON file to write")
    parser.add_argument("--label", default="", help="names this run in the records")
    parser.add_argument(
        "--shapes",
        default="qwen3_gate_up,mixtral_gate_up,dsv3_ep8_down",
        help="comma-separated grouped_gemm_h200 shape names",
    )
    parser.add_argument("--k-scales", default="1", help="comma-separated factors of K")
    parser.add_argument("--no-store", action="store_true", help="also time ours without stores")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        parser.error("the probe times the GPU: no GPU backend here")
    import torch  # the GPU image has it

    by_name = {s.name: s for s in gg.SHAPES}
    unknown = [n for n in args.shapes.split(",") if n not in by_name]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {sorted(by_name)}")
    scales = [float(s) for s in args.k_scales.split(",")]
    report = {
        "command": "python3 -m bench.gmm_probe " + " ".join(argv or []),
        "label": args.label,
        "kernels_from": str(pathlib.Path(mosaic_gpu.__file__).resolve().parent),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": jax.devices()[0].device_kind,
        "records": [],
    }
    for name in args.shapes.split(","):
        for scale in scales:
            k = int(by_name[name].k * scale)
            shape = dataclasses.replace(by_name[name], k=k)
            for record in probe(shape, torch, no_store=args.no_store):
                record["label"] = args.label
                report["records"].append(record)
                print(
                    f"{args.label:10s} {name:18s} K={k:6d} {record['variant']:14s} "
                    f"ours {record['ours_ms']:.3f} ms torch {record['torch_ms']:.3f} ms "
                    f"x torch {record['x_torch']:.3f} "
                    f"[{record['x_torch_p25_p75'][0]:.3f}-{record['x_torch_p25_p75'][1]:.3f}]",
                    flush=True,
                )
            report["fixed_shares"] = fixed_shares(report["records"])
            args.out.write_text(json.dumps(report, indent=1, default=float))
    for row in report.get("fixed_shares", []):
        print(
            f"fixed share of t(K) {row['shape']} {row['variant']} K={row['k']}: "
            f"ours {row['ours_fixed_share']:.3f} torch {row['torch_fixed_share']:.3f}"
        )
    return report


if __name__ == "__main__":
    main()
