"""--async-save: the training step copies this rank's shard to host memory and returns; a thread writes it.

A save costs a copy (memory bandwidth) and a write (the disk). Only the copy stalls training:

1. **snapshot** (main thread, in the step that saves): the model weights this rank writes, its optimizer-state
   pieces and its RNG states, copied into host buffers kept for the next save (pinned on CUDA: non-blocking
   copies and one event sync). The stamp broadcast (and, under ZeRO 3, the unit gathers) are its only
   collectives, run where every rank runs them.
2. **write** (one background thread per rank): the very files ``save_checkpoint`` writes, into the staging
   folder, each fsynced. The thread runs no collective: gloo and NCCL need every rank to issue its
   collectives in one order, which a thread racing the training loop's own collectives cannot promise.
3. **conclude** (main thread, at a point every rank reaches in the same step): once every rank's writer is
   done (``poll``: one tiny all-reduce per step while a save is pending), or at the next save or any orderly
   stop of the trainer - the end of training, a signal, a diverged run (``finish``: waits) - the vote and
   rank 0's publish are ``save_checkpoint``'s own (``save.conclude``): ``metadata.json``, the rename,
   ``latest``, --keep-last.

Until the conclusion the files sit in ``iter_N.tmp-<stamp>/``: a crash (or an error exit that only some
ranks may share, ``close``) leaves ``latest`` as it was, and the next save removes the leftover folder.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..optimizer.protocol import ShardedOptimizerState
from ..parallel import collectives as C
from . import save as S


@dataclass
class Snapshot:
    """One rank's share of a save, in host memory: file name -> tensors, and its index entries."""

    target: S.SaveTarget
    files: dict[str, dict[str, torch.Tensor]]
    model_index: dict[str, Any]
    optim_info: dict[str, Any] | None
    piece: dict[str, Any] | None = None  # the writer's vote, once it is done
    error: BaseException | None = None
    thread: threading.Thread | None = field(default=None, repr=False)
    paused_s: float = 0.0  # training blocked while the snapshot was taken, for the line that reports the save


class HostBuffers:
    """Host tensors reused from one save to the next (a fresh 1 GB allocation costs as much as the copy)."""

    def __init__(self, device: torch.device) -> None:
        self.pin = device.type == "cuda"
        self.buffers: dict[str, torch.Tensor] = {}

    def copy(self, key: str, src: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``src`` (as ``dtype``) into the buffer kept under ``key``; non-blocking from a CUDA device."""
        dtype = dtype or src.dtype
        buf = self.buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != dtype:
            buf = torch.empty(src.shape, dtype=dtype, pin_memory=self.pin)
            self.buffers[key] = buf
        return buf.copy_(src.detach(), non_blocking=self.pin)


def _model_copies(named: dict[str, nn.Parameter], optimizer: ShardedOptimizerState, buffers: HostBuffers,
                  keep: bool, gathers: bool) -> dict[str, torch.Tensor]:
    """The weights this rank writes. ZeRO 3 (``gathers``): the optimizer's own copies, one gathered unit at
    a time, a collective every DP rank joins; otherwise straight from the parameters into ``buffers``."""
    if gathers:
        copies = optimizer.host_copies(keep=keep)
        return {n: copies[p] for n, p in named.items()} if keep else {}
    optimizer.wait_param_gather()
    return {n: buffers.copy(f"model/{n}", p) for n, p in named.items()} if keep else {}


def take_snapshot(target: S.SaveTarget, ctx: S.CheckpointContext, buffers: HostBuffers) -> Snapshot:
    """Everything this rank writes, copied to the host now (the only part of a save that blocks the step)."""
    named, pstate = S.named_parameters(ctx.chunks), ctx.pstate
    writes_model = S.writes_any(pstate)  # as save_checkpoint: one copy of each region (placement.py)
    weights = _model_copies(named, ctx.optimizer, buffers, writes_model, gathers=ctx.plan.zero.shards_parameters)
    files, optim_info = S.rank_files(ctx.chunks, weights, ctx.optimizer, pstate, ctx.tp_rng,
                                     lambda key, view: buffers.copy(f"optim/{key}", view, torch.float32))
    if buffers.pin:  # one sync for every non-blocking copy above
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
    index = S.model_index(ctx.chunks, pstate)
    return Snapshot(target, files, index, optim_info)


def write_snapshot(snap: Snapshot) -> None:
    """The background thread: write and fsync every file; record this rank's vote (never raises)."""
    try:
        bad = S.write_files(snap.target.staging, snap.files)
        snap.piece = {"model": snap.model_index, "optim": snap.optim_info, "non_finite": bad, "error": None}
    except Exception as err:  # noqa: BLE001 - voted by every rank when the save concludes
        snap.error, snap.piece = err, S.failed_piece(err, snap.target)


class AsyncCheckpointer:
    """The run's ``Checkpointer`` under --async-save: at most one save in flight per rank.

    ``save`` (every rank, at the same iteration) concludes the previous save, snapshots and starts
    the writer; ``poll`` (every rank, every step) concludes a save whose writers are all done;
    ``finish`` (every rank) waits for and concludes it; ``close`` (an error exit) only waits.
    """

    saves = True

    def __init__(self, ctx: S.CheckpointContext) -> None:
        self.ctx = ctx
        self.buffers = HostBuffers(ctx.pstate.device)
        self.pending: Snapshot | None = None

    def save(self, iteration: int, consumed_samples: int) -> None:
        """Snapshot this rank's share to host memory and start writing it in the background."""
        ctx = self.ctx
        self.finish()  # the next save waits for the previous one
        target = S.start_save(ctx.root, iteration, consumed_samples, ctx.optimizer, ctx.pstate)
        snap = take_snapshot(target, ctx, self.buffers)
        snap.paused_s = time.perf_counter() - target.started
        snap.thread = threading.Thread(target=write_snapshot, args=(snap,), daemon=True,
                                       name=f"megazero-async-save-{iteration}")
        self.pending = snap
        snap.thread.start()

    def poll(self) -> None:
        """Conclude the pending save once every rank's writer is done (all ranks agree in one all-reduce)."""
        if self.pending is None:
            return
        done = torch.tensor([float(not self.pending.thread.is_alive())], device=self.ctx.pstate.device)
        C.all_reduce(done, self.ctx.pstate.world_group, op=dist.ReduceOp.MIN)
        if done.item() > 0:
            self.finish()

    def finish(self) -> None:
        """Wait for this rank's writer, vote, publish (rank 0); raises on every rank when any rank failed."""
        snap, self.pending = self.pending, None
        if snap is None:
            return
        snap.thread.join()
        pieces = C.all_gather_object(snap.piece, self.ctx.pstate.world_group)  # the barrier and the vote
        S.conclude(snap.target, pieces, snap.error, self.ctx, paused_s=snap.paused_s)

    def close(self) -> None:
        """On an error exit that not every rank may share: let the writer end, publish nothing (a collective
        could hang when the error is this rank's alone), and say what ``latest`` names on disk. Every orderly
        stop (the end, a signal, a diverged run) has already concluded the save with ``finish``."""
        snap, self.pending = self.pending, None
        if snap is None:
            return
        snap.thread.join()
        if self.ctx.pstate.rank == 0:
            self.ctx.log(f"megazero: --async-save: the checkpoint of iteration {snap.target.iteration} was not "
                         f"published (the run stopped on an error before every rank confirmed its write); "
                         f"{self.latest()}; the next save removes {snap.target.staging}")

    def latest(self) -> str:
        """What the --save folder's ``latest`` names on disk now."""
        return S.describe_latest(self.ctx.root)
