"""Load a checkpoint into any valid layout of the same model, reading only the slices needed.

Model weights load *before* the optimizer is built (its fp32 master copy is
taken from the loaded weights); optimizer state loads after, piece by piece:
for each flat range of a TP-local parameter this rank updates, the saved
pieces that overlap it are read from whichever (tp, dp) shards hold them.
Nothing here unpickles: safetensors and JSON only.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from ..config import Config
from ..parallel.state import ParallelState
from ..tensor_parallel.layers import full_shape, spec_of
from . import storage
from .save import KINDS, named_parameters
from .slices import Region, intersect, relative, tp_region

# Settings that define the model's math: a checkpoint only loads into the same values.
MODEL_KEYS = ("arch", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "vocab_size", "untie_embeddings_and_output_weights", "max_position_embeddings")


class ShardReader:
    """Opens shard files on demand and reads tensor slices with clear errors."""

    def __init__(self, folder: str) -> None:
        self.folder, self.handles = folder, {}

    def _open(self, fname: str):
        if fname not in self.handles:
            path = os.path.join(self.folder, fname)
            if not os.path.isfile(path):
                raise ValueError(f"checkpoint shard {path!r} is missing; the checkpoint is incomplete - "
                                 f"load an earlier one.")
            try:
                self.handles[fname] = safe_open(path, framework="pt")
            except Exception as err:  # safetensors raises its own error types for truncation
                raise ValueError(f"checkpoint shard {path!r} is unreadable or truncated ({err}); "
                                 f"load an earlier checkpoint.") from None
        return self.handles[fname]

    def read(self, fname: str, key: str, expected_shape: list[int], index: tuple[slice, ...] | None = None):
        handle = self._open(fname)
        if key not in handle.keys():
            raise ValueError(f"checkpoint shard {fname!r} has no tensor {key!r} although metadata.json lists it; "
                             f"the metadata does not match the shards.")
        part = handle.get_slice(key)
        if list(part.get_shape()) != list(expected_shape):
            raise ValueError(f"checkpoint shard {fname!r} holds {key!r} with shape {part.get_shape()}, but "
                             f"metadata.json says {expected_shape}; the metadata does not match the shards.")
        try:
            return part[index] if index is not None else part[:]
        except Exception as err:
            raise ValueError(f"checkpoint shard {fname!r} is truncated ({err}); load an earlier checkpoint.") from None


def check_compatible(meta: dict[str, Any], cfg: Config) -> None:
    saved = meta["config"]
    current = cfg.to_flat()
    for key in MODEL_KEYS:
        if saved.get(key) != current.get(key) and not (key == "vocab_size" and current.get(key) is None):
            raise ValueError(f"checkpoint was saved with --{key.replace('_', '-')} {saved.get(key)} but this run "
                             f"has {current.get(key)}; use the same model settings as the checkpoint.")


def _size(region: Region) -> list[int]:
    return [hi - lo for lo, hi in region]


def load_model_weights(folder: str, meta: dict[str, Any], chunks: list[nn.Module], pstate: ParallelState) -> None:
    """Fill this rank's parameters from the overlapping regions of the saved model shards."""
    reader, index = ShardReader(folder), meta["model"]
    for name, p in named_parameters(chunks).items():
        entry = index.get(name)
        if entry is None:
            raise ValueError(f"checkpoint has no tensor {name!r}; it was saved from a different architecture.")
        shape = list(full_shape(p, pstate.tp_size))
        padded = spec_of(p).valid_rows is not None
        if entry["shape"] != shape and not (padded and entry["shape"][1:] == shape[1:]):
            raise ValueError(f"checkpoint tensor {name!r} has shape {entry['shape']}, this model needs {shape}; "
                             f"it was saved from a model of a different size.")
        target = tp_region(shape, spec_of(p).split_dim, pstate.tp_rank, pstate.tp_size)
        local = torch.zeros(_size(target), dtype=torch.float32)
        for fname, region in entry["files"].items():
            overlap = intersect(target, [tuple(r) for r in region])
            if overlap is not None:
                local[relative(overlap, target)] = reader.read(fname, name, _size(region),
                                                               relative(overlap, region)).float()
        with torch.no_grad():
            p.copy_(local.to(p.device, p.dtype))


def _saved_local(reader: ShardReader, meta: dict, name: str, kind: str, tp_rank: int, region: Region):
    """The saved TP-local tensor of rank ``tp_rank`` for ``name``, assembled from its DP pieces."""
    flat = torch.zeros(_size(region), dtype=torch.float32).view(-1)
    for fname, info in meta["optimizer"]["files"].items():
        rng = info["ranges"].get(name)
        if info["tp_rank"] == tp_rank and rng is not None:
            flat[rng[0]: rng[1]] = reader.read(fname, f"{name}/{kind}", [rng[1] - rng[0]])
    return flat.view(_size(region))


def load_optimizer_state(folder: str, meta: dict[str, Any], optimizer: Any, chunks: list[nn.Module],
                         pstate: ParallelState) -> None:
    """Restore master weights and moments for every piece this rank updates, from any saved layout."""
    if not meta["optimizer"]["files"]:
        return  # e.g. converted from HF: fresh Adam state, masters already equal the loaded weights
    reader, saved_tp = ShardReader(folder), meta["layout"]["tp"]
    names = {id(p): n for n, p in named_parameters(chunks).items()}
    for param, param_lo, views in optimizer.state_segments():
        name = names[id(param)]
        entry = meta["model"][name]
        shape = list(full_shape(param, pstate.tp_size))
        target = tp_region(shape, spec_of(param).split_dim, pstate.tp_rank, pstate.tp_size)
        n = views["exp_avg"].numel()
        for kind in KINDS:
            local = torch.zeros(_size(target), dtype=torch.float32)
            for s in range(saved_tp):
                region = tp_region(entry["shape"], entry["split_dim"], s, saved_tp)
                overlap = intersect(target, region)
                if overlap is not None:
                    saved = _saved_local(reader, meta, name, kind, s, region)
                    local[relative(overlap, target)] = saved[relative(overlap, region)]
            with torch.no_grad():
                views[kind].copy_(local.view(-1)[param_lo: param_lo + n].to(views[kind].device))
    optimizer.load_state_scalars(meta["optimizer"]["scalars"])
    optimizer.sync_params_from_master()


def same_layout(meta: dict[str, Any], cfg: Config, pstate: ParallelState) -> bool:
    lay = meta["layout"]
    return (lay["tp"], lay["pp"], lay["dp"], lay["zero"], lay["virtual_stages"]) == (
        pstate.tp_size, pstate.pp_size, pstate.dp_size, cfg.parallel.zero,
        cfg.parallel.virtual_size(cfg.model.num_layers))


def load_rng(folder: str, pstate: ParallelState, tp_rng: Any) -> None:
    """Exact resume in the same layout: restore this rank's generators."""
    handle = ShardReader(folder)._open(storage.rng_file(pstate.rank))
    torch.set_rng_state(handle.get_tensor("cpu"))
    if pstate.device.type == "cuda" and "cuda" in handle.keys():
        torch.cuda.set_rng_state(handle.get_tensor("cuda"), pstate.device)
    if tp_rng is not None and "tp" in handle.keys():
        tp_rng.set_state(handle.get_tensor("tp"))
