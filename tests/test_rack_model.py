"""bench/rack_model.py on the CPU: the calibration against the measured H200 times, the
model's properties (imbalance, link bandwidth, overlap, EP 1), its input checks and the
command line's files."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mok_jax
from bench import rack_model as rm
from mok_jax import layer, tiles

RESULTS = rm.ROOT / "bench" / "results" / "2026-12-01_rack_model"
RESULTS_COMMAND = "python -m bench.rack_model --out bench/results/2026-12-01_rack_model"

# The calibration must reproduce every measured single-H200 time of the fused layer within
# CALIBRATION_TOLERANCE, and all of them within CALIBRATION_RMS (relative errors). The fit has
# 4 parameters for 24 points at 3 shapes; it reached 9.0% max and 5.1% RMS on 2026-12-01
# (in-sample: the points it was fitted to).
CALIBRATION_TOLERANCE = 0.12
CALIBRATION_RMS = 0.07


@pytest.fixture(scope="module")
def points():
    return rm.load_layer_measurements()


@pytest.fixture(scope="module")
def h200(points):
    return rm.calibrate(points)


def _rack(h200, link_fraction: float = 0.8) -> rm.Hardware:
    return rm.rack_hardware(h200, link_fraction)


def _workload(**kw) -> rm.Workload:
    kw.setdefault("layout", rm.Layout(expert=64))
    return rm.Workload(shape=rm.MOK_SHAPE, **kw)


def test_calibration_reproduces_the_measured_h200_times(h200, points):
    rows = rm.calibration_rows(h200, points)
    assert len(rows) == len(points) >= 20
    worst = max(rows, key=lambda r: abs(r["error"]))
    assert abs(worst["error"]) <= CALIBRATION_TOLERANCE, worst
    rms = (sum(r["error"] ** 2 for r in rows) / len(rows)) ** 0.5
    assert rms <= CALIBRATION_RMS


def test_calibration_is_physical(h200):
    # Efficiencies within (0, 1] (Hardware validates it) and GEMM rates under the measured
    # dense 8192^3 matmul (DESIGN.md: 677 TFLOP/s): grouped GEMMs do not beat a dense one.
    for eff in (h200.gemm_efficiency, h200.gemm_efficiency_bwd):
        assert eff > 0.3 and eff * h200.peak_tflops_bf16 < 677
    assert 0.1 < h200.hbm_efficiency < h200.stream_efficiency
    assert h200.chunk_overhead_us > 0


def test_calibration_reads_the_file_it_names(points):
    # Each run's fused median, e.g. the qwen3 forward of run 1 on ea58fad
    # (bench/results/2026-12-01_moe_layer_h200/, bench/results/moe_layer_h200.md).
    qwen3 = [p for p in points if p.run == "ea58fad_run1" and p.label.startswith("qwen3")]
    assert {p.product: round(p.ms, 2) for p in qwen3} == {"forward": 4.29, "fwd_bwd": 13.37}


@pytest.mark.parametrize("exchange", rm.EXCHANGES)
@pytest.mark.parametrize("dtype", rm.DTYPES)
def test_ep1_has_no_transfer(h200, exchange, dtype):
    w = _workload(layout=rm.Layout(data=72, expert=1), dtype=dtype)
    p = rm.predict(_rack(h200), w, exchange, rm.ExchangeConfig())
    for c in (p.forward, p.backward):
        assert c.transfer == 0 and c.exposed_transfer == 0
    fused = rm.predict(_rack(h200), w, "fused", rm.ExchangeConfig())
    assert p.total == pytest.approx(fused.total)


rhos = st.floats(min_value=1.0, max_value=8.0, allow_nan=False)
fractions = st.floats(min_value=0.05, max_value=1.0, allow_nan=False)
eps = st.sampled_from([2, 4, 8, 16, 64])
shares = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@given(
    rho=rhos, more=st.floats(min_value=0.0, max_value=4.0), ep=eps, dtype=st.sampled_from(rm.DTYPES)
)
def test_more_imbalance_is_never_faster(h200, rho, more, ep, dtype):
    hw, cfg = _rack(h200), rm.ExchangeConfig()
    lo = min(rho, ep)
    hi = min(rho + more, ep)
    for exchange in rm.EXCHANGES:
        fast = rm.predict(
            hw, _workload(layout=rm.Layout(expert=ep), imbalance=lo, dtype=dtype), exchange, cfg
        )
        slow = rm.predict(
            hw, _workload(layout=rm.Layout(expert=ep), imbalance=hi, dtype=dtype), exchange, cfg
        )
        assert slow.forward.total >= fast.forward.total * (1 - 1e-12)
        assert slow.backward.total >= fast.backward.total * (1 - 1e-12)


@given(low=fractions, high=fractions, ep=eps, rho=rhos)
def test_more_link_bandwidth_is_never_slower(h200, low, high, ep, rho):
    low, high = sorted((low, high))
    w = _workload(layout=rm.Layout(expert=ep), imbalance=min(rho, ep))
    for exchange in rm.EXCHANGES:
        slow = rm.predict(_rack(h200, low), w, exchange, rm.ExchangeConfig())
        fast = rm.predict(_rack(h200, high), w, exchange, rm.ExchangeConfig())
        assert fast.total <= slow.total * (1 + 1e-12)


@given(fraction=fractions, ep=eps, rho=rhos, dtype=st.sampled_from(rm.DTYPES))
def test_fused_with_every_sm_on_the_gemms_is_never_slower_than_the_unoverlapped_exchange(
    h200, fraction, ep, rho, dtype
):
    w = _workload(layout=rm.Layout(expert=ep), imbalance=min(rho, ep), dtype=dtype)
    cfg = rm.ExchangeConfig(comm_sm_share=0.0)
    fused = rm.predict(_rack(h200, fraction), w, "fused", cfg)
    a2a = rm.predict(_rack(h200, fraction), w, "ragged_all_to_all", cfg)
    assert fused.forward.total <= a2a.forward.total * (1 + 1e-12)
    assert fused.backward.total <= a2a.backward.total * (1 + 1e-12)


@given(fraction=fractions, ep=eps, low=shares, high=shares)
def test_more_sms_copying_is_never_faster_and_costs_the_gemms_at_most_their_share(
    h200, fraction, ep, low, high
):
    """The copy programs hold their SMs for the whole kernel: the fused layer's time never
    falls as they take more, and rises by at most the routed GEMMs' slowdown."""
    low, high = sorted((min(low, 0.95), min(high, 0.95)))
    w = _workload(layout=rm.Layout(expert=ep))
    hw = _rack(h200, fraction)
    slow = rm.predict(hw, w, "fused", rm.ExchangeConfig(comm_sm_share=high))
    fast = rm.predict(hw, w, "fused", rm.ExchangeConfig(comm_sm_share=low))
    assert fast.total <= slow.total * (1 + 1e-12)
    row_gemm = sum(rm.compute(hw, w, d).row_gemm for d in rm.DIRECTIONS)
    bound = row_gemm * (1 / (1 - high) - 1 / (1 - low))
    assert slow.total - fast.total <= bound * (1 + 1e-9) + 1e-15


def test_the_default_share_is_the_layers_copy_programs_on_the_h200():
    assert rm.ExchangeConfig().comm_sm_share == pytest.approx(24 / 132)
    with pytest.raises(ValueError, match="comm_sm_share"):
        rm.ExchangeConfig(comm_sm_share=1.0)


def test_components_add_up_and_imbalance_costs_rounds(h200):
    w = _workload(imbalance=3.0)
    assert rm.rounds(w, rm.ExchangeConfig(buffer_factor=2.0)) == 2
    assert rm.rounds(_workload(imbalance=2.0), rm.ExchangeConfig(buffer_factor=2.0)) == 1
    p = rm.predict(_rack(h200), w, "ragged_all_to_all", rm.ExchangeConfig())
    c = p.forward
    assert c.total == pytest.approx(c.gemm + c.memory + c.overhead + c.exposed_transfer)
    # Nothing overlaps: the exposed transfer is the link time plus 2 rounds of 2 latencies.
    assert c.exposed_transfer == pytest.approx(c.transfer + 4 * 10e-6)


def test_fp8_moves_fewer_dispatch_bytes_and_computes_faster(h200):
    bf16 = rm.predict(
        _rack(h200), _workload(dtype="bf16"), "ragged_all_to_all", rm.ExchangeConfig()
    )
    fp8 = rm.predict(_rack(h200), _workload(dtype="fp8"), "ragged_all_to_all", rm.ExchangeConfig())
    assert fp8.forward.transfer < bf16.forward.transfer
    assert fp8.forward.gemm < bf16.forward.gemm


def _hardware(**changes) -> rm.Hardware:
    """A valid toy Hardware with `changes`."""
    fields = dict(name="x", peak_tflops_bf16=1, peak_tflops_fp8=None, hbm_tbps=1, link_gbps=1)
    return rm.Hardware(**{**fields, **changes})


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (
            lambda: rm.LayerShape(name="x", tokens=0, d_model=8, d_ff=8, num_experts=4, top_k=2),
            "tokens",
        ),
        (
            lambda: rm.LayerShape(name="x", tokens=8, d_model=8, d_ff=8, num_experts=4, top_k=5),
            "top_k",
        ),
        (lambda: rm.Layout(expert=0), "expert"),
        (lambda: _workload(layout=rm.Layout(expert=5)), "divide"),
        (lambda: _workload(imbalance=0.5), "imbalance"),
        (lambda: _workload(layout=rm.Layout(expert=1), imbalance=1.5), "imbalance"),
        (lambda: _workload(dtype="fp4"), "dtype"),
        (lambda: _workload(fused_residuals="all"), "fused_residuals"),
        (lambda: rm.ExchangeConfig(comm_sm_share=1.5), "comm_sm_share"),
        (lambda: rm.ExchangeConfig(a2a_bytes_factor=0.5), "a2a_bytes_factor"),
        (lambda: _hardware(peak_tflops_bf16=-1), "peak_tflops_bf16"),
        (lambda: _hardware(gemm_efficiency=1.2), "gemm_efficiency"),
        (lambda: _hardware(collective_latency_us=-1), "collective_latency_us"),
    ],
)
def test_bad_inputs_raise(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


def test_bad_exchange_and_missing_fp8_rate_raise(h200):
    with pytest.raises(ValueError, match="exchange"):
        rm.predict(_rack(h200), _workload(), "allgather", rm.ExchangeConfig())
    no_fp8 = dataclasses.replace(_rack(h200), peak_tflops_fp8=None)
    with pytest.raises(ValueError, match="fp8"):
        rm.predict(no_fp8, _workload(dtype="fp8"), "fused", rm.ExchangeConfig())


def test_cli_writes_both_files(tmp_path, capsys):
    report = rm.main(["--out", str(tmp_path)])
    saved = json.loads((tmp_path / "rack_model.json").read_text())
    text = (tmp_path / "rack_model.md").read_text()
    assert saved["calibration"]["max_abs_error"] == report["calibration"]["max_abs_error"]
    assert len(saved["gb300"]["speedups"]) == 8  # 2 layouts x 2 dtypes x 2 link fractions
    assert {r["exchange"] for r in saved["ep2_check"]} == {"ragged_all_to_all", "ring"}
    for heading in (
        "## Calibration on one H200",
        "## Check on two H200s",
        "## GB300 NVL72",
        "## Sources",
        "## Assumptions",
    ):
        assert heading in text
    assert "python -m bench.rack_model --out" in text
    assert "MoK claims" in capsys.readouterr().out


def test_calibration_fit_is_the_model(h200, points):
    # The fit is linear in (1/eta_gemm, 1/eta_gemm_bwd, 1/eta_hbm, c_chunk) only while the
    # weights' streaming never bounds a GEMM: then the fitted model and predict() agree.
    base = rm.Hardware(**rm.H200_PUBLISHED)
    coef = np.array(
        [
            1 / h200.gemm_efficiency,
            1 / h200.gemm_efficiency_bwd,
            1 / h200.hbm_efficiency,
            h200.chunk_overhead_us,
        ]
    )
    for p in points:
        for d in rm.PRODUCT_DIRECTIONS[p.product]:
            flops = rm.routed_gemm_flops(p.workload, d) / h200.gemm_flops_per_s("bf16", d)
            assert rm.weight_bytes(p.workload, d) / h200.stream_bytes_per_s < flops, p.label
        fitted = 1e3 * rm._features(p.workload, p.product, base) @ coef
        assert rm.model_ms(h200, p) == pytest.approx(fitted, rel=1e-9), p.label


@pytest.mark.parametrize("ep", [2, 8, 64])
@pytest.mark.parametrize("buffer_factor", [1.0, 2.0, 8.0])
@pytest.mark.parametrize("tokens", [256, 2048])
def test_ring_chunk_and_window_follow_the_layer(ep, buffer_factor, tokens):
    # mok_jax/layer.py's _buffer_rows sizes the ring's chunk and the all-to-all's window.
    cfg = dataclasses.replace(mok_jax.presets["mok_bench"], buffer_factor=buffer_factor)
    w = rm.Workload(shape=rm.LayerShape.from_config("x", cfg, tokens), layout=rm.Layout(expert=ep))
    xc = rm.ExchangeConfig(buffer_factor=buffer_factor)
    axes = layer._Axes(expert="expert", expert_devices=ep)
    rows = tokens * cfg.top_k
    chunk = layer._buffer_rows(rows, dataclasses.replace(cfg, exchange="ring"), axes)
    assert chunk == math.ceil(rm.ring_chunk_factor(w, xc) * rows / ep)
    window = layer._buffer_rows(rows, cfg, axes)
    for rho in (1.0, 1.5, buffer_factor, buffer_factor + 0.5, ep):
        if rho <= ep and window == math.ceil(buffer_factor * rows):  # the window is not capped
            busiest = rm.Workload(shape=w.shape, layout=w.layout, imbalance=rho)
            assert rm.rounds(busiest, xc) == math.ceil(rho * rows / window - 1e-9)


@pytest.mark.parametrize(("tokens", "chunk"), [(2048, 2048), (2048, 512), (100, 64), (4096, 512)])
def test_token_loops_follow_tiles(tokens, chunk):
    shape = dataclasses.replace(rm.MOK_SHAPE, tokens=tokens)
    w = rm.Workload(shape=shape, token_chunk=chunk)
    assert (w.chunk, w.padded_tokens) == tiles._token_chunks(tokens, chunk)
    assert rm.token_chunks(w) == w.padded_tokens // w.chunk
    default = rm.Workload(shape=shape)
    assert default.chunk == tiles.token_chunk(None, mok_jax.presets["mok_bench"].row_tile)


def test_backward_sends_the_rows_again(h200):
    # routed.py's backward recomputes each round's forward (x out) before dy out and dx back;
    # fused sends dy once, rounded, with x (it forms dy times the routing weight at the buffer).
    w = _workload(imbalance=3.0)
    fwd_out, fwd_back = rm.exchange_bytes(w, "forward")
    bwd_out, bwd_back = rm.exchange_bytes(w, "backward")
    assert bwd_out == 2 * fwd_out and bwd_back == fwd_back
    rows = w.shape.tokens * w.shape.top_k * 63 / 64
    assert fwd_out == rows * w.shape.d_model * 2
    p = rm.predict(_rack(h200), w, "ragged_all_to_all", rm.ExchangeConfig())
    # 2 rounds of 3 collectives, 10 us each, on top of the link time.
    assert p.backward.exposed_transfer == pytest.approx(p.backward.transfer + 6 * 10e-6)


def test_fp8_quantizes_the_rows_once():
    # MXFP8 changes only the sorted copy's written bytes on the token side.
    bf16, fp8 = _workload(dtype="bf16"), _workload(dtype="fp8")
    s = rm.MOK_SHAPE
    diff = rm.token_memory_bytes(bf16, "forward") - rm.token_memory_bytes(fp8, "forward")
    assert diff == pytest.approx(s.tokens * s.top_k * s.d_model * (2 - rm.MXFP8_BYTES))


def test_shared_expert_backward_recomputes_gate_and_up():
    cfg = mok_jax.presets["deepseek_v3"]
    w = rm.Workload(shape=rm.LayerShape.from_config("dsv3", cfg, 4096))
    router = 2.0 * w.padded_tokens * cfg.d_model * cfg.num_experts
    shared = 2.0 * w.padded_tokens * cfg.d_model * cfg.d_ff
    assert rm.token_gemm_flops(w, "forward") == pytest.approx(router + 3 * shared)
    assert rm.token_gemm_flops(w, "backward") == pytest.approx(2 * router + 8 * shared)


@pytest.fixture(scope="module")
def report():
    return rm.build_report()


def test_committed_results_are_the_codes(report):
    # Regenerate with the command in RESULTS_COMMAND when the model or its inputs change.
    assert (RESULTS / "rack_model.md").read_text() == rm.markdown(report, RESULTS_COMMAND)
    saved = json.loads((RESULTS / "rack_model.json").read_text())
    assert saved["gb300"] == report["gb300"] and saved["calibration"] == report["calibration"]


def test_readme_table_is_the_generated_one(report):
    readme = (rm.ROOT / "bench" / "README.md").read_text()
    section = readme[readme.index("## rack_model") :]
    for line in rm.markdown_speedups(report):
        assert line in section, f"bench/README.md's rack_model table lacks: {line}"


def test_fused_check_finds_the_link_fraction_of_the_measured_time(report, h200):
    # The fused row on two H200s (bench/results/multi_gpu_h200x2.md, run 7): the model at the
    # implied link fraction takes the measured time (the bisection), and at the collectives'
    # fraction less.
    (row,) = report["fused_check"]
    assert (row["exchange"], row["ep"]) == ("fused@16", 2)
    cfg = rm.SCALING[row["case"]][0]
    shape = rm.LayerShape.from_config(row["case"], cfg, row["tokens_per_device"])
    w = rm.Workload(shape=shape, layout=rm.Layout(expert=2))
    at = dataclasses.replace(h200, link_efficiency=row["implied_link_fraction"])
    # Its 16 copy programs of the H200's 132 SMs.
    ex = rm.fused_exchange_config(row["exchange"])
    assert ex.comm_sm_share == pytest.approx(16 / 132)
    assert rm.fused_exchange_config("fused") == rm.ExchangeConfig()
    model_ms = 1e3 * rm.predict(at, w, "fused", ex).total
    assert model_ms == pytest.approx(row["measured_fwd_bwd_ms"], rel=1e-6)
    assert row["model_fwd_bwd_ms"] < row["measured_fwd_bwd_ms"]
    assert 0 < row["implied_link_fraction"] < row["link_fraction"]


def test_fused_rounds_each_expose_a_first_and_a_last_tile(h200):
    # rho 3 through a buffer of 2: two rounds, each exposing its first tile's arrival and its
    # last tile's return; the link time itself does not change with the rounds.
    w = _workload(imbalance=3.0)
    hw = _rack(h200)
    one, two = rm.ExchangeConfig(buffer_factor=4.0), rm.ExchangeConfig(buffer_factor=2.0)
    assert (rm.rounds(w, one), rm.rounds(w, two)) == (1, 2)
    for direction in rm.DIRECTIONS:
        a, b = rm.fused(hw, w, one, direction), rm.fused(hw, w, two, direction)
        assert b.transfer == pytest.approx(a.transfer)
        dispatch, back = rm.exchange_bytes(w, direction)
        rows = w.shape.tokens * w.shape.top_k * (w.ep - 1) / w.ep
        tile = w.shape.row_tile / rows
        round_cost = tile * (dispatch + back) / hw.link_bytes_per_s + 2 * hw.latency_s
        assert b.exposed_transfer - a.exposed_transfer == pytest.approx(round_cost, rel=1e-6)
