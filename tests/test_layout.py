"""The package's layout: argparse only under commands/, no import cycle, every module importable, modules and
commands small, README.md a front page."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "onebit_predict"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path) -> set[str]:
    """The modules (absolute names) a module imports, at any depth of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # "from . import stats": the names may be modules themselves
            found.update(f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in MODULES)
    return found


GRAPH = {name: {m for m in imports(name, path) if m in MODULES and m != name} for name, path in MODULES.items()}


def test_the_rooms_exist():
    for room in ("commands", "checks", "llama", "costmodel", "metrics"):
        assert f"onebit_predict.{room}" in MODULES, room
    for kept in ("policy", "trace", "constants"):
        assert f"onebit_predict.{kept}" in MODULES, kept


def test_argparse_only_under_commands():
    offenders = [
        name
        for name, path in MODULES.items()
        if not name.startswith("onebit_predict.commands") and "argparse" in imports(name, path)
    ]
    assert offenders == []


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(GRAPH[name]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep) :] + [dep] if dep in path else [name, dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert cycles == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name):
    importlib.import_module(name)


MODULE_LINES_MAX = 600  # a module with more holds more than one job: split it
COMMAND_LINES_MAX = 300  # a command parses and prints; its logic lives in the rooms


def test_modules_stay_small():
    """No module over 600 lines, no command over 300 (issue 22's limits, kept)."""
    too_long = []
    for name, path in MODULES.items():
        n = len(path.read_text().splitlines())
        limit = COMMAND_LINES_MAX if name.startswith("onebit_predict.commands.") else MODULE_LINES_MAX
        if n > limit:
            too_long.append(f"{path.relative_to(PACKAGE.parent)}: {n} lines (at most {limit})")
    assert too_long == []


README = PACKAGE.parent / "README.md"
README_LINES_MAX = 170  # the front page: detail lives in docs/, linked from it


def test_the_readme_is_a_front_page():
    """README.md stays at most 170 lines (issue 29): the knob table is docs/policy.md's, and so on."""
    n = len(README.read_text().splitlines())
    assert n <= README_LINES_MAX, f"README.md has {n} lines (at most {README_LINES_MAX}): move detail to docs/"
