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


def _rank_main(script: str, args: list[str], env: dict[str, str], cwd: str, umask: int, stdout: str,
               stderr: str) -> None:
    """The child: become ``python script *args`` with ``env`` (and the test's umask) and exit with its status."""
    os.umask(umask)
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)
    code = 0
    try:
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
               timeout: float) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each rank; a rank still running after ``timeout`` is killed (-9)."""
    umask = os.umask(0o022)  # read the test's umask (only set-and-restore reads it), which a new process inherits
    os.umask(umask)
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        outs = [(os.path.join(tmp, f"{r}.out"), os.path.join(tmp, f"{r}.err")) for r in range(len(rank_envs))]
        procs = [CONTEXT.Process(target=_rank_main, args=(script, args, env, cwd, umask, *out))
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
