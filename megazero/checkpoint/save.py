"""Sharded checkpoint save: every rank writes only what it owns, in parallel, as safetensors.

- model weights: one file per (tp, pp) rank, written by DP rank 0, under the
  canonical (TP- and PP-independent) parameter names;
- optimizer state: one file per (tp, pp, dp) shard with, for each parameter
  piece this rank updates, its fp32 master weights and Adam moments; the
  piece is a flat range of the TP-local parameter (ZeRO 0 keeps full state on
  every DP rank, so only DP rank 0 writes it);
- RNG states: one small file per rank (exact resume in the same layout);
- metadata.json (rank 0, last): config, layout, iteration, consumed samples,
  optimizer scalars, and an index of each tensor's full shape and the region
  or flat range each file holds - what resharding on load needs.

No checkpoint holds a NaN or inf: each rank checks what it writes, the ranks
vote in the all-gather that already ends the writing, and a bad vote removes
the staging folder and raises on every rank (``latest`` is untouched).
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from ..config import Config
from ..parallel import collectives as C
from ..optimizer.protocol import ShardedOptimizerState
from ..parallel.state import ParallelState
from ..run_plan import RunPlan
from ..tensor_parallel.layers import full_shape, spec_of
from . import storage
from .slices import tp_region

KINDS = ("master", "exp_avg", "exp_avg_sq")


def named_parameters(chunks: list[nn.Module]) -> dict[str, nn.Parameter]:
    """Canonical name -> parameter over all of this rank's chunks (names are unique per rank)."""
    named: dict[str, nn.Parameter] = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            assert name not in named, f"parameter {name} appears in two chunks of one rank"
            named[name] = p
    return named


def rng_state(pstate: ParallelState, tp_rng: Any) -> dict[str, torch.Tensor]:
    """The default generators plus every dropout stream of ``tp_rng`` (a ``DropoutRNG``), as ``dropout/<name>``."""
    state = {"cpu": torch.get_rng_state()}
    if pstate.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(pstate.device)
    if tp_rng is not None:
        state.update({f"dropout/{name}": s for name, s in tp_rng.state_dict().items()})
    return state


def _model_index(named: dict[str, nn.Parameter], pstate: ParallelState) -> dict[str, Any]:
    index = {}
    for name, p in named.items():
        shape = list(full_shape(p, pstate.tp))
        region = tp_region(shape, spec_of(p).split_dim, pstate.tp_rank, pstate.tp)
        index[name] = {"shape": shape, "split_dim": spec_of(p).split_dim, "dtype": str(p.dtype).replace("torch.", ""),
                       "padded_rows": spec_of(p).valid_rows is not None,
                       "file": storage.model_file(pstate.tp_rank, pstate.pp_rank), "region": region}
    return index


def non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors holding a NaN or inf (checked where they live; one copy to the host)."""
    if not tensors:
        return []
    finite = torch.stack([torch.isfinite(t).all() for t in tensors.values()]).tolist()
    return [name for name, ok in zip(tensors, finite) if not ok]


def _write_optimizer(optimizer: ShardedOptimizerState, named: dict[str, nn.Parameter], staging: str,
                     pstate: ParallelState) -> tuple[dict[str, Any], list[str]]:
    """Write this rank's master weights and moments; returns their index entry and any non-finite names."""
    names = {id(p): n for n, p in named.items()}
    tensors, ranges = {}, {}
    transient = getattr(optimizer, "state_views_transient", False)  # disk offload reuses its buffers
    for param, param_lo, views in optimizer.state_segments():
        name = names[id(param)]
        n = views["exp_avg"].numel()
        ranges[name] = [param_lo, param_lo + n]
        for kind in KINDS:
            tensors[f"{name}/{kind}"] = views[kind].detach().clone() if transient else views[kind].detach()
    bad = non_finite(tensors)
    fname = storage.optim_file(pstate.tp_rank, pstate.pp_rank, pstate.dp_rank)
    save_file({k: t.float().contiguous().cpu() for k, t in tensors.items()}, os.path.join(staging, fname))
    return {"file": fname, "tp_rank": pstate.tp_rank, "ranges": ranges}, bad


def _refuse_non_finite(pieces: list[dict], staging: str, iteration: int, pstate: ParallelState) -> None:
    """No checkpoint holds NaN/inf: if any rank wrote one, every rank raises and nothing is published."""
    bad = [f"{name} (rank {rank})" for rank, piece in enumerate(pieces) for name in piece["non_finite"]]
    if not bad:
        return
    if pstate.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    C.barrier(pstate.world_group)  # the staging folder is gone before any rank exits
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    raise ValueError(f"checkpoint of iteration {iteration} not saved: non-finite values in {', '.join(bad[:3])}"
                     f"{more}; the run diverged - 'latest' still names the last good checkpoint, resume from it "
                     f"(e.g. with a lower --lr).")


def save_checkpoint(root: str, *, iteration: int, consumed_samples: int, cfg: Config, plan: RunPlan,
                    pstate: ParallelState, chunks: list[nn.Module], optimizer: ShardedOptimizerState,
                    tp_rng: Any = None, keep_last: int | None = None) -> str:
    """Write this rank's shards; rank 0 publishes the checkpoint once all ranks are done."""
    stamp = C.broadcast_object(f"{int(time.time() * 1000)}" if pstate.rank == 0 else None, 0, pstate.world_group)
    staging = storage.staging_dir(root, iteration, stamp)
    os.makedirs(staging, exist_ok=True)
    named, bad = named_parameters(chunks), []
    copies = optimizer.host_copies(keep=pstate.dp_rank == 0)  # every DP rank takes part (ZeRO 3 gathers)
    if pstate.dp_rank == 0:
        weights = {n: copies[p] for n, p in named.items()}
        bad = non_finite(weights)
        save_file(weights, os.path.join(staging, storage.model_file(pstate.tp_rank, pstate.pp_rank)))
    del copies
    optim_info = None
    if pstate.dp_rank == 0 or optimizer.shards_state_over_dp:
        optim_info, optim_bad = _write_optimizer(optimizer, named, staging, pstate)
        bad += optim_bad
    save_file(rng_state(pstate, tp_rng), os.path.join(staging, storage.rng_file(pstate.rank)))
    mine = {"model": _model_index(named, pstate) if pstate.dp_rank == 0 else {}, "optim": optim_info,
            "non_finite": bad}
    pieces = C.all_gather_object(mine, pstate.world_group)  # also the barrier and the finiteness vote
    _refuse_non_finite(pieces, staging, iteration, pstate)
    final = os.path.join(root, storage.iteration_dir(iteration))
    if pstate.rank == 0:
        meta = _metadata(cfg, plan, iteration, consumed_samples, optimizer, pieces)
        storage.write_json_atomic(os.path.join(staging, storage.METADATA), meta)
        final = storage.publish(root, staging, iteration, keep_last)
    C.barrier(pstate.world_group)  # nobody moves on (or exits) before the checkpoint is published
    return final


def _metadata(cfg: Config, plan: RunPlan, iteration: int, consumed_samples: int, optimizer: ShardedOptimizerState,
              pieces: list[dict]) -> dict[str, Any]:
    model: dict[str, Any] = {}
    for piece in pieces:
        for name, entry in piece["model"].items():
            slot = model.setdefault(name, {k: entry[k] for k in ("shape", "split_dim", "dtype", "padded_rows")})
            slot.setdefault("files", {})[entry["file"]] = entry["region"]
    optim_files = {p["optim"]["file"]: {"tp_rank": p["optim"]["tp_rank"], "ranges": p["optim"]["ranges"]}
                   for p in pieces if p["optim"] is not None}
    return storage.metadata_dict(
        config=cfg.to_flat(), iteration=iteration, consumed_samples=consumed_samples, model=model,
        layout=plan.layout_record(), optimizer_scalars=optimizer.state_scalars(), optimizer_files=optim_files,
        rng_files=True)
