"""Mixture-of-experts training runs for model-parity tests: tiny MoE configs, many layouts inside one world.

A run trains through the pieces ``pretrain_gpt.py`` uses (``build_model_chunks``, ``parallelize``, the
plan's schedule, ``Trainer``: ``optimizer_harness.train``); the parent compares each iteration's loss and
grad norm with the same config trained in one process, which keeps its global batch (dp only changes how
many micro-batches each rank runs).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from megazero.config import Config, ParallelConfig
from megazero.model.chunk import routers_of
from megazero.parallel.layout import Layout
from megazero.parallel.state import ParallelState
from megazero.training.parallelize import TrainingModel
from tests.helpers.optimizer_harness import train
from tests.helpers.session_cache import cached
from tests.helpers.tiny_config import degrees, family, tiny_config

VOCAB = 256
MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)


def make_cfg(arch: str = "llama", *, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
             zero: int = 0, comm: str = "p2p", schedule: str | None = None, vp: int | None = None,
             layers: int = 2, iters: int = 20, model: dict | None = None, parallel: dict | None = None,
             training: dict | None = None) -> Config:
    """``tiny_config`` as a MoE model (E 4, k 2, aux and z losses on), sequence-parallel under TP; ``model`` /
    ``parallel`` / ``training``: more (flat) settings of those sections."""
    return tiny_config(**degrees(tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, zero=zero, sp=tp > 1, comm=comm,
                               schedule=schedule, vp=vp), **(parallel or {}),
                       **family(arch), num_layers=layers, seq_length=32, vocab_size=VOCAB, **{**MOE, **(model or {})},
                       train_iters=iters, **(training or {}))


@dataclass(frozen=True)
class MoERun:
    key: str
    cfg: Config
    rerun: bool = False  # train it a second time: the records must be bitwise equal


def layout_of(cfg: Config, world: int) -> Layout:
    p = cfg.parallel
    return Layout.from_world(world, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.expert_tensor_parallel_size)


def state_for(states: dict[Any, ParallelState], cfg: Config, world: int) -> ParallelState:
    """The ParallelState of ``cfg``'s layout and CP form in a ``world``-rank world, built the first time it is
    asked for (collective: every rank asks for the same layouts in the same order) and reused after."""
    key = (layout_of(cfg, world), cfg.parallel.cp_a2a)
    if key not in states:
        states[key] = ParallelState.build(key[0], "cpu", cp_a2a=key[1])
    state = states[key]
    # The world group is one object shared by every state of the process, charged to the ledger that named it
    # last: a reused state names it again, or its world collectives (Muon's sends) count in another's ledger.
    state.ledger.name_group(state.world_group, "world")
    return state


def records(result: dict[str, Any]) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in result["records"]]


def _routers_where_configured(cfg: Config):
    """A ``train`` hook: a chunk holds routers exactly when one of its layers is MoE (a run that built dense
    layers only would test nothing)."""
    def check(model: TrainingModel, pstate: ParallelState) -> None:
        for chunk in model.chunks:
            moe = any(cfg.model.is_moe_layer(layer) for layer in chunk.layer_ids)
            assert bool(routers_of(chunk)) == moe, f"layers {chunk.layer_ids}: MoE {moe}, routers {routers_of(chunk)}"
    return check


def run_many(pstate: ParallelState, runs: list[MoERun]) -> dict[str, list[list[tuple[float, float]]]]:
    """Every rank trains every run (twice where ``rerun``), building each new layout's groups collectively."""
    states: dict[Any, ParallelState] = {}
    out = {}
    for run in runs:
        state = state_for(states, run.cfg, pstate.layout.world_size)
        hook = _routers_where_configured(run.cfg)
        out[run.key] = [records(train(state, run.cfg, hook=hook)) for _ in range(2 if run.rerun else 1)]
    return out


def serial_config(cfg: Config) -> Config:
    """The same training in one process: no parallelism, ZeRO 0, nothing offloaded, no recompute (bitwise the
    same in one process), the same model."""
    return replace(cfg, parallel=ParallelConfig(), training=replace(cfg.training, recompute="none"))


def serial_records(cfgs: list[Config]) -> list[list[tuple[float, float]]]:
    """One-process runs on one thread (as every spawned rank runs; two would contend with the ranks)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [cached(_serial_records, serial_config(cfg)) for cfg in cfgs]  # once per session per config
    finally:
        torch.set_num_threads(threads)


def _serial_records(cfg: Config) -> list[tuple[float, float]]:
    return records(train(ParallelState.serial(), cfg))
