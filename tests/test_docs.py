"""Every Python block in docs/ and the README runs, and every docstring example passes."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import vmapens

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
PAGES = sorted(
    p for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")] if BLOCK.search(p.read_text())
)
TEST_COMMAND = re.compile(r"^(pip install .*\[test\].*&& *python -m pytest.*)$", re.M)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_run(page: Path, tmp_path: Path, monkeypatch):
    blocks = BLOCK.findall(page.read_text())
    monkeypatch.chdir(tmp_path)  # files the docs write land in a temporary directory
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for k, block in enumerate(blocks):
        code = compile(block, f"{page.name} block {k + 1}", "exec")
        exec(code, namespace)


MODULES = sorted(
    m.name
    for m in pkgutil.iter_modules(vmapens.__path__, "vmapens.")
    if m.name not in ("vmapens.__main__",)
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


def test_docs_pages_exist():
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {"index.md", "semantics.md", "optim.md", "fit.md", "performance.md"} <= names


def test_readme_setup_commands_and_ci_agree():
    text = (ROOT / "README.md").read_text()
    assert re.search(r"^pip install .*&& *python -m vmapens demo$", text, re.M)
    (test_command,) = TEST_COMMAND.findall(text)
    assert test_command in (ROOT / ".ci" / "run").read_text(), (
        ".ci/run must run the README's command"
    )
