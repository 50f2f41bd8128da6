"""Map a full megazero state dict to and from HF transformers (GPT2LMHeadModel, LlamaForCausalLM, Qwen3ForCausalLM).

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

Configs map both ways too, and an HF config field the converter cannot express
is refused rather than dropped: a silently dropped field (a bias, a RoPE
scaling, another activation) gives a model that loads and computes something
else. Every field is either mapped, harmless to the forward pass, or required
to hold the value megazero's math assumes; an unknown field with a value is refused.
"""
from __future__ import annotations

import json
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


ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_kind(cfg: ModelConfig) -> str:
    """The HF model_type that computes what ``cfg`` does: Llama has no q/k norms, Qwen3 always has them."""
    if cfg.arch == "gpt2":
        return "gpt2"
    return "qwen3" if cfg.qk_layernorm else "llama"


def hf_config(cfg: ModelConfig, special_ids: dict[str, int | None] | None = None,
              dtype: torch.dtype = torch.float32) -> Any:
    """The transformers config of the same model (dropouts and init std carried over, for fine-tuning).

    ``special_ids`` (bos/eos/pad_token_id) come from the tokenizer shipped with the model; without one
    they are None rather than transformers' GPT-2 defaults (50256), which may lie outside the vocabulary.
    ``architectures`` and ``dtype`` (the weights' dtype) are written as ``save_pretrained`` of a model
    writes them: ``AutoModelForCausalLM`` picks the class from the one, and loads in the other.
    """
    import transformers

    ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **(special_ids or {})}
    common: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tied_embeddings, initializer_range=cfg.init_method_std,
        architectures=[ARCHITECTURES[hf_kind(cfg)]], dtype=str(dtype).removeprefix("torch."), **ids)
    if cfg.arch == "gpt2":
        if cfg.query_groups != cfg.num_attention_heads:
            raise ValueError(f"--num-query-groups {cfg.query_groups} (grouped-query attention) cannot be expressed "
                             f"by HF GPT2 ({cfg.num_attention_heads} heads); convert a model with one group per head.")
        if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
            raise ValueError(f"--kv-channels {cfg.kv_channels} (a head dimension other than --hidden-size / "
                             "--num-attention-heads) cannot be expressed by HF GPT2; convert a model without it.")
        return transformers.GPT2Config(
            n_positions=cfg.position_table_size, n_embd=cfg.hidden_size, n_layer=cfg.num_layers,
            n_head=cfg.num_attention_heads, n_inner=cfg.ffn_size, activation_function="gelu_new",
            layer_norm_epsilon=cfg.norm_epsilon, resid_pdrop=cfg.hidden_dropout, embd_pdrop=cfg.hidden_dropout,
            attn_pdrop=cfg.attention_dropout, **common)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling_type == "llama3":
        rope.update(rope_type="llama3", factor=cfg.rope_scaling_factor,
                    low_freq_factor=cfg.rope_scaling_low_freq_factor,
                    high_freq_factor=cfg.rope_scaling_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_scaling_original_max_position_embeddings)
    common.update(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.query_groups, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.position_table_size, rms_norm_eps=cfg.norm_epsilon, rope_parameters=rope,
        attention_bias=False, hidden_act="silu", attention_dropout=cfg.attention_dropout)
    if cfg.qk_layernorm:
        return transformers.Qwen3Config(use_sliding_window=False, **common)
    return transformers.LlamaConfig(mlp_bias=False, pretraining_tp=1, **common)


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


def _llama_layer_to_hf(src: State, i: int, cfg: ModelConfig) -> State:
    p, o = f"layers.{i}.", f"model.layers.{i}."
    q, k, v = _split_qkv(src[p + "attention.qkv.weight"], cfg)
    norms = {theirs: src[ours] for ours, theirs in _head_norm_names(i).items()} if cfg.qk_layernorm else {}
    return {
        **norms,
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
            p + "attention.proj.weight": src[o + "attn.c_proj.weight"].t(),
            p + "attention.proj.bias": src[o + "attn.c_proj.bias"],
            p + "norm2.weight": src[o + "ln_2.weight"], p + "norm2.bias": src[o + "ln_2.bias"],
            p + "mlp.fc1.weight": src[o + "mlp.c_fc.weight"].t(), p + "mlp.fc1.bias": src[o + "mlp.c_fc.bias"],
            p + "mlp.fc2.weight": src[o + "mlp.c_proj.weight"].t(), p + "mlp.fc2.bias": src[o + "mlp.c_proj.bias"],
        }
    o = f"model.layers.{i}."
    a = o + "self_attn."
    norms = {ours: src[theirs] for ours, theirs in _head_norm_names(i).items()} if cfg.qk_layernorm else {}
    return {
        **norms,
        p + "norm1.weight": src[o + "input_layernorm.weight"],
        p + "attention.qkv.weight": _fuse_qkv(src[a + "q_proj.weight"], src[a + "k_proj.weight"],
                                              src[a + "v_proj.weight"], cfg),
        p + "attention.proj.weight": src[a + "o_proj.weight"],
        p + "norm2.weight": src[o + "post_attention_layernorm.weight"],
        p + "mlp.gate.weight": src[o + "mlp.gate_proj.weight"], p + "mlp.fc1.weight": src[o + "mlp.up_proj.weight"],
        p + "mlp.fc2.weight": src[o + "mlp.down_proj.weight"],
    }


# Fields that do not change a causal LM's forward pass: ids, labels, dtype, caching, generation
# defaults, dropouts (training settings: pass --hidden-dropout/--attention-dropout to keep them) and
# heads megazero does not convert (GPT2DoubleHeadsModel's summary).
HARMLESS = frozenset({
    "transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype", "use_cache", "return_dict",
    "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16", "tf_legacy_loss", "id2label",
    "label2id", "num_labels", "problem_type", "finetuning_task", "tokenizer_class", "prefix", "task_specific_params",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "initializer_range",
    "chunk_size_feed_forward", "is_decoder", "tie_encoder_decoder", "max_length", "min_length", "do_sample",
    "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "n_ctx",
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
    "is_llama_config"})
# Fields that change the math: each must hold one of the values megazero's model computes with.
REQUIRED: dict[str, dict[str, tuple]] = {
    "common": {"is_encoder_decoder": (False,), "add_cross_attention": (False,), "pruned_heads": ({},)},
    "gpt2": {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "scale_attn_weights": (True,),
             "scale_attn_by_inverse_layer_idx": (False,), "reorder_and_upcast_attn": (False,)},
    "llama": {"hidden_act": ("silu", "swish"), "attention_bias": (False,), "mlp_bias": (False,),
              "pretraining_tp": (1,), "partial_rotary_factor": (1.0,), "sliding_window": (),
              "use_sliding_window": (False,), "rope_interleaved": (False,)},
    "qwen3": {"hidden_act": ("silu", "swish"), "attention_bias": (False,), "use_sliding_window": (False,)},
}
# Fields read into ModelConfig (checked by the readers below).
MAPPED = {
    "gpt2": {"model_type", "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
             "layer_norm_epsilon", "tie_word_embeddings"},
    "llama": {"model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "head_dim",
              "rope_theta", "rope_parameters", "rope_scaling", "original_max_position_embeddings",
              "tie_word_embeddings"},
}
# Qwen3 reads llama's fields; sliding_window and max_window_layers only act with use_sliding_window (which
# must be false), and layer_types is checked to be all full attention.
MAPPED["qwen3"] = MAPPED["llama"] | {"sliding_window", "max_window_layers", "layer_types"}
# head_dim when config.json leaves it out: transformers' Qwen3Config defaults to 128, Llama to hidden / heads.
# One other than hidden / heads becomes --kv-channels.
DEFAULT_HEAD_DIM = {"qwen3": 128}
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _unmapped(config: dict[str, Any], kind: str) -> list[str]:
    """'field=value (why)' for every field that would change the math and is not mapped."""
    required = {**REQUIRED["common"], **REQUIRED[kind]}
    problems = []
    for key, value in config.items():
        if key in MAPPED[kind] or key in HARMLESS or value is None:
            continue
        if key not in required:
            problems.append(f"{key}={json.dumps(value)} (a field the converter does not know)")
        elif value not in required[key]:
            allowed = " or ".join(json.dumps(v) for v in required[key]) or "null"
            problems.append(f"{key}={json.dumps(value)} (megazero computes with {allowed})")
    return problems


def _rope_from_hf(config: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """ModelConfig RoPE settings from rope_parameters (transformers 5) or rope_scaling + rope_theta (4.x)."""
    params, legacy = config.get("rope_parameters") or {}, config.get("rope_scaling") or {}
    name, rope = ("rope_parameters", params) if params else ("rope_scaling", legacy)
    if params and legacy and any(params.get(k) != v for k, v in legacy.items()):
        problems.append(f"rope_scaling={json.dumps(legacy)} (disagrees with rope_parameters)")
    type_key = "rope_type" if "rope_type" in rope else "type"
    kind = rope.get(type_key, "default")
    out: dict[str, Any] = {"rotary_base": float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))}
    if kind not in ("default", "llama3"):
        problems.append(f"{name}.{type_key}={json.dumps(kind)} (megazero supports default or llama3 RoPE)")
        return out
    known = {"rope_type", "type", "rope_theta", *(LLAMA3_KEYS if kind == "llama3" else ())}
    for key, value in rope.items():
        if key == "partial_rotary_factor" and value not in (None, 1.0):
            problems.append(f"{name}.{key}={json.dumps(value)} (megazero rotates the whole head)")
        elif key not in known and key != "partial_rotary_factor" and value is not None:
            problems.append(f"{name}.{key}={json.dumps(value)} (not used by {kind} RoPE)")
    if kind == "llama3":
        original = config.get("original_max_position_embeddings") or rope.get(
            "original_max_position_embeddings", config.get("max_position_embeddings"))
        missing = [k for k in LLAMA3_KEYS[:3] if rope.get(k) is None]
        if missing:
            problems.append(f"{name} lacks {', '.join(missing)} (llama3 RoPE needs them)")
            return out
        out.update(rope_scaling_type="llama3", rope_scaling_factor=float(rope["factor"]),
                   rope_scaling_low_freq_factor=float(rope["low_freq_factor"]),
                   rope_scaling_high_freq_factor=float(rope["high_freq_factor"]),
                   rope_scaling_original_max_position_embeddings=int(original))
    return out


def model_config_from_hf(config: dict[str, Any], source: str = "HF config.json") -> ModelConfig:
    """ModelConfig of an HF GPT-2, Llama or Qwen3 config dict; raises naming every field it cannot express."""
    kind = config.get("model_type")
    if kind not in ARCHITECTURES:
        raise ValueError(f"{source}: model_type {kind!r} is not supported; convert a gpt2, llama or qwen3 model.")
    problems = _unmapped(config, kind)
    if kind == "gpt2":
        settings = dict(arch="gpt2", num_layers=config["n_layer"], hidden_size=config["n_embd"],
                        num_attention_heads=config["n_head"], ffn_hidden_size=config.get("n_inner"),
                        seq_length=config["n_positions"], max_position_embeddings=config["n_positions"],
                        vocab_size=config["vocab_size"], norm_epsilon=config.get("layer_norm_epsilon", 1e-5),
                        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", True))
    else:
        settings = _llama_family_settings(config, kind, problems)
    if problems:
        raise ValueError(f"{source} has {kind} settings megazero cannot express, so the converted model would "
                         f"compute something else: {'; '.join(problems)}; convert a model without them.")
    return ModelConfig(**settings)


def _llama_family_settings(config: dict[str, Any], kind: str, problems: list[str]) -> dict[str, Any]:
    """ModelConfig settings of an HF Llama or Qwen3 config (Qwen3: --qk-layernorm; a head_dim other than
    hidden / heads: --kv-channels); appends to ``problems`` what it cannot take."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim", DEFAULT_HEAD_DIM.get(kind))
    if any(t != "full_attention" for t in config.get("layer_types") or ()):
        problems.append(f"layer_types={json.dumps(config['layer_types'])} (megazero attends over the whole "
                        "causal context in every layer)")
    return dict(arch="llama", qk_layernorm=kind == "qwen3", num_layers=config["num_hidden_layers"],
                kv_channels=None if head_dim in (None, hidden / heads) else head_dim, hidden_size=hidden,
                num_attention_heads=heads, num_query_groups=config.get("num_key_value_heads"),
                ffn_hidden_size=config["intermediate_size"], seq_length=config["max_position_embeddings"],
                max_position_embeddings=config["max_position_embeddings"], vocab_size=config["vocab_size"],
                norm_epsilon=config.get("rms_norm_eps", 1e-6),
                untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
                **_rope_from_hf(config, problems))
