"""The repository's shape: one-way layering (the kernels' tests included), and the set-up
script's search for Python."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = {
    "pallas_kernels": set(),
    "mok_jax": {"pallas_kernels"},
    "train": {"mok_jax", "pallas_kernels"},
}


def _imported_packages(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_imports_only_point_down(package):
    for path in (ROOT / package).rglob("*.py"):
        upward = (_imported_packages(path) & set(LAYERS)) - LAYERS[package] - {package}
        assert not upward, f"{path.relative_to(ROOT)} imports {upward}: layers point down only"


def _imported_modules(path: pathlib.Path) -> set[str]:
    """The dotted names of the modules `path` imports (absolute imports, anywhere in the file)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return names


# What the kernels and their tests must not import: the layers above them, directly or through
# those layers' test helpers.
ABOVE_KERNELS = ("mok_jax", "train", "tests.mok_jax", "tests.train")


def _above_kernels(path: pathlib.Path) -> set[str]:
    return {
        name
        for name in _imported_modules(path)
        if any(name == top or name.startswith(f"{top}.") for top in ABOVE_KERNELS)
    }


@pytest.mark.parametrize("tree", ["pallas_kernels", "tests/pallas_kernels"])
def test_kernels_and_their_tests_import_nothing_above(tree):
    """The kernels' tests stand on pallas_kernels alone (its protocol, tolerances, mesh types)."""
    paths = sorted((ROOT / tree).rglob("*.py"))
    assert paths, tree
    for path in paths:
        above = _above_kernels(path)
        assert not above, f"{path.relative_to(ROOT)} imports {sorted(above)}: kernels stand alone"


@pytest.mark.parametrize(
    "source",
    [
        "import mok_jax",
        "from mok_jax import exchange",
        "from mok_jax.tolerances import tolerance",
        "import train.step as step",
        "from tests.mok_jax.cases import random_inputs",
        "def f():\n    from mok_jax import exchange\n",
    ],
)
def test_an_upward_import_is_found(tmp_path, source):
    path = tmp_path / "planted.py"
    path.write_text(f"import jax\nfrom pallas_kernels import mesh\n{source}\n")
    assert _above_kernels(path)
    path.write_text("import jax\nfrom pallas_kernels import mesh\nimport tests.pallas_kernels\n")
    assert not _above_kernels(path)


def _fake_command(folder: pathlib.Path, name: str, script: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)


def test_setup_stops_clearly_without_python_312(tmp_path):
    """A python3 that is 3.11 and a python3.12 shim that fails must not be taken."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_command(bin_dir, "python3", "exit 1")  # "too old": fails the check
    _fake_command(
        bin_dir, "python3.12", 'echo "pyenv: python3.12: command not found" >&2; exit 127'
    )
    for tool in ("bash", "dirname", "cat", "sha256sum", "cut", "grep", "sort", "rm"):
        real = subprocess.run(
            ["sh", "-c", f"command -v {tool}"], capture_output=True, text=True, check=True
        ).stdout.strip()
        (bin_dir / tool).symlink_to(real)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "MOK_JAX_VENV": str(tmp_path / "venv")}
    result = subprocess.run(
        [str(bin_dir / "bash"), "-c", f'source "{ROOT}/scripts/venv.sh"'],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert "needs Python 3.12 or newer" in result.stderr and "pyenv install" in result.stderr
    assert not (tmp_path / "venv").exists()


def test_setup_reuses_an_up_to_date_environment(tmp_path):
    """A stamp matching pyproject.toml means nothing to install: the script only sets MOK_PY."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    _fake_command(venv / "bin", "python", "exit 0")
    digest = subprocess.run(
        ["sha256sum", str(ROOT / "pyproject.toml")], capture_output=True, text=True, check=True
    ).stdout.split()[0]
    (venv / ".mok-jax-installed-test").write_text(digest + "\n")
    env = {**os.environ, "MOK_JAX_VENV": str(venv), "MOK_JAX_GPU": "0"}
    result = subprocess.run(
        ["bash", "-c", f'source "{ROOT}/scripts/venv.sh" test; echo "$MOK_PY"'],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(venv / "bin" / "python")
    assert "installing" not in result.stderr


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff_is_clean(command):
    pytest.importorskip("ruff")
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command, str(ROOT)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
