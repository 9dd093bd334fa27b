"""bench/activation_memory.py on CPU: the residual listing against hand counts (a function whose
residuals are known, the layer's permuted copy of x), the totals against the listing, and the
command line's files."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp

from bench import activation_memory as am
from mok_jax import MoEOptions, presets, scale_down

T = 1024  # whole token chunks (8 tiles of 64), at least the 2 loop steps: nothing is padded


def _cfg(implementation: str):
    cfg = dataclasses.replace(
        scale_down(presets["qwen3_30b_a3b"]),
        implementation=implementation.removesuffix("_gate_up"),
        dtype=jnp.bfloat16,
    )
    if cfg.implementation != "fused":  # the residuals option is fused's alone
        return cfg
    residuals = "gate_up" if implementation == "fused_gate_up" else "inputs"
    return dataclasses.replace(cfg, options=MoEOptions(residuals=residuals))


def test_residuals_of_a_known_function_are_counted_by_hand():
    # y = sin(x @ w) * 2: the VJP keeps x and w (inputs), cos(x @ w) f32 [T, F]; nothing else.
    def fn(x, params):
        return jnp.sin(x @ params["w"]) * 2.0

    x = jax.ShapeDtypeStruct((48, 16), jnp.float32)
    params = {"w": jax.ShapeDtypeStruct((16, 24), jnp.float32)}
    res = am.saved_residuals(fn, x, params, arg_names=("x", "params"))
    inputs = sorted(r.source for r in res if r.kind == am.ARGUMENT)
    assert inputs == ["from the argument params.w", "from the argument x"]
    counted = [r for r in res if r.kind == am.ACTIVATION]
    assert [(r.shape, r.dtype) for r in counted] == [((48, 24), "float32")]
    assert "cos" in counted[0].source
    assert am.counted_bytes(res) == 48 * 24 * 4


def test_pallas_keeps_the_permuted_copy_of_x_and_fused_does_not():
    cfg = _cfg("pallas")
    n, d = T * cfg.top_k, cfg.d_model
    pallas = am.measure(cfg, T)
    fused = am.measure(_cfg("fused"), T)

    def copies(row):
        return [r for r in row["residuals"] if r["where"].endswith("_tokens_to_rows_fwd")]

    (copy,) = copies(pallas)
    assert copy["kind"] == am.ACTIVATION and copy["stage"] == "dispatch"
    assert (tuple(copy["shape"]), copy["dtype"]) == ((n, d), "bfloat16")
    assert copy["nbytes"] == n * d * 2 and copy["grows"] is True
    assert not copies(fused)
    # fused keeps x itself (an input, not counted) instead.
    assert any(r["source"] == "from the argument x" for r in fused["residuals"])

    # The combine of pallas keeps the expert outputs in slot order, f32 [T, K, D] (chunked),
    # for the routing weights' gradient; fused's rows are already weighted and keep none.
    def slot_outputs(row):
        return [
            r
            for r in row["residuals"]
            if r["stage"] == "combine" and r["dtype"] == "float32" and r["nbytes"] == n * d * 4
        ]

    assert len(slot_outputs(pallas)) == 1 and not slot_outputs(fused)
    # So fused saves those two arrays' bytes, the chunked combine's bool mask [T, K, D] and its
    # hoisted f32 [C, K, D] (fused sums its weighted rows in one pass, keeping only the [T, K]
    # mask), plus the small differences of the plan (hand count: (2 + 4 + 1) * N * D bytes and
    # 4 * C * K * D, C = 512 tokens a chunk).
    saved = pallas["counted_bytes"] - fused["counted_bytes"]
    hoisted = 4 * 512 * cfg.top_k * d
    assert 7 * n * d + hoisted <= saved < 7 * n * d + hoisted + 64 * n


def test_totals_are_the_sum_of_the_listed_residuals():
    for implementation in am.IMPLEMENTATIONS:
        row = am.measure(_cfg(implementation), T)
        listed = [r for r in row["residuals"] if r["kind"] == am.ACTIVATION]
        assert row["counted_bytes"] == sum(r["nbytes"] for r in listed) > 0
        assert row["bytes_per_token"] == row["counted_bytes"] / T
        for r in row["residuals"]:
            size = 1
            for dim in r["shape"]:
                size *= dim
            assert r["nbytes"] == size * jnp.dtype(r["dtype"]).itemsize
        grown = sum(r["nbytes"] for r in listed if r["grows"])
        fixed = sum(r["nbytes"] for r in listed if r["grows"] is False)
        assert grown + fixed == row["counted_bytes"], "every residual is classified"
        # Each growing residual doubles at 2T (T is a whole number of chunks): slope * T.
        assert row["slope_bytes_per_token"] * T == grown
        assert row["fixed_bytes"] == fixed


def test_command_line_writes_the_table_and_json(tmp_path, capsys):
    out = tmp_path / "act"
    results = am.main(["--smoke", "--shapes", "smoke_qwen3", "--out", str(out.with_suffix(".md"))])
    data = json.loads((tmp_path / "act.json").read_text())
    md = (tmp_path / "act.md").read_text()
    assert data["rows"] == json.loads(json.dumps(results["rows"]))
    assert [r["implementation"] for r in data["rows"]] == list(am.IMPLEMENTATIONS)
    assert "--smoke" in data["command"] and data["date"]
    for r in data["rows"]:
        ratio = r["bytes_per_token"] / data["rows"][0]["bytes_per_token"]
        assert (
            f"| {r['implementation']} | {r['bytes_per_token'] / 1024:,.1f} KiB | {ratio:.2f}x" in md
        )
        assert f"### smoke_qwen3, {r['implementation']}:" in md
    assert re.search(r"permute\.py:\d+ _tokens_to_rows_fwd", md)
    assert md in capsys.readouterr().out
