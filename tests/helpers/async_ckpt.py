"""--async-save in-process: a saver over the serial test model, and a subprocess whose background write dies.

`python -m tests.helpers.async_ckpt ROOT` publishes an async save of iteration 5, then starts one of
iteration 9 whose writer half-writes the optimizer shard and hangs: it prints SAVE-RETURNED once
the step is free again, HALF-WRITTEN once the shard is half written, and waits for the test's SIGKILL.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any

import torch

from megazero.checkpoint.async_save import AsyncCheckpointer
from megazero.checkpoint.save import CheckpointContext
from megazero.parallel.state import ParallelState
from tests.helpers import serial_ckpt


def saver_for(root: str, pstate: ParallelState, zero: int = 0, **kw: Any) -> AsyncCheckpointer:
    """An ``AsyncCheckpointer`` over ``serial_ckpt``'s tiny model, its optimizer at ``zero`` over ``pstate``."""
    cfg, _, model = serial_ckpt.build(pstate=pstate, zero=zero)
    return AsyncCheckpointer(CheckpointContext(root, cfg, serial_ckpt.plan_of(cfg, pstate), pstate, model, **kw))


def _crash_mid_background_write(root: str) -> None:
    saver = saver_for(root, ParallelState.serial(), log=lambda line: print(line, file=sys.stderr))  # stdout: the marks
    saver.save(5, 0)
    saver.finish()
    written = threading.Event()
    serial_ckpt.hang_mid_write(written.set)
    saver.save(9, 0)
    print("SAVE-RETURNED", flush=True)  # the step is free while the writer is still busy
    written.wait(300)
    print("HALF-WRITTEN", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    torch.set_num_threads(1)
    _crash_mid_background_write(sys.argv[1])
