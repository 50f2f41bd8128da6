"""Map a full megazero state dict to and from HF transformers (GPT-2, Llama, Qwen3, Mixtral, Qwen3-MoE, DeepSeek-V3).

Both directions work on *full* tensors under megazero's canonical names
(``layers.3.attention.qkv.weight``), i.e. the TP=1, single-stage model; the
checkpoint layer gathers or slices shards around this.

The one layout that needs care is the fused QKV weight, stored group by
group: for each of g query groups, its q heads, then k, then v (d rows each).
HF GPT-2 wants [Q all heads; K; V] in a Conv1D (transposed) weight; HF Llama
keeps separate q/k/v projections. RoPE needs no permutation: megazero rotates
halves exactly as HF Llama does. Qwen3 is the llama family with per-head q/k
RMSNorm (megazero's --qk-layernorm): a llama model with it exports as Qwen3.
Vocabulary padding rows are dropped going to HF and restored as zeros coming back.
Mixtral and Qwen3-MoE layers map their router and experts in ``hf_moe.py``; a model with
--multi-latent-attention is a DeepseekV3ForCausalLM (``hf_deepseek.py``: MLA, its MoE, MTP, FP8).

Every HF tensor must be taken by some megazero tensor: one left over (an expert of a
layer the config does not route, a stray head) fails naming it, so no weight is
dropped silently. The configs map in ``hf_fields.py`` (re-exported here).
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from .hf_deepseek import block_from_hf, block_to_hf, dequantize_state, mtp_from_hf, mtp_to_hf
from .hf_deepseek_config import deepseek_config_fields
from .hf_fields import hf_config, model_config_from_hf
from .hf_moe import moe_config_fields, moe_layer_from_hf, moe_layer_to_hf

__all__ = ["from_hf", "hf_config", "model_config_from_hf", "to_hf"]

State = dict[str, torch.Tensor]


class _Reads:
    """An HF state read by name: a missing key raises naming it; ``unread`` lists what no mapping took."""

    def __init__(self, state: State) -> None:
        self.state, self.taken = state, set[str]()

    def __contains__(self, key: str) -> bool:
        return key in self.state

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.state:
            raise ValueError(f"the HF weights lack {key!r}, which the model's config.json needs; convert a folder "
                             "whose weights match its config.")
        self.taken.add(key)
        return self.state[key]

    def unread(self) -> list[str]:
        return [key for key in self.state if key not in self.taken]


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


def _gpt2_layer_to_hf(src: State, i: int, cfg: ModelConfig) -> State:
    p, o = f"layers.{i}.", f"transformer.h.{i}."
    q, k, v = _split_qkv(src[p + "attention.qkv.weight"], cfg)
    qb, kb, vb = _split_qkv(src[p + "attention.qkv.bias"], cfg)
    return {
        o + "ln_1.weight": src[p + "norm1.weight"], o + "ln_1.bias": src[p + "norm1.bias"],
        o + "attn.c_attn.weight": torch.cat([q, k, v]).t(), o + "attn.c_attn.bias": torch.cat([qb, kb, vb]),
        o + "attn.c_proj.weight": src[p + "attention.proj.weight"].t(),
        o + "attn.c_proj.bias": src[p + "attention.proj.bias"],
        o + "ln_2.weight": src[p + "norm2.weight"], o + "ln_2.bias": src[p + "norm2.bias"],
        o + "mlp.c_fc.weight": src[p + "mlp.fc1.weight"].t(), o + "mlp.c_fc.bias": src[p + "mlp.fc1.bias"],
        o + "mlp.c_proj.weight": src[p + "mlp.fc2.weight"].t(), o + "mlp.c_proj.bias": src[p + "mlp.fc2.bias"],
    }


def _head_norm_names(i: int) -> dict[str, str]:
    """megazero -> HF names of layer ``i``'s q/k head norms (--qk-layernorm; Qwen3)."""
    return {f"layers.{i}.attention.{n}_norm.weight": f"model.layers.{i}.self_attn.{n}_norm.weight" for n in "qk"}


# megazero -> HF names of a dense llama-family MLP (SwiGLU: fc1 is the up projection)
_LLAMA_MLP = {"mlp.gate.weight": "mlp.gate_proj.weight", "mlp.fc1.weight": "mlp.up_proj.weight",
              "mlp.fc2.weight": "mlp.down_proj.weight"}


def _llama_layer_to_hf(src: State, i: int, cfg: ModelConfig) -> State:
    p, o = f"layers.{i}.", f"model.layers.{i}."
    q, k, v = _split_qkv(src[p + "attention.qkv.weight"], cfg)
    norms = {theirs: src[ours] for ours, theirs in _head_norm_names(i).items()} if cfg.qk_layernorm else {}
    if cfg.is_moe_layer(i):
        mlp = moe_layer_to_hf(src, i, cfg)
    else:
        mlp = {o + theirs: src[p + ours] for ours, theirs in _LLAMA_MLP.items()}
    return {
        **norms,
        o + "input_layernorm.weight": src[p + "norm1.weight"],
        o + "self_attn.q_proj.weight": q, o + "self_attn.k_proj.weight": k, o + "self_attn.v_proj.weight": v,
        o + "self_attn.o_proj.weight": src[p + "attention.proj.weight"],
        o + "post_attention_layernorm.weight": src[p + "norm2.weight"], **mlp,
    }


def to_hf(src: State, cfg: ModelConfig) -> State:
    """Full megazero state -> HF state dict (contiguous tensors, vocabulary padding dropped)."""
    if cfg.multi_latent_attention:
        deepseek_config_fields(cfg)  # raises naming what DeepseekV3ForCausalLM cannot compute, before any tensor
    elif cfg.num_experts is not None:
        moe_config_fields(cfg)  # raises naming what HF's MoE classes cannot compute, before any tensor is read
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
            mla = cfg.multi_latent_attention
            out.update(block_to_hf(src, f"layers.{i}.", f"model.layers.{i}.", cfg) if mla else
                       _llama_layer_to_hf(src, i, cfg))
        out["model.norm.weight"] = src["final_norm.weight"]
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = src["output.weight"][:vocab]
    if cfg.multi_latent_attention:
        out.update(mtp_to_hf(src, cfg, out["model.embed_tokens.weight"],
                             out.get("lm_head.weight", out["model.embed_tokens.weight"])))
    return {k: v.contiguous().clone() for k, v in out.items()}


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def from_hf(hf_state: State, cfg: ModelConfig, padded_vocab: int) -> State:
    """HF state dict -> full megazero state (vocabulary padded with zero rows to ``padded_vocab``).

    Raises naming the first HF tensor no megazero tensor takes (a tied model's ``lm_head.weight`` is
    taken when it equals the embedding, as transformers' in-memory state dicts hold it)."""
    if cfg.multi_latent_attention:
        hf_state = dequantize_state(hf_state)  # FP8 hub weights with their block scales
    src, out = _Reads(hf_state), {}
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
    if cfg.multi_latent_attention:
        out.update(mtp_from_hf(src, cfg, emb, emb if cfg.tied_embeddings else src["lm_head.weight"]))
    tied_copy = cfg.tied_embeddings and torch.equal(hf_state.get("lm_head.weight", emb), emb)
    unread = [key for key in src.unread() if not (tied_copy and key == "lm_head.weight")]
    if unread:
        more = f" and {len(unread) - 1} more" if len(unread) > 1 else ""
        raise ValueError(f"the HF weights hold {unread[0]!r}{more} that no tensor of the model its config.json "
                         f"describes takes (converting would drop {'them' if more else 'it'}); convert a folder "
                         "whose config matches its weights.")
    return {k: v.contiguous().clone() for k, v in out.items()}


def _layer_from_hf(src: _Reads, i: int, cfg: ModelConfig) -> State:
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
            p + "attention.proj.weight": src[o + "attn.c_proj.weight"].t(),
            p + "attention.proj.bias": src[o + "attn.c_proj.bias"],
            p + "norm2.weight": src[o + "ln_2.weight"], p + "norm2.bias": src[o + "ln_2.bias"],
            p + "mlp.fc1.weight": src[o + "mlp.c_fc.weight"].t(), p + "mlp.fc1.bias": src[o + "mlp.c_fc.bias"],
            p + "mlp.fc2.weight": src[o + "mlp.c_proj.weight"].t(), p + "mlp.fc2.bias": src[o + "mlp.c_proj.bias"],
        }
    o = f"model.layers.{i}."
    if cfg.multi_latent_attention:
        return block_from_hf(src, p, o, cfg, cfg.is_moe_layer(i))
    a = o + "self_attn."
    norms = {ours: src[theirs] for ours, theirs in _head_norm_names(i).items()} if cfg.qk_layernorm else {}
    if cfg.is_moe_layer(i):
        mlp = moe_layer_from_hf(src, i, cfg)
    else:
        mlp = {p + ours: src[o + theirs] for ours, theirs in _LLAMA_MLP.items()}
    return {
        **norms,
        p + "norm1.weight": src[o + "input_layernorm.weight"],
        p + "attention.qkv.weight": _fuse_qkv(src[a + "q_proj.weight"], src[a + "k_proj.weight"],
                                              src[a + "v_proj.weight"], cfg),
        p + "attention.proj.weight": src[a + "o_proj.weight"],
        p + "norm2.weight": src[o + "post_attention_layernorm.weight"], **mlp,
    }
