"""The quickstart (`python -m mok_jax`, the layer's command in the README)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mok_jax.quickstart import main


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--tokens", "64", "--repeats", "1"], marks=pytest.mark.slow),
        pytest.param(
            ["--preset", "deepseek_v3", "--tokens", "32", "--repeats", "1", "--dtype", "float32"],
            marks=pytest.mark.slow,
        ),
        ["--preset", "switch", "--tokens", "32", "--repeats", "1", "--no-reference"],
    ],
)
def test_quickstart_reports(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    for line in (
        "config",
        "shapes",
        "aux losses",
        "expert load",
        "time forward",
        "time fwd+bwd",
        "deterministic : yes",
    ):
        assert line in out, out
    if "--no-reference" in argv:
        assert "vs reference" not in out
    else:
        assert "vs reference" in out and "TOO LARGE" not in out


def test_quickstart_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["--tokens", "0"])
    assert "--tokens=0" in capsys.readouterr().err


@pytest.mark.slow
def test_python_dash_m():
    result = subprocess.run(
        [sys.executable, "-m", "mok_jax", "--tokens", "16", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "dL/dw_down" in result.stdout
