"""Shared pieces of the pipeline tests: tiny configs, synthetic batches, one training run per config.

A run trains 5 iterations with the real build functions, optimizer, schedule and
``Trainer`` and returns the logged losses, the full (TP-gathered) weights of this
rank's chunks and the schedule's own counts, for the parent test to compare with
the serial run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megazero.config import Config
from megazero.parallel.layout import Layout
from megazero.parallel.state import ParallelState
from megazero.pipeline.schedules import build_schedule, schedule_timeline
from megazero.run_plan import RunPlan
from megazero.training.metrics import MetricsLog
from megazero.training.parallelize import build_training_model
from megazero.training.trainer import Trainer
from tests.helpers.batches import SyntheticBatches  # noqa: F401 (re-exported)
from tests.helpers.compare import full_params, rel_err
from tests.helpers.session_cache import cached
from tests.helpers.tiny_config import degrees, family, tiny_config

VOCAB, ITERS = 1000, 5


def make_cfg(arch: str, *, tp: int = 1, pp: int = 1, sp: bool = False, schedule: str | None = None,
             vp: int | None = None, per_vstage: int | None = None, layers: int = 4, mbs: int = 2,
             gbs: int = 8, seq: int = 16,
             timeline: str | None = None) -> Config:
    """``tiny_config`` at this layout and schedule, lr 3e-3 and AdamW's default weight decay."""
    return tiny_config(**degrees(tp=tp, pp=pp, sp=sp, schedule=schedule, vp=vp, per_vstage=per_vstage),
                       **family(arch), num_layers=layers, seq_length=seq, vocab_size=VOCAB, lr=3e-3, weight_decay=0.01,
                       micro_batch_size=mbs, global_batch_size=gbs, train_iters=ITERS, timeline=timeline)


def train(cfg: Config, pstate: ParallelState) -> dict:
    """Five iterations through the real training pieces; returns losses, weights and schedule counts."""
    plan = RunPlan.resolve(cfg, pstate.layout.world_size)
    model = build_training_model(cfg, plan, pstate)
    schedule = build_schedule(plan, timeline=schedule_timeline(cfg.logging, pstate))
    trainer = Trainer(cfg, pstate, model, schedule, SyntheticBatches(cfg, pstate.dp_rank, pstate.dp),
                      MetricsLog(None, enabled=False))
    records = trainer.train()
    params: dict[str, torch.Tensor] = {}
    for chunk in model.chunks:
        params.update(full_params(chunk, pstate.tp_group))
    return {"losses": [r["loss"] for r in records], "params": params,
            "max_in_flight": schedule.stats.max_in_flight,
            "bubble": [r.get("bubble_fraction") for r in records], "pp_rank": pstate.pp_rank}


@dataclass
class Run:
    key: str
    cfg: Config
    layout: tuple[int, int, int] | None = None  # (tp, dp, pp) when not the spawned world's own layout


def run_many(pstate: ParallelState, runs: list[Run]) -> dict[str, dict]:
    """Every rank trains every run in order (new groups built, collectively, for other layouts)."""
    states = {(pstate.layout.tp, pstate.layout.dp, pstate.layout.pp): pstate}
    out = {}
    for run in runs:
        shape = run.layout or (pstate.layout.tp, pstate.layout.dp, pstate.layout.pp)
        if shape not in states:
            states[shape] = ParallelState.build(Layout(*shape), "cpu")
        out[run.key] = train(run.cfg, states[shape])
    return out


def serial_reference(cfg: Config) -> dict:
    """The same training in this process at tp = pp = dp = 1."""
    flat = cfg.to_flat()
    flat.update(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, sequence_parallel=False,
                pipeline_schedule=None, virtual_pipeline_size=None, num_layers_per_virtual_pipeline_stage=None,
                timeline=None)
    return cached(_serial_train, Config.from_flat(flat))  # once per session for each distinct config


def _serial_train(cfg: Config) -> dict:
    return train(cfg, ParallelState.serial())


def parity_errors(result: dict, ref: dict) -> dict[str, float]:
    """Relative errors of each iteration's loss and of every weight this rank holds."""
    errs = {f"loss[{i}]": abs(a - b) / abs(b) for i, (a, b) in enumerate(zip(result["losses"], ref["losses"]))}
    assert len(result["losses"]) == len(ref["losses"]) == ITERS, (result["losses"], ref["losses"])
    for name, p in result["params"].items():
        expected = ref["params"][name]
        if p.shape != expected.shape:  # vocabulary padding may differ with TP; real rows must match
            p, expected = p[:VOCAB], expected[:VOCAB]
        errs[name] = rel_err(p, expected)
    return errs
