"""Where the optimizer state lives: on the device, in host memory, or in a file on disk.

The step (``zero.py``) visits every bucket of every buffer in one fixed order and
asks the store for that bucket's fp32 state - views ``(master, exp_avg,
exp_avg_sq)`` of its shard - through ``sweep()``, a generator of
``(bucket index, views)``. The three stores give the same views, so AdamW runs
the same kernel, on the same numbers, in the same order, and an offloaded run is
bitwise the in-memory one on a CPU-only machine (where host = device):

    DeviceStore  the existing ``ShardedAdamState`` per buffer (fp32 runs: the
                 parameter shard itself is the master copy)
    HostStore    master + moments in host memory (pinned on CUDA), the master a
                 separate copy so the parameter shard stays where the params live
                 (ZeRO-Offload)
    DiskStore    master + moments in one file per rank, laid out per bucket as
                 [master | exp_avg | exp_avg_sq]; a sweep streams buckets through
                 K preallocated host buffers with read-ahead of the next bucket and
                 write-behind of the last (ZeRO-Infinity's NVMe tier)

On CUDA, ``HostTransfers`` moves the gradients and parameters between the device
and the host on side streams so the copies overlap compute; on a CPU-only
machine it is not built and the step reads the shards in place.

The disk store reads and writes with ``os.preadv``/``os.pwritev`` into its own
buffers, never ``mmap``: mapped file pages would count in the process RSS the
offload is meant to shrink. The file's blocks are reserved up front
(``posix_fallocate``), so a full disk is reported at start-up, not mid-step.
The files are a working set, not a checkpoint: checkpoints still go through
``state_segments`` into the sharded safetensors format.
"""
from __future__ import annotations

import errno
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

import torch

from ..run_plan import Placement, StatePlacement
from .adam import ShardedAdamState

Views = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (master, exp_avg, exp_avg_sq), each [shard_numel] fp32
KINDS = 3  # tensors of state per bucket, in file order


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


class OffloadError(ValueError):
    """The offload folder cannot hold the optimizer state; the message names --offload-path and the fix."""


class DeviceStore:
    """The in-memory state: one ``ShardedAdamState`` per buffer, as without offload."""

    placement = Placement.DEVICE

    def __init__(self, shards: list[list[torch.Tensor]]) -> None:
        self.states = [ShardedAdamState(s) for s in shards]
        self.separate_master = any(s.separate_master for s in self.states)
        self._views = [v for state in self.states for v in state.views]

    def sweep(self) -> Iterator[tuple[int, Views]]:
        yield from enumerate(self._views)

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
    states: list = []

    def __init__(self, shards: list[list[torch.Tensor]]) -> None:
        flat = [t for s in shards for t in s]
        total = sum(t.numel() for t in flat)
        self.separate_master = True  # the parameter shard stays on the device; the master is a copy here
        self.data = _host_empty(KINDS * total)
        self.data.zero_()
        master, self.exp_avg, self.exp_avg_sq = self.data.split(total)
        self._views, offset = [], 0
        for t in flat:
            sl = slice(offset, offset + t.numel())
            master[sl].copy_(_read(t))  # fp32 masters start as the (compute-dtype) parameters upcast
            self._views.append((master[sl], self.exp_avg[sl], self.exp_avg_sq[sl]))
            offset += t.numel()

    def tensors(self) -> list[torch.Tensor]:
        return []

    def host_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class DiskStore:
    """Master + moments in ``DIR/rank{r}/optimizer_state.bin``, streamed through ``buffers`` host buffers."""

    placement = Placement.DISK
    states: list = []

    def __init__(self, shards: list[list[torch.Tensor]], folder: str, rank: int, buffers: int) -> None:
        assert buffers >= 2, "one buffer is computed while the next is read ahead"
        self.folder, self.separate_master = folder, True
        self.numels = [t.numel() for s in shards for t in s]
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + KINDS * n * 4)
        self.dir = os.path.join(folder, f"rank{rank}")
        self.path = os.path.join(self.dir, "optimizer_state.bin")
        width = KINDS * max(self.numels, default=0)
        # the only state this rank holds in memory: K buffers, or one per bucket when there are fewer
        self.pool = [_host_empty(width) for _ in range(max(1, min(buffers, len(self.numels))))]
        self.io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="offload-io")
        self.fd = -1
        try:
            os.makedirs(self.dir, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            if self.offsets[-1]:
                os.posix_fallocate(self.fd, 0, self.offsets[-1])
            self._write_initial([t for s in shards for t in s])
        except OSError as err:
            self.close()
            raise self.error(err, "creating the optimizer-state file") from err

    def error(self, err: OSError, doing: str) -> OffloadError:
        """One line naming the flag, the folder, what failed and the fix."""
        need = f"{self.offsets[-1] / 2**20:.1f} MiB per rank"
        fix = ("free space there or choose a folder on a larger disk" if err.errno in (errno.ENOSPC, errno.EDQUOT)
               else "choose a writable folder")
        return OffloadError(f"--offload-path {self.folder}: {doing} failed ({err.strerror or err}; the optimizer "
                            f"state needs {need}); {fix}.")

    def _write_initial(self, flat: list[torch.Tensor]) -> None:
        """Masters = the parameters upcast, moments = 0, bucket by bucket through the first buffer."""
        buf = self.pool[0]
        for i, t in enumerate(flat):
            n = t.numel()
            buf[:KINDS * n].zero_()
            buf[:n].copy_(_read(t))
            self._pwrite(i, buf)

    def _span(self, i: int, buf: torch.Tensor) -> memoryview:
        n = self.numels[i]
        return memoryview(buf[:KINDS * n].numpy()).cast("B")

    def _pwrite(self, i: int, buf: torch.Tensor) -> None:
        view, done = self._span(i, buf), 0
        while done < len(view):  # a short write is legal; ENOSPC/EIO raise OSError
            done += os.pwritev(self.fd, [view[done:]], self.offsets[i] + done)

    def _pread(self, i: int, buf: torch.Tensor) -> None:
        view, done = self._span(i, buf), 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], self.offsets[i] + done)
            if got == 0:
                raise OSError(errno.EIO, f"{self.path} is shorter than the optimizer state")
            done += got

    def _views(self, i: int, buf: torch.Tensor) -> Views:
        n = self.numels[i]
        return tuple(buf[k * n:(k + 1) * n] for k in range(KINDS))  # type: ignore[return-value]

    def sweep(self) -> Iterator[tuple[int, Views]]:
        """Every bucket's state in order; what the caller writes into the views reaches the file.

        Buffers cycle free -> reading -> in the caller's hands -> writing -> free; a read-ahead
        takes a free buffer, or waits for the oldest write-behind to finish, so no more than K
        buckets' state is ever in memory.
        """
        free, reads, writes = deque(self.pool), deque(), deque()

        def take() -> torch.Tensor:
            if not free:
                fut, buf, doing = writes.popleft()
                self._finish(fut, doing)
                free.append(buf)
            return free.popleft()

        def read(i: int) -> None:
            buf = take()
            reads.append((i, buf, self.io.submit(self._pread, i, buf)))

        try:
            if self.numels:
                read(0)
            for i in range(len(self.numels)):
                _, buf, fut = reads.popleft()
                if i + 1 < len(self.numels):
                    read(i + 1)
                self._finish(fut, "reading the optimizer state")
                yield i, self._views(i, buf)
                writes.append((self.io.submit(self._pwrite, i, buf), buf, "writing the optimizer state"))
        finally:
            for fut, _, doing in list(writes) + [(f, None, "reading the optimizer state") for _, _, f in reads]:
                self._finish(fut, doing)  # nothing is left in flight when the sweep ends (or is abandoned)

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
        if self.fd >= 0:
            close_rank_file(self.fd, self.path, self.dir)
            self.fd = -1


def close_rank_file(fd: int, path: str, folder: str) -> None:
    """Close and remove a rank's working file, and its folder once empty (the user's --offload-path stays)."""
    os.close(fd)
    os.remove(path)
    try:
        os.rmdir(folder)
    except OSError:
        pass  # another tier's file still lives there


class HostTransfers:
    """CUDA + an offloaded optimizer: the grad shards' trip to the host and the updated shards' trip back,
    on side streams, so neither stalls the step (ZeRO-Offload's overlap).

    Down: when a bucket's reduction for the step's last micro-batch retires (``GradSyncEngine._retire``)
    its grad shard is copied, non_blocking, into a pinned fp32 host buffer on the ``down`` stream while
    backward goes on; the step waits for that bucket's event only when it reaches the bucket
    (``host_grad``). A bucket whose shard is summed again after its DP reduction (sequence-parallel or
    tied-embedding segments) is copied after that sum, in ``finish_grads``.
    Up: each updated master shard is copied to the device parameter shard on the ``up`` stream while the
    host runs AdamW on the next bucket; ``params_sent`` then makes the compute stream wait for the copies
    on the GPU (the host never blocks), so the next all-gather or forward reads updated parameters. The
    disk tier reuses its host buffers, so its masters go up through a ring of ``RING`` pinned buffers
    whose slot is reused only after its copy's event.
    """

    RING = 2

    def __init__(self, buckets: list, persistent_master: bool) -> None:
        self.slot = {id(b): i for i, (_, b) in enumerate(buckets)}
        self.late = {id(b) for _, b in buckets if any(s.tp_sync or s.emb_sync for s in b.segments)}
        numels = [b.shard_numel for _, b in buckets]
        self.grads = _host_empty(sum(numels))
        self.views = list(self.grads.split(numels)) if numels else []
        self.down_events: dict[int, torch.cuda.Event] = {}
        self.down, self.up = torch.cuda.Stream(), torch.cuda.Stream()
        self.ring = [] if persistent_master else [_host_empty(max(numels, default=0)) for _ in range(self.RING)]
        self.ring_events: list[torch.cuda.Event | None] = [None] * len(self.ring)
        self.sent_up = 0

    def reset(self) -> None:
        """A new step: no bucket's grads are on their way yet (a skipped step left its events unread)."""
        self.down_events.clear()

    def grad_ready(self, b, shard: torch.Tensor, late_ok: bool = False) -> None:
        """Start copying bucket ``b``'s reduced grad shard to the host (after the compute stream's work on it)."""
        i = self.slot[id(b)]
        if i in self.down_events or (id(b) in self.late and not late_ok):
            return
        self.down.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.down):
            src = shard if shard.dtype == torch.float32 else shard.float()  # bf16 main grads: cast on the device
            self.views[i].copy_(src, non_blocking=True)
            self.down_events[i] = torch.cuda.Event()
            self.down_events[i].record(self.down)

    def finish_grads(self, buckets: list, shard_of) -> None:
        """After the replicated-grad sums: copy every bucket not yet on its way, then fence the compute
        stream behind the copies (the step unscales and clips the device shards in place next)."""
        for buf, b in buckets:
            self.grad_ready(b, shard_of(buf, b), late_ok=True)
        torch.cuda.current_stream().wait_stream(self.down)

    def host_grad(self, i: int) -> torch.Tensor:
        """Bucket ``i``'s grad shard on the host [shard_numel] fp32, once its copy has landed."""
        self.down_events.pop(i).synchronize()
        return self.views[i]

    def send_param(self, buf, b, master: torch.Tensor) -> None:
        """Copy updated master ``master`` (host fp32) into ``b``'s device parameter shard, asynchronously."""
        if buf.param_store is not None:  # --offload-params: the shard lives on the host too
            buf.set_param_shard(b, master)
            return
        if self.sent_up == 0:
            self.up.wait_stream(torch.cuda.current_stream())  # nothing still reads this step's parameters
        src = master
        if self.ring:  # the disk tier's buffer is reused for the next bucket: stage through the ring
            k = self.sent_up % len(self.ring)
            if self.ring_events[k] is not None:
                self.ring_events[k].synchronize()
            src = self.ring[k][:master.numel()].copy_(master)
        self.sent_up += 1
        with torch.cuda.stream(self.up):
            buf.param_shard(b).copy_(src.to(buf.device, non_blocking=True))  # cast on the device, as before
            if self.ring:
                self.ring_events[k] = torch.cuda.Event()
                self.ring_events[k].record(self.up)

    def params_sent(self) -> None:
        """The compute stream waits (on the GPU) for every copy up; the next gather or forward is behind it."""
        torch.cuda.current_stream().wait_stream(self.up)
        self.sent_up = 0

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [self.grads, *self.ring])


def _host_empty(numel: int) -> torch.Tensor:
    """fp32 host memory, pinned when a GPU will copy to and from it."""
    t = torch.empty(numel, dtype=torch.float32)
    return t.pin_memory() if torch.cuda.is_available() else t


def build_store(shards: list[list[torch.Tensor]], placement: StatePlacement, rank: int):
    """The store for ``placement.optimizer_state``; ``shards``: per buffer, each bucket's parameter shard."""
    where = placement.optimizer_state
    if where == Placement.HOST:
        return HostStore(shards)
    if where == Placement.DISK:
        assert placement.offload_path, "RunPlan.resolve requires --offload-path with disk"
        return DiskStore(shards, placement.offload_path, rank, placement.offload_buffers)
    return DeviceStore(shards)
