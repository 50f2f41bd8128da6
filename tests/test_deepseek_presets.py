"""The DeepSeek-V3-family presets: their shapes against the hub's config.json, their total and active parameters
against transformers' ``DeepseekV3ForCausalLM`` built on the meta device, the layouts their comments launch, and
the tiny one training.

The hub configs below are the published ``config.json`` fields (deepseek-ai/DeepSeek-V3,
moonshotai/Moonlight-16B-A3B), written out here, not derived from the presets: a preset that drifts from its
model fails the field check or the count. transformers builds no MTP layer (it drops the hub's layer 61 on
load): its counts are the main model's (V3: 671B total, 37B active), and the MTP module the presets build
(``mtp_num_layers: 1``, the hub's ``num_nextn_predict_layers``) is counted from transformers' own MoE block.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re

import pytest
import torch

from megazero.arguments import parse_config
from megazero.checkpoint.convert import save_hf
from megazero.config import ModelConfig
from megazero.memory import num_parameters
from megazero.memory.experts import inactive_params
from megazero.model.gpt import GPTModel, count_parameters
from megazero.model.transformer import TPContext
from megazero.tensor_parallel.layers import initialize_parameters, spec_of
from megazero.training.metrics import format_iteration
from megazero.training.run import validate
from tests.helpers.deepseek_hf import LOGIT_TOL, ids, logits_error
from tests.helpers.launch import TEST_VOCAB, train_records

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
YARN_V3 = dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
               mscale=1.0, mscale_all_dim=1.0)
HUB = {  # the published config.json fields that decide the shape and the routing
    "deepseek-v3.yaml": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
        first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid", rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=YARN_V3, tie_word_embeddings=False, num_nextn_predict_layers=1),
    "moonlight-16b-a3b.yaml": dict(
        vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
        n_routed_experts=64, routed_scaling_factor=2.446, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1, num_experts_per_tok=6,
        first_k_dense_replace=1, norm_topk_prob=True, scoring_func="sigmoid", rms_norm_eps=1e-5, rope_theta=50000.0,
        rope_scaling=None, tie_word_embeddings=False, num_nextn_predict_layers=0),
}
PUBLISHED = {"deepseek-v3.yaml": (671, 37), "moonlight-16b-a3b.yaml": (16, 3)}  # billions, as the model cards say
PRESETS = ("deepseek-tiny.yaml", "deepseek-v3.yaml", "moonlight-16b-a3b.yaml")


def preset(name: str, *flags: str) -> ModelConfig:
    cfg, _ = parse_config(["--config", os.path.join(ROOT, "configs", name), *flags])
    return cfg.model if cfg.model.vocab_size else cfg.updated(vocab_size=8000).model  # the corpus's tokenizer


def hub_fields(m: ModelConfig) -> dict:
    """The config.json a preset stands for, read off our fields by DeepseekV3Config's names and meanings."""
    assert m.num_experts is not None
    pattern = m.moe_layer_pattern(m.num_layers)
    dense = pattern.index(True)
    assert all(pattern[dense:]), "DeepSeek's layout: the first k layers dense, every later one MoE"
    shared = m.moe_shared_expert_intermediate_size or 0
    assert shared % m.moe_ffn_size == 0, "HF's shared experts are n_shared_experts experts of the routed width"
    yarn = None if m.rope_scaling_type is None else dict(
        rope_type=m.rope_scaling_type, factor=m.rope_scaling_factor,
        original_max_position_embeddings=m.rope_scaling_original_max_position_embeddings,
        beta_fast=m.rope_scaling_beta_fast, beta_slow=m.rope_scaling_beta_slow, mscale=m.rope_scaling_mscale,
        mscale_all_dim=m.rope_scaling_mscale_all_dim)
    return dict(  # the padded vocabulary: what both models build (equal to the hub's for V3 and Moonlight)
        vocab_size=m.padded_vocab_size(1), hidden_size=m.hidden_size, intermediate_size=m.ffn_size,
        moe_intermediate_size=m.moe_ffn_size, num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_attention_heads, n_shared_experts=shared // m.moe_ffn_size,
        n_routed_experts=m.num_experts, routed_scaling_factor=m.moe_router_topk_scaling_factor or 1.0,
        kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank, qk_rope_head_dim=m.qk_pos_emb_head_dim,
        v_head_dim=m.v_head_dim, qk_nope_head_dim=m.qk_head_dim, n_group=m.moe_router_num_groups or 1,
        topk_group=m.moe_router_group_topk or 1, num_experts_per_tok=m.moe_router_topk, first_k_dense_replace=dense,
        norm_topk_prob=True, scoring_func=m.moe_router_score_function, rms_norm_eps=m.norm_epsilon,
        rope_theta=m.rotary_base, rope_scaling=yarn, tie_word_embeddings=m.tied_embeddings,
        num_nextn_predict_layers=m.mtp_depth)


def hf_model(fields: dict):
    """transformers' DeepseekV3ForCausalLM of these config.json fields, on the meta device (no memory)."""
    fields = dict(fields)
    rope = {"rope_theta": fields.pop("rope_theta"), **(fields.pop("rope_scaling") or {"rope_type": "default"})}
    fields.pop("scoring_func")  # DeepseekV3Config has no such field: its router is sigmoid only
    longest = int(rope["factor"] * rope["original_max_position_embeddings"]) if "factor" in rope else 4096
    config = transformers.DeepseekV3Config(**fields, rope_parameters=rope, max_position_embeddings=longest)
    with torch.device("meta"):
        return transformers.DeepseekV3ForCausalLM(config)


def counts(named: list[tuple[str, torch.Tensor]], is_expert, m: ModelConfig) -> tuple[int, int]:
    """(total, active): active drops E - k of the E routed experts' weights (what a token does not run)."""
    assert m.num_experts is not None
    total = sum(p.numel() for _, p in named)
    experts = sum(p.numel() for name, p in named if is_expert(name, p))
    return total, total - experts * (m.num_experts - m.moe_router_topk) // m.num_experts


def _documented(text: str, what: str) -> int:
    match = re.search(rf"^# {what}: ([\d,]+)", text, re.MULTILINE)
    assert match, f"the preset does not document its {what.lower()}"
    return int(match.group(1).replace(",", ""))


@pytest.mark.parametrize("name", sorted(HUB))
def test_preset_fields_are_the_hub_config(name):
    ours = hub_fields(preset(name))
    assert ours == HUB[name]


def mtp_counts(fields: dict, depth: int) -> tuple[int, int]:
    """(total, active) of ``depth`` MTP modules from transformers' own block: each an MoE block as the last layer
    (DeepSeek's layer 61) plus enorm, hnorm, the 2h -> h eh_proj and the final norm (shared_head.norm)."""
    if depth == 0:
        return 0, 0
    model = hf_model({**fields, "num_hidden_layers": fields["first_k_dense_replace"] + 1})
    named, h = list(model.model.layers[-1].named_parameters()), fields["hidden_size"]
    experts = sum(p.numel() for n, p in named if n.startswith("mlp.experts."))
    block = sum(p.numel() for _, p in named)
    idle = experts * (fields["n_routed_experts"] - fields["num_experts_per_tok"]) // fields["n_routed_experts"]
    module = block + 2 * h * h + 3 * h
    return depth * module, depth * (module - idle)


@pytest.mark.parametrize("name", PRESETS)
def test_total_and_active_parameters_equal_transformers(name):
    """Ours (the built model, MTP included) = transformers' main model + the MTP modules from its blocks; the
    planner's arithmetic agrees; the documented and published figures are these."""
    m = preset(name)
    with torch.device("meta"):
        model = GPTModel(m, TPContext())
    ours = counts(list(model.named_parameters()), lambda _, p: spec_of(p).expert, m)
    fields = HUB.get(name) or hub_fields(m)
    main = counts(list(hf_model(fields).named_parameters()), lambda n, _: ".mlp.experts." in n, m)
    mtp = mtp_counts(fields, m.mtp_depth)
    assert ours == (main[0] + mtp[0], main[1] + mtp[1])
    text = open(os.path.join(ROOT, "configs", name)).read()
    assert ours == (_documented(text, "Parameters"), _documented(text, "Active parameters"))
    assert ours == (num_parameters(m), num_parameters(m) - inactive_params(m)) == (count_parameters(model), ours[1])
    if m.mtp_depth:
        assert _documented(text, "MTP module") == mtp[0]
    if name in PUBLISHED:
        if m.mtp_depth:
            assert re.search(rf"^# Main model: {main[0]:,} parameters, {main[1]:,} active", text, re.MULTILINE)
        assert PUBLISHED[name] in ((round(main[0] / 1e9), round(main[1] / 1e9)),
                                   (round(main[0] / 1e9), int(main[1] / 1e9)))


def test_the_hubs_total_with_mtp():
    """DeepSeek-V3's hub files hold the main model, the MTP module, and the shared embedding and head again."""
    hub = HUB["deepseek-v3.yaml"]
    text = open(os.path.join(ROOT, "configs", "deepseek-v3.yaml")).read()
    copies = 2 * hub["vocab_size"] * hub["hidden_size"]
    # 684.5B of weights, which the model card rounds to 685B (its FP8 block scales add ~0.04B)
    assert round((_documented(text, "Parameters") + copies) / 1e9, 1) == 684.5


@pytest.mark.parametrize("name", PRESETS)
def test_the_commented_layout_validates(name):
    text = open(os.path.join(ROOT, "configs", name)).read()
    line = re.search(r"torchrun (.*) pretrain_gpt\.py --config \S+ (.*)$", text, re.MULTILINE)
    assert line, "the preset's comment launches no layout"
    launcher, flags = line.group(1).split(), line.group(2).split()
    nodes = int(launcher[launcher.index("--nnodes") + 1]) if "--nnodes" in launcher else 1
    world = nodes * int(launcher[launcher.index("--nproc_per_node") + 1])
    cfg, _ = parse_config(["--config", os.path.join(ROOT, "configs", name), *flags])
    layout = validate(cfg.updated(vocab_size=cfg.model.vocab_size or 8000), world_size=world)
    assert layout.world_size == world


def test_tiny_preset_trains_two_iterations(tmp_path):
    """One process, the small corpus: the dense first layer routes nothing, the three MoE layers and the MTP
    module's block (global layer 4) route every token; the first LM and MTP losses are ln V at initialisation
    (the output head starts near uniform)."""
    records = train_records(tmp_path / "m.jsonl", ["--config", "configs/deepseek-tiny.yaml", "--train-iters", "2",
                                                   "--log-interval", "1"], 1)
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert all(math.isfinite(r["mtp_1_loss"]) for r in records)
    assert abs(records[0]["loss"] - math.log(TEST_VOCAB)) < 0.5
    assert abs(records[0]["mtp_1_loss"] - math.log(TEST_VOCAB)) < 0.5
    assert f"| mtp 1 loss {records[0]['mtp_1_loss']:.6E} |" in format_iteration(records[0])  # the log line's
    tokens = 16 * 128 * 4  # the global batch's tokens, k = 4 experts each
    for r in records:
        assert sorted(r["moe_layers"]) == ["1", "2", "3", "4"]
        assert all(sum(v["tokens_per_expert"]) == tokens for v in r["moe_layers"].values())


def test_tiny_preset_exports_to_transformers(tmp_path):
    """The CI-sized preset is one transformers computes: exported as DeepseekV3ForCausalLM (no refused setting),
    ``from_pretrained`` gives megazero's logits within 1e-5 (the MTP module is written as hub layer 4, which
    transformers drops on load, so the main model is compared)."""
    cfg = preset("deepseek-tiny.yaml")
    model = GPTModel(cfg, TPContext())
    initialize_parameters(model, 5, None)
    state = model.state_dict()
    save_hf(str(tmp_path / "hf"), cfg, state, None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    main = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    assert logits_error(dataclasses.replace(cfg, mtp_num_layers=None), main, hf, ids(5)) <= LOGIT_TOL
