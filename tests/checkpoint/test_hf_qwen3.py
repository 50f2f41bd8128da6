"""Qwen3 (dense) <-> megazero: a tiny Qwen3ForCausalLM made by transformers converts in and out bitwise, and the
converted model (llama with --qk-layernorm, and --kv-channels for a head_dim other than hidden / heads) gives
transformers' logits; Qwen3 fields megazero cannot express are refused. The references are transformers' own
Qwen3 classes, never megazero itself.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from megazero.checkpoint.convert import read_full_state
from megazero.checkpoint.hf import from_hf, hf_config, model_config_from_hf, to_hf
from megazero.config import ConfigError, ModelConfig
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from tests.helpers.reference import full_logits
from tests.helpers.tool_module import load_tool

transformers = pytest.importorskip("transformers")

# head_dim 32, not hidden / heads = 16, as in Qwen3-30B-A3B (--kv-channels); GQA with 2 query groups
TINY_QWEN3 = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=64, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})
LOGIT_TOL = 1e-5  # fp32, absolute
# (field, value) pairs Qwen3 checkpoints may carry that megazero's math cannot express; each must be named.
QWEN3_REFUSED = [("use_sliding_window", True), ("attention_bias", True), ("hidden_act", "gelu"),
                 ("layer_types", ["full_attention", "sliding_attention"]), ("mlp_bias", True),
                 ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6})]


def _qwen3(seed: int, **overrides) -> torch.nn.Module:
    """A random tiny Qwen3 whose q/k norm weights are not ones, so a dropped or swapped norm moves the logits."""
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**TINY_QWEN3, **overrides}))
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape))
            layer.input_layernorm.weight.add_(0.1 * torch.randn(64))
    return model.eval()


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(seed))


def _ours(cfg: ModelConfig, state: dict) -> GPTModel:
    model = GPTModel(cfg, TPContext()).eval()
    model.load_state_dict(state)
    return model


def _convert(args: list[str]) -> int:
    """tools/convert_checkpoint.py in-process (its exit status)."""
    return load_tool("convert_checkpoint").main(args)


def test_qwen3_folder_to_megazero_tp2_and_back_bitwise(tmp_path):
    """HF folder -> megazero (tp 2) -> HF folder: logits within 1e-5 of transformers', weights and logits bitwise."""
    hf = _qwen3(0)
    hf.save_pretrained(tmp_path / "hf")
    ids = _ids(1)
    with torch.no_grad():
        theirs = hf(ids).logits
    assert _convert(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mz"), "--to", "megazero",
                     "--tp", "2"]) == 0
    cfg, state = read_full_state(str(tmp_path / "mz"), tp=1)
    assert cfg.model.qk_layernorm and cfg.model.rotary_base == 1e6 and cfg.model.query_groups == 2
    assert cfg.model.kv_channels == 32
    assert (full_logits(_ours(cfg.model, state), ids) - theirs).abs().max() <= LOGIT_TOL
    # the check can fail: the same weights without the head norms compute something else
    plain = {k: v for k, v in state.items() if not k.endswith(("q_norm.weight", "k_norm.weight"))}
    no_norms = full_logits(_ours(dataclasses.replace(cfg.model, qk_layernorm=False), plain), ids)
    assert (no_norms - theirs).abs().max() > 100 * LOGIT_TOL

    assert _convert(["--input", str(tmp_path / "mz"), "--output", str(tmp_path / "back"), "--to", "hf"]) == 0
    original, exported = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" /
                                                                                       "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["head_dim"]) == ("qwen3", ["Qwen3ForCausalLM"], 32)
    with torch.no_grad():
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()(ids).logits
    assert torch.equal(again, theirs)


def test_tied_qwen3_state_round_trips_in_process():
    """tie_word_embeddings (the small Qwen3 models tie), head_dim = hidden / heads: logits within 1e-5,
    HF state -> megazero -> HF bitwise."""
    hf = _qwen3(2, tie_word_embeddings=True, head_dim=16)
    cfg = model_config_from_hf(hf.config.to_dict())
    assert cfg.tied_embeddings and cfg.qk_layernorm and cfg.kv_channels is None
    hf_state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied: save_pretrained drops it
    ours = from_hf(hf_state, cfg, cfg.padded_vocab_size(1))
    ids = _ids(3)
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (full_logits(_ours(cfg, ours), ids) - theirs).abs().max() <= LOGIT_TOL
    back = to_hf(ours, cfg)
    assert back.keys() == hf_state.keys() and all(torch.equal(back[k], hf_state[k]) for k in hf_state)
    assert hf_config(cfg).to_dict()["tie_word_embeddings"] is True


def test_megazero_config_with_qk_layernorm_exports_as_qwen3():
    """llama + --qk-layernorm writes a Qwen3 config that reads back to the same model; without it, Llama."""
    cfg = ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                      vocab_size=300, qk_layernorm=True, untie_embeddings_and_output_weights=True)
    written = hf_config(cfg).to_dict()
    assert (written["model_type"], written["use_sliding_window"], written["head_dim"]) == ("qwen3", False, 8)
    assert model_config_from_hf(written).kv_channels is None  # hidden / heads: nothing to set
    back = model_config_from_hf(written)
    keys = ("qk_layernorm", "num_layers", "hidden_size", "num_attention_heads", "query_groups", "ffn_size",
            "vocab_size", "norm_epsilon", "rotary_base", "tied_embeddings", "position_table_size")
    assert {k: getattr(back, k) for k in keys} == {k: getattr(cfg, k) for k in keys}
    plain = ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=300)
    assert hf_config(plain).to_dict()["model_type"] == "llama"


@pytest.mark.parametrize("field,value", QWEN3_REFUSED, ids=[f for f, _ in QWEN3_REFUSED])
def test_each_qwen3_field_megazero_cannot_express_is_refused(field, value):
    config = transformers.Qwen3Config(**TINY_QWEN3).to_dict()
    config[field] = value
    with pytest.raises(ValueError) as err:
        model_config_from_hf(config)
    key = f"{field}.rope_type" if field == "rope_parameters" else field
    shown = json.dumps(value["rope_type"] if field == "rope_parameters" else value)
    assert f"{key}={shown}" in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_qwen3_head_dim_defaults_to_128_and_an_inactive_window_is_harmless():
    """A config.json without head_dim means transformers' 128, not hidden / heads; one equal to hidden / heads
    needs no --kv-channels; sliding_window and max_window_layers do nothing while use_sliding_window is false."""
    config = transformers.Qwen3Config(**TINY_QWEN3).to_dict()
    config.update(sliding_window=4096, max_window_layers=1)
    assert model_config_from_hf(config).qk_layernorm
    assert model_config_from_hf({**config, "head_dim": 16}).kv_channels is None
    del config["head_dim"]
    assert model_config_from_hf(config).head_dim == 128


def test_llama_head_dim_maps_to_kv_channels():
    """LlamaForCausalLM with head_dim 32 (hidden / heads = 16): logits within 1e-5, state round trip bitwise."""
    torch.manual_seed(5)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{k: v for k, v in TINY_QWEN3.items() if k != "rope_parameters"})).eval()
    cfg = model_config_from_hf(hf.config.to_dict())
    assert (cfg.kv_channels, cfg.qk_layernorm) == (32, False)
    ours = from_hf(hf.state_dict(), cfg, cfg.padded_vocab_size(1))
    ids = _ids(6)
    with torch.no_grad():
        assert (full_logits(_ours(cfg, ours), ids) - hf(ids).logits).abs().max() <= LOGIT_TOL
    back = to_hf(ours, cfg)
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
    assert hf_config(cfg).to_dict()["head_dim"] == 32


def test_gpt2_with_kv_channels_cannot_export():
    cfg = ModelConfig(arch="gpt2", num_layers=1, hidden_size=64, num_attention_heads=4, kv_channels=32,
                      vocab_size=300)
    with pytest.raises(ValueError, match="--kv-channels 32 .* cannot be expressed by HF GPT2"):
        hf_config(cfg)


def test_qk_layernorm_needs_llama():
    with pytest.raises(ConfigError, match="--qk-layernorm needs --arch llama"):
        ModelConfig(arch="gpt2", num_layers=1, hidden_size=64, num_attention_heads=4, qk_layernorm=True)
