"""``run_python`` behaves as ``subprocess.run`` of a fresh ``python`` for what a tool test reads.

One forked child per case is cheap (no interpreter start), so each case is its own run: exit codes,
``sys.exit("msg")``, an uncaught exception, ``os._exit``, stdout/stderr, ``-m``, stdin, a replaced
environment and the working directory.
"""
from __future__ import annotations

import os

from tests.helpers.launch import run_python

PROBE = """
import os, sys
print("argv", sys.argv[1:], "cwd", os.getcwd(), "path0", sys.path[0])
print("env", os.environ.get("PROBE_VALUE"), "home" if "HOME" in os.environ else "no-home")
print("stdin", sys.stdin.read().strip() or "-")
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "code":
    sys.exit(3)
if how == "message":
    sys.exit("one clear line")
if how == "raise":
    raise ValueError("uncaught")
if how == "hard":
    sys.stdout.flush()
    os._exit(7)
"""


def test_exit_codes_and_output_are_the_scripts_own(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    done = run_python(["probe.py", "ok", "x y"], cwd=str(tmp_path))
    assert done.returncode == 0 and done.stderr == "to stderr\n"
    assert done.stdout.splitlines()[0] == f"argv ['ok', 'x y'] cwd {tmp_path} path0 {tmp_path}"
    assert done.stdout.splitlines()[2] == "stdin -"  # /dev/null without input
    assert done.args[1:] == ["probe.py", "ok", "x y"]
    assert run_python(["probe.py", "code"], cwd=str(tmp_path)).returncode == 3
    message = run_python(["probe.py", "message"], cwd=str(tmp_path))
    assert message.returncode == 1 and message.stderr.endswith("one clear line\n")
    raised = run_python(["probe.py", "raise"], cwd=str(tmp_path))
    assert raised.returncode == 1 and raised.stderr.rstrip().endswith("ValueError: uncaught")
    assert "Traceback" in raised.stderr
    hard = run_python(["probe.py", "hard"], cwd=str(tmp_path))
    assert hard.returncode == 7 and hard.stdout.startswith("argv ['hard']")


def test_module_stdin_and_a_replaced_environment(tmp_path, monkeypatch):
    pkg = tmp_path / "probepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "probe.py").write_text(PROBE)
    monkeypatch.setenv("PROBE_VALUE", "inherited")
    done = run_python(["-m", "probepkg.probe", "ok"], cwd=str(tmp_path), input="fed on stdin\n")
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stderr
    assert lines[0] == f"argv ['ok'] cwd {tmp_path} path0 {tmp_path}"
    assert lines[1:3] == ["env inherited home" if "HOME" in os.environ else "env inherited no-home",
                          "stdin fed on stdin"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()  # the package is found only through the new environment's PYTHONPATH, as python reads it
    replaced = run_python(["-m", "probepkg.probe", "code"], cwd=str(elsewhere),
                          env={"PROBE_VALUE": "own", "PYTHONPATH": str(tmp_path)})
    assert replaced.returncode == 3, replaced.stderr
    assert replaced.stdout.splitlines()[:2] == [f"argv ['code'] cwd {elsewhere} path0 {elsewhere}", "env own no-home"]
