"""Rules for the test tree that keep it readable as it grows.

- No file under tests/ imports a ``test_*`` module: importing one runs its module-level code and
  couples two test files; whatever both need lives in a helper module.
- A helper module imported by more than one file under tests/ lives under tests/helpers/ (a module
  beside its one test file, split out to keep that file short, may stay there).

Imports are read with ``ast``, so imports inside functions and relative imports count too.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def module_name(path: Path) -> str:
    """``tests/a/b.py`` -> ``tests.a.b`` (a package's ``__init__.py`` -> the package)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every dotted name ``source`` (the code of ``module``) imports, absolute or relative: for
    ``from a import b`` both ``a`` and ``a.b`` (``b`` may be a module or a name inside ``a``)."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def tree_imports() -> dict[str, set[str]]:
    """Module name -> the names it imports, for every ``.py`` under tests/."""
    return {module_name(p): imported_modules(p.read_text(), module_name(p), p.name == "__init__.py")
            for p in sorted(TESTS.rglob("*.py"))}



def test_no_test_file_imports_another_test_file():
    bad = [f"{importer} imports {name}" for importer, names in tree_imports().items() for name in sorted(names)
           if name.startswith("tests.") and name.rpartition(".")[2].startswith("test_")]
    assert not bad, "move what they share into tests/helpers/:\n" + "\n".join(bad)


def test_shared_helpers_live_under_tests_helpers():
    modules = tree_imports()
    importers: dict[str, set[str]] = defaultdict(set)
    for importer, names in modules.items():
        for name in names & modules.keys():
            if name != importer:
                importers[name].add(importer)
    shared = {name: sorted(users) for name, users in importers.items()
              if len(users) > 1 and not name.startswith("tests.helpers")
              and not name.rpartition(".")[2].startswith("test_") and name != "tests" and not name.endswith("__init__")
              and (ROOT / (name.replace(".", "/") + ".py")).exists()}
    assert not shared, f"helpers used by several test files belong in tests/helpers/: {shared}"


def test_the_import_reader_sees_every_form():
    """The checks above are only as good as this reader: absolute, from-, relative and nested imports."""
    source = ("import tests.data.test_a\nfrom tests.data.test_b import x\nfrom tests.data import test_c\n"
              "from .test_d import y\nfrom . import test_e\nfrom ..helpers.dist import spawn\n"
              "def f():\n    from tests.cuda.test_f import z\n")
    names = imported_modules(source, "tests.optimizer.test_here")
    assert {"tests.data.test_a", "tests.data.test_b", "tests.data.test_c", "tests.optimizer.test_d",
            "tests.optimizer.test_e", "tests.helpers.dist", "tests.cuda.test_f"} <= names, names
    assert "tests.helpers.dist" in imported_modules("from .dist import spawn\n", "tests.helpers", is_package=True)
