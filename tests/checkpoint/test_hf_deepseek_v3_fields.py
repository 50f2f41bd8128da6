"""DeepseekV3ForCausalLM configs <-> megazero flags (issue 43): every HF field megazero cannot represent, and every
megazero setting DeepseekV3ForCausalLM cannot compute, refused in one line naming it (the tool exits 2 before
writing); a config of DeepSeek-V3's own shape maps to its flags and back; a tensor no megazero tensor takes, an FP8
weight without its scales and an MTP layer megazero cannot take fail naming them.
"""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from megazero.checkpoint.convert import load_hf
from megazero.checkpoint.hf import from_hf, hf_config, model_config_from_hf, to_hf
from megazero.config import ModelConfig
from tests.helpers.deepseek_hf import YARN, hf_dict, hf_model
from tests.helpers.tool_module import load_tool


# HF fields megazero cannot represent (or would ignore): each named, field=value, in one line.
REFUSED = [("scoring_func", "softmax"), ("topk_method", "greedy"),
           ("num_key_value_heads", 2), ("norm_topk_prob", False), ("topk_group", 1), ("attention_bias", True),
           ("hidden_act", "gelu"), ("moe_layer_freq", 2), ("n_shared_experts", 0), ("output_router_logits", True),
           ("some_new_field", 3)]


@pytest.mark.parametrize("field,value", REFUSED, ids=[f for f, _ in REFUSED])
def test_each_field_megazero_cannot_express_is_refused_in_one_line(field, value):
    with pytest.raises(ValueError) as err:
        model_config_from_hf(hf_dict("v3", **{field: value}))
    assert f"{field}={json.dumps(value)}" in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("rope,named", [
    ({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, 'rope_parameters.rope_type="dynamic"'),
    ({**YARN, "attention_factor": 0.9}, "rope_parameters.attention_factor=0.9"),
    ({**YARN, "mscale_all_dim": None}, "rope_parameters.mscale=0.8 without mscale_all_dim"),
    ({**YARN, "truncate": False}, "rope_parameters.truncate=false"),
], ids=["dynamic", "attention_factor", "mscale_alone", "truncate"])
def test_rope_fields_megazero_cannot_compute_are_refused(rope, named):
    with pytest.raises(ValueError, match="cannot express") as err:
        model_config_from_hf(hf_dict("v3", rope_parameters=rope))
    assert named in str(err.value), str(err.value)


def test_a_quantisation_other_than_fp8_128_blocks_is_refused():
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 64]}
    with pytest.raises(ValueError, match=r"quantization_config.weight_block_size=\[64, 64\]"):
        model_config_from_hf(hf_dict("v3", quantization_config=quant))


def test_a_config_of_deepseek_v3s_shape_maps_to_its_flags():
    """The hub's field names (rope_scaling with "type", rope_theta outside it, the remote code's training fields):
    the flags megazero trains DeepSeek-V3 with, --mtp-num-layers 1 when the weights hold layer 61 (an MoE layer,
    as megazero's MTP block after an MoE last layer is); MoE MTP layers after dense ones are refused."""
    hub = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
               intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
               num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
               kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
               topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8, moe_layer_freq=1,
               first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid", aux_loss_alpha=0.001,
               seq_aux=True, hidden_act="silu", max_position_embeddings=163840, rms_norm_eps=1e-6,
               rope_theta=10000, rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
               attention_bias=False, attention_dropout=0.0, tie_word_embeddings=False, num_nextn_predict_layers=1,
               ep_size=1, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16",
               quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "weight_block_size": [128, 128]})
    kimi = model_config_from_hf({**hub, "model_type": "kimi_k2"}, weights=[])  # Kimi K2's name for the same class
    assert kimi.multi_latent_attention and kimi.num_experts == 256
    cfg = model_config_from_hf(hub, weights=["model.layers.61.eh_proj.weight"])  # the MTP layer: MoE, as layer 60
    assert cfg.mtp_depth == 1 and model_config_from_hf(hub, weights=["model.layers.60.mlp.gate.weight"]).mtp_depth == 0
    with pytest.raises(ValueError, match=r"first_k_dense_replace=61 with num_nextn_predict_layers=1 \(MTP layer "
                                         r"model.layers.61 is a mixture of experts after dense layers"):
        model_config_from_hf({**hub, "first_k_dense_replace": 61}, weights=["model.layers.61.eh_proj.weight"])
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == (
        1536, 512, 128, 64, 128)
    assert (cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_size, cfg.moe_shared_expert_intermediate_size) == (
        256, 8, 2048, 2048)
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk, cfg.moe_router_topk_scaling_factor) == (8, 4, 2.5)
    assert cfg.moe_layer_pattern(61) == (False,) * 3 + (True,) * 58 and cfg.moe_router_enable_expert_bias
    assert (cfg.rope_scaling_type, cfg.rope_scaling_factor, cfg.rope_scaling_original_max_position_embeddings,
            cfg.rope_scaling_mscale_all_dim, cfg.ffn_size) == ("yarn", 40.0, 4096, 1.0, 18432)
    back = hf_config(cfg).to_dict()
    for key in ("n_group", "topk_group", "first_k_dense_replace", "n_shared_experts", "q_lora_rank",
                "num_key_value_heads"):
        assert back[key] == hub[key], key
    assert back["rope_parameters"]["factor"] == 40.0 and back["rope_parameters"]["mscale_all_dim"] == 1.0


def v3_config() -> ModelConfig:
    return model_config_from_hf(hf_dict("v3"))


NOT_EXPORTABLE = [
    (dict(mla_latent_norm_epsilon=1e-5), "--mla-latent-norm-epsilon 1e-05"),
    (dict(moe_router_score_function="softmax", moe_router_num_groups=None, moe_router_group_topk=None),
     "--moe-router-score-function softmax"),
    (dict(moe_shared_expert_intermediate_size=None), "--moe-shared-expert-intermediate-size None"),
    (dict(moe_shared_expert_intermediate_size=24), "--moe-shared-expert-intermediate-size 24"),
    (dict(moe_layer_freq=["[0,1,0]"]), "--moe-layer-freq with a dense layer after an MoE one"),
    (dict(moe_expert_capacity_factor=1.0), "--moe-expert-capacity-factor"),
    (dict(moe_router_num_groups=2, moe_router_group_topk=1), "--moe-router-group-topk 1 with --moe-router-topk 4"),
]


@pytest.mark.parametrize("changes,named", NOT_EXPORTABLE, ids=[n.split()[0] + str(i)
                                                               for i, (_, n) in enumerate(NOT_EXPORTABLE)])
def test_each_setting_deepseek_v3_cannot_compute_is_refused_in_one_line(changes, named):
    cfg = dataclasses.replace(v3_config(), **changes)
    for export in (lambda: hf_config(cfg), lambda: to_hf({}, cfg)):
        with pytest.raises(ValueError, match="DeepseekV3ForCausalLM cannot compute") as err:
            export()
        assert named in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_tensor_left_unread_or_an_fp8_weight_without_scales_fails_naming_it(tmp_path):
    hf_model("v2_lite", 5).save_pretrained(tmp_path)
    cfg, state = load_hf(str(tmp_path))
    extra = "model.layers.1.mlp.experts.4.up_proj.weight"  # an expert the config does not count
    with pytest.raises(ValueError, match=f"hold '{extra}' that no tensor"):
        from_hf({**state, extra: state["model.layers.1.mlp.experts.0.up_proj.weight"]}, cfg, cfg.padded_vocab_size(1))
    orphan = "model.layers.0.self_attn.o_proj.bias_scale_inv"  # block scales of no weight
    with pytest.raises(ValueError, match=f"hold '{orphan}' that no tensor"):
        from_hf({**state, orphan: torch.ones(1, 1)}, cfg, cfg.padded_vocab_size(1))
    name = "model.layers.0.self_attn.o_proj.weight"
    with pytest.raises(ValueError, match=f"{name} is torch.float8_e4m3fn without its {name}_scale_inv"):
        from_hf({**state, name: state[name].to(torch.float8_e4m3fn)}, cfg, cfg.padded_vocab_size(1))


def test_a_config_naming_mtp_layers_the_weights_lack_imports_without_mtp():
    """transformers writes num_nextn_predict_layers 1 and saves no MTP layer: nothing to drop, the model imports
    with D = 0 (the weights, not the config, say whether the layer is there)."""
    cfg = model_config_from_hf(hf_dict("v2_lite", num_nextn_predict_layers=1), weights=["lm_head.weight"])
    assert cfg.mtp_depth == 0
    with_layer = model_config_from_hf(hf_dict("v2_lite", num_nextn_predict_layers=1),
                                      weights=["lm_head.weight", "model.layers.2.eh_proj.weight"])
    assert with_layer.mtp_depth == 1


def test_the_tool_refuses_an_unrepresentable_field_in_one_line_before_writing(tmp_path, capsys):
    hf_model("v2_lite", 10).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "scoring_func": "softmax"}))
    capsys.readouterr()  # save_pretrained's progress bar
    assert load_tool("convert_checkpoint").main(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mz"),
                                                 "--to", "megazero"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "scoring_func=" in err, err
    assert not os.path.exists(tmp_path / "mz")
