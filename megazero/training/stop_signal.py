"""How a run stops on SIGTERM/SIGINT: the first asks for a save after the step, a later one ends the process."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from ..parallel import collectives as C
from ..parallel.state import ParallelState


class StopSignal:
    """First SIGTERM/SIGINT: finish the step, save, stop (all ranks agree). A later one: exit at once.

    A Python handler runs only when the main thread is back in Python, which a rank blocked in a
    C++ collective never is, so a second Ctrl-C would be swallowed too. The interpreter's C-level
    handler also writes each signal's number to a wakeup fd; a small thread reads it, prints the
    notice on the first signal and ends the process on a later one, even mid-collective.

    A repeat within ``REPEAT_S`` of the first is the same request delivered twice, not a second one:
    torchrun forwards SIGTERM to workers that received it already from their process group (Slurm's
    cancel and time limit, ``timeout``), a few milliseconds apart, and the stop must still save.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    REPEAT_S = 1.0

    def __init__(self, rank: int = 0) -> None:
        self.received = False
        self.rank = rank
        self.previous: dict[int, Any] = {}
        self._previous_fd = -1
        self._write_fd: int | None = None
        self.first_at: float | None = None  # monotonic time the watcher read the first signal

    def install(self) -> None:
        """Take over SIGTERM/SIGINT (main thread only) and start the watcher thread."""
        for sig in self.SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handle)
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # the C handler must never block
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), daemon=True, name="megazero-stop-signal").start()

    def _handle(self, signum, frame) -> None:
        self.received = True  # the watcher counts the signals and decides when to exit

    def _watch(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while byte := pipe.read(1):
                if byte[0] not in self.SIGNALS:
                    continue
                self.received = True
                name, now = signal.Signals(byte[0]).name, time.monotonic()
                if self.first_at is None:
                    self.first_at = now
                    print(f"megazero: rank {self.rank}: {name} received: will save after this step; "
                          f"send it again to exit at once (a repeat within {self.REPEAT_S:g} s counts as this "
                          "one)", file=sys.stderr, flush=True)
                elif now - self.first_at >= self.REPEAT_S:
                    print(f"megazero: rank {self.rank}: second {name}: exiting now without saving",
                          file=sys.stderr, flush=True)
                    os._exit(128 + byte[0])

    def restore(self) -> None:
        """Give the signals back; the watcher thread ends when its pipe closes. A stop that finished within
        ``REPEAT_S`` of its signal keeps them until then: the duplicate delivery still on its way would
        otherwise meet the default handler and kill the process after its save."""
        if self.first_at is not None:
            time.sleep(max(0.0, self.REPEAT_S - (time.monotonic() - self.first_at)))
        if self._write_fd is not None:
            signal.set_wakeup_fd(self._previous_fd)
            os.close(self._write_fd)
            self._write_fd = None
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()

    def agreed(self, pstate: ParallelState) -> bool:
        """True on every rank when any rank was signalled (one tiny all-reduce over the world)."""
        flag = torch.tensor([float(self.received)], device=pstate.device)
        C.all_reduce(flag, pstate.world_group, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)
