"""The MoE share of the multi-token-prediction blocks on the last pipeline stage (``model/mtp.py``).

An MTP block takes the last layer's kind (``is_moe_layer``); an MoE one keeps, beyond the dense terms
``activations.mtp_terms`` charges it, what ``moe_plan.moe_layer_terms`` says one MoE layer keeps - unless full
recompute checkpoints it (the chunk's first --recompute-num-layers blocks reach it; None: every block).
"""
from __future__ import annotations

from ..config import Config
from ..run_plan import RunPlan
from .activations import ActivationSpec
from .moe_plan import moe_layer_terms


def mtp_expert_activation_bytes(cfg: Config, run: RunPlan, a: ActivationSpec, blocks_before: int) -> int:
    """Bytes the MTP blocks' MoE layers keep per micro-batch beyond their dense MLP terms (0 without MoE MTP)."""
    m, n = cfg.model, cfg.training.recompute_num_layers
    if not m.mtp_depth or m.num_experts is None or not m.is_moe_layer(m.num_layers):
        return 0
    kept = [k for k in range(1, m.mtp_depth + 1) if a.recompute != "full" or (n is not None and n < blocks_before + k)]
    return len(kept) * sum(moe_layer_terms(cfg, run, a).values())
