"""Evaluation reports each multi-token prediction depth's loss (issue 43): ``val_mtp_<k>_loss``, unweighted.

In one process: against a per-depth ``F.cross_entropy`` reference that slices where the model rolls and masks
(``tests/helpers/mtp_reference.py``), and on packed documents against what the model's own
training forward records for the same batches; ``val_loss`` stays the LM's, bit for bit the walk without MTP
reporting; through the ``Trainer``, the eval record and line carry the depths and the training records stay
those of a run that does not evaluate. In one spawned 4-rank world: pp 2 x dp 2, cp 2 x dp 2, tp 2 (sequence
parallel) x dp 2 and dp 4 at ZeRO 3 with full recompute (the head gathered while the depths run) on packed
documents (each rank keeps different counts at each depth) give one process's values within 1e-6.
"""
from __future__ import annotations

import io
import json
from typing import Any

import torch

from megazero.config import Config
from megazero.model.documents import PackingRule
from megazero.parallel.layout import Layout
from megazero.parallel.state import ParallelState
from megazero.pipeline.runner import step_documents
from megazero.pipeline.schedules import build_schedule
from megazero.run_plan import RunPlan
from megazero.training.evaluate import evaluate
from megazero.training.metrics import MetricsLog, format_eval
from megazero.training.trainer import Trainer
from tests.helpers.batches import PACKED_RULE, PackedBatches, SyntheticBatches
from tests.helpers.cp_runs import serial_config
from tests.helpers.dist import spawn
from tests.helpers.mtp_reference import depth_token_losses, lm_token_losses
from tests.helpers.optimizer_harness import build
from tests.helpers.tiny_config import degrees, family, tiny_config

DEPTH, EVAL_ITERS, WORLD, TOL, VOCAB = 2, 2, 4, 1e-6, 96
MTP_KEYS = tuple(f"val_mtp_{k}_loss" for k in range(1, DEPTH + 1))


def mtp_cfg(**flat: Any) -> Config:
    """A 2-layer llama with D = 2, 16 tokens, 8 samples a global batch of micro-batches of 2."""
    return tiny_config(**family("llama"), mtp_num_layers=DEPTH, seq_length=16, vocab_size=VOCAB, **flat)


def run_eval(pstate: ParallelState, cfg: Config, rule: PackingRule | None) -> dict[str, float]:
    plan = RunPlan.resolve(cfg, pstate.layout.world_size)
    chunks = build(pstate, cfg).chunks  # as a run builds them (ZeRO 3's units, recompute)
    data = (SyntheticBatches if rule is None else PackedBatches)(cfg, pstate.dp_rank, pstate.dp)
    result = evaluate(chunks, data, EVAL_ITERS, pstate, plan.stage_shape, plan.compute_dtype, rule)
    assert all(not chunk.mtp.values for chunk in chunks if chunk.mtp is not None)  # nothing left for training
    return result


def serial_model_and_batches(cfg: Config, rule: PackingRule | None):
    model = build(ParallelState.serial(), cfg).chunks[0].eval()
    data = (SyntheticBatches if rule is None else PackedBatches)(cfg, 0, 1)
    return model, [data.next_step() for _ in range(EVAL_ITERS)]


def lm_walk_loss(model, steps, rule: PackingRule | None) -> float:
    """The validation loss as the walk gave it before MTP was reported: the model's no-grad LM losses."""
    losses = []
    with torch.no_grad():
        for mbs in steps:
            docs = [None] * len(mbs) if rule is None else step_documents(rule, mbs, ParallelState.serial())
            losses += [model(mb[:, :-1], mb[:, 1:], documents=d).float() for mb, d in zip(mbs, docs)]
    return float(torch.stack(losses).mean())


def test_depth_losses_equal_the_cross_entropy_reference():
    """Each depth's value: the mean over the batches of each batch's per-token mean of ``F.cross_entropy``;
    the LM loss equal to the walk's without MTP bit for bit, and to its reference; the log line names them."""
    cfg = mtp_cfg()
    got = run_eval(ParallelState.serial(), cfg, None)
    model, steps = serial_model_and_batches(cfg, None)
    with torch.no_grad():
        depths, lm = [], []
        for mbs in steps:
            tokens = torch.cat(mbs)
            depths.append(torch.stack([losses.mean() for losses in depth_token_losses(model, tokens)]))
            lm.append(lm_token_losses(model, tokens).mean())
    want = torch.stack(depths).double().mean(dim=0).tolist()
    assert len(want) == DEPTH and all(w > 0 for w in want)
    for key, w in zip(MTP_KEYS, want):
        assert abs(got[key] - w) <= TOL * w, (key, got[key], w)
    assert got["val_loss"] == lm_walk_loss(model, steps, None)
    assert abs(got["val_loss"] - float(torch.stack(lm).mean())) <= TOL * got["val_loss"]
    line = format_eval({"iteration": 3, **got})
    assert line.endswith(f"| mtp 1 loss value: {got['val_mtp_1_loss']:.6E} | mtp 2 loss value: "
                         f"{got['val_mtp_2_loss']:.6E}"), line


def test_packed_depth_losses_equal_what_training_records():
    """On packed documents (all three flags, so counts differ by micro-batch): the model's training forward
    (grad on) with the schedule's documents records, per batch, the values evaluation reports."""
    cfg = mtp_cfg()
    got = run_eval(ParallelState.serial(), cfg, PACKED_RULE)
    model, steps = serial_model_and_batches(cfg, PACKED_RULE)
    rows = []
    for mbs in steps:
        for mb, docs in zip(mbs, step_documents(PACKED_RULE, mbs, ParallelState.serial(), DEPTH)):
            model(mb[:, :-1], mb[:, 1:], documents=docs)
        rows += model.mtp.take_values()
    want = torch.stack(rows).double().mean(dim=0).tolist()
    for key, w in zip(MTP_KEYS, want):
        assert abs(got[key] - w) <= TOL * w, (key, got[key], w)
    assert got["val_loss"] == lm_walk_loss(model, steps, PACKED_RULE)
    assert abs(got["val_mtp_1_loss"] - run_eval(ParallelState.serial(), cfg, None)["val_mtp_1_loss"]) > 1e-3


def train_records(cfg: Config, tmp_path, evaluates: bool) -> tuple[list[dict[str, Any]], str]:
    """Two packed training steps through the ``Trainer``, evaluating after each or not: records and stdout."""
    cfg = cfg.updated(train_iters=2, eval_interval=1 if evaluates else 0, eval_iters=1)
    pstate, stream = ParallelState.serial(), io.StringIO()
    schedule = build_schedule(RunPlan.resolve(cfg, 1), packing=PACKED_RULE)
    log = MetricsLog(str(tmp_path / f"metrics{int(evaluates)}.jsonl"), enabled=True, stream=stream)
    trainer = Trainer(cfg, pstate, build(pstate, cfg), schedule, PackedBatches(cfg, 0, 1), log,
                      eval_batches=lambda: PackedBatches(cfg, 0, 1) if evaluates else None)
    records = trainer.train()
    log.close()
    return records, stream.getvalue()


def test_the_trainer_logs_and_records_the_depths_and_training_keeps_its_own(tmp_path):
    """The eval record (metrics file) and line carry each depth; the training steps' mtp_<k>_loss are those of a
    run that does not evaluate (evaluation leaves nothing on the model for the next step's record)."""
    cfg = mtp_cfg()
    with_eval, out = train_records(cfg, tmp_path, True)
    without, _ = train_records(cfg, tmp_path, False)
    evals = [r for r in with_eval if r.get("event") == "eval"]
    steps = [r for r in with_eval if r.get("event") != "eval"]
    assert len(evals) == 2 and all(r[key] > 0 for r in evals for key in MTP_KEYS)
    for got, want in zip(steps, without, strict=True):
        assert [got[f"mtp_{k}_loss"] for k in (1, 2)] == [want[f"mtp_{k}_loss"] for k in (1, 2)]
    written = [json.loads(line) for line in (tmp_path / "metrics1.jsonl").read_text().splitlines()]
    assert [{k: r[k] for k in MTP_KEYS} for r in written if r.get("event") == "eval"] == [
        {k: r[k] for k in MTP_KEYS} for r in evals]
    assert f"| mtp 2 loss value: {evals[-1]['val_mtp_2_loss']:.6E}" in out


LAYOUTS = {"pp2.dp2": degrees(pp=2), "cp2.dp2": degrees(cp=2), "tp2.sp.dp2": degrees(tp=2, sp=True),
           "dp4.zero3.recompute": dict(**degrees(zero=3), recompute="full")}


def _world(pstate: ParallelState) -> dict[str, dict[str, float]]:
    out = {}
    for key, flat in LAYOUTS.items():  # collective: every rank builds each layout's groups in the same order
        cfg = mtp_cfg(**flat)
        p = cfg.parallel
        layout = ParallelState.build(Layout.from_world(WORLD, p.tp, p.pp, p.cp), "cpu")
        out[key] = run_eval(layout, cfg, PACKED_RULE)
    return out


def test_every_layout_reports_what_one_process_reports():
    serial = run_eval(ParallelState.serial(), serial_config(mtp_cfg()), PACKED_RULE)
    bad = []
    for rank, per_layout in enumerate(spawn(_world, WORLD)):
        for key, got in per_layout.items():
            assert got.keys() == serial.keys(), (key, got.keys())
            bad += [f"{key} rank {rank} {name}: {got[name]} vs {w}" for name, w in serial.items()
                    if not abs(got[name] - w) <= TOL * abs(w)]
    assert not bad, "\n".join(bad)
