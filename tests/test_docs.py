"""Every Python block in docs/ and the README runs, and every docstring example passes."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
import sys
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


def _packages() -> list[Path]:
    """The package and every other top-level package of the checkout (the benchmarks)."""
    others = [d for d in ROOT.iterdir() if d.name != "vmapens" and (d / "__init__.py").is_file()]
    return [Path(vmapens.__file__).parent, *sorted(others)]


def _modules(package: Path) -> list[str]:
    """Every module of `package`, subpackages included, as the import system finds them."""
    if str(package.parent) not in sys.path:
        sys.path.insert(0, str(package.parent))  # a top-level package outside the wheel
    found = pkgutil.walk_packages([str(package)], f"{package.name}.")
    return [package.name, *(m.name for m in found)]


PACKAGES = _packages()
MODULES = sorted(
    name
    for package in PACKAGES
    for name in _modules(package)
    if name.rpartition(".")[2] != "__main__"  # `python -m` entry points run on import
)


def test_every_source_file_is_collected():
    # Written from the files, not the import system: a subpackage that pkgutil does not walk
    # (no __init__.py, a typo in the prefix) shows up here as files whose examples never run.
    expected = set()
    for package in PACKAGES:
        for path in package.rglob("*.py"):
            parts = path.relative_to(package.parent).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts[-1] != "__main__":
                expected.add(".".join(parts))
    assert "vmapens.optim.plateau" in expected
    assert sorted(expected - set(MODULES)) == []


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
