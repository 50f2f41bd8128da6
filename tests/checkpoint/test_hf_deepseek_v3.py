"""DeepseekV3ForCausalLM weights <-> megazero (issue 43): tiny DeepSeek-V3s made by transformers (random init,
saved with save_pretrained, an MTP layer added in the hub's layout) convert in at a parallel layout and out
bitwise, with q LoRA, YaRN, group-limited routing, the score-correction bias, a dense first layer and the shared
expert, and without q LoRA (DeepSeek-V2-Lite's shape); the converted model's logits equal transformers' within
1e-5 (fp32) and from_pretrained of the export gives them exactly. FP8 hub weights quantised here (float8_e4m3fn,
one scale per 128 x 128 block) import as the stated formula, bitwise. The references are transformers' own
classes, a dequantisation written out here, and for the MTP layer (which transformers drops on load) the
safetensors files themselves. The refusals: ``test_hf_deepseek_v3_fields.py``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megazero.checkpoint import storage
from megazero.checkpoint.convert import hf_to_checkpoint, load_hf, read_full_state, save_hf
from megazero.checkpoint.hf_deepseek import halves_to_interleaved, permute_rope_rows
from megazero.checkpoint.hf import from_hf, model_config_from_hf, to_hf
from megazero.config import ModelConfig
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from tests.helpers.deepseek_hf import CASES, LOGIT_TOL, VOCAB, hf_dict, hf_model, ids, logits_error

transformers = pytest.importorskip("transformers")

LAYOUTS = {"v3": dict(tp=1, pp=1, ep=2), "v2_lite": dict(tp=2, pp=2, ep=1)}


def add_hub_mtp_layer(folder) -> None:
    """What transformers never saves: DeepSeek-V3's MTP layer ``model.layers.{L}`` (a decoder layer of the last
    layer's kind with fresh random values, enorm, hnorm, eh_proj, shared_head.norm, and the hub's copies of the
    embedding and head), added to a save_pretrained folder, num_nextn_predict_layers 1 in its config.json."""
    config = json.loads((folder / "config.json").read_text())
    last, h = config["num_hidden_layers"], config["hidden_size"]
    state, gen = load_file(folder / "model.safetensors"), torch.Generator().manual_seed(9)
    prefix, mtp = f"model.layers.{last - 1}.", f"model.layers.{last}."
    state.update({mtp + k[len(prefix):]: (torch.rand(v.shape, generator=gen) + 0.5 if v.ndim == 1 else
                                          0.1 * torch.randn(v.shape, generator=gen)) for k, v in list(state.items())
                  if k.startswith(prefix)})
    state.update({mtp + n: 1 + 0.3 * torch.randn(h, generator=gen) for n in ("enorm.weight", "hnorm.weight",
                                                                             "shared_head.norm.weight")})
    state[mtp + "eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=gen)
    state[mtp + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state[mtp + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))


@pytest.mark.parametrize("case", sorted(CASES))
def test_folder_to_megazero_and_back_bitwise(case, tmp_path):
    """save_pretrained (with an MTP layer added in the hub's layout) -> megazero checkpoint at a parallel layout
    (v3 at ep 2; V2-Lite's shape at tp 2 x pp 2, MTP on the last stage) -> HF folder: logits within 1e-5 of
    transformers', every tensor back bitwise, the MTP layer and the fp32 bias included, and from_pretrained of
    the export gives transformers' logits exactly. transformers' in-memory state (stacked experts) converts to the
    same tensors."""
    hf = hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    add_hub_mtp_layer(tmp_path / "hf")
    hf_to_checkpoint(str(tmp_path / "hf"), str(tmp_path / "mz"), **LAYOUTS[case], log=lambda *_: None)
    mtp_files = storage.read_metadata(storage.resolve(str(tmp_path / "mz")))["model"]["mtp.0.eh_proj.weight"]["files"]
    assert all(f.endswith(f"_pp{LAYOUTS[case]['pp'] - 1:02d}.safetensors") for f in mtp_files), mtp_files
    cfg, state = read_full_state(str(tmp_path / "mz"), tp=1)
    model = cfg.model
    assert model.multi_latent_attention and model.q_lora_rank == CASES[case]["q_lora_rank"]
    assert model.moe_layer_pattern(model.num_layers) == (False,) + (True,) * (model.num_layers - 1)
    assert model.mtp_depth == 1 and "mtp.0.block.mlp.router.expert_bias" in state  # an MoE MTP block
    main = dataclasses.replace(model, mtp_num_layers=None)  # transformers drops the MTP layer: compare without it
    main_state = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    assert logits_error(main, main_state, hf, ids(1)) <= LOGIT_TOL
    stacked = from_hf(hf.state_dict(), main, main.padded_vocab_size(1))  # transformers 5's in-memory experts
    assert stacked.keys() == main_state.keys() and all(torch.equal(stacked[k], main_state[k]) for k in stacked)
    # the check can fail: the RoPE rows of the queries left in the hub's interleaved order compute something else
    d, r = model.qk_head_dim, model.qk_pos_emb_head_dim
    q_name = "attention.q_up.weight" if model.q_lora_rank else "attention.q_proj.weight"
    wrong = {k: permute_rope_rows(v, d + r, d, r, halves_to_interleaved(r)) if k.endswith(q_name) else v
             for k, v in main_state.items()}
    assert logits_error(main, wrong, hf, ids(1)) > 100 * LOGIT_TOL

    save_hf(str(tmp_path / "back"), model, state, None)
    original, exported = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "back"))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) and exported[k].dtype == original[k].dtype for k in original)
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["model_type"] == "deepseek_v3" and written["architectures"] == ["DeepseekV3ForCausalLM"]
    assert written["num_nextn_predict_layers"] == model.mtp_depth
    with torch.no_grad():
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
        assert torch.equal(again.eval()(ids(2)).logits, hf(ids(2)).logits)
    if case == "v3":  # a bf16 export keeps the score-correction bias fp32, as transformers holds it
        save_hf(str(tmp_path / "bf16"), model, state, None, dtype=torch.bfloat16)
        dtypes = {k: v.dtype for k, v in load_file(tmp_path / "bf16" / "model.safetensors").items()}
        assert {d for k, d in dtypes.items() if k.endswith("e_score_correction_bias")} == {torch.float32}
        assert {d for k, d in dtypes.items() if not k.endswith("e_score_correction_bias")} == {torch.bfloat16}


def test_a_tied_checkpoint_saved_with_rotate_half_rope_rows_converts(tmp_path):
    """rope_interleave false (transformers rotates halves, the rows as megazero's) and tied embeddings: imported as
    it computes, exported in the hub's interleaved layout with rope_interleave true, which transformers computes
    the same."""
    hf = hf_model("v2_lite", 8, rope_interleave=False, tie_word_embeddings=True)
    hf.save_pretrained(tmp_path / "hf")
    cfg, hub = load_hf(str(tmp_path / "hf"))
    state = from_hf(hub, cfg, cfg.padded_vocab_size(1))
    assert cfg.tied_embeddings and "output.weight" not in state
    assert logits_error(cfg, state, hf, ids(8)) <= LOGIT_TOL
    save_hf(str(tmp_path / "back"), cfg, state, None)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["rope_interleave"] is True
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    with torch.no_grad():
        assert float((again(ids(8)).logits - hf(ids(8)).logits).abs().max()) <= LOGIT_TOL


def test_moonlight_norm_epsilon_imports_with_the_latent_norms_at_transformers_1e_6(tmp_path):
    """Moonlight's rms_norm_eps is 1e-5 while transformers normalises the q/kv latents with 1e-6: the import keeps
    both (--norm-epsilon 1e-5, --mla-latent-norm-epsilon 1e-6), so the logits are transformers'; the export writes
    rms_norm_eps back. A latent norm at 1e-5 instead would be wrong by far more than the tolerance."""
    hf = hf_model("v3", 11, rms_norm_eps=1e-5)
    hf.save_pretrained(tmp_path / "hf")
    cfg, hub = load_hf(str(tmp_path / "hf"))
    assert (cfg.norm_epsilon, cfg.mla_latent_norm_epsilon) == (1e-5, 1e-6)
    state = from_hf(hub, cfg, cfg.padded_vocab_size(1))
    assert logits_error(cfg, state, hf, ids(11)) <= LOGIT_TOL
    assert logits_error(dataclasses.replace(cfg, mla_latent_norm_epsilon=1e-5), state, hf, ids(11)) > LOGIT_TOL
    save_hf(str(tmp_path / "back"), cfg, state, None)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["rms_norm_eps"] == 1e-5


def quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The hub's FP8 scheme, written out: per 128 x 128 block, scale_inv = max|w| / 448, fp8 = w / scale_inv."""
    rows, cols = w.shape
    scale = torch.empty(math.ceil(rows / 128), math.ceil(cols / 128))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scale[i, j] = tile.abs().max() / 448.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def dequantised(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w[i, j] = float(q[i, j]) * scale_inv[i // 128, j // 128], element by block."""
    out = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= scale[i, j]
    return out


def test_fp8_weights_dequantise_by_the_formula_bitwise(tmp_path):
    """Every projection of self_attn and the MLPs stored FP8 with weight_scale_inv (the dense MLP 160 rows: two
    row blocks, one partial) and quantization_config in config.json: the import holds the formula's values
    bitwise, and the converted model gives the logits of transformers running those values."""
    hf = hf_model("v3", 3)
    hf.save_pretrained(tmp_path / "bf")
    state = load_file(tmp_path / "bf" / "model.safetensors")
    fp8, reference = {}, {}
    for name, w in state.items():
        if w.ndim == 2 and ("self_attn." in name or "mlp." in name) and not name.endswith("mlp.gate.weight"):
            q, scale = quantise(w)
            fp8.update({name: q, name + "_scale_inv": scale})
            reference[name] = dequantised(q, scale)
        else:
            fp8[name] = reference[name] = w
    assert fp8["model.layers.0.mlp.gate_proj.weight"].shape == (160, 64)  # a partial second row block
    config = json.loads((tmp_path / "bf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    os.makedirs(tmp_path / "fp8")
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    save_file(fp8, tmp_path / "fp8" / "model.safetensors")
    cfg, loaded = load_hf(str(tmp_path / "fp8"))
    ours = from_hf(loaded, cfg, cfg.padded_vocab_size(1))
    back = to_hf(ours, cfg)
    assert back.keys() == reference.keys()
    assert all(torch.equal(back[k], reference[k]) for k in reference)
    gate = "model.layers.0.mlp.gate_proj.weight"
    assert not torch.equal(reference[gate], state[gate])  # quantisation moved the values: the test sees the formula
    save_file(reference, tmp_path / "bf" / "model.safetensors")  # transformers runs the formula's values
    runs_formula = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf", attn_implementation="eager")
    assert logits_error(cfg, ours, runs_formula.eval(), ids(4)) <= LOGIT_TOL


MTP_HUB_KEYS = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
                "shared_head.head.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
                "self_attn.q_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight",
                "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                "mlp.down_proj.weight"}


def mtp_state(cfg: ModelConfig, seed: int) -> dict:
    """A full megazero state with ``cfg.mtp_depth`` MTP modules, written by name (mtp.{k}.enorm, .hnorm, .eh_proj,
    .block.* as a main block's inner names, .final_norm): random values, so a misplaced tensor shows."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:  # norms about 1, weights of an initialised model's scale
        noise = torch.randn(shape, generator=gen)
        return 1 + 0.3 * noise if len(shape) == 1 else 0.1 * noise

    base = GPTModel(dataclasses.replace(cfg, mtp_num_layers=None), TPContext()).state_dict()
    state = {k: rand(*v.shape) for k, v in base.items()}
    for name in ("embedding.word.weight", "output.weight"):  # vocabulary padding: zeros, as an import restores it
        state[name][cfg.vocab_size:] = 0
    h = cfg.hidden_size
    for k in range(cfg.mtp_depth):
        state.update({f"mtp.{k}.block.{name[len('layers.0.'):]}": rand(*v.shape)
                      for name, v in base.items() if name.startswith("layers.0.")})
        state.update({f"mtp.{k}.{n}.weight": rand(h) for n in ("enorm", "hnorm", "final_norm")})
        state[f"mtp.{k}.eh_proj.weight"] = rand(h, 2 * h)
    return state


def test_mtp_layer_round_trips_bitwise_through_the_files(tmp_path):
    """A dense V2-Lite-shaped model with one MTP module: exported as hub layer num_hidden_layers (with its embedding
    and head copies, first_k_dense_replace past it), read back bitwise from the safetensors file (transformers drops
    that layer on load, so it is not the reference here); from_pretrained still gives the main model's logits."""
    cfg = dataclasses.replace(model_config_from_hf(hf_dict("v2_lite", first_k_dense_replace=2)), mtp_num_layers=1)
    assert cfg.num_experts is None and cfg.mtp_depth == 1
    state = mtp_state(cfg, 6)
    assert state.keys() == GPTModel(cfg, TPContext()).state_dict().keys()  # megazero's own MTP names
    save_hf(str(tmp_path / "hf"), cfg, state, None)
    written = load_file(tmp_path / "hf" / "model.safetensors")
    assert {k[len("model.layers.2."):] for k in written if k.startswith("model.layers.2.")} == MTP_HUB_KEYS
    assert torch.equal(written["model.layers.2.eh_proj.weight"], state["mtp.0.eh_proj.weight"])
    assert torch.equal(written["model.layers.2.embed_tokens.weight"], state["embedding.word.weight"][:VOCAB])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["num_nextn_predict_layers"], config["first_k_dense_replace"]) == (1, 3)
    back_cfg, hub = load_hf(str(tmp_path / "hf"))
    assert back_cfg.mtp_depth == 1
    back = from_hf(hub, back_cfg, back_cfg.padded_vocab_size(1))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    main = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    assert logits_error(dataclasses.replace(cfg, mtp_num_layers=None), main, hf, ids(7)) <= LOGIT_TOL
    # a different embedding copy in the MTP layer would be dropped: refused, naming it
    hub["model.layers.2.embed_tokens.weight"] = hub["model.layers.2.embed_tokens.weight"] + 1
    with pytest.raises(ValueError, match="model.layers.2.embed_tokens.weight differs from the model's own embedding"):
        from_hf(hub, back_cfg, back_cfg.padded_vocab_size(1))


