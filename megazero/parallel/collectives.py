"""Every collective megazero issues goes through here, so its bytes can be counted.

The ledger counts what one rank *sends* per call, with the ring algorithms'
standard accounting (N ranks in the group, B bytes of the full tensor):

    all_reduce       2 (N-1)/N * B      (reduce-scatter + all-gather)
    reduce_scatter     (N-1)/N * B      (B = the full input)
    all_gather         (N-1)/N * B      (B = the full output)
    broadcast          B on the source rank (counted as (N-1)/N * B per rank, ring-pipelined)
    send               B

keyed by (kind, axis), where the axis is the name ParallelState gave the
group ("tp", "dp", "pp", "mp", "emb"). ZeRO's claim that stages 1 and 2 move
as many bytes as DDP's all-reduce is checked against these numbers.

With ``timing`` on (``--log-timers``) it also adds up, per axis, the seconds
this rank spent blocked in collectives: the whole call for blocking ones,
and the ``wait()`` for asynchronous ones (time a collective spends overlapped
with compute is not blocked time, and is not counted). On CPU that is host
time (perf_counter). On CUDA a NCCL call returns once it is enqueued, so host
time would measure nothing: there two CUDA events on the current stream time
how long the compute stream stalls for the collective, read at ``take``.

The ledger is process-wide measurement state, like torch's profiler: it
records nothing unless enabled, and the trainer reads and resets it per step.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Iterator

import torch
import torch.distributed as dist


class CommLedger:
    def __init__(self) -> None:
        self.enabled = False
        self.timing = False
        self.wait_s: dict[str, float] = defaultdict(float)
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.axis_names: dict[int, str] = {}
        self.pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # CUDA spans not read yet

    def name_group(self, group, name: str) -> None:
        if group is not None:
            self.axis_names[id(group)] = name

    def axis(self, group) -> str:
        return self.axis_names.get(id(group), "world" if group is None else "other")

    def add(self, kind: str, group, nbytes: float) -> None:
        if self.enabled:
            key = (kind, self.axis(group))
            self.bytes[key] += int(round(nbytes))
            self.calls[key] += 1

    def take(self) -> dict[str, int]:
        """Bytes sent since the last call, as {"kind/axis": bytes}; resets the counts."""
        out = {f"{k}/{a}": v for (k, a), v in sorted(self.bytes.items())}
        self.bytes.clear()
        self.calls.clear()
        return out

    @contextlib.contextmanager
    def blocked(self, axis: str, device: torch.device) -> Iterator[None]:
        """Charge the time spent inside the block to ``axis`` (device time on CUDA, see above)."""
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.pending.append((axis, start, end))
            return
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.wait_s[axis] += time.perf_counter() - begin

    def take_wait_seconds(self) -> dict[str, float]:
        """Seconds blocked in collectives per axis since the last call; resets them."""
        for axis, start, end in self.pending:  # waits for those events: at most once per logged step
            end.synchronize()
            self.wait_s[axis] += start.elapsed_time(end) / 1000
        self.pending.clear()
        out = dict(sorted(self.wait_s.items()))
        self.wait_s.clear()
        return out


LEDGER = CommLedger()


class _TimedWork:
    """An async collective's handle whose ``wait()`` adds the blocked time to the ledger."""

    def __init__(self, work, axis: str, device: torch.device) -> None:
        self.work, self.axis, self.device = work, axis, device

    def wait(self, *args):
        with LEDGER.blocked(self.axis, self.device):
            return self.work.wait(*args)

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _timed(group, call, async_op: bool, device: torch.device):
    """Run a collective; with timing on, charge its blocked time to the group's axis."""
    if not LEDGER.timing:
        return call()
    axis = LEDGER.axis(group)
    if async_op:
        return _TimedWork(call(), axis, device)
    with LEDGER.blocked(axis, device):
        return call()


# newer torch renamed the flat-tensor collectives (the old names warn); older torch has only the old ones
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _size(group) -> int:
    return dist.get_world_size(group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    n = _size(group)
    LEDGER.add("all_reduce", group, 2 * (n - 1) / n * _nbytes(t))
    return _timed(group, lambda: dist.all_reduce(t, op=op, group=group, async_op=async_op), async_op, t.device)


def all_gather_into_tensor(out: torch.Tensor, t: torch.Tensor, group, async_op: bool = False):
    n = _size(group)
    LEDGER.add("all_gather", group, (n - 1) / n * _nbytes(out))
    return _timed(group, lambda: _ALL_GATHER(out, t, group=group, async_op=async_op), async_op, t.device)


def reduce_scatter_tensor(out: torch.Tensor, t: torch.Tensor, group, op=dist.ReduceOp.SUM,
                          async_op: bool = False):
    n = _size(group)
    LEDGER.add("reduce_scatter", group, (n - 1) / n * _nbytes(t))
    return _timed(group, lambda: _REDUCE_SCATTER(out, t, op=op, group=group, async_op=async_op), async_op, t.device)


def broadcast(t: torch.Tensor, src: int, group, async_op: bool = False):
    n = _size(group)
    LEDGER.add("broadcast", group, (n - 1) / n * _nbytes(t))
    return _timed(group, lambda: dist.broadcast(t, src=src, group=group, async_op=async_op), async_op, t.device)


def batch_isend_irecv(ops: list[dist.P2POp], group) -> list:
    """Point-to-point ops issued together; counts the bytes of the sends."""
    for op in ops:
        if op.op in (dist.isend, dist.send):
            LEDGER.add("send", group, _nbytes(op.tensor))
    works = dist.batch_isend_irecv(ops)
    if not LEDGER.timing:
        return works
    return [_TimedWork(w, LEDGER.axis(group), op.tensor.device) for w, op in zip(works, ops)]


def all_gather_object(obj, group=None) -> list:
    """Every rank's picklable ``obj`` (start-up metadata such as memory records), in rank order."""
    import pickle

    n = _size(group)
    LEDGER.add("all_gather_object", group, (n - 1) * len(pickle.dumps(obj)))
    out: list = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out
