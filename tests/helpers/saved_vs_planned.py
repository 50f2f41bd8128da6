"""The bytes one training forward saves (``SavedTensorMeter``) beside the planner's figure for the same run."""
from __future__ import annotations

import torch

from megazero.config import Config
from megazero.memory import PlanSpec, chunk_activation_bytes
from megazero.model.chunk import blocks_of
from megazero.model.recompute import apply_recompute
from megazero.run_plan import RunPlan
from megazero.training.parallelize import build_model_chunks
from tests.helpers.saved_tensors import SavedTensorMeter

VOCAB, SEED, BATCH = 1000, 5, 2


def measured_and_planned(pstate, flat: dict) -> tuple[int, int]:
    """(measured, planned) bytes on this rank for the run ``flat`` describes (flat settings; vocabulary 1000,
    micro-batch 2, CPU), built as a run builds it at ``pstate``'s tp (and the cp ``flat`` names)."""
    cfg = Config.from_flat({**flat, "vocab_size": VOCAB, "micro_batch_size": BATCH, "global_batch_size": BATCH,
                            "device": "cpu", "seed": SEED, "tensor_model_parallel_size": pstate.tp})
    plan = RunPlan.resolve(cfg, pstate.layout.world_size)
    (model,) = build_model_chunks(cfg, plan, pstate)
    apply_recompute(blocks_of(model), cfg.training.recompute)
    tokens = torch.randint(0, VOCAB, (BATCH, cfg.model.seq_length + 1), generator=torch.Generator().manual_seed(0))
    with SavedTensorMeter(model.parameters()) as meter:
        model.train()(tokens[:, :-1], tokens[:, 1:])
    spec = PlanSpec.from_plan(cfg, plan, "cpu").activation_spec()
    return meter.bytes, chunk_activation_bytes(cfg.model, spec, cfg.model.num_layers, True, True)
