"""The tile-config sweep (bench/gmm_sweep.py) on CPU: its candidate lists, a smoke run of our
forward kernel in GPU interpret mode, a wrong config reported as failed (a stand-in kernel, so
it is cheap), the time budget, and grouped_gemm --configs picking the sweep's best."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import gmm_sweep as sweep
from bench import grouped_gemm as gg
from pallas_kernels.grouped_matmul import mosaic_gpu, mosaic_gpu_wgrad

H200 = jax.sharding.AbstractMesh(
    (1,),
    ("x",),
    abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"
    ),
)
PAIRS = [
    (product, shape)
    for product in sweep.PRODUCTS
    for shape in sweep.SHAPES
    if product != "swiglu" or shape.gate_up
]


def test_the_sweep_covers_the_five_design_shapes():
    assert [s.name for s in sweep.SHAPES] == [
        "qwen3_gate_up",
        "qwen3_down",
        "mixtral_gate_up",
        "dsv3_ep8_gate_up",
        "dsv3_ep8_down",
    ]
    assert len(PAIRS) == 18


@pytest.mark.parametrize(("product", "shape"), PAIRS, ids=lambda x: getattr(x, "name", x))
def test_candidates_start_with_the_default_and_fit_the_shape(product, shape):
    trials = sweep.candidates(product, shape)
    expected_default = {
        "forward": lambda: mosaic_gpu.default_config(n=shape.n),
        "dgrad": lambda: mosaic_gpu.default_config(n=shape.k, transpose_rhs=True),
        "swiglu": lambda: mosaic_gpu.default_config(n=shape.n // 2, swiglu=True),
        "wgrad": lambda: mosaic_gpu_wgrad.default_config(shape.k, shape.n),
    }[product]()
    assert trials[0].label == sweep.DEFAULT_LABEL and trials[0].config == expected_default
    assert 5 <= len(trials) <= 9
    assert len({t.label for t in trials}) == len(trials)
    assert len({t.config for t in trials}) == len(trials), "a candidate repeats another"
    for trial in trials:
        assert trial.why
        assert sweep.fits(product, shape, trial.config) is None, trial
        if product == "wgrad":
            mosaic_gpu_wgrad.check_config(trial.config)


def test_fits_names_what_does_not_fit():
    shape = sweep.SHAPES[1]  # qwen3_down: K=768
    base = sweep.default_config("forward", shape, interpret=False)
    deep = dataclasses.replace(base, max_concurrent_steps=6)
    assert "shared memory" in sweep.fits("forward", shape, deep)
    assert "K=768 is not a multiple of its block 512" in sweep.fits(
        "forward", shape, dataclasses.replace(base, block_k=512, max_concurrent_steps=2)
    )


@pytest.mark.slow
@pytest.mark.parametrize(("product", "shape_index"), [("wgrad", 0), ("forward", 1)])
def test_candidates_lower_for_cuda(product, shape_index):
    """Every candidate of a pair goes through the whole Mosaic GPU lowering on this CPU, so no
    device time is spent on one that cannot compile."""
    shape = sweep.SHAPES[shape_index]
    m, k, n, g = shape.m, shape.k, shape.n, shape.g
    bf16 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
    for trial in sweep.candidates(product, shape):
        if product == "wgrad":
            fn = functools.partial(
                mosaic_gpu_wgrad.tgmm, out_dtype=jnp.bfloat16, config=trial.config
            )
            args = (bf16((m, k)), bf16((m, n)), sizes)
        else:
            fn = functools.partial(mosaic_gpu.gmm, config=trial.config)
            args = (bf16((m, k)), bf16((g, k, n)), sizes)
        with jax.sharding.use_abstract_mesh(H200):
            lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text(), trial.label


@pytest.mark.slow
def test_smoke_run_times_our_kernel_and_writes_the_best(tmp_path):
    results = sweep.main(
        ["--smoke", "--products", "forward", "--max-candidates", "1", "--out", str(tmp_path)]
    )
    on_disk = json.loads((tmp_path / "sweep.json").read_text())
    assert on_disk["pairs"] == json.loads(json.dumps(results["pairs"], default=str))
    (pair,) = on_disk["pairs"]
    assert pair["product"] == "forward" and pair["shape"] == "smoke_uniform"
    assert [r["label"] for r in pair["runs"]] == ["default", "order_m2"]
    for run in pair["runs"]:
        assert run["ok"] and run["check"]["ok"] and run["bitwise_repeatable"]["identical"]
        assert run["timing"]["samples"] == 2 and run["median_ms"] > 0 and run["tflops"] > 0
    assert "x_default" in pair["runs"][1]
    fastest = min(pair["runs"], key=lambda r: r["median_ms"])
    assert pair["best"]["label"] == fastest["label"]
    best = gg.best_configs(on_disk)[("forward", "smoke_uniform")]
    assert dataclasses.asdict(best["config"]) == fastest["config"]
    text = (tmp_path / "sweep.md").read_text()
    assert (
        "## Best passing config per (product, shape)" in text
        and "| forward | smoke_uniform" in text
    )


def _right(x, w, gs):
    return jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)


def _wrong(x, w, gs):
    del gs
    return x @ w[0]


def _fake_forward(p, config, interpret):
    """A stand-in for gmm: right for the default config, every row times group 0's matrix for
    any other (what a broken tile schedule could do)."""
    del interpret
    default = sweep.default_config("forward", p.shape, interpret=True)
    return (_right if config == default else _wrong), (p.x, p.w, p.gs)


def _fake_right_forward(p, config, interpret):
    """A stand-in for gmm, right for every config (XLA's ragged_dot in bf16)."""
    del config, interpret
    return (lambda x, w, gs: _right(x, w, gs).astype(x.dtype)), (p.x, p.w, p.gs)


def test_a_wrong_config_fails_its_check_and_is_never_the_best(tmp_path, monkeypatch):
    monkeypatch.setitem(sweep.KERNELS, "forward", _fake_forward)
    results = sweep.main(["--smoke", "--products", "forward", "--out", str(tmp_path)])
    (pair,) = results["pairs"]
    default, wrong = pair["runs"]
    assert default["ok"] and "median_ms" in default
    assert wrong["status"] == "failed check (not timed)"
    assert not wrong["ok"] and "timing" not in wrong and "median_ms" not in wrong
    assert not wrong["check"]["parts"][0]["vs_full_reference"]["ok"]
    assert pair["best"]["label"] == "default"
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert gg.best_configs(saved)[("forward", "smoke_uniform")]["label"] == "default"
    assert "**failed check**" in (tmp_path / "sweep.md").read_text()


def _stand_in_torch(monkeypatch):
    """torch._grouped_mm as XLA's ragged_dot (no torch here): a yardstick to pair runs with."""

    def torch_candidates(self, product):
        p = self.p
        fn = lambda x, w, gs: _right(x, w, gs).astype(x.dtype)  # noqa: E731
        return [
            gg.Candidate(
                "torch._grouped_mm", "torch", lambda: gg.h.jax_runner(fn, *(p.x, p.w, p.gs))
            )
        ]

    monkeypatch.setattr(gg.Bench, "torch_candidates", torch_candidates)


@pytest.mark.parametrize("paired", [True, False])
def test_x_torch_comes_from_timing_each_run_paired_with_torch(tmp_path, monkeypatch, paired):
    monkeypatch.setitem(sweep.KERNELS, "forward", _fake_right_forward)
    _stand_in_torch(monkeypatch)
    args = ["--smoke", "--products", "forward", "--timed", "5", "--out", str(tmp_path)]
    results = sweep.main([*args, *([] if paired else ["--no-paired"])])
    (pair,) = results["pairs"]
    torch_rec = pair["torch"]
    assert torch_rec["ok"] and "paired" not in torch_rec
    runs = pair["runs"]
    assert [r["label"] for r in runs] == ["default", "order_m2"] and all(r["ok"] for r in runs)
    text = (tmp_path / "sweep.md").read_text()
    if not paired:
        for r in runs:
            assert "paired" not in r and "x_torch_unpaired" not in r
            assert r["x_torch"] == torch_rec["median_ms"] / r["median_ms"]
        assert runs[1]["x_default"] == runs[0]["median_ms"] / runs[1]["median_ms"]
        return
    for r in runs:
        torch_ms = np.array(r["paired"]["base_timing"]["samples_ms"])
        ours_ms = np.array(r["timing"]["samples_ms"])
        assert len(torch_ms) == len(ours_ms) == 5
        np.testing.assert_allclose(
            r["paired"]["base_over_this"]["ratios"], torch_ms / ours_ms, rtol=1e-3
        )
        assert r["x_torch"] == r["x_torch_paired"] == r["paired"]["base_over_this"]["median"]
        assert r["x_torch_unpaired"] == torch_rec["median_ms"] / r["median_ms"]
        lo, hi = r["x_torch_p25_p75"]
        assert lo <= r["x_torch"] <= hi
        assert f"| {r['label']} | {r['median_ms']:.3f} | " in text
        assert f"| {r['x_torch']:.3f} [{lo:.3f}-{hi:.3f}] | {r['x_torch_unpaired']:.3f} | " in text
    assert runs[1]["x_default"] == runs[1]["x_torch"] / runs[0]["x_torch"]
    best = max(runs, key=lambda r: r["x_torch"])
    assert pair["best"]["label"] == best["label"]
    assert pair["best"]["x_torch_p25_p75"] == best["x_torch_p25_p75"]


def test_no_run_starts_after_the_budget(tmp_path):
    results = sweep.main(["--smoke", "--budget-s", "0", "--out", str(tmp_path)])
    assert {p["product"] for p in results["pairs"]} == set(sweep.PRODUCTS)
    for pair in results["pairs"]:
        assert pair["torch"]["status"].startswith("skipped: time budget")
        assert pair["runs"] and all(
            r["status"].startswith("skipped: time budget") for r in pair["runs"]
        )
        assert pair.get("best") is None
    assert gg.best_configs(json.loads((tmp_path / "sweep.json").read_text())) == {}


def test_grouped_gemm_takes_the_sweeps_best_config(tmp_path, monkeypatch):
    monkeypatch.setitem(sweep.KERNELS, "forward", _fake_forward)
    sweep.main(["--smoke", "--products", "forward", "--out", str(tmp_path / "sweep")])
    path = tmp_path / "sweep" / "sweep.json"
    args = gg.parse_args(["--smoke", "--configs", str(path), "--out", str(tmp_path)])
    args.torch_missing = "not needed here"
    problem = gg.make_problem(gg.SMOKE_SHAPES[0], None)
    bench = gg.Bench(args, problem)
    (forward, _triton) = bench.ours_candidates("forward")
    picked = gg.best_configs(json.loads(path.read_text()))[("forward", "smoke_uniform")]
    assert forward.config == repr(picked["config"])
    assert forward.config_source.startswith(f"sweep {path}: best passing run 'default'")
    (dgrad,) = bench.ours_candidates("dgrad")  # not in the sweep: the defaults table
    assert dgrad.config_source == "defaults table (config=None)"
    with pytest.raises(SystemExit):
        gg.parse_args(["--smoke", "--configs", str(tmp_path / "missing.json"), "--out", "x"])


def test_a_pair_that_cannot_be_prepared_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    monkeypatch.setitem(sweep.KERNELS, "forward", _fake_forward)
    real_subsets = gg.subset_reference

    def subsets(p, product, *, cap):
        if product == "dgrad":
            raise MemoryError("no room for dgrad's reference")
        return real_subsets(p, product, cap=cap)

    monkeypatch.setattr(gg, "subset_reference", subsets)
    args = ["--smoke", "--products", "dgrad,forward", "--max-candidates", "0"]
    results = sweep.main([*args, "--out", str(tmp_path)])
    dgrad, forward = results["pairs"]
    assert dgrad["torch"]["status"].startswith("error preparing the pair: MemoryError")
    assert dgrad["runs"][0]["status"].startswith("error preparing the pair: MemoryError")
    assert forward["runs"][0]["ok"] and forward["best"]["label"] == "default"
