"""Import a script of tools/ as a module, so a test calls its ``main(argv)`` in-process (no interpreter start)."""
from __future__ import annotations

import importlib.util
import os
from types import ModuleType

from tests.helpers.launch import ROOT


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py, freshly executed."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
