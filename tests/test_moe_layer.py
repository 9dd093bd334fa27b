"""The MoE layer benchmark (bench/moe_layer.py) on CPU: the capped Zipf loads, a smoke run (our
layers in GPU interpret mode, the GPU-only baselines "not available"), the fused options, and
the forward+backward product's outputs."""

from __future__ import annotations

import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import moe_layer as layer
from mok_jax import init_params, moe


def test_moe_layer_capped_zipf_loads_sum_to_the_rows_and_respect_the_cap():
    loads = layer.capped_zipf_loads(16384 * 8, 128, 16384, 1.2)
    assert loads.sum() == pytest.approx(16384 * 8) and loads.max() <= 16384
    assert list(loads[:2]) == [16384, 16384] and 16384 > loads[2] > loads[3] > loads[-1] > 0
    ranks = np.arange(3, 129, dtype=np.float64)  # uncapped ranks keep the power law
    np.testing.assert_allclose(loads[2:] / loads[2], (ranks / 3) ** -1.2)


@pytest.mark.slow
def test_moe_layer_smoke_checks_times_and_marks_gpu_baselines_not_available(tmp_path):
    args = ["--smoke", "--shapes", "smoke_mixtral", "--products", "forward"]
    results = layer.main([*args, "--out", str(tmp_path)])
    on_disk = json.loads((tmp_path / "moe_layer.json").read_text())
    assert [s["shape"]["name"] for s in on_disk["shapes"]] == ["smoke_mixtral"]
    entry = results["shapes"][0]["products"]["forward"]
    recs = {c["key"]: c for c in entry["candidates"]}
    assert list(recs) == ["fused", "tokamax", "torch", "torch_det", "xla"]
    assert entry["anchor"] == "fused" and recs["fused"]["anchor"]
    for key in ("fused", "xla"):
        rec = recs[key]
        assert rec["status"] == "ok", rec
        assert rec["check"]["outputs"]["y"]["vs_reference_first_tokens"]["ok"]
        assert rec["bitwise_repeatable"] == {
            "runs": 3,
            "identical": True,
            "outputs_differing": [],
            "last_timed_run_identical": True,
        }
        assert rec["timing"]["samples"] == 2 and rec["timing"]["median_ms"] > 0
    assert recs["xla"]["check"]["outputs"]["y"]["vs_fused"]["ok"]
    assert len(recs["xla"]["paired"]["this_over_base"]["ratios"]) == 2  # paired with fused
    assert recs["xla"]["fused_speedup"] > 0 and "fused_speedup" not in recs["fused"]
    assert recs["tokamax"]["status"].startswith("not available: needs a CUDA GPU")
    if importlib.util.find_spec("torch") is None:
        for key in ("torch", "torch_det"):
            assert recs[key]["status"].startswith("not available: import torch"), recs[key]
    text = (tmp_path / "moe_layer.md").read_text()
    assert "## smoke_mixtral: T=64" in text and "| 2. MaxText recipe + tokamax mosaic |" in text
    assert "not available" in text and "SMOKE RUN" in text


def test_moe_layer_fused_options_set_the_fused_config_and_reject_unknown_fields():
    args = layer.parse_args(["--fused-options", "residuals=gate_up,token_chunk=2048", "--out", "x"])
    assert args.fused_options == {"residuals": "gate_up", "token_chunk": 2048}
    bench = layer.Bench(args, None, layer.SHAPES[0])
    assert bench.computes("fused").endswith("; with " + str(args.fused_options))
    assert bench.computes("pallas") == layer.COMPUTES["pallas"]
    with pytest.raises(SystemExit):  # MoEConfig's field before the options moved
        layer.parse_args(["--fused-options", "fused_residuals=gate_up", "--out", "x"])
    with pytest.raises(SystemExit):  # a MoEConfig field, not an option
        layer.parse_args(["--fused-options", "row_tile=128", "--out", "x"])


@pytest.mark.slow
def test_moe_layer_fwd_bwd_returns_y_not_the_cancelling_loss():
    """fwd_bwd's outputs are y (the forward's bits, checked entry by entry) and the gradients of
    sum(y * cot); the loss itself, a sum that cancels, is not among them."""
    shape = layer.SMOKE_SHAPES[0]
    cfg = shape.config("xla")
    kx, kp, kc = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (16, cfg.d_model), jnp.float32).astype(jnp.bfloat16)
    cot = jax.random.normal(kc, x.shape, jnp.float32).astype(jnp.bfloat16)
    params = init_params(kp, cfg, dtype=jnp.bfloat16)

    def fn(x, p):
        return moe(x, p, cfg)[0]

    names = layer.output_names("fwd_bwd", shared=False)
    assert names[:2] == ("y", "dx") and "loss" not in names
    outs = jax.jit(layer.jax_products(fn, "fwd_bwd", False))(x, params, cot)
    assert len(outs) == len(names)
    # Against y and dx from programs of their own (close, not bitwise: XLA may fuse each
    # program differently); a loss in place of y would fail on its shape.
    (y,) = jax.jit(layer.jax_products(fn, "forward", False))(x, params, cot)
    dx = jax.jit(
        jax.grad(lambda x: jnp.sum(fn(x, params).astype(jnp.float32) * cot.astype(jnp.float32)))
    )(x)
    for out, expected in ((outs[0], y), (outs[1], dx)):
        assert out.shape == expected.shape and out.dtype == expected.dtype
        np.testing.assert_allclose(
            np.asarray(out, np.float32), np.asarray(expected, np.float32), rtol=2**-7, atol=2**-7
        )
