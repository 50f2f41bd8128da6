"""When each forward and backward ran: spans per rank, Chrome-trace output, bubble fraction.

Spans use ``time.perf_counter`` (CLOCK_MONOTONIC on Linux, shared by all
processes of one host), so the traces of one node's ranks line up when
opened together. On CUDA the host only enqueues kernels, so a host-timed span would
measure the launch, not the work: there each span is a pair of CUDA events,
placed on the host clock by an anchor event recorded right after a device
synchronize at the start of the step (two synchronizes per step, only while
a timeline is recorded). The bubble of a step is the time a rank spends not computing inside
the step's window. Narayanan et al. (2021) state it relative to the ideal
(busy) time: (p-1)/m for 1F1B, (p-1)/(v*m) for interleaving with v chunks;
``bubble_ratio`` is that quantity, ``bubble_fraction`` the share of the window.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterator

import torch


@dataclass
class Span:
    kind: str  # "F" or "B"
    micro_batch: int
    chunk: int
    start: float  # seconds, perf_counter
    end: float


@dataclass
class Timeline:
    """Records this rank's compute spans, step by step; keeps the first ``max_steps`` steps for the trace."""

    rank: int
    pp_rank: int = 0
    max_steps: int = 50
    steps: list[tuple[float, float, list[Span]]] = field(default_factory=list)
    current: list[Span] = field(default_factory=list)
    step_start: float = 0.0
    last: tuple[float, float, list[Span]] | None = None
    cuda: bool | None = None  # time with CUDA events; None = when CUDA is in use in this process
    _events: list[tuple[str, int, int, Any, Any]] = field(default_factory=list)
    _anchor: Any = None

    def _on_cuda(self) -> bool:
        if self.cuda is None:
            self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        return self.cuda

    def _event(self) -> "torch.cuda.Event":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin_step(self) -> None:
        self.current, self._events = [], []
        if self._on_cuda():
            torch.cuda.synchronize()  # the device is idle, so the anchor runs at step_start
        self.step_start = time.perf_counter()
        if self.cuda:
            self._anchor = self._event()

    def end_step(self) -> None:
        end = time.perf_counter()
        if self.cuda:
            last = self._event()
            last.synchronize()
            at = lambda e: self.step_start + self._anchor.elapsed_time(e) / 1000  # noqa: E731
            self.current = [Span(k, mb, c, at(s), at(e)) for k, mb, c, s, e in self._events]
            end = at(last)
        self.last = (self.step_start, end, self.current)
        if len(self.steps) < self.max_steps:
            self.steps.append(self.last)

    @contextlib.contextmanager
    def span(self, kind: str, micro_batch: int, chunk: int) -> Iterator[None]:
        if self.cuda:
            start_event = self._event()
            try:
                yield
            finally:
                self._events.append((kind, micro_batch, chunk, start_event, self._event()))
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.current.append(Span(kind, micro_batch, chunk, start, time.perf_counter()))

    def last_bubble_fraction(self) -> float:
        """Share of this rank's last schedule call spent not computing (its own window)."""
        assert self.last is not None, "no step recorded yet"
        start, end, spans = self.last
        busy = sum(s.end - s.start for s in spans)
        return max(0.0, 1.0 - busy / max(end - start, 1e-12))

    def step_fields(self) -> dict[str, float]:
        """What the last step adds to its logged record: this rank's bubble fraction."""
        return {"bubble_fraction": self.last_bubble_fraction()}

    def chrome_events(self) -> list[dict]:
        """Complete ('X') events in microseconds; pid = rank, tid = model chunk."""
        events = [{"name": "process_name", "ph": "M", "pid": self.rank,
                   "args": {"name": f"rank {self.rank} (stage {self.pp_rank})"}}]
        for step, (_, _, spans) in enumerate(self.steps):
            for s in spans:
                events.append({"name": f"{s.kind}{s.micro_batch}", "cat": "forward" if s.kind == "F" else "backward",
                               "ph": "X", "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6, "pid": self.rank,
                               "tid": s.chunk, "args": {"step": step, "micro_batch": s.micro_batch,
                                                        "chunk": s.chunk, "stage": self.pp_rank}})
        return events

    def write(self, path: str) -> str:
        """Write this rank's trace to ``rank_path(path, rank)``; returns the file written."""
        out = rank_path(path, self.rank)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as fh:
            json.dump({"traceEvents": self.chrome_events(), "displayTimeUnit": "ms"}, fh)
        return out


class NullTimeline:
    """A schedule that records no spans (no --timeline, and no bubble line to log): every call does nothing,
    so the step runner and the trainer make the same calls with or without a timeline."""

    def begin_step(self) -> None:
        """Nothing to record."""

    def end_step(self) -> None:
        """Nothing to record."""

    def span(self, kind: str, micro_batch: int, chunk: int) -> ContextManager[None]:
        return contextlib.nullcontext()

    def step_fields(self) -> dict[str, float]:
        return {}

    def write(self, path: str) -> str:
        """Nothing was recorded, so no file is written ('')."""
        return ""


NO_TIMELINE = NullTimeline()


def rank_path(path: str, rank: int) -> str:
    """``path`` with '{rank}' filled in, else with '.rank<N>' before the extension."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext or '.json'}"


def bubble_of_step(rank_spans: list[list[tuple[float, float]]]) -> tuple[float, float]:
    """(bubble_ratio, bubble_fraction) of one step from every rank's (start, end) compute spans.

    The window runs from the first compute start to the last compute end over all ranks;
    each rank idles for window - busy. ratio = mean idle / mean busy (the paper's measure),
    fraction = mean idle / window.
    """
    start = min(s for spans in rank_spans for s, _ in spans)
    end = max(e for spans in rank_spans for _, e in spans)
    window = end - start
    busy = [sum(e - s for s, e in spans) for spans in rank_spans]
    idle = [window - b for b in busy]
    mean_busy, mean_idle = sum(busy) / len(busy), sum(idle) / len(idle)
    return mean_idle / mean_busy, mean_idle / window
