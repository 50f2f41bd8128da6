"""MLA decoding with a latent KV cache (``mla.MLA.decode``, ``kv_cache.LatentKVCache``; issue 43).

- Greedy decoding with the cache (prefill, then one token a step; and a prompt fed in two chunks) equals
  decoding without one (the whole sequence recomputed by the training forward each token), token for token
  and in every step's logits within 1e-5 of their largest magnitude: with q LoRA and YaRN, and without q LoRA
  with a value head wider than the query/key head. ``generation.generate`` gives the same ids.
- The cache holds, per token and layer, exactly kv_lora_rank + qk_pos_emb_head_dim values (the normalised
  latent, then the RoPE'd shared key), and no other tensor.
- transformers' ``DeepseekV3ForCausalLM.generate`` (its own cache of expanded keys and values) on the same
  weights gives the same 24 greedy ids, in both shapes.
- tools/generate.py, in this process, on an MLA checkpoint written by ``write_checkpoint``: its greedy ids
  are the uncached greedy ids of the model rebuilt from that checkpoint's state.
"""
from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from megazero.model.generation import Sampling, generate
from megazero.model.gpt import GPTModel
from megazero.model.kv_cache import KVCache, LatentKVCache
from megazero.model.mla import MLA
from megazero.model.transformer import TPContext
from megazero.model_config import ModelConfig
from megazero.tensor_parallel.layers import initialize_parameters
from tests.helpers.tool_module import load_tool

VOCAB, PROMPT, NEW = 280, [5, 17, 3, 60, 41], 24
SHAPES: dict[str, dict[str, Any]] = {
    "q_lora.yarn": dict(q_lora_rank=16, v_head_dim=6, rope_scaling_type="yarn", rope_scaling_factor=4.0,
                        rope_scaling_original_max_position_embeddings=8, rope_scaling_mscale=0.8,
                        rope_scaling_mscale_all_dim=1.0),
    "no_q_lora.wide_v": dict(q_lora_rank=None, v_head_dim=16),
}


def mla_model(**shape: Any) -> GPTModel:  # VOCAB: the tool test's tokenizer's, so every id decodes
    """A 2-layer MLA llama (latent 8, q/k 8 + 4 RoPE) with wide weights (std 0.2): next-token margins far above
    the ~1e-6 by which the cached and recomputed logits differ, and a varied continuation."""
    cfg = ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32,
                      vocab_size=VOCAB, init_method_std=0.2, norm_epsilon=1e-6, multi_latent_attention=True,
                      kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, **shape)
    model = GPTModel(cfg, TPContext())
    initialize_parameters(model, 11, None)
    return model.eval()


@torch.no_grad()
def uncached_greedy(model: GPTModel, prompt: list[int], new: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy ids and each step's last-token logits, the whole sequence through the training forward every step."""
    ids, logits = list(prompt), []
    for _ in range(new):
        step = model(torch.tensor([ids]))[-1, 0, :VOCAB]
        logits.append(step)
        ids.append(int(step.argmax()))
    return ids[len(prompt):], logits


@torch.no_grad()
def cached_greedy(model: GPTModel, prompt: list[int], new: int,
                  chunks: int = 1) -> tuple[list[int], list[torch.Tensor], KVCache]:
    """The same with the latent cache: the prompt in ``chunks`` pieces, then one token per step."""
    cache = KVCache.for_model(model.cfg, 1, len(prompt) + new, dtype=torch.float32)
    for piece in torch.tensor([prompt]).chunk(chunks, dim=1):
        step = model.decode(piece, cache)[0, -1]
    ids, logits = [], []
    for _ in range(new):
        logits.append(step)
        ids.append(int(step.argmax()))
        step = model.decode(torch.tensor([[ids[-1]]]), cache)[0, -1]
    return ids, logits, cache


def rel_max(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


@pytest.mark.parametrize("name", SHAPES)
def test_cached_greedy_decoding_equals_recomputing_every_token(name):
    model = mla_model(**SHAPES[name])
    want_ids, want_logits = uncached_greedy(model, PROMPT, NEW)
    assert len(set(want_ids)) > 4, want_ids  # a varied continuation, not one token repeated
    for chunks in (1, 2):  # a second prompt chunk attends to the cached first one (the bottom-right causal mask)
        ids, logits, cache = cached_greedy(model, PROMPT, NEW, chunks)
        assert ids == want_ids, (chunks, ids, want_ids)
        errs = [rel_max(got, want) for got, want in zip(logits, want_logits, strict=True)]
        assert max(errs) <= 1e-5, (chunks, max(errs))
    assert generate(model, PROMPT, NEW, eos_id=-1, sampling=Sampling()) == want_ids
    cfg = model.cfg
    assert isinstance(cache, LatentKVCache) and cache.keys == cache.values == []
    per_token = cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
    assert cache.values_per_token == per_token == 12
    assert [tuple(t.shape) for t in cache.latents] == [(1, len(PROMPT) + NEW, per_token)] * cfg.num_layers
    held = sum(t.numel() for t in vars(cache).values() if isinstance(t, torch.Tensor))
    held += sum(t.numel() for v in vars(cache).values() if isinstance(v, list) for t in v)
    assert held == cfg.num_layers * (len(PROMPT) + NEW) * per_token  # no expanded keys or values anywhere


def hf_twin(model: GPTModel) -> Any:
    """transformers' ``DeepseekV3ForCausalLM`` (all layers dense, rotate-half RoPE) with ``model``'s weights."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = model.cfg
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling_type == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": cfg.rotary_base, "factor": cfg.rope_scaling_factor,
                "original_max_position_embeddings": cfg.rope_scaling_original_max_position_embeddings,
                "beta_fast": cfg.rope_scaling_beta_fast, "beta_slow": cfg.rope_scaling_beta_slow,
                "mscale": cfg.rope_scaling_mscale, "mscale_all_dim": cfg.rope_scaling_mscale_all_dim}
    hf_cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size,
                              num_hidden_layers=cfg.num_layers, first_k_dense_replace=cfg.num_layers,
                              num_attention_heads=cfg.num_attention_heads,
                              num_key_value_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
                              kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_head_dim,
                              qk_rope_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim,
                              max_position_embeddings=64, rms_norm_eps=cfg.norm_epsilon, rope_parameters=rope,
                              rope_interleave=False, attention_bias=False, tie_word_embeddings=False,
                              attn_implementation="eager")
    hf = DeepseekV3ForCausalLM(hf_cfg).eval()
    names = {"norm1": "input_layernorm", "norm2": "post_attention_layernorm", "attention.q_down": "self_attn.q_a_proj",
             "attention.q_norm": "self_attn.q_a_layernorm", "attention.q_up": "self_attn.q_b_proj",
             "attention.q_proj": "self_attn.q_proj", "attention.kv_down": "self_attn.kv_a_proj_with_mqa",
             "attention.kv_norm": "self_attn.kv_a_layernorm", "attention.kv_up": "self_attn.kv_b_proj",
             "attention.proj": "self_attn.o_proj", "mlp.fc1": "mlp.up_proj", "mlp.gate": "mlp.gate_proj",
             "mlp.fc2": "mlp.down_proj"}
    theirs = {"model.embed_tokens.weight": model.embedding.word.weight[:VOCAB], "model.norm.weight":
              model.final_norm.weight, "lm_head.weight": model.output.weight[:VOCAB]}
    for i, layer in model.layers.items():
        for name, p in layer.named_parameters():
            ours = name.rsplit(".", 1)[0]
            theirs[f"model.layers.{i}.{names[ours]}.weight"] = p
    hf_params = dict(hf.named_parameters())
    assert hf_params.keys() == theirs.keys(), set(hf_params) ^ set(theirs)
    with torch.no_grad():
        for name, p in hf_params.items():
            p.copy_(theirs[name])
    return hf


@pytest.mark.parametrize("name", SHAPES)
def test_cached_greedy_ids_equal_transformers_generate(name):
    """transformers decodes with its own (expanded) key/value cache: the ids over 24 tokens must agree."""
    model = mla_model(**SHAPES[name])
    ids, _, _ = cached_greedy(model, PROMPT, NEW)
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        out = hf_twin(model).generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW,
                                      do_sample=False, pad_token_id=0, eos_token_id=None)
    assert out[0, len(PROMPT):].tolist() == ids


def test_deepseek_v3_shapes_cache_576_values_per_token_and_layer():
    """DeepSeek-V3's attention shapes: 512 + 64 values per token and layer, against n (dq + dr + dv) expanded."""
    cfg = ModelConfig(arch="llama", num_layers=61, hidden_size=7168, num_attention_heads=128, seq_length=4096,
                      vocab_size=129280, multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512,
                      qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128)
    cache = KVCache.for_model(cfg, 1, 1, dtype=torch.bfloat16)
    expanded = cfg.num_attention_heads * (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim + cfg.v_head_dim)
    assert isinstance(cache, LatentKVCache) and len(cache.latents) == 61
    assert (cache.values_per_token, expanded) == (576, 40960)


def test_an_mla_layer_refuses_a_plain_cache():
    model = mla_model(**SHAPES["no_q_lora.wide_v"])
    plain = KVCache(2, 1, 4, 8, 12, dtype=torch.float32)
    with pytest.raises(TypeError, match="LatentKVCache"):
        next(m for m in model.modules() if isinstance(m, MLA))(torch.zeros(1, 1, 32), cache=plain)


def test_tools_generate_decodes_an_mla_checkpoint(tmp_path, capsys):
    from megazero.checkpoint.convert import write_checkpoint
    from megazero.config import Config
    from megazero.data.tokenizer import load_tokenizer, train_sentencepiece

    tok = train_sentencepiece([f"w{i} token{i % 37} text{i % 11}" for i in range(400)], str(tmp_path / "tok"), 280)
    model = mla_model(**SHAPES["q_lora.yarn"])
    state = {k: v.detach() for k, v in model.state_dict().items()}
    ckpt = write_checkpoint(str(tmp_path / "ckpt"), Config(model=model.cfg).updated(
        tokenizer_model=tok, data_path=[str(tmp_path / "data")]), state, tp=1, pp=1, log=lambda _: None)
    assert load_tokenizer(tok).vocab_size == VOCAB
    prompt = load_tokenizer(tok).encode("w5 token5")
    capsys.readouterr()
    assert load_tool("generate").main(["--load", ckpt, "--prompt", "w5 token5", "--max-new-tokens", "12",
                                       "--print-ids"]) == 0
    [record] = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert record["prompt_ids"] == prompt
    want, _ = uncached_greedy(model, prompt, len(record["new_ids"]))
    eos = load_tokenizer(tok).eos_id
    if eos in want:
        want = want[:want.index(eos) + 1]
    assert record["new_ids"] == want and len(want) >= 1, (record, want)
