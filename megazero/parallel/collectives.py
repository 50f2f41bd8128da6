"""Every collective megazero issues goes through here, so its bytes can be counted.

A group is a ``torch.distributed`` process group or ``None``, and ``None``
only ever means "nothing to do": the group of one rank, where a reduction is
the identity and a gather a copy. A world-wide collective names the world
group (``ParallelState.world_group``) like any other; nothing here falls back
to the default group.

Each ``ParallelState`` owns a ``CommLedger`` and names its groups in it
(``"tp"``, ``"dp"``, ``"pp"``, ``"mp"``, ``"emb"``, ``"world"``), so two
worlds in one process never share counts and call sites pass only the group.
The ledger counts what one rank *sends* per call, with the ring algorithms'
standard accounting (N ranks in the group, B bytes of the full tensor):

    all_reduce       2 (N-1)/N * B      (reduce-scatter + all-gather)
    reduce_scatter     (N-1)/N * B      (B = the full input)
    all_gather         (N-1)/N * B      (B = the full output)
    broadcast          B on the source rank (counted as (N-1)/N * B per rank, ring-pipelined)
    all_to_all         (N-1)/N * B      (B = the input; the block a rank keeps is not sent)
    send               B

keyed by (kind, axis); ZeRO 3's parameter gathers are kinds of their own
(``all_gather.forward``, ``all_gather.backward``, ``all_gather.checkpoint``). ZeRO's claim that stages 1 and 2
move as many bytes as DDP's all-reduce is checked against these numbers.

With ``timing`` on (``--log-timers``) it also adds up, per axis, the seconds
this rank spent blocked in collectives: the whole call for blocking ones,
and the ``wait()`` for asynchronous ones (time a collective spends overlapped
with compute is not blocked time, and is not counted). On CPU that is host
time (perf_counter). On CUDA a NCCL call returns once it is enqueued, so host
time would measure nothing: there two CUDA events on the current stream time
how long the compute stream stalls for the collective (``timer.DeviceTimer``
does both), read at ``take_wait_seconds``.
"""
from __future__ import annotations

import contextlib
import pickle
import weakref
from collections import defaultdict
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from .timer import DeviceTimer

Group = Optional[dist.ProcessGroup]  # None: a group of one rank, nothing to do


class CommLedger:
    """Bytes and blocked seconds of one ``ParallelState``'s collectives; records nothing unless enabled."""

    def __init__(self) -> None:
        self.enabled = False
        self.timing = False
        self.wait_s: dict[str, float] = defaultdict(float)
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.pending: list[tuple[str, DeviceTimer]] = []  # spans not read yet

    def name_group(self, group: Group, name: str) -> None:
        """Charge ``group``'s collectives to this ledger under axis ``name``."""
        if group is not None:
            _OWNER[group] = (self, name)

    def add(self, kind: str, axis: str, nbytes: float) -> None:
        if self.enabled:
            key = (kind, axis)
            self.bytes[key] += int(round(nbytes))
            self.calls[key] += 1

    @classmethod
    def keep_out_of_compile(cls) -> None:
        """Run ``add`` as is under --compile (traced, its counts became guards and each step recompiled).

        Called before a block is compiled, not at import: ``torch.compiler.disable`` imports
        torch._dynamo (~1.5 CPU-s per process), which a run without --compile never needs.
        """
        if not getattr(cls.add, "_kept_eager", False):
            cls.add = torch.compiler.disable(cls.add)  # type: ignore[method-assign]
            cls.add._kept_eager = True  # type: ignore[attr-defined]

    def take(self) -> dict[str, int]:
        """Bytes sent since the last call, as {"kind/axis": bytes}; resets the counts."""
        out = {f"{k}/{a}": v for (k, a), v in sorted(self.bytes.items())}
        self.bytes.clear()
        self.calls.clear()
        return out

    @contextlib.contextmanager
    def blocked(self, axis: str, device: torch.device) -> Iterator[None]:
        """Charge the time spent inside the block to ``axis`` (device time on CUDA, see above)."""
        timer = DeviceTimer(device).start()
        try:
            yield
        finally:
            self.pending.append((axis, timer.stop()))  # read at take_wait_seconds: no sync per collective

    def take_wait_seconds(self) -> dict[str, float]:
        """Seconds blocked in collectives per axis since the last call; resets them."""
        for axis, timer in self.pending:  # on CUDA waits for those events: at most once per logged step
            self.wait_s[axis] += timer.seconds()
        self.pending.clear()
        out = dict(sorted(self.wait_s.items()))
        self.wait_s.clear()
        return out


# group -> (its owner's ledger, axis name): a lookup, not counts; entries go with their groups
_OWNER: "weakref.WeakKeyDictionary[dist.ProcessGroup, tuple[CommLedger, str]]" = weakref.WeakKeyDictionary()
_UNOWNED = CommLedger()  # groups no ParallelState named (a test's own group): never enabled, never counted


def _owner(group: dist.ProcessGroup) -> tuple[CommLedger, str]:
    return _OWNER.get(group, (_UNOWNED, "other"))


class _Done:
    """The handle of an asynchronous collective on ``None``: there was nothing to wait for."""

    def wait(self, *args) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _TimedWork:
    """An async collective's handle whose ``wait()`` adds the blocked time to the ledger."""

    def __init__(self, work, ledger: CommLedger, axis: str, device: torch.device) -> None:
        self.work, self.ledger, self.axis, self.device = work, ledger, axis, device

    def wait(self, *args):
        with self.ledger.blocked(self.axis, self.device):
            return self.work.wait(*args)

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _issue(kind: str, group: dist.ProcessGroup, nbytes: float, call: Callable[[], Any], async_op: bool,
           device: torch.device):
    """Count a collective on its group's ledger and run it; with timing on, charge its blocked time."""
    ledger, axis = _owner(group)
    ledger.add(kind, axis, nbytes)
    if not ledger.timing:
        return call()
    if async_op:
        return _TimedWork(call(), ledger, axis, device)
    with ledger.blocked(axis, device):
        return call()


def _nothing(async_op: bool) -> _Done | None:
    return _Done() if async_op else None


def _copy(out: torch.Tensor, t: torch.Tensor) -> None:
    """The gather or scatter of one rank: ``out`` is ``t``."""
    if out.data_ptr() != t.data_ptr():
        out.copy_(t)


# newer torch renamed the flat-tensor collectives (the old names warn); older torch has only the old ones
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(t: torch.Tensor, group: Group, op=dist.ReduceOp.SUM, async_op: bool = False):
    if group is None:
        return _nothing(async_op)
    n = dist.get_world_size(group)
    return _issue("all_reduce", group, 2 * (n - 1) / n * _nbytes(t),
                  lambda: dist.all_reduce(t, op=op, group=group, async_op=async_op), async_op, t.device)


def all_gather_into_tensor(out: torch.Tensor, t: torch.Tensor, group: Group, async_op: bool = False,
                           phase: str | None = None):
    """``phase`` (e.g. ZeRO 3's "forward"/"backward") is counted apart: ``all_gather.<phase>``."""
    if group is None:
        _copy(out, t)
        return _nothing(async_op)
    n = dist.get_world_size(group)
    return _issue("all_gather" if phase is None else f"all_gather.{phase}", group, (n - 1) / n * _nbytes(out),
                  lambda: _ALL_GATHER(out, t, group=group, async_op=async_op), async_op, t.device)


def reduce_scatter_tensor(out: torch.Tensor, t: torch.Tensor, group: Group, op=dist.ReduceOp.SUM,
                          async_op: bool = False):
    if group is None:
        _copy(out, t)
        return _nothing(async_op)
    n = dist.get_world_size(group)
    return _issue("reduce_scatter", group, (n - 1) / n * _nbytes(t),
                  lambda: _REDUCE_SCATTER(out, t, op=op, group=group, async_op=async_op), async_op, t.device)


def broadcast(t: torch.Tensor, src: int, group: Group, async_op: bool = False):
    """``src`` is a global rank, as in ``torch.distributed``."""
    if group is None:
        return _nothing(async_op)
    n = dist.get_world_size(group)
    return _issue("broadcast", group, (n - 1) / n * _nbytes(t),
                  lambda: dist.broadcast(t, src=src, group=group, async_op=async_op), async_op, t.device)


def all_to_all_single(out: torch.Tensor, t: torch.Tensor, group: Group, async_op: bool = False,
                      out_splits: list[int] | None = None, in_splits: list[int] | None = None):
    """Block i of ``t`` (along dim 0: equal blocks, or ``in_splits[i]`` rows) goes to group rank i; ``out`` gets
    block j from rank j (``out_splits[j]`` rows). The block a rank keeps is not counted as sent."""
    if group is None:
        _copy(out, t)
        return _nothing(async_op)
    n = dist.get_world_size(group)
    row_bytes = _nbytes(t) // t.shape[0] if t.shape[0] else 0
    kept = t.shape[0] // n if in_splits is None else in_splits[dist.get_rank(group)]
    return _issue("all_to_all", group, _nbytes(t) - kept * row_bytes,
                  lambda: dist.all_to_all_single(out, t, out_splits, in_splits, group=group, async_op=async_op),
                  async_op, t.device)


def batch_isend_irecv(ops: list[dist.P2POp], group: Group, phase: str | None = None) -> list:
    """Point-to-point ops issued together; counts the bytes of the sends (``phase``: as ``send.<phase>``)."""
    assert group is not None or not ops, "point-to-point ops need the group of their peers"
    if not ops:
        return []
    ledger, axis = _owner(group)
    for op in ops:
        if op.op in (dist.isend, dist.send):
            ledger.add("send" if phase is None else f"send.{phase}", axis, _nbytes(op.tensor))
    works = dist.batch_isend_irecv(ops)
    if not ledger.timing:
        return works
    return [_TimedWork(w, ledger, axis, op.tensor.device) for w, op in zip(works, ops)]


def all_gather_object(obj: Any, group: Group) -> list:
    """Every rank's picklable ``obj`` (start-up metadata such as memory records), in group rank order."""
    if group is None:
        return [obj]
    n = dist.get_world_size(group)
    ledger, axis = _owner(group)
    ledger.add("all_gather_object", axis, (n - 1) * len(pickle.dumps(obj)))
    out: list = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int, group: Group) -> Any:
    """Global rank ``src``'s picklable ``obj`` on every rank of ``group`` (pass anything elsewhere)."""
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(group: Group) -> None:
    """Wait until every rank of ``group`` gets here."""
    if group is not None:
        dist.barrier(group=group)


def all_reduce_coalesced(tensors: list[torch.Tensor], group: Group) -> None:
    """Sum ``tensors`` over ``group`` in one collective (one flat copy instead of one call each)."""
    if group is None or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat, group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()
