"""bench/gemm_options.py on CPU: the timing, FLOP count and bit checksums of one variant."""

from __future__ import annotations

import pytest

from bench import gemm_options


def test_gemm_options_times_the_backward_products_and_sums_their_bits(monkeypatch):
    monkeypatch.setitem(gemm_options.SHAPES, "tiny", (32, 16, 8))
    got = gemm_options.measure("cublas_untuned", "tiny")
    assert got["ms"] > 0 and got["tflops"] == pytest.approx(4 * 32 * 16 * 8 / got["ms"] / 1e9)
    # dx and dw: their bf16 bits summed, the same in a second call.
    assert len(got["checksum"]) == 2
    assert got["checksum"] == gemm_options.measure("cublas_untuned", "tiny")["checksum"]
