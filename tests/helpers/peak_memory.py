"""Peak bytes a piece of CPU code allocates above what was live when it started.

The profiler records every allocation and free of PyTorch's CPU allocator
(``profile_memory=True``); its memory timeline replays them in time order, and
the highest total is the code's peak. Unlike a saved-tensor count this sees
transients too: a forward's scratch buffers and the gradients a backward creates.
The timeline export is deprecated in favour of a CUDA-only snapshot, hence the
silenced warning: on CPU it is what there is.
"""
from __future__ import annotations

import json
import os
import tempfile
import warnings
from typing import Callable

from torch.profiler import ProfilerActivity, profile


def peak_allocated_bytes(fn: Callable[[], object]) -> int:
    """Run ``fn`` once under the profiler; the highest CPU bytes live at once that it allocated."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        path = os.path.join(tmp, "timeline.json")
        prof.export_memory_timeline(path, device="cpu")
        with open(path) as f:
            _times, sizes = json.load(f)  # sizes: per time, bytes by category (parameter, activation, ...)
    assert sizes, "the profiler recorded no CPU allocation"
    return max(sum(per_category) for per_category in sizes)


def peak_live_bytes(fn: Callable[[], object], repeats: int = 1) -> int:
    """Most CPU bytes ``fn`` holds at once beyond what was live before, from the profiler's raw allocation
    and free events in time order (the timeline export above also counts what it cannot attribute).

    With ``repeats`` > 1, the least peak of that many runs: a gloo collective's buffers are released by
    gloo's own threads, and on a loaded machine a descheduled thread keeps them alive past the caller's
    peak, which raises it by whole buffers in some runs and lowers it in none."""
    return min(_one_peak(fn) for _ in range(repeats))


def _one_peak(fn: Callable[[], object]) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak
