"""The suite's CPU meter counts what a test's own processes burn: a spawned world's ranks, a subprocess."""
from __future__ import annotations

import subprocess
import sys
import time

from tests.helpers.cpu_meter import cpu_now, summary
from tests.helpers.dist import spawn

BURN = 0.3  # CPU-seconds each process spends


def _burn(pstate=None) -> float:
    start = time.process_time()
    while time.process_time() - start < BURN:
        pass
    return time.process_time() - start


def _counted_after(start: float, least: float) -> float:
    """The CPU counted since ``start`` once it reaches ``least`` (the forkserver reaps its children a moment
    after they exit), or what was counted after 10 s."""
    deadline = time.monotonic() + 10
    while cpu_now() - start < least and time.monotonic() < deadline:
        time.sleep(0.05)
    return cpu_now() - start


def test_a_spawned_worlds_ranks_are_counted():
    spawn(_burn, 1)  # the forkserver is running before the measurement starts
    start = cpu_now()
    burnt = sum(spawn(_burn, 2))
    assert _counted_after(start, burnt) >= burnt


def test_a_subprocess_is_counted():
    start = cpu_now()
    code = f"import time\nt = time.process_time()\nwhile time.process_time() - t < {BURN}: pass"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert _counted_after(start, BURN) >= BURN


def test_summary_totals_each_tier():
    lines = summary([("a", "launch", 3.0), ("b", "spawn", 1.0), ("c", "in-process", 0.5)], top=1)
    assert lines[0].startswith("4 CPU-seconds in 3 tests")
    assert "launch" in lines[1] and "3 s in    1 tests (67%)" in lines[1]
    assert lines[-1].endswith("s a") and len(lines) == 5
