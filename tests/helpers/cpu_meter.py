"""CPU-seconds of each test, the processes it started included: what a test costs on CI's two cores.

``--durations`` gives wall time, which on a shared machine (two xdist workers, another suite beside this one)
says as much about the neighbours as about the test. CPU-seconds add up: the suite's total over the cores is
the shortest it can take, so ``--cpu-report N`` (``.ci/run``) prints the total, each tier's share and the N
costliest tests. A test's CPU is that of its pytest process and of every process it started once reaped:
``getrusage`` of the process and its waited-for children (subprocesses, torchrun and its workers) plus the
test forkserver's own and its children's (spawned worlds and forked ranks, which the forkserver reaps;
``/proc/PID/stat``). A child the forkserver has not reaped yet when the test ends counts to the next test.
"""
from __future__ import annotations

import os
import resource
from multiprocessing import forkserver

_TICK = os.sysconf("SC_CLK_TCK")
KEY = "cpu_s"


def forkserver_cpu() -> float:
    """utime + stime + cutime + cstime of this process's forkserver (0 before it starts)."""
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if not pid:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # not Linux, or the forkserver has exited
        return 0.0
    return sum(int(v) for v in fields[11:15]) / _TICK  # fields 14-17 of proc(5), counted from the state (3)


def cpu_now() -> float:
    """CPU-seconds used so far by this process, its reaped children and the forkserver's."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forkserver_cpu()


def tier(keywords) -> str:
    """The tier a report's markers name (``tests/helpers/tiers.py``)."""
    return next((name for name in ("launch", "spawn") if name in keywords), "in-process")


def summary(costs: list[tuple[str, str, float]], top: int) -> list[str]:
    """Lines for the terminal: the total, each tier's share, the ``top`` costliest tests."""
    total = sum(cpu for _, _, cpu in costs)
    lines = [f"{total:.0f} CPU-seconds in {len(costs)} tests (the suite cannot take less than this / cores)"]
    for name in ("launch", "spawn", "in-process"):
        part = [cpu for _, t, cpu in costs if t == name]
        share = 100 * sum(part) / max(total, 1e-9)
        lines.append(f"  {name:<10} {sum(part):7.0f} s in {len(part):4d} tests ({share:.0f}%)")
    for nodeid, _, cpu in sorted(costs, key=lambda c: -c[2])[:top]:
        lines.append(f"{cpu:8.2f}s {nodeid}")
    return lines
