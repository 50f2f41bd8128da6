"""Rules that keep the package and its tests readable as they grow (docs/STYLE: "Recommended layout").

- No file under tests/ imports a ``test_*`` module: importing one runs its module-level code and
  couples two test files; whatever both need lives in a helper module.
- A helper module imported by more than one file under tests/ lives under tests/helpers/ (a module
  beside its one test file, split out to keep that file short, may stay there).
- No import cycle among megazero's modules: a cycle makes import order matter and hides which module
  owns what.
- Imports in megazero/ point one way, up ``LAYERS``; nothing in the package imports the scripts on
  top (tools/, bench/, pretrain_gpt.py) or the tests.
- Modules are at most 400 lines and functions at most 60, in megazero/ and in the scripts on top.
- A name shared across the package has one home (``HOMES``): defined there only, imported from there only.
- A chunk's blocks are found one way, ``megazero.model.chunk.blocks_of``.

Imports are read with ``ast``, so imports inside functions and relative imports count too.
"""
from __future__ import annotations

import ast
import re
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


def tree_imports(folder: Path = TESTS) -> dict[str, set[str]]:
    """Module name -> the names it imports, for every ``.py`` under ``folder`` (tests/ by default)."""
    return {module_name(p): imported_modules(p.read_text(), module_name(p), p.name == "__init__.py")
            for p in sorted(folder.rglob("*.py"))}


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


PACKAGE = ROOT / "megazero"

# megazero's parts from the bottom up: a module imports modules of its own part or of a lower layer,
# never of its layer's other parts or of a higher one (``data_parallel`` never imports ``optimizer``;
# nothing but ``training`` imports ``training``). A part is a subpackage or a top-level module.
LAYERS = (
    {"config_fields", "dtypes", "optional"}, {"moe_config"}, {"model_config", "parallel_config"}, {"config"},
    {"parallel"}, {"tensor_parallel", "context_parallel"}, {"run_plan"}, {"moe"},
    {"model"}, {"pipeline"}, {"data_parallel"}, {"optimizer"}, {"data"},
    {"memory", "checkpoint"}, {"training"}, {"arguments"},
)
ON_TOP = ("tools", "bench", "pretrain_gpt", "tests")  # scripts and tests: they import the package, not the reverse


def part_of(module: str) -> str:
    """``megazero.data_parallel.engine`` -> ``data_parallel``; ``megazero.config`` -> ``config``."""
    return module.split(".")[1]


def layer_of(part: str) -> int:
    return next(i for i, parts in enumerate(LAYERS) if part in parts)


def package_graph() -> dict[str, set[str]]:
    """megazero module -> the megazero modules it imports (a name inside a module counts as the module)."""
    modules = tree_imports(PACKAGE)
    return {m: {n for n in names if n in modules and n != m} for m, names in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph``: each strongly connected set of more than one node, sorted (iterative
    Tarjan, so a deep import chain does not hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = stack[stack.index(node):]
                del stack[stack.index(node):]
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycle_in_the_package():
    cycles = import_cycles(package_graph())
    assert not cycles, "break these import cycles (move what both need below them):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": {"f"}, "g": set()}
    assert sorted(import_cycles(graph)) == [["a", "b", "c"], ["d", "e"]]


def test_package_imports_point_up_the_layers():
    bad = []
    for module, names in tree_imports(PACKAGE).items():
        if module == "megazero":
            continue
        part = part_of(module)
        for name in sorted(names):
            if name.split(".")[0] in ON_TOP:
                bad.append(f"{module} imports {name}: nothing in megazero imports scripts or tests")
            elif name.startswith("megazero.") and part_of(name) != part and layer_of(part_of(name)) >= layer_of(part):
                bad.append(f"{module} imports {name}: {part_of(name)} is not below {part}")
    assert not bad, "megazero's imports point one way, up LAYERS:\n" + "\n".join(bad)


def test_every_part_of_the_package_has_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert parts == set().union(*LAYERS), "place each part of megazero in LAYERS (and drop gone ones)"


def sources_with_limits() -> list[Path]:
    """The files the size limits hold for: the package and the scripts on top of it."""
    return [*sorted(PACKAGE.rglob("*.py")), ROOT / "pretrain_gpt.py", *sorted((ROOT / "tools").rglob("*.py")),
            *sorted((ROOT / "bench").rglob("*.py"))]


def long_parts(path: Path, max_module: int = 400, max_function: int = 60) -> list[str]:
    """What in ``path`` is over the limits: the module (lines) and each function or method (``def`` to its
    last line, docstring included)."""
    source = path.read_text()
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found = [f"{name}: {n} lines > {max_module}" for n in [len(source.splitlines())] if n > max_module]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > max_function:
                found.append(f"{name}:{node.lineno} {node.name}: {length} lines > {max_function}")
    return found


def test_modules_and_functions_are_small():
    too_long = [line for path in sources_with_limits() for line in long_parts(path)]
    assert not too_long, "split these (modules <= 400 lines, functions <= 60):\n" + "\n".join(too_long)


def test_the_size_check_measures_defs(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(60))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\nclass C:\n    def long(self):\n{body}\n")
    found = long_parts(tmp_path / "m.py", max_module=5)
    assert len(found) == 2 and "lines > 5" in found[0] and "long: 61 lines > 60" in found[1], found


# Names many modules use, each defined in and imported from one module only (no re-exports, no copies).
HOMES = {"Placement": "megazero.config", "DTYPES": "megazero.dtypes", "DTYPE_NAMES": "megazero.dtypes",
         "free_port": "megazero.parallel.state"}


def homeless_names(source: str, module: str, is_package: bool = False) -> list[str]:
    """Where ``source`` (the code of ``module``) defines or imports a ``HOMES`` name away from its home."""
    package = module if is_package else module.rpartition(".")[0]
    bad = []
    for node in ast.walk(ast.parse(source)):
        defined = [node.name] if isinstance(node, ast.ClassDef | ast.FunctionDef) else \
            [node.id] if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) else []
        bad += [f"{module} defines {name} (its home is {HOMES[name]})" for name in defined
                if name in HOMES and module != HOMES[name]]
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            bad += [f"{module} imports {a.name} from {base} (its home is {HOMES[a.name]})" for a in node.names
                    if a.name in HOMES and base != HOMES[a.name]]
    return bad


def test_shared_names_have_one_home():
    bad = [line for path in sources_with_limits() + sorted(TESTS.rglob("*.py"))
           for line in homeless_names(path.read_text(), module_name(path), path.name == "__init__.py")]
    assert not bad, "define and import these from their one home:\n" + "\n".join(bad)


def test_the_home_check_sees_copies_and_re_exports():
    source = "from ..run_plan import Placement\nfrom ..dtypes import DTYPES\nDTYPE_NAMES = {}\n"
    assert homeless_names(source, "megazero.checkpoint.convert") == [
        "megazero.checkpoint.convert imports Placement from megazero.run_plan (its home is megazero.config)",
        "megazero.checkpoint.convert defines DTYPE_NAMES (its home is megazero.dtypes)"]


# Ways of walking a chunk's blocks other than ``model.chunk.blocks_of``; the chunk itself (gpt.py) runs its own.
BLOCK_WALKS = re.compile(r"\.layers\.(values|items|keys)\(\)|len\([^()]*\.layers\)"
                         r"|isinstance\([^)]*TransformerBlock|nn\.ModuleList, nn\.ModuleDict")
BLOCK_WALKERS = {"megazero/model/chunk.py", "megazero/model/gpt.py"}


def test_the_blocks_of_a_chunk_are_found_one_way():
    bad = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for path in sorted(PACKAGE.rglob("*.py"))
           if str(path.relative_to(ROOT)) not in BLOCK_WALKERS
           for i, line in enumerate(path.read_text().splitlines(), start=1) if BLOCK_WALKS.search(line)]
    assert not bad, "find a chunk's blocks with megazero.model.chunk.blocks_of:\n" + "\n".join(bad)


# Files whose subject is the process itself (signals, torchrun restarts, two nodes, CUDA, the entry path's smoke
# launch): only these start ranks as fresh interpreters (``launch(..., fresh=True)``); every other launch forks its
# ranks from the test forkserver (``tests/helpers/forked_ranks.py``), as each is still its own process.
FRESH_LAUNCHERS = {"tests/parallel/test_two_nodes.py", "tests/cuda/test_gpu_path.py", "tests/cuda/test_offload_cuda.py",
                   "tests/test_pretrain.py"}


def test_fresh_interpreters_only_where_the_process_is_the_subject():
    used = {str(path.relative_to(ROOT)) for path in sorted(TESTS.rglob("*.py")) if path.name != "launch.py"
            and re.search(r"fresh\s*=\s*True", path.read_text()) and path.name != "test_repo_rules.py"}
    assert used <= FRESH_LAUNCHERS, ("launch(..., fresh=True) outside the listed files; fork the ranks (the default) "
                                     f"or add the file to FRESH_LAUNCHERS with why: {sorted(used - FRESH_LAUNCHERS)}")
    assert FRESH_LAUNCHERS <= used, f"listed but no longer fresh: {sorted(FRESH_LAUNCHERS - used)}"


# Files that start a fresh interpreter themselves (``sys.executable`` in a subprocess), each for why the process
# is the subject; every other tool or script run goes through ``tests/helpers/launch.py:run_python``, a forked
# child of the test forkserver (3-4 CPU-seconds of interpreter start and imports saved a run).
FRESH_INTERPRETERS = {
    "tests/checkpoint/test_async_save.py",  # SIGKILL of a writer mid-save
    "tests/checkpoint/test_resume.py",  # ranks stopped by SIGTERM mid-run
    "tests/checkpoint/test_safety.py",  # SIGKILL mid-write
    "tests/data/test_hf_tokenizer.py",  # runs under setpriv (dropped capabilities need an exec)
    "tests/parallel/test_two_nodes.py",  # torchrun agents in network namespaces
    "tests/training/test_folder_ownership.py",  # another process holding the folders, a second job
    "tests/training/test_host_memory.py",  # glibc's allocator state of a new process is what is measured
    "tests/training/test_orderly_stop.py",  # signals to a run
    "tests/training/test_restart.py",  # elastic agents restarting killed workers
    "tests/training/test_robustness.py",  # killed ranks, torchrun ending the job
    "tests/training/test_run_messages.py",  # torchrun's own summary of a failing job
    "tests/training/test_run_starts.py",  # a run stopped by SIGINT
    "tests/test_cpu_meter.py",  # a child process's CPU time is what is counted
}


def test_tool_runs_fork_unless_the_process_is_the_subject():
    used = {str(path.relative_to(ROOT)) for path in sorted(TESTS.rglob("*.py"))
            if path.name not in ("launch.py", "test_repo_rules.py") and "sys.executable" in path.read_text()}
    assert used <= FRESH_INTERPRETERS, ("a fresh interpreter (sys.executable) outside the listed files; run the tool "
                                        "with tests.helpers.launch.run_python, or add the file to FRESH_INTERPRETERS "
                                        f"with why: {sorted(used - FRESH_INTERPRETERS)}")
    assert FRESH_INTERPRETERS <= used, f"listed but no longer fresh: {sorted(FRESH_INTERPRETERS - used)}"
