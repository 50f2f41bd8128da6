"""THE tiny test config: one base that every test helper varies with ``Config.updated`` (issue 41).

A helper states only what its tests need beyond the base (vocabulary, depth, batch, parallel degrees), so
what all of them share - CPU, fp32, a metrics record every iteration, a constant lr of 1e-3, seed 7, a
32-wide, 4-head model - is written once.
"""
from __future__ import annotations

import os
from typing import Any

from megazero.config import Config, LoggingConfig, ModelConfig, OptimizerConfig, TrainingConfig

# The attention key bias has a zero gradient in exact arithmetic (softmax ignores a per-query shift), so
# with a tiny eps Adam would turn rounding noise into +-lr steps that differ between any two
# summation orders. eps = 1e-4 keeps such noise-only updates ~1e-6 of lr; real grads are >> eps.
ADAM_EPS = 1e-4

BASE = Config(
    model=ModelConfig(arch="gpt2", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                      vocab_size=1000),
    optimizer=OptimizerConfig(lr=1e-3, lr_decay_style="constant", adam_eps=ADAM_EPS, weight_decay=0.1),
    training=TrainingConfig(micro_batch_size=2, global_batch_size=8, train_iters=3, seed=7, device="cpu"),
    logging=LoggingConfig(log_interval=1))

# the short names the helpers (and the CLI's --tp/--pp/--cp/--ep/--etp) use for the parallel settings
SHORT_PARALLEL = dict(tp="tensor_model_parallel_size", pp="pipeline_model_parallel_size",
                      cp="context_parallel_size", ep="expert_model_parallel_size",
                      etp="expert_tensor_parallel_size", zero="zero", sp="sequence_parallel",
                      schedule="pipeline_schedule", vp="virtual_pipeline_size",
                      per_vstage="num_layers_per_virtual_pipeline_stage", comm="cp_comm_type", a2a="cp_a2a_size")


def tiny_config(**flat: Any) -> Config:
    """The base with these flat settings (``pretrain_gpt.py`` flag names, underscored) changed."""
    return BASE.updated(**flat)


def parity_iters(default: int = 5) -> int:
    """Iterations of the MLA / MTP parity runs: ``default`` in the suite, ``MEGAZERO_PARITY_ITERS=20`` for the
    issue's 20 (the same tables, about 3x the CPU; docs/models.md records such a run)."""
    return int(os.environ.get("MEGAZERO_PARITY_ITERS", default))


def degrees(**short: Any) -> dict[str, Any]:
    """Flat parallel settings from their short names: ``degrees(tp=2, sp=True)`` ->
    ``{"tensor_model_parallel_size": 2, "sequence_parallel": True}``."""
    return {SHORT_PARALLEL[name]: value for name, value in short.items()}


def family(arch: str) -> dict[str, Any]:
    """The model family; llama's grouped-query attention shares 2 key/value heads among the 4 heads."""
    return dict(arch=arch, num_query_groups=2 if arch == "llama" else None)
