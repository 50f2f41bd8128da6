"""How a script that a test spawns ends: the way pretrain_gpt.py does, so its exit code is the script's own.

A process that used gloo can abort in the interpreter's teardown ("terminate called without an active
exception", exit -6) after its work is done and printed, when gloo's C++ threads are torn down; a
test that reads the exit code then fails for a reason that is not the code under test. So a spawned
script runs its body through ``run_then_exit``: it flushes, destroys the process group (after a
success), and leaves with ``os._exit``, skipping that teardown.
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Callable, NoReturn

FAILED = 1  # the body raised: its traceback is on stderr


def run_then_exit(body: Callable[[], int | None]) -> NoReturn:
    """Run ``body``; exit with its return value (None: 0), or FAILED after printing what it raised."""
    import torch.distributed as dist

    try:
        code = body() or 0
    except BaseException:  # noqa: BLE001 - report every failure through the exit code
        traceback.print_exc()
        code = FAILED
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0 and dist.is_initialized():  # after a failure a peer may be gone: a destroy could hang
        dist.destroy_process_group()
    os._exit(code)
