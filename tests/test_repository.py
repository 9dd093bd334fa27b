"""The repository's shape: one-way layering (the kernels' tests included), the set-up
script's search for Python, and no development-process text in the tracked files."""

from __future__ import annotations

import ast
import os
import pathlib
import re
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


# The tracked files say what the code does and what was measured, not how the work was organised:
# no work-session or issue numbers, no numbered calls of a remote runner nor its arguments, no
# result paths named by session or call. Matched case-insensitively, line by line; "issue" and
# "call" as ordinary words ("a custom call", "the producer issues 128 rows") do not match.
PROCESS_TEXT = {
    "session number": r"\bsessions? \d",
    "issue number": r"\bissue #?\d|\bissues #\d|\bissues \d+(?:,? (?:and|or) #?\d+)+",
    "runner call number": r"\bcall \d|\bcalls \d+(?:,? (?:and|or|to) \d+|-\d+)",
    "runner argument": r"\bcarry=|\btimeout_s=",
    "result path named by session or call": (
        r"\d{4}-\d\d-\d\d_[\w.-]*_s\d+\b|results/[\w./-]*_s\d+\b|(?<![\w-])_s\d+/"
        r"|_call\d|session\d|\bcall\d+[a-z]?(?=[_/.{])"
    ),
}
_PROCESS_TEXT = re.compile(
    "|".join(f"(?P<p{i}>{p})" for i, p in enumerate(PROCESS_TEXT.values())), re.I
)
# Raw result files keep what the runs wrote; their READMEs and markdown summaries are scanned.
RAW_RESULT_SUFFIXES = (".log", ".json", ".jsonl", ".txt", ".csv", ".out", ".png", ".svg", ".jpg")


def process_text(text: str) -> list[tuple[int, str, str]]:
    """(line number, kind, line) for each line of `text` that reads as development process."""
    kinds = list(PROCESS_TEXT)
    hits = []
    for number, line in enumerate(text.splitlines(), start=1):
        match = _PROCESS_TEXT.search(line)
        if match:
            kind = kinds[int(match.lastgroup[1:])]
            hits.append((number, kind, line.strip()))
    return hits


def is_scanned(path: str) -> bool:
    """Every tracked text file but the raw result files under bench/results/."""
    return not (path.startswith("bench/results/") and path.endswith(RAW_RESULT_SUFFIXES))


def process_text_in_file(path: pathlib.Path) -> list[tuple[int, str, str]]:
    """process_text of a text file; [] for a binary one (a NUL byte, or not UTF-8)."""
    raw = path.read_bytes()
    if b"\0" in raw:
        return []
    try:
        return process_text(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return []


def test_no_development_process_text_in_the_tracked_files():
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if listed.returncode != 0:
        pytest.skip(f"not a git work tree: {listed.stderr.strip()}")
    found = [
        f"{name}:{number}: [{kind}] {line[:160]}"
        for name in listed.stdout.split("\0")
        if name and is_scanned(name) and (ROOT / name).is_file()
        for number, kind, line in process_text_in_file(ROOT / name)
    ]
    assert not found, (
        "Say what the code does or what was measured (date, device, commit, command, run N), "
        "not how the work was organised:\n" + "\n".join(found)
    )


# Built with format() so that this file holds none of them verbatim.
PLANTED = [
    "measured in session {}",
    "Sessions {} and 14 ran it",
    "the fused layer (issue {})",
    "see issue #{} for the plan",
    "issues {} and 7",
    "device call {} of 2026-11-30",
    "## Call {}: the lowering failure",
    "calls {}-4 were fresh machines",
    "run(..., " + "carry" + "=[{}])",
    "run(..., " + "timeout_s" + "={})",
    "bench/results/2026-12-01_exchange_h200_s{}/",
    "2026-12-01_exchange_backward_h200_s{0}/ and _s{0}/",
    "`2026-11-30_moe_layer_h200_" + "call{}/README.md`",
    "p.run == 'session{}_run1'",
    "its log, `call{}_probe.log`",
]
ORDINARY = [
    "a custom call in the HLO",
    "call the kernel once a round",
    "the call site passes the mesh",
    "a second call of the compiled step",
    "the producer issues 128 one-row TMAs per K step",
    "four warps issue the rows",
    "XLA issue threads report the same (openxla/xla#33386)",
    "run 3 of 2026-12-01_moe_layer_h200/",
    "results/2026-12-01_exchange_tail_h200/run6_probe_layer.json",
    "s = 0.18, the comm_sm_share",
    "tile_s16 = 4; block_s2/",
    "session_log events in the metrics",
]


@pytest.mark.parametrize("template", PLANTED)
def test_process_text_is_found(template):
    line = template.format(5)
    assert [number for number, _, _ in process_text(f"ok\n{line}\n")] == [2], line


@pytest.mark.parametrize("line", ORDINARY)
def test_ordinary_words_are_not_process_text(line):
    assert process_text(line) == []


def test_a_planted_file_is_reported_and_raw_results_are_skipped(tmp_path):
    path, number = tmp_path / "README.md", 12
    path.write_text(f"# Results\n\nmeasured in session {number}, on one H200\n")
    line = f"measured in session {number}, on one H200"
    assert process_text_in_file(path) == [(3, "session number", line)]
    path.write_bytes(b"\0session 12")
    assert process_text_in_file(path) == []
    assert is_scanned("bench/results/2026-12-01_exchange_tail_h200/README.md")
    assert is_scanned("bench/results/moe_layer_h200.md")
    assert is_scanned("bench/moe_layer_h200.py")
    assert not is_scanned("bench/results/multi_gpu_h200x2/run5_multi_gpu.log")
    assert not is_scanned("bench/results/moe_layer_h200.json")
    assert not is_scanned("bench/results/plots/moe_layer_h200.png")
