"""What starting a test's processes costs: a spawned gloo world, a forked script, a fresh interpreter.

The figures behind two decisions of the test suite (issue 41), measured the way the suite starts them:

- a world of N ranks from the test forkserver (``tests/helpers/dist.py::spawn``) running a function that
  returns at once: its wall time and each rank's CPU. This is all that a persistent pool of worlds (PyTorch's
  ``MultiProcContinuousTest`` style) could save per world, so it bounds that design's gain;
- one small gloo all-reduce in such a world: each rank's CPU per collective (its gloo threads included), the
  price of every TP/DP/CP/EP collective a parity test's training issues;
- ``pretrain_gpt.py --help`` as a forked child of the forkserver (``tests/helpers/forked_ranks.py``) and as a
  fresh interpreter (``subprocess``): the interpreter start and imports a forked child does not pay.

Usage: ``.venv/bin/python -m bench.bench_test_worlds [--repeats 5]``. CPU-seconds are steadier than wall time
on a shared machine; both are medians over the repeats.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

from tests.helpers.cpu_meter import forkserver_cpu
from tests.helpers.dist import spawn
from tests.helpers.forked_ranks import run_forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "pretrain_gpt.py")


def _own_cpu(pstate) -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def world_start(ranks: int) -> tuple[float, float]:
    """(wall s, CPU s per rank) of one empty world."""
    start = time.perf_counter()
    cpu = spawn(_own_cpu, ranks)
    return time.perf_counter() - start, statistics.mean(cpu)


def _all_reduce_cpu(pstate, ops: int) -> float:
    """CPU-seconds of this rank (all its threads) per all-reduce of 16 fp32 over the world."""
    import torch
    import torch.distributed as dist

    x = torch.ones(16)
    for _ in range(20):  # connections made, buffers allocated
        dist.all_reduce(x)
    dist.barrier()
    start = time.process_time()
    for _ in range(ops):
        dist.all_reduce(x)
    return (time.process_time() - start) / ops


def all_reduce_cost(ranks: int, ops: int = 500) -> tuple[float, float]:
    """(wall s, CPU s per rank) of one small all-reduce in a world of ``ranks``."""
    start = time.perf_counter()
    cpu = spawn(_all_reduce_cpu, ranks, ops)
    return (time.perf_counter() - start) / ops, statistics.mean(cpu)


def forked_help() -> tuple[float, float]:
    """(wall s, CPU s) of ``pretrain_gpt.py --help`` forked from the forkserver (its CPU as the forkserver reaps
    it: ``tests/helpers/cpu_meter.py``)."""
    before = forkserver_cpu()
    start = time.perf_counter()
    (status, _, err), = run_forked(SCRIPT, [{**os.environ, "PYTHONPATH": ROOT}], ["--help"], ROOT, 120)
    wall = time.perf_counter() - start
    assert status == 0, err
    deadline = time.monotonic() + 2
    while forkserver_cpu() == before and time.monotonic() < deadline:  # reaped a moment after it exits
        time.sleep(0.01)
    return wall, forkserver_cpu() - before


def fresh_help() -> tuple[float, float]:
    """(wall s, CPU s) of ``python pretrain_gpt.py --help`` in a new interpreter."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, SCRIPT, "--help"], check=True, capture_output=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter() - start, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    world_start(2)  # the forkserver starts (imports torch, megazero) outside the measurement
    rows = [(f"spawn world, {n} ranks", lambda n=n: world_start(n)) for n in (2, 4, 8)]
    rows += [(f"one all-reduce of 16 fp32, {n} ranks", lambda n=n: all_reduce_cost(n)) for n in (2, 4)]
    rows += [("pretrain_gpt.py --help, forked", forked_help), ("pretrain_gpt.py --help, fresh", fresh_help)]
    print("| what | wall s | CPU s (per rank for a world or an all-reduce) |\n|---|---|---|")
    for name, measure in rows:
        walls, cpus = zip(*(measure() for _ in range(args.repeats)))
        cpu = statistics.median(cpus)
        print(f"| {name} | {statistics.median(walls):.4f} | {'-' if cpu != cpu else f'{cpu:.4f}'} |")


if __name__ == "__main__":
    main()
