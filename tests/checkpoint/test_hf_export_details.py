"""HF export details (issue 31): config.json keeps the model's own max_position_embeddings and writes
architectures and dtype; --dtype casts the weights; a run's HF tokenizer.json ships as it is.

All in one process: transformers builds and reads the HF folders, tools/convert_checkpoint.py runs
through its ``main``.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open

from megazero.checkpoint.convert import hf_to_checkpoint, load_hf, read_full_state, write_checkpoint
from megazero.checkpoint.hf import hf_config, to_hf
from megazero.config import Config
from megazero.data.tokenizer import load_tokenizer, train_sentencepiece
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from megazero.tensor_parallel.layers import initialize_parameters
from tests.helpers.hf_configs import CONFIGS
from tests.helpers.hf_tokenizers import HARD_STRINGS, byte_level_tokenizer
from tests.helpers.tool_module import load_tool

transformers = pytest.importorskip("transformers")

CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
POSITIONS = {"gpt2": "n_positions", "llama": "max_position_embeddings"}
# bf16 keeps 8 significant bits: each rounding is off by at most u = 2^-8 of its value. The logits of the
# 2-layer models pass ~4 roundings that reach them at full size (the weights, the last hidden state, the
# head's product and the logit itself), so they stay within 4u = 2^-6 (~1.6%, torch.testing's bf16 rtol)
# of the largest logit; measured here: 0.3-0.6%.
BF16_TOLERANCE = 2**-6
# Files an HF tokenizer folder may hold beside tokenizer.json and tokenizer_config.json.
COMPANIONS = {"special_tokens_map.json": '{"eos_token": "<|endoftext|>"}',
              "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}<|endoftext|>{% endfor %}"}


def _convert(*args: str) -> int:
    return load_tool("convert_checkpoint").main(list(args))


def _config_json(folder) -> dict:
    with open(os.path.join(folder, "config.json")) as fh:
        return json.load(fh)


def _file_dtypes(folder) -> set[torch.dtype]:
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as fh:
        return {fh.get_tensor(name).dtype for name in fh.keys()}


def _megazero_checkpoint(root, arch: str, dtype: torch.dtype = torch.float32, **settings) -> tuple[str, dict]:
    """A tp 1 checkpoint of a freshly initialised ``arch`` model stored in ``dtype``; (folder, its HF state)."""
    cfg = Config(model=CONFIGS[arch]).updated(**settings)
    state = {k: v.to(dtype) for k, v in _initialised(cfg).items()}
    return write_checkpoint(str(root / "mz"), cfg, state, tp=1, pp=1), to_hf(state, cfg.model)


def _initialised(cfg: Config) -> dict[str, torch.Tensor]:
    model = GPTModel(cfg.model, TPContext())
    initialize_parameters(model, 0, None)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_round_trip_keeps_positions_architecture_and_dtype(tmp_path, arch):
    """A bf16 HF model with 256 positions -> megazero (tp 2) -> HF keeps all three, and the weights bitwise."""
    config = hf_config(CONFIGS[arch])  # 32 positions, as megazero's test model
    setattr(config, POSITIONS[arch], 256)
    torch.manual_seed(0)
    getattr(transformers, CLASSES[arch])(config).to(torch.bfloat16).save_pretrained(tmp_path / "hf_in")
    hf_to_checkpoint(str(tmp_path / "hf_in"), str(tmp_path / "mz"), tp=2, pp=1)
    imported = read_full_state(str(tmp_path / "mz"))[0].model
    assert (imported.max_position_embeddings, imported.position_table_size) == (256, 256)

    assert _convert("--input", str(tmp_path / "mz"), "--output", str(tmp_path / "hf_out"), "--to", "hf") == 0
    back = _config_json(tmp_path / "hf_out")
    assert back[POSITIONS[arch]] == 256
    assert back["architectures"] == [CLASSES[arch]]
    assert back.get("dtype", back.get("torch_dtype")) == "bfloat16"
    assert _file_dtypes(tmp_path / "hf_out") == {torch.bfloat16}
    state_in, state_out = load_hf(str(tmp_path / "hf_in"))[1], load_hf(str(tmp_path / "hf_out"))[1]
    assert state_out.keys() == state_in.keys()
    assert all(torch.equal(state_out[k], state_in[k]) for k in state_in)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_dtype_flag_writes_bf16_weights_transformers_loads(tmp_path, arch):
    """An fp32 checkpoint exports fp32 by default, bf16 with --dtype bf16: the fp32 weights rounded, which
    transformers loads in bf16 (from config.json's dtype) and whose logits stay within bf16 rounding."""
    ckpt, fp32_state = _megazero_checkpoint(tmp_path, arch)
    fp32_dir, bf16_dir = str(tmp_path / "fp32"), str(tmp_path / "bf16")
    assert _convert("--input", ckpt, "--output", fp32_dir, "--to", "hf") == 0
    assert _convert("--input", ckpt, "--output", bf16_dir, "--to", "hf", "--dtype", "bf16") == 0
    assert _config_json(fp32_dir)["dtype"] == "float32" and _file_dtypes(fp32_dir) == {torch.float32}
    assert _config_json(bf16_dir)["dtype"] == "bfloat16" and _file_dtypes(bf16_dir) == {torch.bfloat16}
    bf16_state = load_hf(bf16_dir)[1]
    assert all(torch.equal(bf16_state[k], v.to(torch.bfloat16)) for k, v in fp32_state.items())

    full = transformers.AutoModelForCausalLM.from_pretrained(fp32_dir).eval()
    half = transformers.AutoModelForCausalLM.from_pretrained(bf16_dir).eval()
    assert (type(half).__name__, half.dtype) == (CLASSES[arch], torch.bfloat16)
    ids = torch.randint(0, CONFIGS[arch].vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference, logits = full(ids).logits, half(ids).logits.float()
    assert 0 < (logits - reference).abs().max() <= BF16_TOLERANCE * reference.abs().max()


def test_a_bf16_llama_run_exports_bf16_and_its_max_positions(tmp_path):
    """The default dtype is the one a --bf16 run stores; llama's --max-position-embeddings, not --seq-length."""
    ckpt, _ = _megazero_checkpoint(tmp_path, "llama", torch.bfloat16, bf16=True, max_position_embeddings=64)
    assert _convert("--input", ckpt, "--output", str(tmp_path / "hf"), "--to", "hf") == 0
    config = _config_json(tmp_path / "hf")
    assert (config["dtype"], config["max_position_embeddings"]) == ("bfloat16", 64)
    assert _file_dtypes(tmp_path / "hf") == {torch.bfloat16}


def test_fp16_out_of_range_and_ignored_flags_are_refused(tmp_path, capsys):
    cfg = Config(model=CONFIGS["gpt2"])
    state = _initialised(cfg)
    state["final_norm.weight"] = torch.full_like(state["final_norm.weight"], 1e5)  # fp16 tops out at 65504
    ckpt = write_checkpoint(str(tmp_path / "mz"), cfg, state, tp=1, pp=1)
    assert _convert("--input", ckpt, "--output", str(tmp_path / "hf"), "--to", "hf", "--dtype", "fp16") == 2
    assert capsys.readouterr().err == ("convert_checkpoint.py: error: --dtype fp16: transformer.ln_f.weight hold "
                                       "values outside its range; export with --dtype bf16 or fp32.\n")
    assert not os.path.exists(tmp_path / "hf" / "config.json")
    assert _convert("--input", str(tmp_path / "hf"), "--output", str(tmp_path / "x"), "--to", "megazero",
                    "--dtype", "bf16") == 2
    assert "--dtype applies to --to hf" in capsys.readouterr().err
    assert _convert("--input", ckpt, "--output", str(tmp_path / "hf"), "--to", "hf", "--tokenizer-type", "hf") == 2
    assert "--tokenizer-type is the kind of --tokenizer-model" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, str]:
    """The run's tokenizer of each kind: a byte-level BPE folder and a sentencepiece .model (300 tokens)."""
    root = tmp_path_factory.mktemp("tokenizers")
    byte_level_tokenizer(str(root / "byte_bpe"), vocab_size=300)
    for name, text in COMPANIONS.items():
        (root / "byte_bpe" / name).write_text(text)
    words = [f"w{i} token{i % 37} text{i % 11}" for i in range(800)]  # the rest by byte fallback
    return {"hf": str(root / "byte_bpe"), "sentencepiece": train_sentencepiece(words, str(root / "sp"), 280)}


@pytest.mark.parametrize("kind", ["hf", "sentencepiece"])
def test_exported_tokenizer_encodes_as_the_run_did(tmp_path, tokenizers, kind):
    """The run's tokenizer (from the checkpoint's config) ships; transformers' AutoTokenizer on the export
    gives the training tokenizer's ids for code, tabs, accents and emoji, and config.json its EOS."""
    ckpt, _ = _megazero_checkpoint(tmp_path, "llama", tokenizer_model=tokenizers[kind],
                                   data_path=[str(tmp_path / "data")])
    assert _convert("--input", ckpt, "--output", str(tmp_path / "hf"), "--to", "hf") == 0
    ours = load_tokenizer(tokenizers[kind])
    shipped = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert [shipped(t, add_special_tokens=False)["input_ids"] for t in HARD_STRINGS] == ours.encode_batch(HARD_STRINGS)
    assert [shipped.decode(ours.encode(t)) for t in HARD_STRINGS] == HARD_STRINGS
    assert shipped.eos_token_id == ours.eos_id == _config_json(tmp_path / "hf")["eos_token_id"]
    if kind == "hf":  # shipped as it is, not rebuilt
        for name in ("tokenizer.json", "tokenizer_config.json", *COMPANIONS):
            with open(tmp_path / "hf" / name, "rb") as a, open(os.path.join(tokenizers[kind], name), "rb") as b:
                assert a.read() == b.read(), name


def test_bare_tokenizer_json_ships_with_its_eos(tmp_path, tokenizers):
    """--tokenizer-model naming a tokenizer.json with nothing beside it: the export adds a tokenizer_config.json
    naming the EOS megazero reads from it, so transformers knows where documents end."""
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copyfile(os.path.join(tokenizers["hf"], "tokenizer.json"), bare / "tokenizer.json")
    ckpt, _ = _megazero_checkpoint(tmp_path, "gpt2", data_path=[str(tmp_path / "data")])
    assert _convert("--input", ckpt, "--output", str(tmp_path / "hf"), "--to", "hf", "--tokenizer-model",
                    str(bare / "tokenizer.json"), "--tokenizer-type", "hf") == 0
    shipped = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    eos = load_tokenizer(str(bare)).eos_id
    assert shipped.eos_token_id == eos == _config_json(tmp_path / "hf")["eos_token_id"]
    assert shipped(HARD_STRINGS[0], add_special_tokens=False)["input_ids"] == load_tokenizer(str(bare)).encode(
        HARD_STRINGS[0])
