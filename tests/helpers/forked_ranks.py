"""Start a script's ranks as children of the test forkserver instead of fresh interpreters.

Each rank is still its own process: its own environment (replaced whole, as a new
process would get it), working directory, argv, stdout/stderr files, gloo world and
exit code. What goes is only the interpreter start and the imports of torch and
megazero, which the forkserver (``tests/helpers/dist.py``) did once (3-4 CPU-seconds a
rank). The script runs as ``__main__`` (``runpy``), so ``if __name__ == "__main__"``
blocks, ``sys.exit`` codes and ``os._exit`` behave as under ``python script.py``.
"""
from __future__ import annotations

import os
import runpy
import sys
import tempfile
import traceback

from tests.helpers.dist import CONTEXT

MODULE = "-m:"  # a ``script`` of "-m:pkg.mod" runs as ``python -m pkg.mod``


def _rank_main(script: str, args: list[str], env: dict[str, str], cwd: str, umask: int, stdout: str,
               stderr: str, stdin: str = os.devnull) -> None:
    """The child: become ``python script *args`` (``python -m module *args`` for a ``-m`` script, see
    ``run_forked``) with ``env``, the test's umask and ``stdin`` on fd 0, and exit with its status."""
    os.umask(umask)
    for fd, path, flags in ((0, stdin, os.O_RDONLY), (1, stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        target = os.open(path, flags, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(0, closefd=False)  # multiprocessing pointed sys.stdin at a /dev/null of its own
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    module = script[len(MODULE):] if script.startswith(MODULE) else None
    sys.argv = ["-m" if module else script, *args]
    first = os.getcwd() if module else os.path.dirname(script)  # what python puts first in either form
    pythonpath = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]  # read at start
    sys.path[:] = [first, *pythonpath, *(p for p in sys.path[1:] if p not in pythonpath)]
    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:  # sys.exit("message"): printed to stderr, status 1, as the interpreter does
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - an uncaught exception: traceback and status 1, as the interpreter
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_forked(script: str, rank_envs: list[dict[str, str]], args: list[str], cwd: str,
               timeout: float, stdin: str = os.devnull) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each rank; a rank still running after ``timeout`` is killed (-9).
    ``script`` is a path, or ``MODULE + "pkg.mod"``; every rank reads ``stdin`` (a path) on fd 0."""
    umask = os.umask(0o022)  # read the test's umask (only set-and-restore reads it), which a new process inherits
    os.umask(umask)
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        outs = [(os.path.join(tmp, f"{r}.out"), os.path.join(tmp, f"{r}.err")) for r in range(len(rank_envs))]
        procs = [CONTEXT.Process(target=_rank_main, args=(script, args, env, cwd, umask, *out, stdin))
                 for env, out in zip(rank_envs, outs)]
        for p in procs:
            p.start()
        try:
            for p in procs:
                p.join(timeout)  # each rank gets the whole timeout, as Popen.communicate(timeout) gave it
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        results = []
        for p, (out, err) in zip(procs, outs):
            with open(out, errors="replace") as fo, open(err, errors="replace") as fe:
                results.append((p.exitcode if p.exitcode is not None else -9, fo.read(), fe.read()))
        return results
