"""One port finder for the package, the test launchers and the benchmarks: ``megazero.parallel.state.free_port``."""
from __future__ import annotations

import ast
import socket
from pathlib import Path

from megazero.parallel.state import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_one_port_finder_in_the_repo():
    defined = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
               for folder in ("megazero", "tests", "bench", "tools") for path in sorted((ROOT / folder).rglob("*.py"))
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)
               and node.name.lstrip("_") == "free_port"]
    assert defined == [f"{Path('megazero/parallel/state.py')}:{_line_of_free_port()} free_port"], defined


def _line_of_free_port() -> int:
    return free_port.__code__.co_firstlineno


def test_free_port_can_be_bound():
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
