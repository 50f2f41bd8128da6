"""Sharded checkpoint save: every rank writes only what it owns, in parallel, as safetensors.

- model weights: one file per (tp, pp) rank, written by DP rank 0, under the
  canonical (TP- and PP-independent) parameter names, with the persistent
  buffers (the MoE router's ``expert_bias``); MoE expert weights one file per
  (etp, ep, pp) rank of the expert grid, written by expert-DP rank 0, as
  regions of the full [E, ...] tensor (``placement.py``);
- optimizer state: one file per (tp, pp, dp) shard with, for each parameter
  piece this rank updates, its fp32 master weights and Adam moments; the
  piece is a flat range of the rank's region of the parameter (ZeRO 0 keeps
  full state on every DP rank, so only the rank that writes the weight
  writes it);
- RNG states: one small file per rank (exact resume in the same layout);
- every file is fsynced before the vote, so what rank 0 publishes is on disk, and gets the mode the
  umask gives (``storage.shareable``), so a team can share the checkpoint;
- metadata.json (rank 0, last): config, layout, iteration, consumed samples,
  optimizer scalars, and an index of each tensor's full shape and the region
  or flat range each file holds - what resharding on load needs.

No checkpoint holds a NaN or inf: each rank checks what it writes, the ranks
vote in the all-gather that already ends the writing, and a bad vote removes
the staging folder and raises on every rank (``latest`` is untouched). A failed
write (a full disk) is voted the same way, as an OSError naming the file.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from safetensors.torch import save_file
from torch import nn

from ..config import Config
from ..parallel import collectives as C
from ..optimizer.protocol import ModelState, ShardedOptimizerState
from ..parallel.state import ParallelState
from ..run_plan import RunPlan
from ..tensor_parallel.layers import spec_of
from . import storage
from .recorded_data import copy_run_tokenizer
from .placement import model_tensors, named_parameters, region_of, weight_file, writes, writes_any

KINDS = ("master", "exp_avg", "exp_avg_sq")


def rng_state(pstate: ParallelState, tp_rng: Any) -> dict[str, torch.Tensor]:
    """The default generators plus every dropout stream of ``tp_rng`` (a ``DropoutRNG``), as ``dropout/<name>``."""
    state = {"cpu": torch.get_rng_state()}
    if pstate.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(pstate.device)
    if tp_rng is not None:
        state.update({f"dropout/{name}": s for name, s in tp_rng.state_dict().items()})
    return state


def model_index(chunks: list[nn.Module], pstate: ParallelState) -> dict[str, Any]:
    """What metadata.json records of the tensors this rank writes: full shape, split, region and file of each."""
    index = {}
    for name, t in model_tensors(chunks).items():
        if writes(t, pstate):
            shape, region = region_of(t, pstate)
            spec = spec_of(t)
            index[name] = {"shape": shape, "split_dim": spec.split_dim, "dtype": str(t.dtype).replace("torch.", ""),
                           "padded_rows": spec.valid_rows is not None, "expert": spec.expert,
                           "buffer": not isinstance(t, nn.Parameter),  # no optimizer state
                           "file": weight_file(t, pstate), "region": region}
    return index


def non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors holding a NaN or inf (checked where they live; one copy to the host)."""
    if not tensors:
        return []
    finite = torch.stack([torch.isfinite(t).all() for t in tensors.values()]).tolist()
    return [name for name, ok in zip(tensors, finite) if not ok]


def optimizer_tensors(optimizer: ShardedOptimizerState, named: dict[str, nn.Parameter], pstate: ParallelState,
                      take: Callable[[str, torch.Tensor], torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """The master weights and moments this rank writes as ``<param>/<kind>`` -> ``take(key, view)`` (a copy
    made now: under disk offload the views move on), and the file's index entries: each parameter's [lo, hi)
    range in its flat region and, for an expert weight, that region (a dense one's follows from the TP rank).
    ZeRO 1-3: each rank's own shard; ZeRO 0: one copy, from the rank that writes the weight."""
    names = {id(p): n for n, p in named.items()}
    tensors, ranges, regions = {}, {}, {}
    for param, param_lo, views in optimizer.state_segments():
        if not (optimizer.shards_state_over_dp or writes(param, pstate)):
            continue
        name = names[id(param)]
        ranges[name] = [param_lo, param_lo + views["exp_avg"].numel()]
        if spec_of(param).expert:
            regions[name] = region_of(param, pstate)[1]
        for kind in KINDS:
            key = f"{name}/{kind}"
            tensors[key] = take(key, views[kind].detach())
    return tensors, {"ranges": ranges, "regions": regions}


def model_files(chunks: list[nn.Module], weights: dict[str, torch.Tensor], pstate: ParallelState
                ) -> dict[str, dict[str, torch.Tensor]]:
    """File name -> the model tensors this rank writes into it: host copies of its parameters (``weights``,
    by name) and of its persistent buffers, taken now."""
    files: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in model_tensors(chunks).items():
        if writes(t, pstate):
            copy = weights[name] if isinstance(t, nn.Parameter) else t.detach().to("cpu", copy=True)
            files.setdefault(weight_file(t, pstate), {})[name] = copy
    return files


def rank_files(chunks: list[nn.Module], weights: dict[str, torch.Tensor], optimizer: ShardedOptimizerState,
               pstate: ParallelState, tp_rng: Any, take: Callable[[str, torch.Tensor], torch.Tensor]
               ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any] | None]:
    """Every file this rank owns (file name -> tensors) and its optimizer index entry, for a synchronous
    save and an --async-save alike. ``weights``: the parameters' host copies by name, when ``writes_any``."""
    files = model_files(chunks, weights, pstate)
    tensors, index = optimizer_tensors(optimizer, named_parameters(chunks), pstate, take)
    optim_info = None
    if tensors:
        fname = storage.optim_file(pstate.tp_rank, pstate.pp_rank, pstate.dp_cp_rank)  # one per rank
        files[fname] = tensors
        optim_info = {"file": fname, "tp_rank": pstate.tp_rank, **index}
    files[storage.rng_file(pstate.rank)] = {k: t.clone() for k, t in rng_state(pstate, tp_rng).items()}
    return files, optim_info


def write_files(staging: str, files: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    """Write ``files`` into ``staging``, each fsynced (the folder rename that publishes them does not make
    their data durable); the names holding NaN/inf."""
    os.makedirs(staging, exist_ok=True)
    bad: list[str] = []
    for fname, tensors in files.items():
        bad += non_finite(tensors)
        path = os.path.join(staging, fname)
        write_tensors(tensors, path)
        storage.fsync_path(path)
    return bad


def write_tensors(tensors: dict[str, torch.Tensor], path: str) -> None:
    """``save_file``, failing as an OSError that names the file (safetensors raises its own
    SafetensorError for a full disk or a size limit, which would print as a traceback); the file gets
    the umask's mode (``storage.shareable``: save_file writes 0600)."""
    try:
        save_file(tensors, path)
        storage.shareable(path)
    except OSError:
        raise
    except Exception as err:  # noqa: BLE001 - safetensors' error type is not importable by a stable name
        code = re.search(r"os error (\d+)", str(err))
        num = int(code.group(1)) if code else errno.EIO
        raise OSError(num, os.strerror(num) if code else str(err), path) from None


def folder_bytes(folder: str) -> int:
    """Bytes of every file under ``folder`` (what a checkpoint costs on disk)."""
    return sum(os.path.getsize(os.path.join(where, name)) for where, _, names in os.walk(folder) for name in names)


def format_bytes(nbytes: int) -> str:
    """``12.3 MiB`` below a GiB, ``1.25 GiB`` from there."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def describe_latest(root: str) -> str:
    """What ``root/latest`` names now, read from disk (a message about ``latest`` states, never assumes, it)."""
    target = storage.latest_target(root)
    if target is None:
        return f"{root} holds no published checkpoint yet (no 'latest')"
    return f"'latest' in {root} names {os.path.basename(target)}"


def _describe(err: BaseException, target: SaveTarget) -> tuple:
    """A failed write as something every rank can receive (and re-raise) in one collective."""
    if isinstance(err, OSError):
        reason = f"{err.strerror or err}; checkpoint of iteration {target.iteration} not saved, " \
                 f"{describe_latest(target.root)}"
        return ("os", err.errno or errno.EIO, reason, err.filename)
    return ("other", f"checkpoint of iteration {target.iteration} not saved: {type(err).__name__}: {err}; "
                     f"{describe_latest(target.root)}")


def _raise(what: tuple, own: BaseException | None) -> None:
    """Raise the failure on this rank: its own error, or the one another rank described."""
    if what[0] == "os":
        raise OSError(what[1], what[2], what[3]) from None
    if own is not None:
        raise own
    raise RuntimeError(what[1])


def _refuse(pieces: list[dict], target: SaveTarget, pstate: ParallelState, own: BaseException | None) -> None:
    """A failed write or a NaN/inf on any rank: the staging folder goes, every rank raises, nothing is published."""
    failed = [piece["error"] for piece in pieces if piece["error"] is not None]
    bad = [f"{name} (rank {rank})" for rank, piece in enumerate(pieces) for name in piece["non_finite"]]
    if not failed and not bad:
        return
    if pstate.rank == 0:
        shutil.rmtree(target.staging, ignore_errors=True)
    C.barrier(pstate.world_group)  # the staging folder is gone before any rank exits
    if failed:
        mine = pieces[pstate.rank]["error"]
        _raise(mine or failed[0], own)
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    restart = "resume from it" if storage.latest_target(target.root) else "start again"
    raise ValueError(f"checkpoint of iteration {target.iteration} not saved: non-finite values in "
                     f"{', '.join(bad[:3])}{more}; the run diverged - {describe_latest(target.root)}; {restart} "
                     f"(e.g. with a lower --lr).")


def _write_rank(staging: str, chunks: list[nn.Module], copies: dict, optimizer: ShardedOptimizerState,
                pstate: ParallelState, tp_rng: Any) -> dict[str, Any]:
    """Every file this rank owns, into ``staging``; its index entries and the names holding NaN/inf."""
    weights = {n: copies[p] for n, p in named_parameters(chunks).items()} if copies else {}
    transient = optimizer.state_views_transient  # disk offload reuses its buffers

    def take(key: str, view: torch.Tensor) -> torch.Tensor:
        return (view.clone() if transient else view).float().contiguous().cpu()

    files, optim_info = rank_files(chunks, weights, optimizer, pstate, tp_rng, take)
    bad = write_files(staging, files)
    return {"model": model_index(chunks, pstate), "optim": optim_info, "non_finite": bad, "error": None}


def _loaded(cfg: Config, root: str, loaded: str | None) -> tuple[str, ...]:
    """What this run loaded, for --keep-last to spare: ``loaded`` when the caller knows it, else a
    --load that names a checkpoint folder itself (a rollback: ``--load DIR/iter_0000004 --save DIR``).
    A --load of the --save folder itself names no fixed folder (its ``latest`` moves with each save)."""
    load = cfg.checkpoint.load
    if loaded or not load or os.path.realpath(load) == os.path.realpath(root):
        return (loaded,) if loaded else ()
    try:
        return (storage.resolve(load),)
    except ValueError:
        return ()


@dataclass(frozen=True)
class SaveTarget:
    """What one save publishes, fixed when it starts (an --async-save concludes steps later, when the
    optimizer's step count has moved on)."""

    root: str
    iteration: int
    consumed_samples: int
    stamp: str  # rank 0's clock in ms, broadcast: the staging folder's suffix and ``saved_at``
    scalars: dict[str, Any]
    started: float = field(default_factory=time.perf_counter)  # for the line that reports the save

    @property
    def staging(self) -> str:
        return storage.staging_dir(self.root, self.iteration, self.stamp)


def start_save(root: str, iteration: int, consumed_samples: int, optimizer: ShardedOptimizerState,
               pstate: ParallelState) -> SaveTarget:
    """The save's stamp, agreed by every rank (one broadcast), and the optimizer scalars of this step."""
    stamp = C.broadcast_object(f"{int(time.time() * 1000)}" if pstate.rank == 0 else None, 0, pstate.world_group)
    return SaveTarget(root, iteration, consumed_samples, stamp, optimizer.state_scalars())


@dataclass(frozen=True)
class CheckpointContext:
    """What every save of one run writes and where it publishes: fixed for the run, passed as one value."""

    root: str  # the --save folder
    cfg: Config
    plan: RunPlan
    pstate: ParallelState
    model: ModelState  # this rank's wrapped chunks and their optimizer (``training/parallelize.TrainingModel``)
    tp_rng: Any = None  # the dropout streams (``tensor_parallel.random.DropoutRNG``), saved with the generators
    keep_last: int | None = None  # --keep-last
    loaded: str | None = None  # the folder this run resumed from, which --keep-last never removes
    log: Callable[[str], None] = print  # rank 0's line for each published save
    run_id: str | None = None  # the run's id (training/run_identity.py), recorded so that a resume continues it

    @property
    def chunks(self) -> list[nn.Module]:
        return self.model.chunks

    @property
    def optimizer(self) -> ShardedOptimizerState:
        return self.model.optimizer


def save_checkpoint(ctx: CheckpointContext, iteration: int, consumed_samples: int) -> str:
    """Write this rank's shards; rank 0 publishes the checkpoint once all ranks are done.

    A failure on any rank (a full disk) reaches every rank through the collectives every rank is
    in anyway, removes the staging folder and raises everywhere (an OSError naming the file).
    """
    pstate = ctx.pstate
    target = start_save(ctx.root, iteration, consumed_samples, ctx.optimizer, pstate)
    own = None
    copies = ctx.optimizer.host_copies(keep=writes_any(pstate))  # every DP/CP rank takes part (ZeRO 3 gathers)
    try:
        mine = _write_rank(target.staging, ctx.chunks, copies, ctx.optimizer, pstate, ctx.tp_rng)
    except Exception as err:  # noqa: BLE001 - reported to every rank in the all-gather below
        own, mine = err, failed_piece(err, target)
    del copies
    pieces = C.all_gather_object(mine, pstate.world_group)  # also the barrier and the vote
    return conclude(target, pieces, own, ctx)


def failed_piece(err: BaseException, target: SaveTarget) -> dict[str, Any]:
    """This rank's vote when its write failed."""
    return {"model": {}, "optim": None, "non_finite": [], "error": _describe(err, target)}


def conclude(target: SaveTarget, pieces: list[dict], own: BaseException | None, ctx: CheckpointContext,
             paused_s: float | None = None) -> str:
    """After the vote (every rank's ``pieces``): refuse on every rank, or rank 0 publishes, says so in one
    line (path, size, seconds) and rotates.

    Every rank calls it at the same point; it ends with a broadcast, so nobody moves on before the publish.
    ``paused_s``: an --async-save's seconds of blocked training (its snapshot), for that line.
    """
    root, staging, iteration = target.root, target.staging, target.iteration
    cfg, pstate, keep_last, log = ctx.cfg, ctx.pstate, ctx.keep_last, ctx.log
    _refuse(pieces, target, pstate, own)
    final, outcome = os.path.join(root, storage.iteration_dir(iteration)), None
    if pstate.rank == 0:
        try:
            meta = {**_metadata(cfg, ctx.plan, iteration, target.consumed_samples, target.scalars, pieces),
                    "saved_at": int(target.stamp), **({"run_id": ctx.run_id} if ctx.run_id else {})}
            meta.update(copy_run_tokenizer(cfg, staging))  # moves with the checkpoint (recorded_data.py)
            spare = _loaded(cfg, root, ctx.loaded)
            storage.write_json_atomic(os.path.join(staging, storage.METADATA), meta)
            final = storage.publish(root, staging, iteration, keep_last=None)
            log(_saved_line(final, time.perf_counter() - target.started, paused_s))
            removed = storage.rotate(root, keep_last, spare) if keep_last else []
            if removed:
                log(f"megazero: --keep-last {keep_last}: removed {', '.join(removed)}")
        except Exception as err:  # noqa: BLE001 - every rank raises it after the broadcast below
            shutil.rmtree(staging, ignore_errors=True)
            own, outcome = err, _describe(err, target)
    outcome = C.broadcast_object(outcome, 0, pstate.world_group)  # nobody moves on before the publish
    if outcome is not None:
        _raise(outcome, own)
    return final


def _saved_line(final: str, seconds: float, paused_s: float | None) -> str:
    """What one published save reports: where, how large, how long (and, in the background, what it blocked)."""
    size = format_bytes(folder_bytes(final))
    if paused_s is None:
        return f"megazero: saved checkpoint {final} ({size}) in {seconds:.2f} s"
    return (f"megazero: --async-save published checkpoint {final} ({size}) {seconds:.2f} s after it started; "
            f"training paused {paused_s:.2f} s for its snapshot")


def _metadata(cfg: Config, plan: RunPlan, iteration: int, consumed_samples: int, scalars: dict[str, Any],
              pieces: list[dict]) -> dict[str, Any]:
    model: dict[str, Any] = {}
    for piece in pieces:
        for name, entry in piece["model"].items():
            slot = model.setdefault(name, {k: entry[k] for k in ("shape", "split_dim", "dtype", "padded_rows",
                                                                 "expert", "buffer")})
            slot.setdefault("files", {})[entry["file"]] = entry["region"]
    optim_files = {p["optim"]["file"]: {k: v for k, v in p["optim"].items() if k != "file"}
                   for p in pieces if p["optim"] is not None}
    return storage.metadata_dict(
        config=cfg.to_flat(), iteration=iteration, consumed_samples=consumed_samples, model=model,
        layout=plan.layout_record(), optimizer_scalars=scalars, optimizer_files=optim_files,
        rng_files=True)
