"""Mixtral and Qwen3-MoE <-> megazero: tiny models made by transformers convert in (at an expert-parallel layout)
and out bitwise, from the hub's per-expert keys (what ``save_pretrained`` writes) and from transformers 5's stacked
in-memory experts; the converted model gives transformers' logits (fp32, within 1e-5); a model trained through
pretrain_gpt.py exports to a folder ``from_pretrained`` loads; HF fields and megazero settings the other side
cannot compute are refused in one line, and an HF expert tensor no megazero tensor takes fails naming it. The
references are transformers' own classes, never megazero itself.
"""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megazero.checkpoint import storage
from megazero.checkpoint.convert import load_hf, read_full_state
from megazero.checkpoint.hf import from_hf, hf_config, model_config_from_hf, to_hf
from megazero.config import ModelConfig
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from tests.helpers.launch import launch
from tests.helpers.reference import full_logits
from tests.helpers.tool_module import load_tool

transformers = pytest.importorskip("transformers")

VOCAB = 8000  # the default corpus's tokenizer, so pretrain_gpt.py trains the converted model on it
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, num_experts_per_tok=2)
# Mixtral: 4 experts in every layer; Qwen3-MoE: head_dim 32 (--kv-channels), layer 0 dense (mlp_only_layers),
# norm_topk_prob false (--moe-router-pre-softmax)
FAMILIES = {
    "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig,
                dict(num_local_experts=4, intermediate_size=32)),
    "qwen3_moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig,
                  dict(num_experts=4, moe_intermediate_size=32, intermediate_size=48, head_dim=32,
                       mlp_only_layers=[0], norm_topk_prob=False)),
}
LOGIT_TOL = 1e-5  # fp32, absolute


def _hf_model(kind: str, seed: int) -> torch.nn.Module:
    """A random tiny model whose norms are not ones and whose router is sharp enough that top-k choices differ."""
    model_cls, config_cls, extra = FAMILIES[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**COMMON, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape))
            elif name.endswith("gate.weight") and p.shape[0] == 4:  # the router
                p.normal_(0, 0.5)
    return model.eval()


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(seed))


def _ours(cfg: ModelConfig, state: dict) -> GPTModel:
    model = GPTModel(cfg, TPContext()).eval()
    model.load_state_dict(state)
    return model


def _logits_error(cfg: ModelConfig, state: dict, hf: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return float((full_logits(_ours(cfg, state), ids) - hf(ids).logits).abs().max())


@pytest.mark.parametrize("kind,layout", [("mixtral", ["--ep", "2"]), ("qwen3_moe", ["--tp", "2", "--ep", "2"])])
def test_folder_to_megazero_at_ep2_and_back_bitwise(kind, layout, tmp_path):
    """save_pretrained folder -> megazero (experts over 2 ep ranks) -> HF folder: logits within 1e-5 of
    transformers', the weights bitwise, and from_pretrained of the export gives transformers' logits exactly."""
    hf = _hf_model(kind, 0)
    hf.save_pretrained(tmp_path / "hf")
    convert, ids = load_tool("convert_checkpoint"), _ids(1)
    assert convert.main(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mz"), "--to", "megazero",
                         *layout]) == 0
    folder = storage.resolve(str(tmp_path / "mz"))
    meta = storage.read_metadata(folder)
    experts = meta["model"]["layers.1.mlp.experts.fc1_weight"]
    etp = 2 if "--tp" in layout else 1  # --etp defaults to --tp
    # stored by global expert id: two experts per ep rank, each etp rank its slice of them
    assert experts["shape"][0] == 4 and len(experts["files"]) == 2 * etp
    assert sorted(r[0] for r in experts["files"].values()) == sorted([[0, 2], [2, 4]] * etp)
    cfg, state = read_full_state(str(tmp_path / "mz"), tp=1)
    assert cfg.model.num_experts == 4 and cfg.model.moe_router_topk == 2
    assert _logits_error(cfg.model, state, hf, ids) <= LOGIT_TOL
    # the check can fail: the same weights with two experts swapped compute something else
    swapped = dict(state)
    for name in ("fc1_weight", "gate_weight", "fc2_weight"):
        swapped[f"layers.1.mlp.experts.{name}"] = state[f"layers.1.mlp.experts.{name}"][[1, 0, 2, 3]]
    assert _logits_error(cfg.model, swapped, hf, ids) > 100 * LOGIT_TOL

    assert convert.main(["--input", str(tmp_path / "mz"), "--output", str(tmp_path / "back"), "--to", "hf"]) == 0
    original, exported = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "back"))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["model_type"] == kind and written["architectures"] == [FAMILIES[kind][0].__name__]
    with torch.no_grad():
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()(ids).logits
        assert torch.equal(again, hf(ids).logits)


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_stacked_in_memory_experts_convert_like_the_hub_layout(kind, tmp_path):
    """transformers 5's state_dict() stacks the experts (gate_up_proj [E, 2F, H], down_proj [E, H, F]), and so does
    save_pretrained(save_original_format=False); both convert to the same megazero tensors as the per-expert keys
    save_pretrained writes by default."""
    hf = _hf_model(kind, 2)
    assert any(k.endswith("experts.gate_up_proj") for k in hf.state_dict())  # the layout under test
    hf.save_pretrained(tmp_path / "hub")
    hf.save_pretrained(tmp_path / "stacked", save_original_format=False)  # the in-memory layout on disk
    cfg = model_config_from_hf(hf.config.to_dict())
    per_expert = from_hf(load_file(tmp_path / "hub" / "model.safetensors"), cfg, cfg.padded_vocab_size(1))
    for stacked in (hf.state_dict(), load_hf(str(tmp_path / "stacked"))[1]):
        assert any(k.endswith("experts.down_proj") for k in stacked)
        ours = from_hf(stacked, cfg, cfg.padded_vocab_size(1))
        assert ours.keys() == per_expert.keys() and all(torch.equal(ours[k], per_expert[k]) for k in ours)
    assert _logits_error(cfg, per_expert, hf, _ids(3)) <= LOGIT_TOL


def test_qwen3_moe_config_maps_the_router_and_dense_layers():
    cfg = model_config_from_hf(_hf_model("qwen3_moe", 0).config.to_dict())
    assert (cfg.qk_layernorm, cfg.kv_channels, cfg.moe_router_pre_softmax, cfg.moe_ffn_size, cfg.ffn_size) == (
        True, 32, True, 32, 48)
    assert cfg.moe_layer_pattern(2) == (False, True)
    normed = model_config_from_hf({**_hf_model("qwen3_moe", 0).config.to_dict(), "norm_topk_prob": True,
                                   "mlp_only_layers": [], "decoder_sparse_step": 2})
    assert not normed.moe_router_pre_softmax and normed.moe_layer_pattern(2) == (False, True)
    back = hf_config(cfg).to_dict()
    assert (back["mlp_only_layers"], back["norm_topk_prob"], back["moe_intermediate_size"]) == ([0], False, 32)


def _hub_state(kind: str, tmp_path) -> tuple[ModelConfig, dict]:
    hf = _hf_model(kind, 4)
    hf.save_pretrained(tmp_path)
    return model_config_from_hf(hf.config.to_dict()), load_file(tmp_path / "model.safetensors")


def test_an_expert_tensor_left_unread_fails_naming_it(tmp_path):
    """An expert the config does not count, or a stacked copy beside the per-expert keys, is never dropped."""
    cfg, state = _hub_state("mixtral", tmp_path)
    extra = "model.layers.1.block_sparse_moe.experts.4.w1.weight"
    with pytest.raises(ValueError, match=f"hold '{extra}' and 2 more that no tensor") as err:
        from_hf({**state, extra: state["model.layers.1.block_sparse_moe.experts.0.w1.weight"],
                 extra.replace("w1", "w2"): state["model.layers.1.block_sparse_moe.experts.0.w2.weight"],
                 extra.replace("w1", "w3"): state["model.layers.1.block_sparse_moe.experts.0.w3.weight"]},
                cfg, cfg.padded_vocab_size(1))
    assert "\n" not in str(err.value)
    fewer = dataclasses.replace(cfg, num_experts=2)  # a config that routes over 2 of the 4 experts
    with pytest.raises(ValueError, match="experts.2.w1.weight"):
        from_hf(state, fewer, fewer.padded_vocab_size(1))
    missing = "model.layers.0.block_sparse_moe.experts.3.w2.weight"
    with pytest.raises(ValueError, match=f"lack '{missing}'"):
        from_hf({k: v for k, v in state.items() if k != missing}, cfg, cfg.padded_vocab_size(1))


def test_a_folder_with_a_stray_expert_is_refused_by_the_tool(tmp_path, capsys):
    _, state = _hub_state("qwen3_moe", tmp_path / "hf")
    stray = "model.layers.0.mlp.experts.0.up_proj.weight"  # layer 0 is dense (mlp_only_layers)
    save_file({**state, stray: torch.zeros(32, 64)}, tmp_path / "hf" / "model.safetensors")
    capsys.readouterr()  # save_pretrained's progress bar
    assert load_tool("convert_checkpoint").main(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mz"),
                                                 "--to", "megazero"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"hold '{stray}' that no tensor" in err, err
    assert not os.path.exists(tmp_path / "mz")


# HF fields megazero would otherwise ignore: each must be named (field=value) in one line.
REFUSED = [("mixtral", "router_jitter_noise", 0.1), ("mixtral", "output_router_logits", True),
           ("mixtral", "sliding_window", 4096), ("qwen3_moe", "output_router_logits", True),
           ("qwen3_moe", "use_sliding_window", True), ("qwen3_moe", "shared_expert_intermediate_size", 64)]


@pytest.mark.parametrize("kind,field,value", REFUSED, ids=[f"{k}-{f}" for k, f, _ in REFUSED])
def test_each_moe_field_megazero_cannot_express_is_refused(kind, field, value):
    _, config_cls, extra = FAMILIES[kind]
    config = {**config_cls(**COMMON, **extra).to_dict(), field: value}
    with pytest.raises(ValueError) as err:
        model_config_from_hf(config)
    assert f"{field}={json.dumps(value)}" in str(err.value) and "\n" not in str(err.value), str(err.value)


MOE_LLAMA = ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=300,
                        num_experts=4, moe_ffn_hidden_size=32)
NOT_EXPORTABLE = [
    (dict(moe_router_score_function="sigmoid"), "--moe-router-score-function sigmoid"),
    (dict(moe_router_enable_expert_bias=True), "--moe-router-enable-expert-bias"),
    (dict(moe_expert_capacity_factor=1.0), "--moe-expert-capacity-factor"),
    (dict(moe_shared_expert_intermediate_size=64), "--moe-shared-expert-intermediate-size"),
    (dict(moe_router_pre_softmax=True), "--moe-router-pre-softmax"),  # Mixtral always renormalises
    (dict(moe_layer_freq=["[0,1]"]), "--moe-layer-freq"),  # Mixtral routes in every layer
    (dict(arch="gpt2"), "--arch gpt2"),
]


@pytest.mark.parametrize("change,flag", NOT_EXPORTABLE, ids=[f for _, f in NOT_EXPORTABLE])
def test_megazero_moe_settings_hf_cannot_compute_are_refused_on_export(change, flag):
    cfg = dataclasses.replace(MOE_LLAMA, **change)
    for export in (hf_config, lambda cfg: to_hf({}, cfg)):  # the weights too, before any is read
        with pytest.raises(ValueError) as err:
            export(cfg)
        assert flag in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_qwen3_moe_exports_what_mixtral_cannot():
    """With --qk-layernorm the same settings are Qwen3-MoE's: dense layers and no renormalising."""
    cfg = dataclasses.replace(MOE_LLAMA, qk_layernorm=True, moe_router_pre_softmax=True, moe_layer_freq=["[0,1]"])
    written = hf_config(cfg).to_dict()
    assert (written["model_type"], written["mlp_only_layers"], written["norm_topk_prob"]) == ("qwen3_moe", [0], False)
    assert model_config_from_hf(written).moe_layer_pattern(2) == (False, True)


def test_trained_through_megazero_exports_to_from_pretrained(tmp_path):
    """Qwen3-MoE -> megazero at ep 2 -> 2 iterations of pretrain_gpt.py --load on 2 ranks -> HF: from_pretrained
    loads the export and its logits equal megazero's of the trained checkpoint within 1e-5; training moved them."""
    hf = _hf_model("qwen3_moe", 5)
    hf.save_pretrained(tmp_path / "hf")
    convert = load_tool("convert_checkpoint")
    assert convert.main(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mz"), "--to", "megazero",
                         "--ep", "2"]) == 0
    # --num-experts too: --ep is checked before --load supplies the checkpoint's model
    flags = ["--load", str(tmp_path / "mz"), "--save", str(tmp_path / "trained"), "--num-experts", "4", "--ep", "2",
             "--train-iters", "2", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "0"]
    results = launch("pretrain_gpt.py", flags, 2, timeout=300)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.stderr[-3000:]}"
    assert convert.main(["--input", str(tmp_path / "trained"), "--output", str(tmp_path / "out"), "--to", "hf"]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
    cfg, state = read_full_state(str(tmp_path / "trained"), tp=1)
    ids = _ids(6)
    assert _logits_error(cfg.model, state, exported, ids) <= LOGIT_TOL
    with torch.no_grad():
        assert (exported(ids).logits - hf(ids).logits).abs().max() > 100 * LOGIT_TOL


def test_a_target_expert_layout_that_does_not_fit_is_refused_before_writing(tmp_path, capsys):
    _hf_model("mixtral", 7).save_pretrained(tmp_path / "hf")
    capsys.readouterr()  # save_pretrained's progress bar
    assert load_tool("convert_checkpoint").main(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mz"),
                                                 "--to", "megazero", "--ep", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "target layout --tp 1 --pp 1 --ep 3 does not fit the model: --num-experts (4)" \
        in err, err
    assert not os.path.exists(tmp_path / "mz")


# The published config.json of Mixtral-8x7B-v0.1 and Qwen3-30B-A3B (transformers 4.x field names), as on the hub.
HUB_CONFIGS = {
    "mixtral": dict(architectures=["MixtralForCausalLM"], attention_dropout=0.0, bos_token_id=1, eos_token_id=2,
                    hidden_act="silu", hidden_size=4096, initializer_range=0.02, intermediate_size=14336,
                    max_position_embeddings=32768, model_type="mixtral", num_attention_heads=32,
                    num_experts_per_tok=2, num_hidden_layers=32, num_key_value_heads=8, num_local_experts=8,
                    output_router_logits=False, rms_norm_eps=1e-05, rope_theta=1e6, router_aux_loss_coef=0.02,
                    sliding_window=None, tie_word_embeddings=False, torch_dtype="bfloat16",
                    transformers_version="4.36.0.dev0", use_cache=True, vocab_size=32000),
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], attention_bias=False, attention_dropout=0.0,
                      bos_token_id=151643, decoder_sparse_step=1, eos_token_id=151645, head_dim=128,
                      hidden_act="silu", hidden_size=2048, initializer_range=0.02, intermediate_size=6144,
                      max_position_embeddings=40960, max_window_layers=48, mlp_only_layers=[],
                      model_type="qwen3_moe", moe_intermediate_size=768, norm_topk_prob=True,
                      num_attention_heads=32, num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
                      num_key_value_heads=4, output_router_logits=False, rms_norm_eps=1e-06, rope_scaling=None,
                      rope_theta=1000000.0, router_aux_loss_coef=0.001, sliding_window=None,
                      tie_word_embeddings=False, torch_dtype="bfloat16", transformers_version="4.51.0",
                      use_cache=True, use_sliding_window=False, vocab_size=151936),
}


def test_the_hub_configs_of_mixtral_8x7b_and_qwen3_30b_a3b_map():
    mixtral, qwen = (model_config_from_hf(HUB_CONFIGS[k]) for k in ("mixtral", "qwen3_moe"))
    assert (mixtral.num_experts, mixtral.moe_router_topk, mixtral.moe_ffn_size, mixtral.rotary_base) == (
        8, 2, 14336, 1e6)
    assert not mixtral.qk_layernorm and not mixtral.moe_router_pre_softmax and all(mixtral.moe_layer_pattern(32))
    assert (qwen.num_experts, qwen.moe_router_topk, qwen.moe_ffn_size, qwen.kv_channels) == (128, 8, 768, 128)
    assert qwen.qk_layernorm and not qwen.moe_router_pre_softmax and all(qwen.moe_layer_pattern(48))
