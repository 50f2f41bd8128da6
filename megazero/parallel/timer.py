"""One span of work, timed where the work runs: CUDA events on CUDA, ``perf_counter`` on CPU.

On CUDA the host only enqueues kernels, so a host clock around a span
measures the launches, not the work. A pair of events recorded on the
current stream measures the device time between them instead, and reading
it (``seconds``) waits only for the end event. Timers that are read once per
logged step therefore add no synchronisation to the steps in between.
On CPU the work runs on the calling thread, so the host clock is the truth.
"""
from __future__ import annotations

import time

import torch


class DeviceTimer:
    """``start()``, the work, ``stop()``, then ``seconds()`` (which may wait for the device)."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._start: float | torch.cuda.Event | None = None
        self._end: float | torch.cuda.Event | None = None

    def _now(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream, after everything enqueued so far
        return event

    def start(self) -> "DeviceTimer":
        self._start, self._end = self._now(), None
        return self

    def stop(self) -> "DeviceTimer":
        assert self._start is not None, "DeviceTimer.stop() before start()"
        self._end = self._now()
        return self

    def seconds(self) -> float:
        """Seconds from ``start`` to ``stop``; on CUDA, waits until the device has reached ``stop``."""
        assert self._start is not None and self._end is not None, "DeviceTimer.seconds() needs start() and stop()"
        if not self.cuda:
            return self._end - self._start
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1000  # elapsed_time is in milliseconds

    def __enter__(self) -> "DeviceTimer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
