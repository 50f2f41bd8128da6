"""bench.gpu_mfu with one training step looked into: where its time goes, and how often the host waits.

    PROF_STEP=3 python3 -m bench.gpu_step_profile <bench.gpu_mfu arguments>   # top 15 ops by CUDA and CPU time
    SYNC_STEP=2 python3 -m bench.gpu_step_profile <bench.gpu_mfu arguments>   # host syncs of step 2, by site

Pick a warm-up step (``--warmup`` at least that step): the profiler slows the step it watches, and a
timed step would carry that into the MFU. On a CPU the profile shows CPU time only and no sync is counted.
"""
from __future__ import annotations

import collections
import os
import sys
import warnings
from typing import Any, Callable

import torch

from bench import gpu_mfu
from megazero.training.trainer import Trainer

CUDA = torch.cuda.is_available()


def _synchronize() -> None:
    if CUDA:
        torch.cuda.synchronize()


def count_syncs(step: Callable[[], Any]) -> Any:
    """``step()`` under ``torch.cuda.set_sync_debug_mode("warn")``; prints the syncs it made, by source line."""
    _synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sites = collections.Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in caught
                                if "synchroniz" in str(w.message))
    print(f"SYNCS: {sum(sites.values())} host syncs in the step; by site: {sites.most_common(12)}", flush=True)
    return out


def profile(step: Callable[[], Any]) -> Any:
    """``step()`` under ``torch.profiler``; prints the top 15 ops by CUDA time (CPU time on a CPU) and by CPU time."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if CUDA else [])
    _synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        out = step()
        _synchronize()
    averages = prof.key_averages()
    for key in (["cuda_time_total"] if CUDA else []) + ["cpu_time_total"]:
        print(f"PROFILE by {key}:\n{averages.table(sort_by=key, row_limit=15, max_name_column_width=60)}", flush=True)
    return out


def watch_steps(prof_step: int, sync_step: int) -> None:
    """Wrap ``Trainer.train_step`` so that step ``prof_step`` is profiled and step ``sync_step``'s syncs counted."""
    plain, calls = Trainer.train_step, [0]

    def train_step(self: Trainer) -> Any:
        calls[0] += 1
        if calls[0] == sync_step and CUDA:
            return count_syncs(lambda: plain(self))
        if calls[0] == prof_step:
            return profile(lambda: plain(self))
        return plain(self)

    Trainer.train_step = train_step  # type: ignore[method-assign]


if __name__ == "__main__":
    watch_steps(int(os.environ.get("PROF_STEP", "0")), int(os.environ.get("SYNC_STEP", "0")))
    exit_code = gpu_mfu.main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(exit_code)  # as bench.gpu_mfu
