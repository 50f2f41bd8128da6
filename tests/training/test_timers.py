"""--log-timers: blocked time in collectives and the pipeline timeline measure the work, not its launch.

On CPU (gloo) the ledger's host timing is checked against the test's own
perf_counter around the same call. On CUDA a kernel launch returns at once, so
the CUDA-marked tests compare with CUDA events the test records itself
around the same device work.
"""
from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from megazero.parallel import collectives as C
from megazero.pipeline.timeline import Timeline
from tests.helpers.dist import spawn


def _timed_collectives(pstate):
    """Rank 1 joins each collective late; the ledger charges each wait to the 'tp' axis, inside the call."""
    pstate.ledger.enabled, pstate.ledger.timing = True, True
    pstate.ledger.take_wait_seconds()
    x = torch.ones(1000)
    dist.barrier()
    if pstate.tp_rank == 1:
        time.sleep(0.3)
    begin = time.perf_counter()
    C.all_reduce(x, pstate.tp_group)  # blocking
    sync_outer = time.perf_counter() - begin
    sync_ledger = pstate.ledger.take_wait_seconds()
    work = C.all_reduce(x, pstate.tp_group, async_op=True)
    if pstate.tp_rank == 1:
        time.sleep(0.3)
    begin = time.perf_counter()
    work.wait()
    async_outer = time.perf_counter() - begin
    async_ledger = pstate.ledger.take_wait_seconds()
    pstate.ledger.timing = False
    C.all_reduce(x, pstate.tp_group)
    off = pstate.ledger.take_wait_seconds()
    return sync_outer, sync_ledger, async_outer, async_ledger, off, x[0].item()


def test_ledger_times_blocking_and_async_waits_on_cpu():
    results = spawn(_timed_collectives, 2, tp=2)
    for sync_outer, sync_ledger, async_outer, async_ledger, off, value in results:
        assert value == 8.0  # all three all-reduces really ran (1 -> 2 -> 4 -> 8)
        assert set(sync_ledger) == {"tp"} and 0 < sync_ledger["tp"] <= sync_outer
        assert set(async_ledger) == {"tp"} and 0 < async_ledger["tp"] <= async_outer
        assert off == {}  # timing off: nothing charged


def test_timeline_host_spans_on_cpu():
    line = Timeline(rank=0, cuda=False)
    line.begin_step()
    with line.span("F", 0, 0):
        torch.randn(200, 200) @ torch.randn(200, 200)
    line.end_step()
    start, end, spans = line.last
    assert len(spans) == 1 and start <= spans[0].start <= spans[0].end <= end
    assert 0.0 <= line.last_bubble_fraction() < 1.0


def _device_work(x: torch.Tensor, n: int = 40) -> torch.Tensor:
    for _ in range(n):
        x = torch.tanh(x @ x)
    return x


@pytest.mark.cuda  # skipped without a GPU (tests/conftest.py)
def test_timeline_spans_cover_the_device_work():
    """A span around queued kernels lasts as long as the kernels do (CUDA events), not their launch."""
    x = torch.randn(4096, 4096, device="cuda") / 64
    _device_work(x, 2)
    torch.cuda.synchronize()
    line = Timeline(rank=0)
    line.begin_step()
    with line.span("F", 0, 0):
        reference = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        reference[0].record()
        _device_work(x)
        reference[1].record()
    line.end_step()
    work_s = reference[0].elapsed_time(reference[1]) / 1000
    span = line.last[2][0]
    assert line.cuda and span.end - span.start >= 0.9 * work_s
    assert line.last[1] >= span.end


@pytest.mark.cuda  # skipped without a GPU (tests/conftest.py)
def test_ledger_charges_the_stream_stall_of_an_async_nccl_wait():
    """An all-reduce queued behind long work on a side stream: wait() returns at once on the host, but
    the compute stream stalls until the collective is done; the ledger reports that stall."""
    init = tempfile.mktemp()
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=0, world_size=1)
    try:
        world, ledger = dist.group.WORLD, C.CommLedger()
        ledger.name_group(world, "world")
        ledger.enabled, ledger.timing = True, True
        ledger.take_wait_seconds()
        x = torch.randn(4096, 4096, device="cuda") / 64
        C.all_reduce(x, world)  # warm up the communicator
        torch.cuda.synchronize()
        ledger.take_wait_seconds()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            y = _device_work(x)
            end.record()
            work = C.all_reduce(y, world, async_op=True)
        work.wait()  # the default stream now waits for the all-reduce, hence for the side work
        waited = ledger.take_wait_seconds()["world"]
        work_s = begin.elapsed_time(end) / 1000
        assert waited >= 0.5 * work_s, (waited, work_s)
    finally:
        dist.destroy_process_group()
        if os.path.exists(init):
            os.remove(init)
