"""Signal a running process once it is ready, as a user's Ctrl-C or a scheduler's SIGTERM would come."""
from __future__ import annotations

import subprocess
import time
from typing import Callable


def signal_when(proc: subprocess.Popen, ready: Callable[[], bool], sig: int, guard: float) -> tuple[str, str]:
    """Wait (at most ``guard`` s) until ``ready()``, send ``sig``, and return the process's (stdout, stderr);
    a process that died first, or outlived the guard, fails the test with its stderr and is killed."""
    try:
        deadline = time.time() + guard
        while not ready():
            assert time.time() < deadline and proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        proc.send_signal(sig)
        return proc.communicate(timeout=guard)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
