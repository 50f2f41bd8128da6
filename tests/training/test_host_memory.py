"""The allocator tuning keeps a freed block mapped, so the next step reuses its pages.

What this checks is the mechanism, which does not depend on machine load: under glibc's
defaults a 24 MiB block is served by ``mmap`` and handed back to the kernel when freed (the
resident set falls again); with ``keep_freed_host_memory()`` it comes from the heap and stays
resident after ``free``. What that saves per step (page faults, time) is measured in
``bench/bench_host_memory.py``, not asserted here.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from megazero.training.host_memory import keep_freed_host_memory

SCRIPT = """
import sys, torch
if sys.argv[1] == "tuned":
    from megazero.training.host_memory import keep_freed_host_memory
    assert keep_freed_host_memory()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
torch.ones(256).add_(1.0)  # torch's lazy set-up happens here, not inside the measurement
before = rss()
block = torch.empty(6 << 20).fill_(1.0)  # 24 MiB (below glibc's largest mmap threshold), every page touched
during = rss()
del block
print(before, during, rss())
"""
MIB = 1 << 20


def resident(mode: str) -> tuple[int, int, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    before, during, after = map(int, out.stdout.split())
    return before, during, after


@pytest.mark.skipif(not keep_freed_host_memory() or not sys.platform.startswith("linux"),
                    reason="needs glibc's mallopt and /proc (Linux)")
def test_freed_blocks_stay_mapped_only_with_the_tuning():
    before, during, after = resident("default")
    assert during - before >= 23 * MIB, "the probe block should be resident while alive"
    assert after - before < 12 * MIB, "glibc's defaults unmap a freed 24 MiB block"
    before, during, after = resident("tuned")
    assert after - before >= 23 * MIB, "with the tuning the freed block stays mapped for reuse"
