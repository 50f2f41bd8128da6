"""HF config fields: Llama-3 RoPE scaling converts end to end; every field the converter cannot express is refused.

The references are transformers' own LlamaForCausalLM / GPT2LMHeadModel and its
llama3 inverse-frequency function; megazero must match them, never itself.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch

from megazero.checkpoint.convert import read_full_state
from megazero.checkpoint.hf import model_config_from_hf
from megazero.config import ConfigError, ModelConfig
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext, rotary_inv_freq
from tests.helpers.launch import ROOT, launch, run_python
from tests.helpers.reference import full_logits

transformers = pytest.importorskip("transformers")

TOOL = os.path.join(ROOT, "tools", "convert_checkpoint.py")
# head_dim 16, base 1e4: wavelengths 6.3 .. 19869; with original_max 64, low 1, high 4 the
# cut-offs are 64 and 16, so the tiny model has high, smoothed and divided frequencies.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
TINY_LLAMA = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
TINY_GPT2 = dict(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=32)

# (field, value) pairs HF models use and megazero's math cannot express; each must be named in the refusal.
LLAMA_REFUSED = [("attention_bias", True), ("mlp_bias", True), ("hidden_act", "gelu"), ("pretraining_tp", 2),
                 ("sliding_window", 16), ("quantization_config", {"quant_method": "fp8"}),
                 ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})]
LLAMA_REFUSED_LEGACY = [("rope_scaling", {"type": "linear", "factor": 2.0}), ("partial_rotary_factor", 0.5),
                        ("auto_map", {"AutoModelForCausalLM": "custom.Model"})]
GPT2_REFUSED = [("activation_function", "relu"), ("scale_attn_by_inverse_layer_idx", True),
                ("reorder_and_upcast_attn", True), ("scale_attn_weights", False), ("add_cross_attention", True),
                ("use_parallel_residual", True)]


def _named(field: str, value) -> str:
    """How the refusal names a field; rope dicts are named by their type key."""
    if field in ("rope_parameters", "rope_scaling"):
        key = "rope_type" if "rope_type" in value else "type"
        return f"{field}.{key}={json.dumps(value[key])}"
    return f"{field}={json.dumps(value)}"


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """A saved tiny HF Llama (Llama-3 RoPE scaling) and GPT-2, random init, built by transformers."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA, rope_scaling=dict(LLAMA3)))
    with torch.no_grad():  # sharp attention, so positions (and their RoPE frequencies) move the logits
        for layer in llama.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    llama.save_pretrained(root / "llama")
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY_GPT2)).save_pretrained(root / "gpt2")
    return root


def _edited(src, dst, changes: dict, drop: tuple = ()) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key in drop:
        config.pop(key, None)
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def _convert(args: list[str]) -> subprocess.CompletedProcess:
    return run_python([TOOL, *args])


@pytest.mark.parametrize("arch,cases,drop", [
    ("llama", LLAMA_REFUSED, ("rope_parameters",)),
    ("llama", LLAMA_REFUSED_LEGACY, ("rope_parameters",)),
    ("gpt2", GPT2_REFUSED, ()),
], ids=["llama", "llama-legacy", "gpt2"])
def test_tool_refuses_unmapped_fields_in_one_line(hf_dirs, tmp_path, arch, cases, drop):
    """convert_checkpoint.py exits 2 with one line naming every offending field and its value; writes nothing."""
    folder = _edited(hf_dirs / arch, tmp_path / "in", dict(cases), drop)
    out = _convert(["--input", folder, "--output", str(tmp_path / "out"), "--to", "megazero"])
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    for field, value in cases:
        assert _named(field, value) in lines[0], (field, lines[0])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch,field,value", [("llama", f, v) for f, v in LLAMA_REFUSED + LLAMA_REFUSED_LEGACY]
                         + [("gpt2", f, v) for f, v in GPT2_REFUSED])
def test_each_unmapped_field_alone_is_refused(hf_dirs, arch, field, value):
    """Each class on its own (so none hides behind another in the combined runs above)."""
    config = json.loads((hf_dirs / arch / "config.json").read_text())
    if field == "rope_scaling":
        config.pop("rope_parameters")
    config[field] = value
    with pytest.raises(ValueError) as err:
        model_config_from_hf(config)
    assert _named(field, value) in str(err.value) and "\n" not in str(err.value)


def test_harmless_fields_convert(hf_dirs):
    """Ids, dtype, dropouts, use_cache, generation settings and nulls do not block a conversion."""
    config = json.loads((hf_dirs / "gpt2" / "config.json").read_text())
    config.update(torch_dtype="float32", n_ctx=32, summary_type="cls_index", resid_pdrop=0.3, sliding_window=None,
                  task_specific_params={"text-generation": {"do_sample": True}}, architectures=["GPT2LMHeadModel"])
    cfg = model_config_from_hf(config)
    assert (cfg.arch, cfg.hidden_size, cfg.num_layers, cfg.seq_length) == ("gpt2", 64, 2, 32)


def test_llama3_inverse_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(**TINY_LLAMA, rope_scaling=dict(LLAMA3))
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = rotary_inv_freq(model_config_from_hf(hf_cfg.to_dict()), "cpu")
    plain = rotary_inv_freq(ModelConfig(arch="llama", hidden_size=64, num_attention_heads=4), "cpu")
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    assert ours[0] == plain[0] and torch.allclose(ours[-1], plain[-1] / 8)  # high kept, low divided


def test_llama3_hf_to_megazero_to_hf(hf_dirs, tmp_path):
    """HF -> megazero (tp=2) logits equal transformers' within 1e-4; megazero -> HF keeps rope scaling."""
    assert _convert(["--input", str(hf_dirs / "llama"), "--output", str(tmp_path / "mz"), "--to", "megazero",
                     "--tp", "2"]).returncode == 0
    cfg, state = read_full_state(str(tmp_path / "mz"), tp=1)
    assert (cfg.model.rope_scaling_type, cfg.model.rope_scaling_factor) == ("llama3", 8.0)
    assert cfg.model.rope_scaling_original_max_position_embeddings == 64
    model = GPTModel(cfg.model, TPContext()).eval()
    model.load_state_dict(state)
    ids = torch.randint(0, 300, (2, 128), generator=torch.Generator().manual_seed(1))
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dirs / "llama").eval()
    with torch.no_grad():
        theirs = hf(ids).logits
    ours = full_logits(model, ids)
    assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()
    # the check can fail: dropping the scaling (type and its values back to the defaults) moves the logits
    unscaled_cfg = cfg.updated(rope_scaling_type=None, rope_scaling_factor=8.0, rope_scaling_low_freq_factor=1.0,
                               rope_scaling_high_freq_factor=4.0, rope_scaling_original_max_position_embeddings=8192)
    unscaled = GPTModel(unscaled_cfg.model, TPContext()).eval()
    unscaled.load_state_dict(state)
    assert (full_logits(unscaled, ids) - theirs).abs().max() > 1e-2 * theirs.abs().max()

    assert _convert(["--input", str(tmp_path / "mz"), "--output", str(tmp_path / "hf"), "--to", "hf"]).returncode == 0
    assert not (tmp_path / "hf" / "tokenizer.json").exists()  # the default corpus's 8000-token one would not fit
    back = json.loads((tmp_path / "hf" / "config.json").read_text())
    original = json.loads((hf_dirs / "llama" / "config.json").read_text())
    assert back["rope_parameters"] == original["rope_parameters"]
    with torch.no_grad():
        again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()(ids).logits
    assert torch.equal(again, theirs)


def test_rope_scaling_settings_are_validated():
    base = dict(arch="llama", hidden_size=64, num_attention_heads=4)
    for bad in (dict(rope_scaling_type="yarn"), dict(rope_scaling_type="llama3", rope_scaling_factor=0.5),
                dict(rope_scaling_type="llama3", rope_scaling_low_freq_factor=4.0),
                dict(rope_scaling_type="llama3", rope_scaling_original_max_position_embeddings=0),
                dict(rope_scaling_factor=4.0), dict(base, arch="gpt2", rope_scaling_type="llama3")):
        with pytest.raises(ConfigError, match="--rope-scaling"):
            ModelConfig(**{**base, **bad})


def test_trained_with_rope_scaling_converts_to_hf(tmp_path):
    """pretrain_gpt.py (tp=2) with --rope-scaling-type llama3 -> HF folder with rope scaling and the same logits."""
    flags = ["--arch", "llama", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--num-query-groups", "2", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "2",
             "--train-iters", "2", "--tp", "2", "--rope-scaling-type", "llama3", "--rope-scaling-factor", "4",
             "--rope-scaling-original-max-position-embeddings", "32", "--save", str(tmp_path / "ckpt")]
    results = launch("pretrain_gpt.py", flags, 2, timeout=300)
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    assert _convert(["--input", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf"), "--to", "hf"]).returncode == 0
    assert (tmp_path / "hf" / "tokenizer.json").exists()  # trained on the default corpus: its tokenizer ships
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    shipped = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")  # special ids are the tokenizer's
    assert (hf_cfg["bos_token_id"], hf_cfg["eos_token_id"]) == (shipped.bos_token_id, shipped.eos_token_id)
    rope = hf_cfg["rope_parameters"]
    assert rope == {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    cfg, state = read_full_state(str(tmp_path / "ckpt"), tp=1)
    model = GPTModel(cfg.model, TPContext()).eval()
    model.load_state_dict(state)
    ids = torch.randint(0, cfg.model.vocab_size, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()(ids).logits
    ours = full_logits(model, ids)
    assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()
