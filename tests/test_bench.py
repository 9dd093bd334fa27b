"""bench/ as a package: its import graph has no circle and the harness imports no benchmark,
the commands the documentation gives name modules that exist, and the code stays small."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# The benchmarks' Python (bench/results/ not counted): a ceiling, so that shared code stays in the
# harness. Raise it only with a reason in the commit.
MAX_LINES = 7730


def _modules() -> dict[str, pathlib.Path]:
    paths = [p for p in BENCH.rglob("*.py") if "results" not in p.relative_to(BENCH).parts]
    names = {}
    for path in paths:
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph() -> dict[str, set[str]]:
    """bench module -> the bench modules it imports (anywhere in the file)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports (its modules in order, the first repeated last), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_bench_has_no_import_circle():
    graph = import_graph()
    assert {"bench.grouped_gemm", "bench.gmm_sweep", "bench.harness"} <= set(graph)
    assert "bench.grouped_gemm" in graph["bench.gmm_sweep"]
    assert find_cycle(graph) is None, f"an import circle: {' -> '.join(find_cycle(graph))}"


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_harness_imports_no_benchmark():
    for name, imported in import_graph().items():
        if name.startswith("bench.harness"):
            assert all(m.startswith("bench.harness") for m in imported), (name, imported)


def _commands(text: str) -> set[str]:
    return set(re.findall(r"python3? -m (bench\.[a-z_.]+)", text))


DOCS = [
    "bench/README.md",
    "README.md",
    *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")),
]


@pytest.mark.parametrize("doc", DOCS)
def test_documented_commands_name_modules_that_exist(doc):
    path = ROOT / doc
    modules = _modules()
    missing = sorted(c for c in _commands(path.read_text()) if c not in modules)
    assert not missing, f"{doc} runs modules that do not exist: {missing}"


# Libraries of the benchmarks, not benchmarks: no command line of their own.
LIBRARIES = {"bench.harness", "bench.torch_lm"}


def test_each_benchmark_runs_as_a_module_and_there_are_no_wrappers():
    for name, path in _modules().items():
        if name.count(".") == 1 and name not in LIBRARIES:
            assert '__name__ == "__main__"' in path.read_text(), f"{name}: no command line"
    assert not list(BENCH.glob("*.sh")), "one Python command per benchmark, no shell wrapper"


def test_the_benchmarks_stay_small():
    lines = sum(len(p.read_text().splitlines()) for p in _modules().values())
    assert lines <= MAX_LINES, f"bench/ holds {lines} lines of Python, over {MAX_LINES}"
