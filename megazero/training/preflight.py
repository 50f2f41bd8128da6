"""Start-up checks of what a run will write with, so a bad one fails in one line, not after training.

The packages its outputs need (``check_optional_packages``: wandb, tensorboard) are checked with the config,
before the process group. For the paths:

Rank 0 creates each output folder (or a file's parent folder) and writes and
deletes a small file there; the verdict is broadcast so every rank raises the
same ``ValueError`` right after the process group is up, before any other
collective could hang on a rank that already left.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile

import torch.distributed as dist

from ..config import Config
from ..optional import require
from ..pipeline.timeline import rank_path
from .wandb_log import resolve_mode


def check_optional_packages(cfg: Config) -> None:
    """A logging flag whose package (an extra, ``megazero/optional.py``) is not installed: one ValueError."""
    lg = cfg.logging
    if lg.wandb_project and resolve_mode(lg.wandb_mode) != "disabled":
        require("wandb", f"--wandb-project {lg.wandb_project}")
    if lg.tensorboard_dir:
        require("tensorboard", f"--tensorboard-dir {lg.tensorboard_dir}")


def output_paths(cfg: Config) -> list[tuple[str, str]]:
    """(flag, folder that must be writable) for every output the config names."""
    lg, out = cfg.logging, []
    if cfg.checkpoint.save:
        out.append(("--save", cfg.checkpoint.save))
    if lg.metrics_file:
        out.append(("--metrics-file", os.path.dirname(os.path.abspath(lg.metrics_file))))
    if lg.tensorboard_dir:
        out.append(("--tensorboard-dir", lg.tensorboard_dir))
    if lg.timeline:
        out.append(("--timeline", os.path.dirname(os.path.abspath(rank_path(lg.timeline, 0)))))
    if lg.wandb_project and lg.wandb_dir:
        out.append(("--wandb-dir", lg.wandb_dir))
    if cfg.parallel.offload_path:  # given only with --offload-optimizer or --offload-params disk
        out.append(("--offload-path", cfg.parallel.offload_path))
    return out


def probe_folder(flag: str, folder: str) -> str | None:
    """None when ``folder`` can be created and written to; else one line naming flag, path and reason."""
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".megazero_probe_", dir=folder)
        try:
            os.write(fd, b"megazero")
        finally:
            os.close(fd)
            os.remove(tmp)
        if shutil.disk_usage(folder).free == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as err:
        reason = err.strerror or str(err)
        return f"{flag} {folder}: cannot write there ({reason}); choose a writable folder."
    return None


def check_output_paths(cfg: Config) -> None:
    """Probe every output path on rank 0 and raise the same ValueError on every rank if one is unusable."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    verdict: list[str | None] = [None]
    if rank == 0:
        for flag, folder in output_paths(cfg):
            verdict[0] = verdict[0] or probe_folder(flag, folder)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise ValueError(verdict[0])
