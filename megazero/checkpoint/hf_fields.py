"""HF transformers configs <-> megazero's ModelConfig (GPT-2, Llama, Qwen3, Mixtral, Qwen3-MoE, DeepSeek-V3).

An HF config field the converter cannot express is refused rather than dropped: a silently dropped
field (a bias, a RoPE scaling, another activation, a router's noise) gives a model that loads and
computes something else. Every field is either mapped, harmless to the forward pass, or required to
hold the value megazero's math assumes; an unknown field with a value is refused. Going out, a
megazero setting the HF class cannot compute is refused the same way.
"""
from __future__ import annotations

import json
from typing import Any, Iterable

import torch

from ..config import ModelConfig
from . import hf_deepseek_config as deepseek
from .hf_moe import MOE_ARCHITECTURES, MOE_HARMLESS, MOE_MAPPED, moe_config_fields, moe_kind, moe_settings_from_hf

ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 **MOE_ARCHITECTURES, deepseek.KIND: deepseek.ARCHITECTURE}
# model_type names of configs that are DeepseekV3's (Kimi K2 ships DeepseekV3ForCausalLM under its own name)
_ALIASES = {"kimi_k2": deepseek.KIND}
# The transformers config class of each llama-family model_type, and the fields only it has.
_CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "mixtral": "MixtralConfig",
                   "qwen3_moe": "Qwen3MoeConfig"}
_OWN_FIELDS: dict[str, dict[str, Any]] = {
    "llama": dict(attention_bias=False, mlp_bias=False, pretraining_tp=1),
    "qwen3": dict(attention_bias=False, use_sliding_window=False), "mixtral": {},
    "qwen3_moe": dict(attention_bias=False, use_sliding_window=False)}


def hf_kind(cfg: ModelConfig) -> str:
    """The HF model_type that computes what ``cfg`` does: Llama has no q/k norms, Qwen3 always has them; with
    --num-experts, Mixtral and Qwen3-MoE likewise; --multi-latent-attention is DeepSeek-V3's."""
    if cfg.multi_latent_attention:
        return deepseek.KIND
    if cfg.num_experts is not None and cfg.arch == "llama":
        return moe_kind(cfg)
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
    if cfg.multi_latent_attention:
        return transformers.DeepseekV3Config(**common, **deepseek.deepseek_config_fields(cfg))
    if cfg.arch == "gpt2":
        if cfg.num_experts is not None:
            moe_config_fields(cfg)  # raises: HF's MoE classes have SwiGLU experts
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
        hidden_act="silu", attention_dropout=cfg.attention_dropout)
    kind = hf_kind(cfg)
    own = {**_OWN_FIELDS[kind], **(moe_config_fields(cfg) if cfg.num_experts is not None else {})}
    return getattr(transformers, _CONFIG_CLASSES[kind])(**{**common, **own})



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
    "mixtral": {"hidden_act": ("silu", "swish"), "sliding_window": ()},
}
REQUIRED["qwen3_moe"] = REQUIRED["qwen3"]
REQUIRED[deepseek.KIND] = deepseek.REQUIRED
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
# The MoE fields (hf_moe.py), output_router_logits and router_jitter_noise checked there with their reasons.
MAPPED["mixtral"] = MAPPED["llama"] | MOE_MAPPED["mixtral"] | {"output_router_logits", "router_jitter_noise"}
MAPPED["qwen3_moe"] = MAPPED["qwen3"] | MOE_MAPPED["qwen3_moe"] | {"output_router_logits"}
MAPPED[deepseek.KIND] = set(deepseek.MAPPED)
# head_dim when config.json leaves it out: transformers' Qwen3Config defaults to 128, Llama, Mixtral and
# Qwen3-MoE to hidden / heads. One other than hidden / heads becomes --kv-channels.
DEFAULT_HEAD_DIM = {"qwen3": 128}
# rope_theta when config.json has none: transformers' MixtralConfig defaults to 1e6, the others to 1e4.
DEFAULT_ROPE_THETA = {"mixtral": 1e6}
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _unmapped(config: dict[str, Any], kind: str) -> list[str]:
    """'field=value (why)' for every field that would change the math and is not mapped."""
    required = {**REQUIRED["common"], **REQUIRED[kind]}
    problems = []
    for key, value in config.items():
        if key in MAPPED[kind] or key in HARMLESS or key in MOE_HARMLESS or value is None:
            continue
        if key not in required:
            problems.append(f"{key}={json.dumps(value)} (a field the converter does not know)")
        elif value not in required[key]:
            allowed = " or ".join(json.dumps(v) for v in required[key]) or "null"
            problems.append(f"{key}={json.dumps(value)} (megazero computes with {allowed})")
    return problems


def _rope_from_hf(config: dict[str, Any], problems: list[str], default_theta: float = 10000.0) -> dict[str, Any]:
    """ModelConfig RoPE settings from rope_parameters (transformers 5) or rope_scaling + rope_theta (4.x)."""
    params, legacy = config.get("rope_parameters") or {}, config.get("rope_scaling") or {}
    name, rope = ("rope_parameters", params) if params else ("rope_scaling", legacy)
    if params and legacy and any(params.get(k) != v for k, v in legacy.items()):
        problems.append(f"rope_scaling={json.dumps(legacy)} (disagrees with rope_parameters)")
    type_key = "rope_type" if "rope_type" in rope else "type"
    kind = rope.get(type_key, "default")
    out: dict[str, Any] = {"rotary_base": float(rope.get("rope_theta", config.get("rope_theta", default_theta)))}
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
            "original_max_position_embeddings", config["max_position_embeddings"])
        missing = [k for k in LLAMA3_KEYS[:3] if rope.get(k) is None]
        if missing:
            problems.append(f"{name} lacks {', '.join(missing)} (llama3 RoPE needs them)")
            return out
        out.update(rope_scaling_type="llama3", rope_scaling_factor=float(rope["factor"]),
                   rope_scaling_low_freq_factor=float(rope["low_freq_factor"]),
                   rope_scaling_high_freq_factor=float(rope["high_freq_factor"]),
                   rope_scaling_original_max_position_embeddings=int(original))
    return out


def model_config_from_hf(config: dict[str, Any], source: str = "HF config.json",
                         weights: Iterable[str] | None = None) -> ModelConfig:
    """ModelConfig of an HF GPT-2, Llama, Qwen3, Mixtral, Qwen3-MoE or DeepSeek-V3 config dict; raises naming every
    field it cannot express. ``weights``: the checkpoint's tensor names, when known (DeepSeek-V3's MTP layers are
    converted when the weights hold them)."""
    kind = _ALIASES.get(str(config.get("model_type")), config.get("model_type"))
    if kind not in ARCHITECTURES:
        raise ValueError(f"{source}: model_type {kind!r} is not supported; convert a {', '.join(ARCHITECTURES)} "
                         "model.")
    problems = _unmapped(config, kind)
    if kind == deepseek.KIND:
        settings = deepseek.deepseek_settings(config, problems, weights)
    elif kind == "gpt2":
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
    """ModelConfig settings of an HF Llama, Qwen3, Mixtral or Qwen3-MoE config (Qwen3 and Qwen3-MoE:
    --qk-layernorm; a head_dim other than hidden / heads: --kv-channels; the MoE ones: --num-experts and the
    router's settings); appends to ``problems`` what it cannot take."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim", DEFAULT_HEAD_DIM.get(kind))
    if any(t != "full_attention" for t in config.get("layer_types") or ()):
        problems.append(f"layer_types={json.dumps(config['layer_types'])} (megazero attends over the whole "
                        "causal context in every layer)")
    moe = moe_settings_from_hf(config, kind, problems) if kind in MOE_ARCHITECTURES else {}
    return dict(arch="llama", qk_layernorm=kind in ("qwen3", "qwen3_moe"), num_layers=config["num_hidden_layers"],
                kv_channels=None if head_dim in (None, hidden / heads) else head_dim, hidden_size=hidden,
                num_attention_heads=heads, num_query_groups=config.get("num_key_value_heads"),
                ffn_hidden_size=config["intermediate_size"], seq_length=config["max_position_embeddings"],
                max_position_embeddings=config["max_position_embeddings"], vocab_size=config["vocab_size"],
                norm_epsilon=config.get("rms_norm_eps", 1e-6),
                untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
                **_rope_from_hf(config, problems, DEFAULT_ROPE_THETA.get(kind, 10000.0)), **moe)
