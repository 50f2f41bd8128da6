"""One job at a time in each folder a run writes and re-reads: ``--save`` and ``--offload-path``.

Two runs given the same folder overwrite each other's files (the disk tier truncates its state
files at start-up; a save's cleanup removes staging folders it did not write). So a run takes an
advisory lock (``fcntl.flock``) on a lock file in the folder and keeps the descriptor open for its
whole life: the kernel drops the lock when the process dies, so a dead job never blocks a restart
(torchrun --max-restarts, a requeued Slurm job), and a lock file it left behind is simply taken
over. The file holds a note of who holds it (host, pid, Slurm job / torchrun run id, start time),
which the refused job prints.

Who locks what: rank 0 locks ``--save`` (checkpoints need a filesystem every rank shares);
every rank locks ``--offload-path/rank{r}/``, the folder its own files go to (often a disk local
to each node, where one lock for the whole folder would not be seen by the other nodes). The
verdicts are all-gathered over the world, so every rank raises the same one line before any
other collective could hang.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from contextlib import ExitStack
from typing import Any

import torch.distributed as dist

from ..config import Config

LOCK_NAME = ".megazero.lock"
JOB_VARS = (("SLURM_JOB_ID", "Slurm job"), ("TORCHELASTIC_RUN_ID", "torchrun run"))


def holder_note() -> dict[str, Any]:
    """Who this process is, for the lock file: what a refused job needs to find the holder."""
    note: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(),
                            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    note.update({var: os.environ[var] for var, _ in JOB_VARS
                 if os.environ.get(var, "none") != "none"})  # torchrun's static rendezvous says "none"
    return note


def describe(note: dict[str, Any] | None) -> str:
    """The holder as words, e.g. 'Slurm job 4242 (host n1, pid 77, since 2026-11-23 10:00:00 UTC)'."""
    if not note:
        return "another job (its lock file holds no note yet)"
    job = ", ".join(f"{label} {note[var]}" for var, label in JOB_VARS if note.get(var)) or "a job"
    return f"{job} (host {note.get('host', '?')}, pid {note.get('pid', '?')}, since {note.get('started', '?')})"


def read_note(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as fh:
            note = json.loads(fh.read() or "null")
        return note if isinstance(note, dict) else None
    except (OSError, ValueError):
        return None


def _take(path: str) -> int | None:
    """A descriptor holding the exclusive lock on ``path``, or None while another process holds it.

    A holder removes its file as it lets go: a lock won on a file already unlinked is dropped and
    taken again on the path's current file, so two jobs never both hold "the" lock.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError:
            os.close(fd)
            raise
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            return fd
        os.close(fd)


class FolderLock:
    """This process's lock on one folder; ``release`` removes the lock file (and ``remove_dir``, if empty)."""

    def __init__(self, folder: str, fd: int, remove_dir: bool) -> None:
        self.folder, self.fd, self.remove_dir = folder, fd, remove_dir
        self.path = os.path.join(folder, LOCK_NAME)

    @classmethod
    def take(cls, folder: str, remove_dir: bool = False) -> "FolderLock | dict[str, Any] | None":
        """The lock, or the holder's note (None when it wrote none yet) when another process holds it."""
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, LOCK_NAME)
        fd = _take(path)
        if fd is None:
            return read_note(path)
        os.ftruncate(fd, 0)  # a dead holder's note goes; ours replaces it
        os.pwrite(fd, (json.dumps(holder_note()) + "\n").encode(), 0)
        return cls(folder, fd, remove_dir)

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            os.unlink(self.path)  # while still locked: see _take
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = -1
        if self.remove_dir:
            try:
                os.rmdir(self.folder)
            except OSError:
                pass  # files of a run that was not this one's, or the user's


def folders_to_own(cfg: Config, rank: int) -> list[tuple[str, str, str]]:
    """(flag, the folder the user named, the folder this rank locks) for every folder the run re-reads."""
    out = []
    if cfg.checkpoint.save and rank == 0:
        out.append(("--save", cfg.checkpoint.save, cfg.checkpoint.save))
    if cfg.parallel.offload_path:
        out.append(("--offload-path", cfg.parallel.offload_path, os.path.join(cfg.parallel.offload_path,
                                                                                f"rank{rank}")))
    return out


def _lock_mine(cfg: Config, rank: int, owned: ExitStack) -> str | None:
    """Take this rank's locks (released by ``owned``); the first refusal as one line, else None."""
    for flag, named, folder in folders_to_own(cfg, rank):
        try:
            got = FolderLock.take(folder, remove_dir=folder != named)
        except OSError as err:
            if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                continue  # a filesystem without locks: run unguarded rather than not at all
            return f"{flag} {named}: cannot create or lock {os.path.join(folder, LOCK_NAME)} " \
                   f"({err.strerror or err}); choose a writable folder."
        if not isinstance(got, FolderLock):
            return (f"{flag} {named} is in use by {describe(got)}; use another {flag} folder or wait for that "
                    f"job to end.")
        owned.callback(got.release)
    return None


def own_folders(cfg: Config, owned: ExitStack) -> None:
    """Lock the folders this rank writes and re-reads until ``owned`` closes; if any rank is refused,
    every rank raises the same ValueError (the lowest rank's line), holding nothing."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    with ExitStack() as mine:
        problems = [_lock_mine(cfg, rank, mine)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, problems[0])
            problems = gathered
        first = next((p for p in problems if p), None)
        if first:
            raise ValueError(first)  # leaving ``mine`` releases what this rank did get
        owned.enter_context(mine.pop_all())
