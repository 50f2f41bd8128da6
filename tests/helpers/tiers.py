"""Which tier a test module belongs to, read from what it uses (its imports, followed through tests/ helpers).

- ``launch``: starts processes of its own (``tests.helpers.launch``, ``subprocess``, torchrun): the slowest tier.
- ``spawn``: starts gloo worlds from the forkserver (``tests.helpers.dist``), but no process of its own.
- neither: runs in the pytest process.

``conftest.py`` marks every test with its module's tier, so ``-m "not launch"`` (``make test-quick``) is the
suite without launches, and a new test file lands in the right tier without anyone marking it.
"""
from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAUNCHES = ("tests.helpers.launch", "subprocess", "torch.distributed.run", "multiprocessing")
SPAWNS = ("tests.helpers.dist",)


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _local_file(module: str) -> Path | None:
    """The file of a ``tests.*`` module (or None for anything outside tests/)."""
    if not module.startswith("tests."):
        return None
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@lru_cache(maxsize=None)
def _reach(path: Path) -> frozenset[str]:
    """Every module ``path`` imports, directly or through the tests/ modules it imports."""
    seen: set[str] = set()
    todo = [path]
    visited: set[Path] = set()
    while todo:
        current = todo.pop()
        if current in visited:
            continue
        visited.add(current)
        for name in _imports(current):
            seen.add(name)
            local = _local_file(name)
            if local is not None and name not in LAUNCHES + SPAWNS:  # a tier's own helper: its name says it
                todo.append(local)
    return frozenset(seen)


def tier_of(path: Path) -> str | None:
    """``launch``, ``spawn`` or None (in-process) for the test file at ``path``."""
    used = _reach(Path(path).resolve())
    if any(name == mod or name.startswith(mod + ".") for name in used for mod in LAUNCHES):
        return "launch"
    if any(name == mod or name.startswith(mod + ".") for name in used for mod in SPAWNS):
        return "spawn"
    return None
