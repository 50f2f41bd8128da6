"""Load a checkpoint into any valid layout of the same model, reading only the slices needed.

Model weights (and persistent buffers: the MoE router's ``expert_bias``) load
*before* the optimizer is built (its fp32 master copy is taken from the loaded
weights); optimizer state loads after, piece by piece: for each flat range of
this rank's region of a parameter (a TP shard, or an expert shard), the saved
regions that overlap it are assembled from whichever shards hold them.
Nothing here unpickles: safetensors and JSON only.
"""
from __future__ import annotations

import os
from dataclasses import fields
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch
from safetensors import safe_open
from torch import nn

from ..config import Config, ConfigError, ModelConfig, flag
from ..optimizer.protocol import ModelState, ShardedOptimizerState
from ..parallel import collectives as C
from ..parallel.state import ParallelState
from ..run_plan import RunPlan
from ..tensor_parallel.layers import spec_of
from . import rng_streams, storage
from .placement import model_tensors, named_parameters, region_of
from .save import KINDS
from .slices import Region, intersect, relative
from .overridable import OVERRIDABLE_KEYS
from .validate import saved_pieces

# ModelConfig fields that do not define the saved weights: free to differ from the checkpoint
# (the vocabulary padding is refitted on load, like the layout).
RUN_TIME_KEYS = frozenset({"hidden_dropout", "attention_dropout", "init_method_std", "make_vocab_size_divisible_by"})
# How a setting is compared: by what it resolves to, so None and an explicit equal value agree.
RESOLVED = {"num_query_groups": "query_groups", "ffn_hidden_size": "ffn_size",
            "untie_embeddings_and_output_weights": "tied_embeddings", "max_position_embeddings": "position_table_size",
            "kv_channels": "head_dim", "moe_ffn_hidden_size": "moe_ffn_size"}

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
            t = part[index] if index is not None else part[:]
        except Exception as err:
            raise ValueError(f"checkpoint shard {fname!r} is truncated ({err}); load an earlier checkpoint.") from None
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"checkpoint shard {os.path.join(self.folder, fname)!r} holds NaN/inf in {key!r}; "
                             f"the checkpoint is damaged - load an earlier one.")
        return t


def agree(pstate: ParallelState, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` and return what it returns; a ValueError on any rank raises on every rank.

    Each rank reads only the shards it needs, so a damaged file may fail one rank alone: one
    all-gather that every rank reaches (failed or not) shares the verdict, and no rank goes on
    to a collective that the failed rank would never join.
    """
    result = mine = None
    try:
        result = fn(*args)
    except (ValueError, OSError) as err:
        mine = str(err)
    verdicts = C.all_gather_object(mine, pstate.world_group)
    first = mine or next((v for v in verdicts if v), None)
    if first:
        raise ValueError(first)
    return result


def model_keys() -> list[str]:
    """Every setting that defines the saved model (derived from ModelConfig, so new fields are covered)."""
    return [f.name for f in fields(ModelConfig) if f.name not in RUN_TIME_KEYS | {"seq_length"}]


def _meaning(values: dict[str, Any], key: str) -> Any:
    """What a setting means for the model (e.g. ffn_hidden_size None -> the derived MLP width; moe_ffn_hidden_size
    None -> that width, as an HF Mixtral import records its experts' width)."""
    prop = RESOLVED.get(key)
    if prop is None:
        return values[key]
    view = SimpleNamespace(**values)
    for name in ("ffn_size", prop):  # ffn_size first: moe_ffn_size reads it
        setattr(view, name, getattr(ModelConfig, name).fget(view))
    return getattr(view, prop)


def _shown(value: Any, meaning: Any, key: str) -> str:
    if key == "num_experts" and value is None:
        return "dense model (no --num-experts)"
    return f"{value}" if value == meaning else f"{value} (i.e. {RESOLVED[key]} {meaning})"


def _model_values(flat: dict[str, Any]) -> dict[str, Any]:
    defaults = {f.name: f.default for f in fields(ModelConfig)}
    return {k: flat.get(k, default) for k, default in defaults.items()}  # an older checkpoint lacks newer fields


def refuse_other_optimizer(meta: dict[str, Any], cfg: Config) -> None:
    """An optimizer state is loaded only into the optimizer that saved it: AdamW's moments are not Muon's momentum
    (nor the reverse), so a resume across the two is refused unless it starts the optimizer fresh."""
    ck = cfg.checkpoint
    saved, wanted = meta["config"].get("optimizer", "adamw"), cfg.optimizer.optimizer
    if saved != wanted and ck.load_optim and not ck.finetune and not ck.skip_train:
        raise ConfigError(f"--optimizer {wanted} cannot load the {saved} optimizer state of --load {ck.load}; pass "
                          f"--no-load-optim to start {wanted}'s state fresh from the loaded weights, or --optimizer "
                          f"{saved}.")


def merge_config(meta: dict[str, Any], cfg: Config) -> tuple[Config, list[str]]:
    """The run's config with the model taken from the checkpoint unless typed as a flag (as Megatron's
    --use-checkpoint-args); a typed setting that contradicts it is an error, while one that only the --config
    preset gave yields to the checkpoint's (``overridable.preset_yield_line`` names those). Returns the new
    Config and the settings the checkpoint changed. Layout and run-time settings stay the run's."""
    refuse_other_optimizer(meta, cfg)
    saved, run = _model_values(meta["config"]), cfg.to_flat()
    typed = cfg.typed
    given = typed | (cfg.explicit & set(OVERRIDABLE_KEYS))  # a preset's training setting still applies
    merged = {**run, **{k: saved[k] for k in model_keys() if k not in given}}
    table = _meaning(saved, "max_position_embeddings")
    preset_too_long = saved["arch"] == "gpt2" and "seq_length" in cfg.from_preset and run["seq_length"] > table
    if "seq_length" not in cfg.explicit or preset_too_long:  # a preset's --seq-length stays if the model takes it
        merged["seq_length"] = saved["seq_length"]
    if saved["arch"] == "llama" and "max_position_embeddings" not in typed:
        # no position table to fit, but the model's context length (an HF export's max_position_embeddings):
        # kept, or raised to a longer --seq-length
        merged["max_position_embeddings"] = max(_meaning(saved, "max_position_embeddings"), merged["seq_length"])
    for key in [k for k in model_keys() if k in typed - set(OVERRIDABLE_KEYS)]:  # a cause before its effect
        if key == "max_position_embeddings" and saved["arch"] == "llama":
            continue
        if key == "vocab_size" and saved["vocab_size"] is None:
            continue
        want, have = _meaning(saved, key), _meaning(_model_values(merged), key)
        if want != have:
            raise ConfigError(f"{flag(key)} {_shown(merged[key], have, key)} contradicts the checkpoint's "
                              f"{_shown(saved[key], want, key)}; drop the flag to use the checkpoint's model, "
                              f"or load a checkpoint of this model.")
    if saved["arch"] == "gpt2" and merged["seq_length"] > table:
        raise ConfigError(f"--seq-length {merged['seq_length']} exceeds the checkpoint's learned position table "
                          f"({table}); use --seq-length {table} or less.")
    if saved["arch"] == "gpt2":
        merged["max_position_embeddings"] = table
    yielded = (cfg.from_preset & (set(model_keys()) - set(OVERRIDABLE_KEYS))) | (
        {"seq_length"} if preset_too_long else set())
    new = Config.from_flat(merged, explicit=cfg.explicit - yielded, from_preset=cfg.from_preset - yielded)
    changed = [f"{flag(k)} {merged[k]}" for k in model_keys() + ["seq_length"] if merged[k] != run[k]]
    return new, changed

def _size(region: Region) -> list[int]:
    return [hi - lo for lo, hi in region]


def load_model_weights(folder: str, meta: dict[str, Any], chunks: list[nn.Module], pstate: ParallelState) -> None:
    """Fill this rank's parameters from the overlapping regions of the saved model shards (every rank
    raises if any rank's shards are missing, damaged or hold NaN/inf)."""
    agree(pstate, _load_model_weights, folder, meta, chunks, pstate)


def _experts(num: int | None) -> str:
    return "a dense model without --num-experts" if num is None else f"--num-experts {num}"


def _check_experts(folder: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor], pstate: ParallelState) -> None:
    """A dense checkpoint into an MoE model, or another number of experts: one line before any tensor is read.
    (An MoE checkpoint into a dense model lacks the dense MLP's tensors: the loop below names one.)"""
    saved = meta["config"].get("num_experts")
    mine = next((t.shape[0] * pstate.ep for t in tensors.values() if spec_of(t).expert), None)
    if mine is not None and mine != saved:
        raise ValueError(f"checkpoint {folder!r} holds {_experts(saved)}, but this model has {_experts(mine)}; "
                         f"drop --num-experts to take the checkpoint's model, or load a checkpoint of this one.")


def _load_model_weights(folder: str, meta: dict[str, Any], chunks: list[nn.Module], pstate: ParallelState) -> None:
    reader, index, tensors = ShardReader(folder), meta["model"], model_tensors(chunks)
    _check_experts(folder, meta, tensors, pstate)
    for name, p in tensors.items():
        entry = index.get(name)
        if entry is None:
            raise ValueError(f"checkpoint has no tensor {name!r}; it was saved from a different architecture "
                             f"(it holds {_experts(meta['config'].get('num_experts'))}).")
        shape, target = region_of(p, pstate)
        padded = spec_of(p).valid_rows is not None
        if entry["shape"] != shape and not (padded and entry["shape"][1:] == shape[1:]):
            raise ValueError(f"checkpoint tensor {name!r} has shape {entry['shape']}, this model needs {shape}; "
                             f"it was saved from a model of a different size.")
        local = torch.zeros(_size(target), dtype=torch.float32)
        for fname, region in entry["files"].items():
            overlap = intersect(target, [tuple(r) for r in region])
            if overlap is not None:
                local[relative(overlap, target)] = reader.read(fname, name, _size(region),
                                                               relative(overlap, region)).float()
        with torch.no_grad():
            p.copy_(local.to(p.device, p.dtype))


def _saved_region(reader: ShardReader, name: str, kind: str, region: Region, pieces: list[tuple[str, int, int]]):
    """One saved region of ``name``'s state (a TP shard or an expert shard), assembled from its DP pieces."""
    flat = torch.zeros(_size(region), dtype=torch.float32).view(-1)
    for fname, lo, hi in pieces:
        piece = reader.read(fname, f"{name}/{kind}", [hi - lo])
        if kind == "exp_avg_sq" and bool((piece < 0).any()):
            raise ValueError(f"checkpoint shard {os.path.join(reader.folder, fname)!r} holds negative "
                             f"second moments in {name!r}; the checkpoint is damaged - load an earlier one.")
        flat[lo:hi] = piece
    return flat.view(_size(region))


def load_optimizer_state(folder: str, meta: dict[str, Any], model: ModelState, pstate: ParallelState) -> None:
    """Restore ``model``'s master weights and moments for every piece this rank updates, from any saved layout."""
    if not meta["optimizer"]["files"]:
        return  # e.g. converted from HF: fresh Adam state, masters already equal the loaded weights
    optimizer = model.optimizer
    agree(pstate, _load_pieces, folder, meta, optimizer, model.chunks, pstate)  # before the gathers below
    optimizer.load_state_scalars(meta["optimizer"]["scalars"])
    optimizer.sync_params_from_master()


def _load_pieces(folder: str, meta: dict[str, Any], optimizer: ShardedOptimizerState,
                 chunks: list[nn.Module], pstate: ParallelState) -> None:
    reader = ShardReader(folder)
    names = {id(p): n for n, p in named_parameters(chunks).items()}
    for param, param_lo, views in optimizer.state_segments():
        name = names[id(param)]
        target = region_of(param, pstate)[1]
        # one copy of each saved region (a dense tensor replicated over TP was saved by each TP rank)
        regions: dict[tuple, list[tuple[str, int, int]]] = {}
        for (region, _), pieces in saved_pieces(meta, name).items():
            regions.setdefault(region, pieces)
        n = views["exp_avg"].numel()
        for kind in KINDS:
            local = torch.zeros(_size(target), dtype=torch.float32)
            for region, pieces in regions.items():
                overlap = intersect(target, list(region))
                if overlap is not None:
                    saved = _saved_region(reader, name, kind, list(region), pieces)
                    local[relative(overlap, target)] = saved[relative(overlap, list(region))]
            with torch.no_grad():
                views[kind].copy_(local.view(-1)[param_lo: param_lo + n].to(views[kind].device))


def holds_checkpoint(path: str) -> bool:
    """Whether ``--load PATH`` names something to load: a checkpoint folder, or a folder with ``latest``.

    A ``latest`` that names an incomplete folder still counts, so ``storage.resolve`` reports it.
    """
    return any(os.path.isfile(os.path.join(path, name)) for name in (storage.METADATA, storage.LATEST))


def starts_fresh(load: str | None, save: str | None) -> bool:
    """Whether a run given ``--load`` starts from scratch: the restart idiom's first start.

    ``--load D --save D`` is one command line for the first start and every restart of a job
    (torchrun --max-restarts, a requeued Slurm job): until the first save D holds no checkpoint,
    and the run starts fresh, as Megatron does. A --load elsewhere that holds nothing stays an
    error (``storage.resolve``), so a typo cannot silently restart training from iteration 0.
    """
    if not load or not save or os.path.realpath(load) != os.path.realpath(save):
        return False
    return not holds_checkpoint(load) and not storage.is_hf_folder(load)  # an HF folder: "convert it first"


def resume_rng(folder: str, meta: dict[str, Any], plan: RunPlan, pstate: ParallelState, tp_rng: Any) -> str | None:
    """Restore every saved generator whose state does not depend on what changed (``rng_streams``).

    Returns the one line to print when some kinds start again from --seed instead; None when all resume.
    A checkpoint without RNG files (a converted one) leaves every generator as --seed made it.
    """
    if not has_rng(meta):
        return None
    saved = rng_streams.rng_axes(meta["layout"], meta["config"].get("sequence_parallel", False))
    changed = rng_streams.changed_axes(saved, rng_streams.rng_axes(plan.layout_record(), plan.sequence_parallel))
    source = rng_streams.source_rank(saved, plan.layout, pstate.rank)
    resumable = [kind for kind in rng_streams.KINDS if not kind.depends_on & changed.keys()]
    held = rng_streams.held_kinds(agree(pstate, _load_rng, folder, source, resumable, pstate, tp_rng))
    reseed = rng_streams.reseeded(held, changed)
    return rng_streams.describe(held, reseed, changed) if reseed else None


def has_rng(meta: dict[str, Any]) -> bool:
    """Whether the checkpoint holds per-rank RNG files (a converted one does not: generators come from --seed)."""
    return bool(meta.get("rng_files", meta["optimizer"]["files"]))  # older metadata: only converters left them out


def load_rng(folder: str, pstate: ParallelState, tp_rng: Any) -> None:
    """Exact resume in the saved layout: restore this rank's generators (any rank's bad file raises on every rank)."""
    agree(pstate, _load_rng, folder, pstate.rank, rng_streams.KINDS, pstate, tp_rng)


def _open_rng(folder: str, rank: int) -> Any:
    try:
        return ShardReader(folder)._open(storage.rng_file(rank))
    except Exception as err:  # noqa: BLE001 - missing or not safetensors
        raise _unusable(folder, rank, err) from None


def _unusable(folder: str, rank: int, err: Exception) -> ValueError:
    path = os.path.join(folder, storage.rng_file(rank))
    return ValueError(f"RNG file {path!r} is unusable ({str(err).splitlines()[0][:200]}); load an earlier checkpoint.")


def _load_rng(folder: str, rank: int, kinds: Sequence[rng_streams.GeneratorKind], pstate: ParallelState,
              tp_rng: Any) -> list[str]:
    """Restore the generators of ``kinds`` from saved rank ``rank``'s file (the others keep their --seed
    state); returns every key the file holds."""
    handle = _open_rng(folder, rank)
    held = list(handle.keys())
    keys = [key for key in held if any(kind.holds(key) for kind in kinds)]
    try:
        if "cpu" in keys:
            torch.set_rng_state(handle.get_tensor("cpu"))
        if pstate.device.type == "cuda" and "cuda" in keys:
            torch.cuda.set_rng_state(handle.get_tensor("cuda"), pstate.device)
        if tp_rng is not None:  # a DropoutRNG: every stream saved; unsaved ones were never drawn from
            prefix = "dropout/"
            tp_rng.load_state_dict({k[len(prefix):]: handle.get_tensor(k) for k in keys if k.startswith(prefix)})
    except Exception as err:  # noqa: BLE001 - a missing key or a state of the wrong size
        raise _unusable(folder, rank, err) from None
    return held
