"""No function in pallas_kernels is longer than MAX_LINES lines.

A function's lines run from its first decorator to its last line, less the lines of the
functions defined inside it, which are counted on their own: a kernel body that defines its
producer and consumers as nested functions is held to the limit part by part.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

MAX_LINES = 150
ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pallas_kernels"

# Functions still over the limit, "pallas_kernels/<file>:<qualified name>" to its current own
# lines: none may grow, and no other function may go over. Shorten one and lower (or drop) its
# entry here. None is over today.
EXCEPTIONS: dict[str, int] = {}

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _span(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[int, int]:
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return first, node.end_lineno or node.lineno


def _nested_functions(node: ast.AST):
    """The functions defined in `node`'s body, not looking inside them."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _FUNCTIONS):
            yield child
        else:
            yield from _nested_functions(child)


def function_lengths(path: pathlib.Path, *, root: pathlib.Path = ROOT) -> dict[str, int]:
    """{"path:qualified.name": own lines} for every function of the file at `path` (its path
    relative to `root`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    relative = path.relative_to(root).as_posix()
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _FUNCTIONS):
                first, last = _span(child)
                nested = list(_nested_functions(child))
                own = last - first + 1
                for inner in nested:
                    inner_first, inner_last = _span(inner)
                    own -= inner_last - inner_first + 1
                name = f"{prefix}{child.name}"
                key = f"{relative}:{name}"
                while key in lengths:  # a name defined twice in one scope
                    key += "'"
                lengths[key] = own
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return lengths


def over_the_limit(lengths: dict[str, int], exceptions: dict[str, int]) -> dict[str, int]:
    """The functions of `lengths` over MAX_LINES, or over their entry in `exceptions`."""
    return {name: n for name, n in lengths.items() if n > max(MAX_LINES, exceptions.get(name, 0))}


def _all_lengths() -> dict[str, int]:
    lengths: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lengths.update(function_lengths(path))
    return lengths


def test_own_lines_exclude_nested_functions(tmp_path):
    source = tmp_path / "example.py"
    source.write_text(
        "def outer():\n"
        "    x = 1\n"
        "    @decorate\n"  # the nested function's first line
        "    def inner():\n"
        "        return 2\n"
        "    return x\n"
    )
    assert function_lengths(source, root=tmp_path) == {
        "example.py:outer": 3,
        "example.py:outer.inner": 3,
    }


def test_a_function_over_the_limit_is_named(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    source = tmp_path / "long.py"
    source.write_text(f"def long():\n{body}\ndef short():\n    return 1\n")
    lengths = function_lengths(source, root=tmp_path)
    assert over_the_limit(lengths, {}) == {"long.py:long": MAX_LINES + 1}
    # A listed exception passes at its count and fails once it grows.
    assert over_the_limit(lengths, {"long.py:long": MAX_LINES + 1}) == {}
    assert over_the_limit(lengths, {"long.py:long": MAX_LINES}) == {"long.py:long": MAX_LINES + 1}


def test_the_exceptions_name_functions_that_exist():
    lengths = _all_lengths()
    stale = sorted(set(EXCEPTIONS) - set(lengths))
    assert not stale, f"EXCEPTIONS names functions that no longer exist: {stale}"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: p.name)
def test_no_function_is_over_the_limit(path):
    too_long = over_the_limit(function_lengths(path), EXCEPTIONS)
    assert not too_long, (
        f"functions over {MAX_LINES} lines (nested functions counted on their own), or listed "
        f"exceptions that grew: {too_long}; split them into named parts"
    )
