"""The planner's multi-token-prediction activation terms (``activations.mtp_terms``) against what autograd saves.

One training forward per case of a real 2-layer model with MTP depth 1 and 2 under ``SavedTensorMeter``
(``tests/helpers/saved_vs_planned.py``, as ``test_activations.py`` and ``test_mla_activations.py`` measure the
main blocks): llama with GQA and an MLA model (q LoRA, a value head narrower than the query/key head), fp32 and
bf16, recompute none, selective and full, at tp 1: the plan equals the measured bytes, to the byte, as those
tests require. Each depth adds the same bytes (checked too). Before these terms the plan left the MTP depths
out: depth 1 was 43% of the whole llama model's bytes here (281,376 of 658,384 in fp32). Under pipeline
parallelism only the last stage carries them.
"""
from __future__ import annotations

import itertools

import pytest

from megazero.config import Config
from megazero.memory import PlanSpec, chunk_activation_bytes, layer_terms, plan_memory
from megazero.memory.activations import ActivationSpec
from megazero.memory.mtp_plan import mtp_expert_activation_bytes
from megazero.parallel.state import ParallelState
from tests.helpers.saved_vs_planned import measured_and_planned

LLAMA = dict(arch="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=16)
MLA = dict(arch="llama", num_layers=2, hidden_size=48, num_attention_heads=4, seq_length=16,
           multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
           v_head_dim=6)
MODES = ("none", "selective", "full")


@pytest.mark.parametrize("model", [LLAMA, MLA], ids=["llama", "mla"])
def test_mtp_activation_bytes_are_what_autograd_saves(model):
    bad, grows = [], []
    for bf16, mode in itertools.product((False, True), MODES):
        sizes = []
        for depth in (0, 1, 2):
            case = {**model, "bf16": bf16, "recompute": mode, "mtp_num_layers": depth}
            measured, planned = measured_and_planned(ParallelState.serial(), case)
            sizes.append(measured)
            if measured != planned:
                bad.append(f"bf16={bf16} {mode} depth {depth}: measured {measured}, planned {planned}")
        grows.append((sizes[1] - sizes[0], sizes[2] - sizes[1]))
    assert not bad, "\n".join(bad)
    assert all(one == two > 0 for one, two in grows), grows  # every depth keeps the same bytes


def test_full_recompute_of_the_first_n_blocks_keeps_the_mtp_blocks():
    """--recompute-num-layers 2 checkpoints the 2 main layers (the first blocks, ``apply_recompute``); the MTP
    blocks after them are planned as plain blocks (planner arithmetic; the measured helper checkpoints all)."""
    cfg = Config.from_flat({**LLAMA, "vocab_size": 1000, "recompute": "full", "mtp_num_layers": 2,
                            "micro_batch_size": 2, "global_batch_size": 2})
    spec = PlanSpec.for_world(cfg, 1, "cpu").activation_spec()
    plain = ActivationSpec(**{**spec.__dict__, "recompute": "none"})
    some = chunk_activation_bytes(cfg.model, spec, 2, True, True, 2)
    every = chunk_activation_bytes(cfg.model, spec, 2, True, True, None)
    per_block = sum(layer_terms(cfg.model, plain).values()) - sum(layer_terms(cfg.model, spec).values())
    assert some - every == 2 * per_block > 0
    assert chunk_activation_bytes(cfg.model, spec, 2, True, True, 3) - every == per_block  # the first MTP block in


def test_only_the_last_stage_grows():
    flat = {**LLAMA, "num_layers": 4, "vocab_size": 1000, "micro_batch_size": 2, "global_batch_size": 8,
            "pipeline_model_parallel_size": 2, "seq_length": 64}
    stages = {d: plan_memory(PlanSpec.for_world(Config.from_flat({**flat, "mtp_num_layers": d}), 2)).stages
              for d in (0, 2)}
    assert stages[2][0].activations_bytes == stages[0][0].activations_bytes
    last = [stages[d][1] for d in (0, 2)]
    assert last[1].activations_bytes > last[0].activations_bytes


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_an_moe_mtp_block_keeps_its_moe_terms(mode):
    """MLA + MoE, MTP depth 1 (an MoE block, as the last layer): what the depth adds to the saved bytes against
    the dense MTP terms plus one MoE layer's (``mtp_plan``; none under full recompute), within the 3% the MoE
    layer's own test allows (``test_moe_plan.py``: its terms assume balanced routing)."""
    flat = {**MLA, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "recompute": mode}
    (m0, p0), (m1, p1) = (measured_and_planned(ParallelState.serial(), {**flat, "mtp_num_layers": d}) for d in (0, 1))
    cfg = Config.from_flat({**flat, "mtp_num_layers": 1, "vocab_size": 1000, "micro_batch_size": 2,
                            "global_batch_size": 2, "device": "cpu"})
    spec = PlanSpec.for_world(cfg, 1, "cpu")
    moe = mtp_expert_activation_bytes(cfg, spec.run, spec.activation_spec(), cfg.model.num_layers)
    assert (moe == 0) == (mode == "full")
    planned, measured = p1 - p0 + moe, m1 - m0
    assert abs(planned - measured) <= 0.03 * measured, (planned, measured, moe)
