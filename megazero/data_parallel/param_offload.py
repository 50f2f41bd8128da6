"""ZeRO 3 + ``--offload-params``: where a buffer's persistent parameter shards live between uses.

Without offload a ZeRO-3 buffer keeps its shards in ``param_shard_data`` on the
device and a unit's all-gather reads them in place. With offload the shards live
in one of these stores instead, and a unit's gather first *fetches* each
bucket's shard to the device, then all-gathers it:

    HostParamShards  one host tensor (pinned on CUDA); a fetch is the view itself
                     on a CPU-only machine (host = device: the all-gather reads the
                     same bytes as without offload) or a non-blocking copy to the device
    DiskParamShards  one file per rank, ``DIR/rank{r}/param_shards.bin`` (apart from
                     the optimizer-state file); a fetch is a ``preadv`` on an I/O thread
                     into a staging tensor, issued by the prefetch that drives the
                     all-gathers, so the read overlaps the compute of the unit before;
                     the all-gather waits on the read's future (``deferred``)

After the optimizer step the updated shard is written back where it lives
(``write``: a copy, or a ``pwritev`` on the same single I/O thread, so a later
read of the region is ordered after the write). The disk store's file is a
``RankFile`` (``rank_file.py``, shared with the optimizer-state store): ``preadv``/
``pwritev``, never ``mmap``, so file pages do not count in RSS. Each store is made
by its buffer (``ParamGradBuffer``, through ``param_shard_factory``) and closed by it.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from ..config import Placement
from .rank_file import OffloadError, RankFile

MAX_WRITES_BEHIND = 2  # updated shards queued for the disk at once


class Fetch(Protocol):
    """A shard on its way to the device: ``result()`` waits for it and is the tensor."""

    def result(self) -> torch.Tensor: ...


class Ready:
    """A fetch that is already complete (the host tier; shards kept on the device)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def result(self) -> torch.Tensor:
        return self.t


class HostParamShards:
    """The shards in host memory (ZeRO-Offload's placement of ZeRO-3 parameters)."""

    placement = Placement.HOST
    deferred = False  # a fetch completes at once; the all-gather is issued with it

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.device = device
        self.data = torch.zeros(numel, dtype=dtype)
        if torch.cuda.is_available():
            self.data = self.data.pin_memory()

    def fetch(self, lo: int, n: int) -> Ready:
        view = self.data[lo: lo + n]
        return Ready(view if self.device.type == "cpu" else view.to(self.device, non_blocking=True))

    def read(self, lo: int, n: int) -> torch.Tensor:
        return self.data[lo: lo + n]

    def write(self, lo: int, src: torch.Tensor) -> None:
        self.data[lo: lo + src.numel()].copy_(src)

    def flush(self) -> None:
        pass

    def host_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def disk_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class DiskParamShards:
    """The shards in ``folder/rank{rank}/param_shards.bin`` (ZeRO-Infinity's NVMe tier for parameters)."""

    placement = Placement.DISK
    deferred = True  # the all-gather waits for the read, issued by the prefetch

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, folder: str, rank: int,
                 chunk: int = 0) -> None:
        self.dtype, self.device = dtype, device
        self.writes: list[_Checked] = []  # issued since the last flush
        self.item = torch.empty((), dtype=dtype).element_size()
        self.nbytes = numel * self.item
        self.file = RankFile(folder, rank, f"param_shards{chunk}.bin", self.nbytes,  # one per model chunk
                             what="the parameter shards", verb="need")
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="param-offload-io")  # FIFO: write, then read

    @property
    def path(self) -> str:
        return self.file.path

    def error(self, err: OSError, doing: str) -> OffloadError:
        return self.file.error(err, doing)

    def _pread(self, lo: int, out: torch.Tensor) -> torch.Tensor:
        self.file.read(lo * self.item, out)
        return out if self.device.type == "cpu" else out.to(self.device, non_blocking=True)

    def _pwrite(self, lo: int, src: torch.Tensor) -> None:
        self.file.write(lo * self.item, src)

    def fetch(self, lo: int, n: int) -> "_Checked":
        """Start reading shard elements [lo, lo + n) into a fresh staging tensor; ``result()`` waits."""
        staging = torch.empty(n, dtype=self.dtype)
        return _Checked(self, self.io.submit(self._pread, lo, staging), "reading the parameter shards")

    def read(self, lo: int, n: int) -> torch.Tensor:
        return self.fetch(lo, n).result().cpu()

    def write(self, lo: int, src: torch.Tensor) -> None:
        """Write-behind: a private host copy in the parameter dtype goes to the I/O thread; at most
        ``MAX_WRITES_BEHIND`` copies are in flight, so the step never holds every shard twice."""
        while len(self.writes) >= MAX_WRITES_BEHIND:
            self.writes.pop(0).result()
        host = src.to("cpu", self.dtype, copy=True).contiguous()
        self.writes.append(_Checked(self, self.io.submit(self._pwrite, lo, host), "writing the parameter shards"))

    def flush(self) -> None:
        """Wait for every write issued so far; a failed one raises the flag-naming error."""
        writes, self.writes = self.writes, []
        for w in writes:
            w.result()

    def host_bytes(self) -> int:
        return 0  # staging tensors live only while a unit is being gathered

    def disk_bytes(self) -> int:
        return self.nbytes

    def close(self) -> None:
        """Remove this rank's file (and its folder when empty); the user's --offload-path stays."""
        self.io.shutdown(wait=True)
        self.file.close()


class _Checked:
    """A disk transfer's future whose failure becomes the flag-naming OffloadError."""

    def __init__(self, store: DiskParamShards, fut: Future, doing: str) -> None:
        self.store, self.fut, self.doing = store, fut, doing

    def result(self) -> torch.Tensor:
        try:
            return self.fut.result()
        except OSError as err:
            raise self.store.error(err, self.doing) from err


def param_shard_factory(where: Placement, folder: str | None, rank: int):
    """A ``(numel, dtype, device) -> store`` for ``ParamGradBuffer``, or None to keep shards on the device.

    Several buffers (virtual pipeline chunks, expert weights) on one rank would share one file name, so the
    factory numbers the disk stores it makes.
    """
    if where == Placement.DEVICE:
        return None
    if where == Placement.HOST:
        return HostParamShards
    made = [0]

    def disk(numel: int, dtype: torch.dtype, device: torch.device) -> DiskParamShards:
        made[0] += 1
        return DiskParamShards(numel, dtype, device, folder, rank, chunk=made[0] - 1)

    return disk
