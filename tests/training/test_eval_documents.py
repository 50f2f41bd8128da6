"""Evaluation on packed documents with --reset-position-ids --reset-attention-mask --eod-mask-loss equals a
reference that runs every document alone: per global batch, the mean over its kept tokens of their loss, then
the mean over the evaluated batches (what training records for the same batches). One 4-rank world walks the
forward-only pass through pp 2 x dp 2 (two micro-batches per rank, learned positions) and cp 2 x dp 2 (RoPE, the
ring); one process checks the serial walk and that the flags change the loss at all.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megazero.config import Config
from megazero.parallel.layout import Layout
from megazero.parallel.state import ParallelState
from megazero.run_plan import RunPlan
from megazero.training.evaluate import evaluate
from megazero.training.parallelize import build_model_chunks
from tests.helpers.batches import EOD, PACKED_RULE, PackedBatches
from tests.helpers.cp_runs import make_cfg, serial_config
from tests.helpers.dist import spawn

EVAL_ITERS, WORLD = 2, 4
CONFIGS = {"gpt2.pp2.dp2": make_cfg("gpt2", pp=2, gbs=8), "llama.cp2.dp2": make_cfg("llama", cp=2, gbs=8)}


def _val_loss(pstate: ParallelState, cfg: Config, rule=PACKED_RULE) -> float:
    plan = RunPlan.resolve(cfg, pstate.layout.world_size)
    chunks = build_model_chunks(cfg, plan, pstate)
    batches = PackedBatches(cfg, pstate.dp_rank, pstate.dp)
    return evaluate(chunks, batches, EVAL_ITERS, pstate, plan.stage_shape, plan.compute_dtype, rule)["val_loss"]


def _world(pstate: ParallelState) -> dict[str, float]:
    out = {}
    for key, cfg in CONFIGS.items():  # collective: every rank builds each layout's groups in the same order
        p = cfg.parallel
        layout = ParallelState.build(Layout(p.tp, WORLD // (p.tp * p.pp * p.cp), p.pp, p.cp), "cpu")
        out[key] = _val_loss(layout, cfg)
    return out


@torch.no_grad()
def per_document_reference(cfg: Config) -> float:
    """Each document of each sample run alone through the serial model; losses where the input is not EOD."""
    cfg = serial_config(cfg)
    model = build_model_chunks(cfg, RunPlan.resolve(cfg, 1), ParallelState.serial())[0].eval()
    batches, means = PackedBatches(cfg, 0, 1), []
    for _ in range(EVAL_ITERS):
        kept = []
        for sample in torch.cat(batches.next_step()):
            inputs, labels = sample[:-1], sample[1:]
            cuts = [0] + [i + 1 for i in range(len(inputs) - 1) if inputs[i] == EOD] + [len(inputs)]
            for start, end in zip(cuts[:-1], cuts[1:]):
                logits = model(inputs[None, start:end])[:, 0, :cfg.model.vocab_size]  # [s, v]
                losses = F.cross_entropy(logits.float(), labels[start:end], reduction="none")
                kept.append(losses[inputs[start:end] != EOD])
        means.append(torch.cat(kept).mean())
    return float(torch.stack(means).mean())


def test_packed_evaluation_equals_each_document_alone():
    results = spawn(_world, WORLD)
    for key, cfg in CONFIGS.items():
        want = per_document_reference(cfg)
        serial = serial_config(cfg)
        assert abs(_val_loss(ParallelState.serial(), serial, rule=None) - want) > 1e-3, key  # the flags matter
        got = [_val_loss(ParallelState.serial(), serial)] + [per_rank[key] for per_rank in results]
        errs = [abs(g - want) / want for g in got]
        assert max(errs) <= 1e-5, f"{key}: serial and ranks 0-3 rel err {errs}"
