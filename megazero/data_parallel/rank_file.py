"""One working file per rank under ``--offload-path``: the layer under both disk stores.

``RankFile`` opens ``DIR/rank{r}/NAME`` with its blocks reserved up front (``posix_fallocate``, so a
full disk is reported at start-up, not mid-step), reads and writes tensors' bytes at byte offsets with
``os.preadv``/``os.pwritev`` loops (a short transfer is legal; never ``mmap``: mapped file pages would
count in the process RSS the offload is meant to shrink), turns an ``OSError`` into the one-line
``--offload-path`` error, and on ``close`` removes the file and its folder once empty (the user's
``--offload-path`` stays). Used by the optimizer-state store (``optimizer/offload.py`` ``DiskStore``)
and the ZeRO-3 parameter-shard store (``param_offload.py`` ``DiskParamShards``).
"""
from __future__ import annotations

import errno
import os

import torch


class OffloadError(ValueError):
    """The offload folder cannot hold the offloaded state; the message names --offload-path and the fix."""


class RankFile:
    """``folder/rank{rank}/name``, ``nbytes`` long, holding ``what`` (e.g. "the optimizer state")."""

    def __init__(self, folder: str, rank: int, name: str, nbytes: int, *, what: str, verb: str = "needs") -> None:
        self.folder, self.nbytes, self.what, self.verb = folder, nbytes, what, verb
        self.dir = os.path.join(folder, f"rank{rank}")
        self.path = os.path.join(self.dir, name)
        self.fd = -1
        try:
            os.makedirs(self.dir, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            if nbytes:
                os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as err:
            self.close()
            raise self.error(err, f"creating the file for {what}") from err

    def error(self, err: OSError, doing: str) -> OffloadError:
        """One line naming the flag, the folder, what failed, the space needed and the fix."""
        fix = ("free space there or choose a folder on a larger disk" if err.errno in (errno.ENOSPC, errno.EDQUOT)
               else "choose a writable folder")
        return OffloadError(f"--offload-path {self.folder}: {doing} failed ({err.strerror or err}; {self.what} "
                            f"{self.verb} {self.nbytes / 2**20:.1f} MiB per rank); {fix}.")

    def write(self, offset: int, t: torch.Tensor) -> int:
        """Write contiguous ``t``'s bytes at byte ``offset``; returns the bytes written (ENOSPC/EIO raise)."""
        view, done = _bytes(t), 0
        while done < len(view):
            done += os.pwritev(self.fd, [view[done:]], offset + done)
        return len(view)

    def read(self, offset: int, t: torch.Tensor) -> int:
        """Fill contiguous ``t`` from byte ``offset``; returns the bytes read (a short file raises EIO)."""
        view, done = _bytes(t), 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got == 0:
                raise OSError(errno.EIO, f"{self.path} is shorter than {self.what}")
            done += got
        return len(view)

    def close(self) -> None:
        """Close and remove the file, and this rank's folder once empty (the user's --offload-path stays)."""
        if self.fd < 0:
            return
        os.close(self.fd)
        self.fd = -1
        os.remove(self.path)
        try:
            os.rmdir(self.dir)
        except OSError:
            pass  # another store's file still lives there


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B")  # bf16 has no numpy dtype; bytes do
