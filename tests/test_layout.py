"""The package's structure: imports go one way, none hide in function bodies, files stay small."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "vmapens"
FILES = sorted(PACKAGE.rglob("*.py"))
MAX_LINES = 420  # STYLE.md: "~400 lines"; a file past it has the wrong seam


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in FILES}


def _resolve(node: ast.ImportFrom, here: str, is_package: bool) -> list[str]:
    """The package modules an ``import from`` statement names (a name may be a submodule)."""
    if node.level:
        base = here.split(".") if is_package else here.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join([*base, *([node.module] if node.module else [])])
    else:
        target = node.module or ""
    if not target.startswith("vmapens"):
        return []
    found = [target] if target in MODULES else []
    found += [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
    return found


def _imports(path: Path) -> tuple[set[str], list[str]]:
    """(modules imported at module level, descriptions of imports inside functions)."""
    here, tree = _module(path), ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    top: set[str] = set()
    nested: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and _resolve(inner, here, is_package):
                    nested.append(f"{path.name}:{inner.lineno} in {node.name}()")
                if isinstance(inner, ast.Import) and any(
                    a.name.startswith("vmapens") for a in inner.names
                ):
                    nested.append(f"{path.name}:{inner.lineno} in {node.name}()")
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            top.update(_resolve(node, here, is_package))
        elif isinstance(node, ast.Import):
            top.update(a.name for a in node.names if a.name in MODULES)
    top.discard(here)
    return top, nested


GRAPH = {name: _imports(path)[0] for name, path in MODULES.items()}


def _parents(name: str) -> set[str]:
    """Importing a.b runs a/__init__.py first: a package's own __init__ is not an edge."""
    parts = name.split(".")
    return {".".join(parts[:k]) for k in range(1, len(parts))}


def test_no_import_cycle():
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(GRAPH[node] - _parents(node)):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)


def test_no_package_import_inside_a_function():
    nested = [where for path in FILES for where in _imports(path)[1]]
    assert not nested, f"imports of the package's own modules inside functions: {nested}"


def test_lower_layers_know_nothing_above_them():
    # STYLE.md's house: the container and the collectives import nothing that acts on them.
    above = {"vmapens.fit", "vmapens.step", "vmapens.checkpoint", "vmapens.sharding"}
    for low in ("vmapens.ensemble", "vmapens.distributed", "vmapens._checks", "vmapens.history"):
        assert not (GRAPH[low] & above), f"{low} imports {GRAPH[low] & above}"
    assert "vmapens.ensemble" not in GRAPH["vmapens.distributed"]


def test_every_module_imports_alone():
    # Each module imported with no vmapens module loaded before it (torch stays loaded, for
    # speed): an import that only works after another module was imported first (a hidden
    # cycle or a missing import) fails here. import_module("a.b.c") imports a, then a.b, then
    # a.b.c, each only if not loaded yet. So when importing a module's parent package alone
    # already loads the module, the module's own round would run exactly the parent's round
    # again (parents sort first): it is skipped, and inherits what the parent's round loaded.
    # So only the package and the modules that no parent imports (__main__, the Lightning
    # extra) get rounds of their own; the ~70 others each repeated the package's round.
    code = (
        "import importlib, json, sys, torch\n"
        "loaded, round_of = {}, {}\n"
        f"for name in {sorted(MODULES)!r}:\n"
        "    parent = name.rpartition('.')[0]\n"
        "    if name in loaded.get(parent, ()):\n"
        "        loaded[name], round_of[name] = loaded[parent], round_of[parent]\n"
        "        continue\n"
        "    for m in [m for m in sys.modules if m == 'vmapens' or m.startswith('vmapens.')]:\n"
        "        del sys.modules[m]\n"
        "    importlib.import_module(name)\n"
        "    loaded[name] = {m for m in sys.modules if m == 'vmapens' or m.startswith('vmapens.')}\n"
        "    round_of[name] = name\n"
        "print(json.dumps(round_of))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    round_of = json.loads(proc.stdout.splitlines()[-1])
    # Every module was imported, in a round of its own or in its parent's; the package and the
    # Lightning extra (which the package leaves out) had rounds of their own.
    assert set(round_of) == set(MODULES)
    assert round_of["vmapens"] == "vmapens" and round_of["vmapens.fit"] == "vmapens"
    assert round_of["vmapens.lightning"] == "vmapens.lightning", round_of


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_files_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines; split it at its seam"


def test_the_architecture_table_names_every_top_level_file():
    # docs/index.md's table says which file owns what, in import order; nine files added by
    # earlier sessions were missing from it until session 36.
    table = (PACKAGE.parent / "docs" / "index.md").read_text().split("## Architecture", 1)[1]
    missing = [p.name for p in PACKAGE.glob("*.py") if f"`{p.name}`" not in table]
    assert not missing, f"docs/index.md's architecture table does not name {missing}"
