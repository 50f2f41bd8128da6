"""Map a full megazero state dict to and from HF transformers (GPT2LMHeadModel, LlamaForCausalLM).

Both directions work on *full* tensors under megazero's canonical names
(``layers.3.attention.qkv.weight``), i.e. the TP=1, single-stage model; the
checkpoint layer gathers or slices shards around this.

The one layout that needs care is the fused QKV weight, stored group by
group: for each of g query groups, its q heads, then k, then v (d rows each).
HF GPT-2 wants [Q all heads; K; V] in a Conv1D (transposed) weight; HF Llama
keeps separate q/k/v projections. RoPE needs no permutation: megazero rotates
halves exactly as HF Llama does. Vocabulary padding rows are dropped going
to HF and restored as zeros coming back.
"""
from __future__ import annotations

from typing import Any

import torch

from ..config import ModelConfig

State = dict[str, torch.Tensor]


def _split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused [g * (q_per_group + 2) * d, ...] -> q [n*d, ...], k [g*d, ...], v [g*d, ...]."""
    g, d = cfg.query_groups, cfg.head_dim
    per = cfg.num_attention_heads // g
    grouped = qkv.reshape(g, per + 2, d, *qkv.shape[1:])
    q = grouped[:, :per].reshape(g * per * d, *qkv.shape[1:])
    return q, grouped[:, per].reshape(g * d, *qkv.shape[1:]), grouped[:, per + 1].reshape(g * d, *qkv.shape[1:])


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    g, d = cfg.query_groups, cfg.head_dim
    per = cfg.num_attention_heads // g
    rest = q.shape[1:]
    parts = [q.reshape(g, per, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)]
    return torch.cat(parts, dim=1).reshape(g * (per + 2) * d, *rest)


def hf_config(cfg: ModelConfig) -> Any:
    import transformers

    if cfg.arch == "gpt2":
        return transformers.GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.position_table_size, n_embd=cfg.hidden_size,
            n_layer=cfg.num_layers, n_head=cfg.num_attention_heads, n_inner=cfg.ffn_size,
            activation_function="gelu_new", layer_norm_epsilon=cfg.norm_epsilon, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, tie_word_embeddings=True)
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.query_groups, head_dim=cfg.head_dim, max_position_embeddings=cfg.seq_length,
        rms_norm_eps=cfg.norm_epsilon, rope_theta=cfg.rotary_base, tie_word_embeddings=cfg.tied_embeddings,
        attention_bias=False, mlp_bias=False, hidden_act="silu")


def _gpt2_layer_to_hf(src: State, i: int, cfg: ModelConfig) -> State:
    p, o = f"layers.{i}.", f"transformer.h.{i}."
    q, k, v = _split_qkv(src[p + "attention.qkv.weight"], cfg)
    qb, kb, vb = _split_qkv(src[p + "attention.qkv.bias"], cfg)
    return {
        o + "ln_1.weight": src[p + "norm1.weight"], o + "ln_1.bias": src[p + "norm1.bias"],
        o + "attn.c_attn.weight": torch.cat([q, k, v]).t(), o + "attn.c_attn.bias": torch.cat([qb, kb, vb]),
        o + "attn.c_proj.weight": src[p + "attention.proj.weight"].t(), o + "attn.c_proj.bias": src[p + "attention.proj.bias"],
        o + "ln_2.weight": src[p + "norm2.weight"], o + "ln_2.bias": src[p + "norm2.bias"],
        o + "mlp.c_fc.weight": src[p + "mlp.fc1.weight"].t(), o + "mlp.c_fc.bias": src[p + "mlp.fc1.bias"],
        o + "mlp.c_proj.weight": src[p + "mlp.fc2.weight"].t(), o + "mlp.c_proj.bias": src[p + "mlp.fc2.bias"],
    }


def _llama_layer_to_hf(src: State, i: int, cfg: ModelConfig) -> State:
    p, o = f"layers.{i}.", f"model.layers.{i}."
    q, k, v = _split_qkv(src[p + "attention.qkv.weight"], cfg)
    return {
        o + "input_layernorm.weight": src[p + "norm1.weight"],
        o + "self_attn.q_proj.weight": q, o + "self_attn.k_proj.weight": k, o + "self_attn.v_proj.weight": v,
        o + "self_attn.o_proj.weight": src[p + "attention.proj.weight"],
        o + "post_attention_layernorm.weight": src[p + "norm2.weight"],
        o + "mlp.gate_proj.weight": src[p + "mlp.gate.weight"], o + "mlp.up_proj.weight": src[p + "mlp.fc1.weight"],
        o + "mlp.down_proj.weight": src[p + "mlp.fc2.weight"],
    }


def to_hf(src: State, cfg: ModelConfig) -> State:
    """Full megazero state -> HF state dict (contiguous tensors, vocabulary padding dropped)."""
    vocab = cfg.vocab_size
    out: State = {}
    if cfg.arch == "gpt2":
        out["transformer.wte.weight"] = src["embedding.word.weight"][:vocab]
        out["transformer.wpe.weight"] = src["embedding.position.weight"]
        for i in range(cfg.num_layers):
            out.update(_gpt2_layer_to_hf(src, i, cfg))
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = src["final_norm.weight"], src["final_norm.bias"]
    else:
        out["model.embed_tokens.weight"] = src["embedding.word.weight"][:vocab]
        for i in range(cfg.num_layers):
            out.update(_llama_layer_to_hf(src, i, cfg))
        out["model.norm.weight"] = src["final_norm.weight"]
        if not cfg.tied_embeddings:
            out["lm_head.weight"] = src["output.weight"][:vocab]
    return {k: v.contiguous().clone() for k, v in out.items()}


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def from_hf(src: State, cfg: ModelConfig, padded_vocab: int) -> State:
    """HF state dict -> full megazero state (vocabulary padded with zero rows to ``padded_vocab``)."""
    out: State = {}
    gpt2 = cfg.arch == "gpt2"
    emb = src["transformer.wte.weight" if gpt2 else "model.embed_tokens.weight"]
    out["embedding.word.weight"] = _pad_rows(emb, padded_vocab)
    for i in range(cfg.num_layers):
        out.update(_layer_from_hf(src, i, cfg))
    if gpt2:
        out["embedding.position.weight"] = src["transformer.wpe.weight"]
        out["final_norm.weight"], out["final_norm.bias"] = src["transformer.ln_f.weight"], src["transformer.ln_f.bias"]
    else:
        out["final_norm.weight"] = src["model.norm.weight"]
        if not cfg.tied_embeddings:
            out["output.weight"] = _pad_rows(src["lm_head.weight"], padded_vocab)
    return {k: v.contiguous().clone() for k, v in out.items()}


def _layer_from_hf(src: State, i: int, cfg: ModelConfig) -> State:
    p = f"layers.{i}."
    if cfg.arch == "gpt2":
        o = f"transformer.h.{i}."
        n_q = cfg.num_attention_heads * cfg.head_dim
        n_kv = cfg.query_groups * cfg.head_dim
        w, b = src[o + "attn.c_attn.weight"].t(), src[o + "attn.c_attn.bias"]
        q, k, v = w.split([n_q, n_kv, n_kv])
        qb, kb, vb = b.split([n_q, n_kv, n_kv])
        return {
            p + "norm1.weight": src[o + "ln_1.weight"], p + "norm1.bias": src[o + "ln_1.bias"],
            p + "attention.qkv.weight": _fuse_qkv(q, k, v, cfg), p + "attention.qkv.bias": _fuse_qkv(qb, kb, vb, cfg),
            p + "attention.proj.weight": src[o + "attn.c_proj.weight"].t(), p + "attention.proj.bias": src[o + "attn.c_proj.bias"],
            p + "norm2.weight": src[o + "ln_2.weight"], p + "norm2.bias": src[o + "ln_2.bias"],
            p + "mlp.fc1.weight": src[o + "mlp.c_fc.weight"].t(), p + "mlp.fc1.bias": src[o + "mlp.c_fc.bias"],
            p + "mlp.fc2.weight": src[o + "mlp.c_proj.weight"].t(), p + "mlp.fc2.bias": src[o + "mlp.c_proj.bias"],
        }
    o = f"model.layers.{i}."
    a = o + "self_attn."
    return {
        p + "norm1.weight": src[o + "input_layernorm.weight"],
        p + "attention.qkv.weight": _fuse_qkv(src[a + "q_proj.weight"], src[a + "k_proj.weight"],
                                              src[a + "v_proj.weight"], cfg),
        p + "attention.proj.weight": src[a + "o_proj.weight"],
        p + "norm2.weight": src[o + "post_attention_layernorm.weight"],
        p + "mlp.gate.weight": src[o + "mlp.gate_proj.weight"], p + "mlp.fc1.weight": src[o + "mlp.up_proj.weight"],
        p + "mlp.fc2.weight": src[o + "mlp.down_proj.weight"],
    }
