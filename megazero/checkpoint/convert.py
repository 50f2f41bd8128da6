"""Offline conversion: megazero checkpoint <-> full state <-> HF transformers folder.

These run in one process on purpose (a conversion tool, not training): they
assemble the full model from the shards, or slice a full model into the
shards of any target (tp, pp, virtual stages; ep and etp for the experts of
an MoE model, stored by global expert id as a run saves them).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..config import Config, ConfigError, ModelConfig
from ..dtypes import DTYPE_NAMES
from ..model.gpt import GPTModel
from ..model.transformer import TPContext
from ..parallel.layout import Layout
from ..pipeline.partition import chunk_layer_ranges
from ..run_plan import RunPlan, layout_record
from ..tensor_parallel.layers import spec_of
from . import hf_folder, storage
from .hf import from_hf, to_hf
from .hf_deepseek import dequantize_state, hub_rope_layout
from .hf_fields import hf_config, model_config_from_hf
from .hf_tokenizer_export import write_tokenizer
from .load import ShardReader
from .placement import model_tensors
from .recorded_data import copy_hf_tokenizer, recorded_tokenizer
from .save import non_finite, write_tensors
from .slices import Region, expert_region, relative, tp_region

State = dict[str, torch.Tensor]


def read_full_state(path: str, tp: int | None = None, flag: str = "--load") -> tuple[Config, State]:
    """Every tensor of a megazero checkpoint, reassembled at full size.

    Vocabulary padding is kept as saved, or fitted to ``tp`` when given (``tp=1`` gives
    the state dict of a serial ``GPTModel``).
    """
    folder = storage.resolve(path, flag)
    meta = storage.read_metadata(folder)
    cfg = Config.from_flat(meta["config"])
    if "tokenizer" in meta:  # the recorded path while it exists, else the checkpoint's own copy (recorded_data.py):
        tokenizer, kind = recorded_tokenizer(folder, meta)  # what generate.py reads and an HF export ships
        cfg = cfg.updated(tokenizer_model=tokenizer, tokenizer_type=kind)
    reader, state = ShardReader(folder), {}
    for name, entry in meta["model"].items():
        full = torch.zeros(entry["shape"], dtype=getattr(torch, entry["dtype"]))
        whole = [(0, n) for n in entry["shape"]]
        for fname, region in entry["files"].items():
            full[relative([tuple(r) for r in region], whole)] = reader.read(fname, name, [b - a for a, b in region])
        if tp is not None and entry["padded_rows"]:
            full = _fit_rows(full, cfg.model.padded_vocab_size(tp))
        state[name] = full
    return cfg, state


def _fit_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Vocabulary padding for another TP size: drop or add zero rows past the real vocabulary."""
    if t.shape[0] >= rows:
        return t[:rows]
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _stages_of(name: str, cfg: Config, pp: int, vp: int) -> list[int]:
    ranges = chunk_layer_ranges(cfg.model.num_layers, pp, vp)
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        return [r for r in range(pp) if any(layer in chunk for chunk in ranges[r])]
    if name.startswith("embedding."):
        shared = cfg.model.tied_embeddings or cfg.model.mtp_depth > 0  # MTP's last stage embeds too
        tied_copy = name == "embedding.word.weight" and shared and pp > 1
        return [0, pp - 1] if tied_copy else [0]
    return [pp - 1]  # final norm and output head


def target_config(cfg: Config, *, tp: int, pp: int, vp: int = 1, ep: int = 1, etp: int | None = None) -> Config:
    """``cfg`` laid out at (tp, pp, vp; ep, etp), checked as a run at that layout checks it; raises ConfigError first.

    The run's own checks (``Config`` sections, ``RunPlan.resolve``) refuse a --tp that does not divide the
    heads, query groups, hidden or MLP width, a --pp that does not divide the layers, an --ep that does not
    divide the experts, degrees below 1. The batch is the resuming run's choice, not the checkpoint's, so it
    is checked at one that fits any pipeline; the world is the smallest both grids fold into, with sequence
    parallelism where MoE under TP needs it (a run's own setting, not saved).
    """
    try:
        target = cfg.updated(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                             expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        world = pp * math.lcm(tp, (etp or tp) * ep)
        as_run = target.updated(virtual_pipeline_size=vp if vp != 1 else None,
                                global_batch_size=target.training.micro_batch_size * world // tp,
                                sequence_parallel=tp > 1 and cfg.model.num_experts is not None)
        RunPlan.resolve(as_run, world_size=world)
    except ConfigError as err:
        flags = f"--tp {tp} --pp {pp}" + (f" --virtual-pipeline-size {vp}" if vp != 1 else "")
        flags += (f" --ep {ep}" if ep != 1 else "") + (f" --etp {etp}" if etp is not None else "")
        raise ConfigError(f"target layout {flags} does not fit the model: {err}") from None
    return target


def _regions(name: str, shape: list[int], spec: Any, pp_rank: int, layout: Layout) -> dict[str, Region]:
    """File -> the region of ``name`` it holds at ``layout``: a TP shard per tp rank, or for an expert weight
    E/ep experts by global id and an etp slice per (etp, ep) rank, as a run at that layout saves them."""
    if not spec.expert:
        return {storage.model_file(r, pp_rank): tp_region(shape, spec.split_dim, r, layout.tp)
                for r in range(layout.tp)}
    local = shape[0] // layout.ep
    return {storage.expert_file(t, e, pp_rank): expert_region(shape, spec.split_dim, e * local, local, t,
                                                              layout.expert_tp)
            for e in range(layout.ep) for t in range(layout.expert_tp)}


def write_checkpoint(root: str, cfg: Config, state: State, *, tp: int, pp: int, vp: int = 1, ep: int = 1,
                     etp: int | None = None, iteration: int = 0, tokenizer_from: str | None = None,
                     log: Callable[[str], None] = print) -> str:
    """Slice a full state into a (tp, pp, vp; ep, etp) megazero checkpoint with no optimizer state.

    The layout is validated before anything is written: a checkpoint a run could not load is never made.
    ``tokenizer_from``: an HF folder whose tokenizer is copied into the checkpoint (``recorded_data``).
    """
    saved_cfg = target_config(cfg, tp=tp, pp=pp, vp=vp, ep=ep, etp=etp)
    with torch.device("meta"):  # parameters and persistent buffers (the routers' expert_bias)
        tensors = model_tensors([GPTModel(cfg.model, TPContext())])
        specs = {n: spec_of(t) for n, t in tensors.items()}
        buffers = {n for n, t in tensors.items() if not isinstance(t, torch.nn.Parameter)}
    if set(specs) != set(state):
        missing, extra = sorted(set(specs) - set(state)), sorted(set(state) - set(specs))
        raise ValueError(f"state does not fit a {cfg.model.arch} model: missing {missing[:3]}, unexpected {extra[:3]}")
    bad = non_finite(state)
    if bad:
        raise ValueError(f"the weights hold NaN/inf in {bad[:3]}; no checkpoint is written - convert a finite model.")
    padded = cfg.model.padded_vocab_size(tp)
    layout = Layout(tp=tp, dp=math.lcm(tp, (etp or tp) * ep) // tp, pp=pp, ep=ep, etp=etp)  # the smallest world
    os.makedirs(root, exist_ok=True)
    staging = storage.staging_dir(root, iteration, f"{int(time.time() * 1000)}")
    os.makedirs(staging)
    index: dict[str, Any] = {}
    for pp_rank in range(pp):
        files: dict[str, State] = {}
        for name in [n for n in specs if pp_rank in _stages_of(n, cfg, pp, vp)]:
            full = _fit_rows(state[name], padded) if specs[name].valid_rows is not None else state[name]
            entry = index.setdefault(name, {"shape": list(full.shape), "split_dim": specs[name].split_dim,
                                            "dtype": str(full.dtype).replace("torch.", ""),
                                            "padded_rows": specs[name].valid_rows is not None,
                                            "expert": specs[name].expert, "buffer": name in buffers, "files": {}})
            for fname, region in _regions(name, list(full.shape), specs[name], pp_rank, layout).items():
                files.setdefault(fname, {})[name] = full[relative(region, [(0, n) for n in full.shape])].contiguous()
                entry["files"][fname] = region
        for fname, tensors in files.items():
            write_tensors(tensors, os.path.join(staging, fname))  # the umask's mode, as a run's save
    record = {**layout_record(Layout(tp=tp, dp=1, pp=pp), cfg.parallel.zero, vp), "ep": ep, "etp": layout.expert_tp}
    meta = storage.metadata_dict(config=saved_cfg.to_flat(), layout=record, iteration=iteration, consumed_samples=0,
                                 model=index, optimizer_scalars={}, optimizer_files={}, rng_files=False)
    tokenizer = copy_hf_tokenizer(tokenizer_from, staging, cfg.model.vocab_size, log) if tokenizer_from else None
    if tokenizer:
        meta["tokenizer"] = tokenizer
    storage.write_json_atomic(os.path.join(staging, storage.METADATA), meta)
    return storage.publish(root, staging, iteration, keep_last=None)


def save_hf(out_dir: str, cfg: ModelConfig, state: State, tokenizer: str | None,
            max_shard_bytes: int = 5 * 2**30, *, tokenizer_type: str | None = None,
            dtype: torch.dtype | None = None) -> list[str]:
    """config.json, model.safetensors (or model-0000i-of-0000n shards + index) and the tokenizer.

    The weights are written in ``dtype`` (None: the dtype ``state`` holds them in). ``tokenizer`` is
    a sentencepiece model or an HF tokenizer.json (or a folder holding one) of ``tokenizer_type``.
    Written into a staging folder and committed as one unit (``hf_folder.commit``): an earlier
    export in the folder, in either layout, is replaced whole, and a crash midway leaves a folder
    that fails to load rather than one that loads the old weights. Returns the earlier export's
    files that were removed rather than replaced.
    """
    dtype = dtype or stored_dtype(state)
    hf_state = _cast(to_hf(state, cfg), dtype)
    staging = hf_folder.new_staging(out_dir)
    try:
        ids = write_tokenizer(staging, tokenizer, tokenizer_type) if tokenizer else None
        hf_config(cfg, ids, dtype).save_pretrained(staging)
        _write_weights(staging, hf_state, max_shard_bytes)
        return hf_folder.commit(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def stored_dtype(state: State) -> torch.dtype:
    """The dtype a checkpoint holds its weights in: a run's compute dtype, or an HF import's own."""
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def _cast(hf_state: State, dtype: torch.dtype) -> State:
    """Every weight in ``dtype``; one that leaves its range (fp16 tops out at 65504) is refused."""
    # DeepSeek-V3's score-correction bias stays fp32, as transformers keeps it (_keep_in_fp32_modules_strict)
    cast = {name: t if name.endswith("e_score_correction_bias") else t.to(dtype) for name, t in hf_state.items()}
    bad = non_finite(cast)
    if bad:
        raise ValueError(f"--dtype {DTYPE_NAMES[dtype]}: {', '.join(bad[:3])} hold values outside its range; "
                         "export with --dtype bf16 or fp32.")
    return cast


def _write_weights(out_dir: str, hf_state: State, max_shard_bytes: int) -> None:
    """model.safetensors, or shards of at most ``max_shard_bytes`` plus model.safetensors.index.json."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in hf_state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in hf_state.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1)


def _tensor_names(path: str) -> list[str]:
    """The tensors a safetensors file holds, from its header (nothing loaded)."""
    with safe_open(path, "pt") as fh:
        return list(fh.keys())


def load_hf(in_dir: str) -> tuple[ModelConfig, State]:
    """An HF folder's model config and state dict (single or sharded safetensors)."""
    config_path = os.path.join(in_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"--input {in_dir!r} has no config.json; pass a HF transformers model folder.")
    with open(config_path) as fh:
        config = json.load(fh)
    index = os.path.join(in_dir, "model.safetensors.index.json")
    if os.path.isfile(index) and os.path.isfile(os.path.join(in_dir, "model.safetensors")):
        raise ValueError(f"--input {in_dir!r} holds both model.safetensors and model.safetensors.index.json "
                         "(two exports in different layouts; transformers loads model.safetensors): delete "
                         "the stale one, or export again into the folder.")
    if os.path.isfile(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    paths = [os.path.join(in_dir, fname) for fname in files]
    for fname, path in zip(files, paths):
        if not os.path.isfile(path):
            raise ValueError(f"--input {in_dir!r} lacks {fname}; only safetensors HF folders are supported.")
    # the config is checked before any weight is read; the files' headers say which tensors (MTP layers) they hold
    names = [name for path in paths for name in _tensor_names(path)]
    cfg = model_config_from_hf(config, source=config_path, weights=names)
    state: State = {}
    for path in paths:
        state.update(load_file(path))
    if cfg.multi_latent_attention:  # FP8 blocks dequantised, then the RoPE rows in the hub's interleaved order
        state = hub_rope_layout(config, dequantize_state(state))
    if cfg.arch == "llama" and cfg.tied_embeddings:
        state.pop("lm_head.weight", None)
    return cfg, state


def hf_to_checkpoint(in_dir: str, out_root: str, *, tp: int, pp: int, vp: int = 1, ep: int = 1,
                     etp: int | None = None, log: Callable[[str], None] = print) -> str:
    """An HF folder as a megazero checkpoint at (tp, pp, vp; ep, etp), with a copy of its tokenizer."""
    model_cfg, hf_state = load_hf(in_dir)
    cfg = Config(model=model_cfg)
    target_config(cfg, tp=tp, pp=pp, vp=vp, ep=ep, etp=etp)  # before from_hf pads for tp
    full = from_hf(hf_state, model_cfg, model_cfg.padded_vocab_size(tp))
    return write_checkpoint(out_root, cfg, full, tp=tp, pp=pp, vp=vp, ep=ep, etp=etp, tokenizer_from=in_dir, log=log)
