"""The README and docs/ stay true: the README's Python runs as written, and every relative link
in them names a file of the repository."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def python_blocks(markdown: str) -> str:
    """The ```python blocks of `markdown`, one after the other."""
    return "\n".join(re.findall(r"^```python\n(.*?)^```", markdown, flags=re.S | re.M))


def broken_links(path: pathlib.Path) -> list[str]:
    """The relative links of markdown file `path` that name no existing file or folder."""
    targets = LINK.findall(path.read_text())
    local = [t for t in targets if not re.match(r"[a-z]+:", t)]
    return [t for t in local if not (path.parent / t).exists()]


def test_readme_python_runs_on_a_cpu_mesh():
    code = python_blocks((ROOT / "README.md").read_text())
    assert "mok_jax.moe" in code and "make_mesh" in code
    env = os.environ | {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_links_resolve(path):
    assert broken_links(path) == []


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[a](there.md) [b](missing.md#part) [c](https://example.com/x.md)")
    assert broken_links(page) == ["missing.md"]
