"""Model-state memory, measured from the tensors' own storage (not computed from formulas).

At start-up every rank reports the bytes it holds in parameters, gradients
(main-grad buffer or ZeRO-2 shard) and optimizer state (fp32 master copy and
Adam moments). Views share storage, so each storage is counted once. With
``--offload-optimizer`` the optimizer bytes on the device are 0 and the record
adds ``optimizer_host_bytes`` (host copy, or the disk tier's K buffers) and
``optimizer_disk_bytes`` (the rank's state file). With ``--offload-params``
(ZeRO 3) ``params_bytes`` counts only the gathered units, and
``params_host_bytes`` / ``params_disk_bytes`` the offloaded shards. On CUDA an
offloaded optimizer adds ``transfer_host_bytes``: the pinned fp32 grad shards the
backward copies into (and the disk tier's staging ring, ``offload.HostTransfers``).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from ..config import Placement
from ..model.gpt import count_parameters
from ..parallel import collectives as C
from ..parallel.state import ParallelState
from .protocol import ModelState
from .zero import DistributedOptimizer


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measured_state_bytes(opt: DistributedOptimizer) -> dict[str, int]:
    """Bytes this rank holds (``megazero.memory.model_state_bytes`` is the formula they should match)."""
    params = storage_bytes([buf.param_data for buf in opt.buffers] + [buf.param_shard_data for buf in opt.buffers]
                           + [b.param for buf in opt.buffers for b in buf.buckets])  # ZeRO 3: only gathered ones
    grads = storage_bytes([buf.grad_data for buf in opt.buffers] + [buf.grad_shard_data for buf in opt.buffers]
                          + [b.grad for buf in opt.buffers for b in buf.buckets])
    optimizer = storage_bytes(opt.store.tensors())  # on the device; offloaded state is counted apart
    out = {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": optimizer}
    if opt.store.placement != Placement.DEVICE:  # --offload-optimizer: host buffers and file bytes
        out.update(optimizer_host_bytes=opt.store.host_bytes(), optimizer_disk_bytes=opt.store.disk_bytes())
    if opt.transfers is not None:
        out["transfer_host_bytes"] = opt.transfers.host_bytes()
    stores = [buf.param_store for buf in opt.buffers if buf.param_store is not None]
    if stores:  # --offload-params: the shards' host memory and file bytes
        out.update(params_host_bytes=sum(s.host_bytes() for s in stores),
                   params_disk_bytes=sum(s.disk_bytes() for s in stores))
    return out


def counted_parameters(chunks: list[nn.Module], pstate: ParallelState) -> int:
    """Parameters of the whole model (every stage, TP slices and expert shards counted at full size, tied
    once), counted from the built modules (``megazero.memory.num_parameters`` is the formula from the config)."""
    local = sum(count_parameters(c, pstate.tp, pstate.ep, pstate.etp) for c in chunks)
    total = torch.tensor(float(local), dtype=torch.float64, device=pstate.device)
    if pstate.pp_group is not None:
        C.all_reduce(total, pstate.pp_group)
    return int(total.item())


def memory_record(model: ModelState, pstate: ParallelState) -> dict[str, Any]:
    """The ``"event": "memory"`` metrics record of this rank, read from ``model``'s ZeRO optimizer."""
    opt = model.optimizer
    assert isinstance(opt, DistributedOptimizer), "memory records read the ZeRO optimizer's storage"
    buf = opt.buffers[0]
    return {
        "event": "memory", "rank": pstate.rank, **measured_state_bytes(opt),
        "num_parameters": counted_parameters(model.chunks, pstate),
        "local_parameters": sum(p.numel() for b in opt.buffers for p in b.params),
        "layout": {"tp": pstate.tp, "cp": pstate.cp, "pp": pstate.pp, "dp": pstate.dp, "zero": int(opt.zero),
                   "param_dtype": str(buf.param_dtype).replace("torch.", ""),
                   "main_grads_dtype": str(buf.grad_dtype).replace("torch.", ""),
                   "buckets": sum(len(b.buckets) for b in opt.buffers)},
    }


def memory_records(model: ModelState, pstate: ParallelState) -> list[dict]:
    """Every rank's memory record of ``model`` (``training/parallelize.TrainingModel``), gathered so the logging
    rank can write them all (call on all ranks)."""
    return C.all_gather_object(memory_record(model, pstate), pstate.world_group)
