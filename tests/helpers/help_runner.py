"""Run ``python SCRIPT --help`` for many scripts in one interpreter, so torch is imported once.

    python tests/helpers/help_runner.py OUT_DIR SCRIPT...

Each script runs in a forked child as ``python SCRIPT --help`` would run it (``__main__``, its
folder first on sys.path); a SCRIPT without ``.py`` is a module, run as ``python -m SCRIPT --help``
from the current folder would run it (the folder first on sys.path). Its stdout and stderr go
to OUT_DIR/<i>, its exit code to OUT_DIR/<i>.rc; a child still running after ``LIMIT_S`` (a script
that ignores --help and starts working) is killed by SIGALRM and reports -14. Forking after
``import torch`` is safe here: nothing has started a thread.
"""
from __future__ import annotations

import os
import runpy
import signal
import sys
import traceback

import torch  # noqa: F401  (imported once, shared by every child)

LIMIT_S = 60


def _child(script: str) -> int:
    """The exit code ``python script --help`` would return."""
    signal.alarm(LIMIT_S)
    sys.argv = [script, "--help"]
    module = not script.endswith(".py")
    sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.abspath(script))
    try:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # what the interpreter would print before exiting 1
        traceback.print_exc()
        return 1


def run_help(script: str, out_path: str) -> int:
    """Fork, run ``script --help`` with its output in ``out_path``; the child's exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        code = _child(script)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def main(out_dir: str, scripts: list[str]) -> None:
    for i, script in enumerate(scripts):
        code = run_help(script, os.path.join(out_dir, str(i)))
        with open(os.path.join(out_dir, f"{i}.rc"), "w", encoding="ascii") as f:
            f.write(str(code))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
