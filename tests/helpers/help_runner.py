"""Run ``python SCRIPT --help`` for many scripts (or any ``python`` command lines) in one interpreter, so torch
is imported once.

    python tests/helpers/help_runner.py OUT_DIR SCRIPT...
    python tests/helpers/help_runner.py OUT_DIR --argv FILE     # FILE: one JSON argv list (after python) a line

Each script runs in a forked child as ``python SCRIPT --help`` would run it (``__main__``, its
folder first on sys.path); a SCRIPT without ``.py`` is a module, run as ``python -m SCRIPT --help``
from the current folder would run it (the folder first on sys.path). Its stdout and stderr go
to OUT_DIR/<i>, its exit code to OUT_DIR/<i>.rc; a child still running after ``LIMIT_S`` (a script
that ignores --help and starts working) is killed by SIGALRM and reports -14. Forking after
``import torch`` is safe here: nothing has started a thread. ``torch._dynamo`` and megazero's entry modules
are imported here too (the entry points reach megazero, and the planner's and --compile's ones dynamo; ~1.3
CPU-seconds a child would otherwise pay again).
"""
from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import traceback

import torch  # noqa: F401  (imported once, shared by every child)
import torch._dynamo  # noqa: F401  (the planner's meta-device builds and --compile reach it)

import megazero.arguments  # noqa: F401
import megazero.training.run  # noqa: F401

LIMIT_S = 60


def _child(argv: list[str]) -> int:
    """The exit code ``python *argv`` would return (``argv[0]`` a script, ``-m`` and a module, or a module name
    alone when it has no ``.py``)."""
    signal.alarm(LIMIT_S)
    if argv[0] == "-m":
        argv = argv[1:]
    script = argv[0]
    sys.argv = list(argv)
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
    return run_argv([script, "--help"], out_path)


def run_argv(argv: list[str], out_path: str) -> int:
    """Fork, run ``python *argv`` with its output in ``out_path`` (stdin /dev/null); the child's exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        code = _child(argv)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def main(out_dir: str, scripts: list[str]) -> None:
    """``--help`` of each script, or with ``--argv FILE`` as the only script, each JSON argv list of FILE's lines."""
    if scripts[:1] == ["--argv"]:
        with open(scripts[1]) as f:
            runs = [json.loads(line) for line in f if line.strip()]
    else:
        runs = [[script, "--help"] for script in scripts]
    for i, argv in enumerate(runs):
        code = run_argv(argv, os.path.join(out_dir, str(i)))
        with open(os.path.join(out_dir, f"{i}.rc"), "w", encoding="ascii") as f:
            f.write(str(code))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
