"""Shared pieces of the MoE checkpoint tests: a tiny MoE config, a load-then-save round trip, and a checkpoint's
full contents read back without megazero's loader, for bitwise comparisons between layouts.

The model: gpt2 (GELU experts with biases), 2 layers of which layer 1 is MoE (so a pp 2 run has a stage
without experts), 4 experts of width 32, a shared expert, aux-loss-free balancing (the router's expert bias).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import torch
from safetensors import safe_open
from torch import nn

from megazero.checkpoint import storage
from megazero.checkpoint.load import load_optimizer_state
from megazero.checkpoint.async_save import AsyncCheckpointer
from megazero.checkpoint.checkpointer import SyncCheckpointer
from megazero.checkpoint.save import CheckpointContext
from megazero.checkpoint.slices import tp_region
from megazero.config import Config
from megazero.model.chunk import routers_of
from megazero.parallel.layout import Layout
from megazero.parallel.state import ParallelState
from megazero.run_plan import RunPlan
from megazero.training.parallelize import build_training_model
from tests.helpers.resume import cfg_for

EXPERTS = 4
KINDS = ("master", "exp_avg", "exp_avg_sq")


def moe_cfg(*, tp: int = 1, etp: int | None = None, ep: int = 1, pp: int = 1, cp: int = 1, zero: int = 0,
            mbs: int = 2, experts: int = EXPERTS, offload_path: str | None = None, **kw: Any) -> Config:
    """The resume tests' tiny gpt2 config (4 iterations, evaluation) as an MoE model in the given layout;
    ``offload_path``: the optimizer state on disk there."""
    base = cfg_for(tp=tp, pp=pp, zero=zero, mbs=mbs, sp=tp > 1, **kw)
    model = dataclasses.replace(base.model, num_experts=experts, moe_ffn_hidden_size=32, moe_layer_freq=["0", "1"],
                                moe_shared_expert_intermediate_size=16, moe_router_enable_expert_bias=True,
                                moe_router_bias_update_rate=0.01)
    offload = dict(offload_optimizer="disk", offload_path=offload_path) if offload_path else {}
    parallel = dataclasses.replace(base.parallel, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                   context_parallel_size=cp, **offload)
    return dataclasses.replace(base, model=model, parallel=parallel)


def layout_state(world: int, cfg: Config) -> ParallelState:
    """The process groups of ``cfg``'s layout over this world (a new set of gloo groups)."""
    p = cfg.parallel
    return ParallelState.build(Layout.from_world(world, p.tp, p.pp, p.context_parallel_size, ep=p.ep,
                                                 etp=p.expert_tensor_parallel_size), "cpu")


def random_biases(chunks: list[nn.Module]) -> None:
    """Every router's expert bias set to seeded values of its own (what training moves it to, but distinct
    per expert and per layer, so a bias loaded into the wrong layer or order shows)."""
    for chunk in chunks:
        for router in routers_of(chunk):
            gen = torch.Generator().manual_seed(1000 + router.layer_id)
            assert router.expert_bias is not None
            router.expert_bias.copy_(torch.randn(router.expert_bias.shape, generator=gen))


def round_trip(pstate: ParallelState, cfg: Config, load: str, save: str,
               edit: Callable[[list[nn.Module]], None] | None = None, asynchronous: bool = False) -> None:
    """Load ``load`` into ``cfg``'s layout as a resume does (``build_training_model`` with its weights, then the
    optimizer) and save it again at once, as the same iteration (``asynchronous``: as --async-save does);
    ``edit`` changes the loaded model's buffers before the save (after the wrap: the optimizer's master copy
    is taken by then, so an edit of a parameter would not reach it)."""
    plan = RunPlan.resolve(cfg, pstate.layout.world_size)
    folder = storage.resolve(load)
    meta = storage.read_metadata(folder)
    model = build_training_model(cfg, plan, pstate, weights=(folder, meta))
    try:
        if edit is not None:
            edit(model.chunks)
        load_optimizer_state(folder, meta, model, pstate)
        ctx = CheckpointContext(save, cfg, plan, pstate, model, log=lambda line: None)
        saver = AsyncCheckpointer(ctx) if asynchronous else SyncCheckpointer(ctx)
        saver.save(int(meta["iteration"]), int(meta["consumed_samples"]))
        saver.finish()
    finally:
        model.close()


def full_contents(root: str) -> dict[str, Any]:
    """Every model tensor and every optimizer state tensor of the checkpoint under ``root``, whole, assembled
    from its files' regions and flat ranges; and its optimizer scalars and recorded layout."""
    folder = storage.resolve(root)
    meta = json.load(open(os.path.join(folder, storage.METADATA)))
    out: dict[str, Any] = {"scalars": meta["optimizer"]["scalars"], "layout": meta["layout"]}
    for name, entry in meta["model"].items():
        full = torch.full(entry["shape"], float("nan"), dtype=getattr(torch, entry["dtype"]))
        for fname, region in entry["files"].items():
            with safe_open(os.path.join(folder, fname), framework="pt") as f:
                full[tuple(slice(lo, hi) for lo, hi in region)] = f.get_tensor(name)
        out[f"model/{name}"] = full
    flats: dict[tuple, torch.Tensor] = {}
    for fname, info in meta["optimizer"]["files"].items():
        with safe_open(os.path.join(folder, fname), framework="pt") as f:
            for name, (lo, hi) in info["ranges"].items():
                entry = meta["model"][name]
                region = info.get("regions", {}).get(name) or tp_region(entry["shape"], entry["split_dim"],
                                                                         info["tp_rank"], meta["layout"]["tp"])
                size = [b - a for a, b in region]
                for kind in KINDS:
                    key = (name, kind, tuple(map(tuple, region)))
                    flat = flats.setdefault(key, torch.full(size, float("nan")).view(-1))
                    flat[lo:hi] = f.get_tensor(f"{name}/{kind}")
    for (name, kind, region), flat in flats.items():
        full = out.setdefault(f"optim/{name}/{kind}", torch.full(meta["model"][name]["shape"], float("nan")))
        full[tuple(slice(lo, hi) for lo, hi in region)] = flat.view([b - a for a, b in region])
    return out
