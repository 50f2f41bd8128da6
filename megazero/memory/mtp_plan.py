"""What the multi-token-prediction modules on the last pipeline stage (``model/mtp.py``) change in its plan
beyond their parameters (``params.py``) and dense activation terms (``activations.mtp_terms``).

Activations: an MTP block takes the last layer's kind (``is_moe_layer``); an MoE one keeps, beyond the dense
terms ``activations.mtp_terms`` charges it, what ``moe_plan.moe_layer_terms`` says one MoE layer keeps - unless
full recompute checkpoints it (the chunk's first --recompute-num-layers blocks reach it; None: every block).

Gradient order: the depths' backward runs before the main head's (their losses ride on the LM loss, created
later) and ends in depth 1's embedding lookup, so the last stage's word-embedding copy gets its gradient after
the MTP parameters' and before the head's (measured with gradient hooks), not first as a tied head alone would.
"""
from __future__ import annotations

from ..config import Config, ModelConfig
from ..data_parallel.bucketing import cut_buckets
from ..run_plan import RunPlan
from .activations import ActivationSpec
from .moe_plan import moe_layer_terms
from .params import mtp_param_numels


def mtp_expert_activation_bytes(cfg: Config, run: RunPlan, a: ActivationSpec, blocks_before: int) -> int:
    """Bytes the MTP blocks' MoE layers keep per micro-batch beyond their dense MLP terms (0 without MoE MTP)."""
    m, n = cfg.model, cfg.training.recompute_num_layers
    if not m.mtp_depth or m.num_experts is None or not m.is_moe_layer(m.num_layers):
        return 0
    kept = [k for k in range(1, m.mtp_depth + 1) if a.recompute != "full" or (n is not None and n < blocks_before + k)]
    return len(kept) * sum(moe_layer_terms(cfg, run, a).values())


def embedding_copy_in_gradient_order(cfg: ModelConfig, buckets: list, numels: list[int], units: list[int],
                                     bucket_size: int, num_shards: int) -> list:
    """A last stage's ``buckets`` (buffer order: the word-embedding copy's alone, last) in the order their
    gradients arrive: the copy's first (the tied head), or with MTP behind the buckets that start with an MTP
    parameter (module docstring). ``numels`` and ``units``: the chunk's parameters in registration order."""
    reverse = numels[::-1]
    cuts = cut_buckets(reverse, bucket_size, num_shards, tied=[i == len(reverse) - 1 for i in range(len(reverse))],
                       units=units[::-1])
    first = sum(c.start < len(mtp_param_numels(cfg, 1)) for c in cuts[:-1])
    return buckets[:first] + buckets[-1:] + buckets[first:-1]
