"""Where the optimizer state lives: on the device, in host memory, or in a file on disk.

The step (``zero.py``) visits every bucket of every buffer in one fixed order and
asks the store for that bucket's fp32 state - views ``(master, exp_avg,
exp_avg_sq)`` of its shard, or of a piece [lo, lo + n) of it - through ``sweep()``,
a generator of ``(bucket index, lo, views)``. The three stores give the same views, so AdamW runs
the same kernel, on the same numbers, in the same order, and an offloaded run is
bitwise the in-memory one on a CPU-only machine (where host = device):

    DeviceStore  the existing ``ShardedAdamState`` per buffer (fp32 runs: the
                 parameter shard itself is the master copy)
    HostStore    master + moments in host memory (pinned on CUDA), the master a
                 separate copy so the parameter shard stays where the params live
                 (ZeRO-Offload)
    DiskStore    master + moments in one file per rank, laid out per piece as
                 [master | exp_avg | exp_avg_sq]; a sweep streams pieces through
                 K preallocated host buffers of ``--offload-buffer-size`` shard elements,
                 with read-ahead of the next piece and write-behind of the last
                 (ZeRO-Infinity's NVMe tier). A piece is a whole bucket shard, or a
                 part of one that does not fit a buffer (``pieces.py``: cut so the
                 update stays bitwise), so the host memory does not grow with buckets.

With ``--optimizer muon`` a store keeps a second moment only for the AdamW-trained elements (``kept``: per
bucket, its shard's AdamW ranges; ``pieces.kept_in``): the views' ``exp_avg_sq`` is then that compact tensor
(the piece's AdamW elements back to back), and a disk piece is [master | exp_avg | its AdamW elements'
exp_avg_sq]. Without ``kept`` every store is exactly AdamW's.

On CUDA, ``HostTransfers`` moves the gradients and parameters between the device
and the host on side streams so the copies overlap compute; on a CPU-only
machine it is not built and the step reads the shards in place.

The disk store reads and writes into its own buffers through a ``RankFile``
(``data_parallel/rank_file.py``: blocks reserved up front, ``preadv``/``pwritev``
loops, never ``mmap``, the ``--offload-path`` error), the layer the ZeRO-3
parameter-shard store uses too. The files are a working set, not a checkpoint: checkpoints still go through
``state_segments`` into the sharded safetensors format.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

import torch

from ..config import Placement
from ..data_parallel.host_transfers import disk_buffer_width, host_empty
from ..data_parallel.rank_file import OffloadError, RankFile
from ..run_plan import StatePlacement
from .adam import ShardedAdamState
from .pieces import Ranges, Runs, kept_in, piece_bounds

Views = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (master, exp_avg, exp_avg_sq), each [shard_numel] fp32
KINDS = 3  # tensors of state per bucket, in file order
DEFAULT_BUFFER_SIZE = 2_000_000  # shard elements per disk-tier host buffer (--offload-buffer-size): 24 MB of state


class ShardOnDemand:
    """A bucket's parameter shard that is read only when a store copies it (``read``).

    With ``--offload-params disk`` the shards live in a file: reading them all before the store is
    built would hold the whole model in host memory at start-up (a model's worth on top of the
    grad shards; at 2.85B parameters that was the run's 22.8 GB peak).
    """

    def __init__(self, numel: int, read) -> None:
        self._numel, self.read = numel, read

    def numel(self) -> int:
        return self._numel


def _read(t) -> torch.Tensor:
    return t.read() if isinstance(t, ShardOnDemand) else t


class DeviceStore:
    """The in-memory state: one ``ShardedAdamState`` per buffer, as without offload."""

    placement = Placement.DEVICE

    def __init__(self, shards: list[list[torch.Tensor]], kept: list[Ranges | None] | None = None) -> None:
        kept = kept or [None] * sum(len(s) for s in shards)
        at = [sum(len(s) for s in shards[:j]) for j in range(len(shards))]
        self.states = [ShardedAdamState(s, kept[a:a + len(s)]) for a, s in zip(at, shards)]
        self.separate_master = any(s.separate_master for s in self.states)
        self._views = [v for state in self.states for v in state.views]

    def sweep(self, whole: bool = False) -> Iterator[tuple[int, int, Views]]:
        """``(bucket, 0, views of its whole shard)`` per bucket (the disk store also yields pieces)."""
        for i, views in enumerate(self._views):
            yield i, 0, views

    def tensors(self) -> list[torch.Tensor]:
        """Device-resident tensors (for memory accounting)."""
        return [t for state in self.states for t in state.tensors()]

    def host_bytes(self) -> int:
        return 0

    def disk_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class HostStore(DeviceStore):
    """Master + moments in host memory, pinned on CUDA so copies to and from the device are asynchronous."""

    placement = Placement.HOST

    def __init__(self, shards: list[list[torch.Tensor]], kept: list[Ranges | None] | None = None) -> None:
        flat = [t for s in shards for t in s]
        kept = kept or [None] * len(flat)
        total = sum(t.numel() for t in flat)
        sq_numels = [kept_in(k, 0, t.numel()) for k, t in zip(kept, flat)]
        self.separate_master = True  # the parameter shard stays on the device; the master is a copy here
        self.data = host_empty(2 * total + sum(sq_numels))
        self.data.zero_()
        master, self.exp_avg, self.exp_avg_sq = self.data.split([total, total, sum(sq_numels)])
        self._views, offset, sq = [], 0, 0
        for t, n_sq in zip(flat, sq_numels):
            sl = slice(offset, offset + t.numel())
            master[sl].copy_(_read(t))  # fp32 masters start as the (compute-dtype) parameters upcast
            self._views.append((master[sl], self.exp_avg[sl], self.exp_avg_sq[sq:sq + n_sq]))
            offset, sq = offset + t.numel(), sq + n_sq

    def tensors(self) -> list[torch.Tensor]:
        return []

    def host_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class DiskStore:
    """Master + moments in ``DIR/rank{r}/optimizer_state.bin``, streamed through ``buffers`` host buffers of
    ``buffer_size`` shard elements each: a bucket's shard larger than that goes through in pieces
    (``pieces.piece_bounds``), so the host holds K x 12 x ``buffer_size`` bytes whatever the bucket size."""

    placement = Placement.DISK

    def __init__(self, shards: list[list[torch.Tensor]], folder: str, rank: int, buffers: int,
                 buffer_size: int = DEFAULT_BUFFER_SIZE, runs: list[Runs] | None = None,
                 kept: list[Ranges | None] | None = None) -> None:
        assert buffers >= 2, "one buffer is computed while the next is read ahead"
        self.folder, self.separate_master = folder, True
        self.numels = [t.numel() for s in shards for t in s]
        runs = runs or [None] * len(self.numels)
        self.kept = kept or [None] * len(self.numels)
        # (bucket, lo, hi) in sweep order; a piece is one [master | exp_avg | exp_avg_sq] region of the file
        self.pieces = [(i, lo, hi) for i, n in enumerate(self.numels)
                       for lo, hi in piece_bounds(n, runs[i], buffer_size)]
        self.sq = [kept_in(self.kept[i], lo, hi) for i, lo, hi in self.pieces]  # each piece's exp_avg_sq elements
        self.offsets = [0]
        for p in range(len(self.pieces)):
            self.offsets.append(self.offsets[-1] + self._span(p) * 4)
        # shard elements per buffer, and K buffers unless one piece is all there is: what the planner
        # predicts from the shard sizes alone (memory/offload.py), whatever the cuts
        self.width = disk_buffer_width(self.numels, buffer_size)
        self.by_bucket: list[list[int]] = [[] for _ in self.numels]
        for p, (i, _, _) in enumerate(self.pieces):
            self.by_bucket[i].append(p)
        # the only state this rank holds in memory
        self.pool = [host_empty(KINDS * self.width) for _ in range(buffers if len(self.pieces) > 1 else 1)]
        self.file = RankFile(folder, rank, "optimizer_state.bin", self.offsets[-1], what="the optimizer state")
        self.io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="offload-io")
        try:
            self._write_initial([t for s in shards for t in s])
        except OSError as err:
            self.close()
            raise self.error(err, "writing the initial optimizer state") from err

    @property
    def path(self) -> str:
        return self.file.path

    def error(self, err: OSError, doing: str) -> OffloadError:
        """One line naming the flag, the folder, what failed and the fix."""
        return self.file.error(err, doing)

    def _write_initial(self, flat: list[torch.Tensor]) -> None:
        """Masters = the parameters upcast, moments = 0, piece by piece through the first buffer: no fp32
        copy of a whole bucket's state is ever built (a ``ShardOnDemand`` shard is read once per bucket)."""
        buf = self.pool[0]
        for i, t in enumerate(flat):
            src = _read(t)
            for p in self.by_bucket[i]:
                n = self._len(p)
                buf[n:self._span(p)].zero_()
                buf[:n].copy_(src[self.pieces[p][1]:self.pieces[p][2]])
                self._pwrite(p, [buf[:self._span(p)]])

    def _len(self, p: int) -> int:
        return self.pieces[p][2] - self.pieces[p][1]

    def _span(self, p: int) -> int:
        """Piece ``p``'s state elements: master and exp_avg of each element, exp_avg_sq of the kept ones."""
        return 2 * self._len(p) + self.sq[p]

    def _pwrite(self, p: int, spans: list[torch.Tensor]) -> None:
        """Write ``spans`` (fp32, back to back) to piece ``p``'s region of the file."""
        offset = self.offsets[p]
        for t in spans:
            offset += self.file.write(offset, t)

    def _pread(self, p: int, spans: list[torch.Tensor]) -> None:
        """Fill ``spans`` (fp32, back to back) from piece ``p``'s region of the file."""
        offset = self.offsets[p]
        for t in spans:
            offset += self.file.read(offset, t)

    def _views(self, p: int, buf: torch.Tensor) -> Views:
        n = self._len(p)
        return buf[:n], buf[n:2 * n], buf[2 * n:self._span(p)]

    def sweep(self, whole: bool = False) -> Iterator[tuple[int, int, Views]]:
        """Every piece's state in order, as ``(bucket, lo, views of shard [lo, lo + n))``; what the caller
        writes into the views reaches the file. ``whole``: one view per bucket (``_sweep_whole``).

        Buffers cycle free -> reading -> in the caller's hands -> writing -> free; a read-ahead
        takes a free buffer, or waits for the oldest write-behind to finish, so no more than K
        pieces' state is ever in memory.
        """
        if whole:
            yield from self._sweep_whole()
            return
        free, reads, writes = deque(self.pool), deque(), deque()

        def take() -> torch.Tensor:
            if not free:
                fut, buf, doing = writes.popleft()
                self._finish(fut, doing)
                free.append(buf)
            return free.popleft()

        def read(p: int) -> None:
            buf = take()
            reads.append((p, buf, self.io.submit(self._pread, p, [buf[:self._span(p)]])))

        try:
            if self.pieces:
                read(0)
            for p, (i, lo, _) in enumerate(self.pieces):
                _, buf, fut = reads.popleft()
                if p + 1 < len(self.pieces):
                    read(p + 1)
                self._finish(fut, "reading the optimizer state")
                yield i, lo, self._views(p, buf)
                span = [buf[:self._span(p)]]
                writes.append((self.io.submit(self._pwrite, p, span), buf, "writing the optimizer state"))
        finally:
            for fut, _, doing in list(writes) + [(f, None, "reading the optimizer state") for _, _, f in reads]:
                self._finish(fut, doing)  # nothing is left in flight when the sweep ends (or is abandoned)

    def _sweep_whole(self) -> Iterator[tuple[int, int, Views]]:
        """One bucket at a time, whole, through a buffer that lives only for this sweep: for checkpoints,
        whose pieces are per parameter segment (a save copies every segment anyway)."""
        buf = torch.empty(KINDS * max(self.numels, default=0), dtype=torch.float32)
        for i, n in enumerate(self.numels):
            sq = kept_in(self.kept[i], 0, n)
            views = (buf[:n], buf[n:2 * n], buf[2 * n:2 * n + sq])
            for p in self.by_bucket[i]:
                self._blocking(self._pread, p, self._spans(p, views), "reading the optimizer state")
            yield i, 0, views
            for p in self.by_bucket[i]:
                self._blocking(self._pwrite, p, self._spans(p, views), "writing the optimizer state")

    def _spans(self, p: int, views: Views) -> list[torch.Tensor]:
        """Piece ``p``'s regions inside a whole bucket's ``views`` (master, exp_avg, compact exp_avg_sq)."""
        i, lo, hi = self.pieces[p]
        sq = kept_in(self.kept[i], 0, lo)
        return [views[0][lo:hi], views[1][lo:hi], views[2][sq:sq + self.sq[p]]]

    def _blocking(self, fn, p: int, spans: list[torch.Tensor], doing: str) -> None:
        try:
            fn(p, spans)
        except OSError as err:
            raise self.error(err, doing) from err

    def _finish(self, fut: Future, doing: str) -> None:
        """Wait for one transfer; a failed one becomes the flag-naming error."""
        try:
            fut.result()
        except OSError as err:
            raise self.error(err, doing) from err

    def tensors(self) -> list[torch.Tensor]:
        return []

    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.pool)

    def disk_bytes(self) -> int:
        return self.offsets[-1]

    def close(self) -> None:
        """Remove this rank's file (and its folder when empty); the user's --offload-path stays."""
        self.io.shutdown(wait=True)
        self.file.close()


def build_store(shards: list[list[torch.Tensor]], placement: StatePlacement, rank: int,
                runs: list[Runs] | None = None, kept: list[Ranges | None] | None = None):
    """The store for ``placement.optimizer_state``; ``shards``: per buffer, each bucket's parameter shard;
    ``runs``: each bucket's weight-decay runs in the same order (where the disk store may cut a shard);
    ``kept`` (Muon): each bucket's ranges that keep a second moment (None: all, AdamW)."""
    where = placement.optimizer_state
    if where == Placement.HOST:
        return HostStore(shards, kept)
    if where == Placement.DISK:
        assert placement.offload_path, "RunPlan.resolve requires --offload-path with disk"
        return DiskStore(shards, placement.offload_path, rank, placement.offload_buffers,
                         placement.offload_buffer_size, runs, kept)
    return DeviceStore(shards, kept)
