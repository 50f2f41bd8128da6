"""DeepseekV3ForCausalLM configs (DeepSeek-V3/R1, Kimi K2, Moonlight, DeepSeek-V2-Lite's shape) <-> ModelConfig.

As ``hf_fields.py`` does for the other families, every field is mapped, harmless to the forward pass, or required
to hold what megazero computes; anything else is refused in one line naming the field. The DeepSeek specifics:

- transformers' ``DeepseekV3Attention`` normalises the q/kv latents with eps 1e-6 whatever ``rms_norm_eps`` says
  (Moonlight's is 1e-5): an import sets --mla-latent-norm-epsilon 1e-6, an export needs it (or --norm-epsilon) 1e-6.
- transformers' router always scores by sigmoid, adds ``e_score_correction_bias`` for the choice and sums each
  group's best 2 experts: megazero's group score (the best k // topk_group) is that only where k // topk_group is 2.
  A model imports with --moe-router-enable-expert-bias (the bias is a weight of every DeepSeek-V3 checkpoint).
- ``first_k_dense_replace`` dense layers come first (--moe-layer-freq); it also decides whether the MTP layers
  (``model.layers.{num_hidden_layers + k}``) are MoE, which in megazero take the last layer's kind: a dense megazero
  model exports with every layer dense, the MTP ones included.
- ``num_nextn_predict_layers`` is --mtp-num-layers when the weights hold the MTP layers (transformers writes 1 by
  default and saves none: then the model imports without MTP, nothing being dropped).
- FP8 checkpoints (``quantization_config`` fp8, 128 x 128 blocks) are dequantised on import (``hf_deepseek.py``).
"""
from __future__ import annotations

import json
from typing import Any, Iterable

from ..config import ModelConfig

KIND = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, used for q_a_layernorm and kv_a_layernorm
MAPPED = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts", "routed_scaling_factor",
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "qk_head_dim", "head_dim",
    "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "rope_scaling",
    "rope_theta", "rope_interleave", "num_nextn_predict_layers", "num_mtp_layers", "scoring_func", "topk_method",
    "moe_layer_freq", "quantization_config", "output_router_logits",
    # training-only or placement fields of the hub's remote code (the forward pass does not read them)
    "aux_loss_alpha", "seq_aux", "ep_size", "auto_map"})
REQUIRED: dict[str, tuple] = {"hidden_act": ("silu", "swish"), "attention_bias": (False,), "pretraining_tp": (1,),
                              "mlp_bias": (False,)}
# transformers' DeepseekV3Config defaults, for a field config.json leaves out
DEFAULTS: dict[str, Any] = dict(
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048, num_experts_per_tok=8, n_group=8,
    topk_group=4, first_k_dense_replace=3, norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-6,
    tie_word_embeddings=False, rope_interleave=True, max_position_embeddings=4096, intermediate_size=18432)
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _get(config: dict[str, Any], key: str) -> Any:
    return config[key] if key in config else DEFAULTS[key]


def mtp_layers_in(config: dict[str, Any], weights: Iterable[str] | None) -> int:
    """D, the MTP layers the checkpoint holds: the config's, unless ``weights`` (tensor names) lack layer L."""
    depth = config.get("num_nextn_predict_layers", config.get("num_mtp_layers")) or 0
    if weights is None or not depth:
        return depth
    first = f"model.layers.{config['num_hidden_layers']}."
    return depth if any(name.startswith(first) for name in weights) else 0


def deepseek_settings(config: dict[str, Any], problems: list[str],
                      weights: Iterable[str] | None = None) -> dict[str, Any]:
    """ModelConfig settings of a DeepseekV3 config dict; appends to ``problems`` what megazero cannot express."""
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    nope, rope = _get(config, "qk_nope_head_dim"), _get(config, "qk_rope_head_dim")
    checks = [
        (config.get("num_key_value_heads") not in (None, heads),
         f"num_key_value_heads={json.dumps(config.get('num_key_value_heads'))} (MLA has one key and value per head: "
         f"{heads})"),
        (config.get("qk_head_dim") not in (None, nope + rope),
         f"qk_head_dim={json.dumps(config.get('qk_head_dim'))} (qk_nope_head_dim + qk_rope_head_dim = {nope + rope})"),
        (config.get("head_dim") not in (None, rope), f"head_dim={json.dumps(config.get('head_dim'))} (transformers "
                                                     f"rotates head_dim = qk_rope_head_dim = {rope})"),
        (config.get("moe_layer_freq") not in (None, 1),
         f"moe_layer_freq={json.dumps(config.get('moe_layer_freq'))} "
         "(transformers routes every layer after first_k_dense_replace)"),
        (config.get("output_router_logits"), "output_router_logits=true (a training loss megazero does not compute: "
                                             "set it false; megazero's is --moe-aux-loss-coeff)"),
    ]
    problems += [why for bad, why in checks if bad]
    _check_quantization(config.get("quantization_config"), problems)
    depth = mtp_layers_in(config, weights)
    moe = _moe_settings(config, layers, depth, problems)
    return dict(arch="llama", multi_latent_attention=True, num_layers=layers, hidden_size=config["hidden_size"],
                num_attention_heads=heads, ffn_hidden_size=_get(config, "intermediate_size"),
                seq_length=_get(config, "max_position_embeddings"),
                max_position_embeddings=_get(config, "max_position_embeddings"), vocab_size=config["vocab_size"],
                norm_epsilon=_get(config, "rms_norm_eps"), mla_latent_norm_epsilon=LATENT_NORM_EPS,
                untie_embeddings_and_output_weights=not _get(config, "tie_word_embeddings"),
                q_lora_rank=_get(config, "q_lora_rank"), kv_lora_rank=_get(config, "kv_lora_rank"),
                qk_head_dim=nope, qk_pos_emb_head_dim=rope, v_head_dim=_get(config, "v_head_dim"),
                **({"mtp_num_layers": depth} if depth else {}), **_rope_settings(config, problems), **moe)


def _check_quantization(quant: dict[str, Any] | None, problems: list[str]) -> None:
    """Only the hub's FP8 scheme (e4m3, one scale per 128 x 128 block) is dequantised on import."""
    if not quant:
        return
    want = {"quant_method": ("fp8",), "fmt": ("e4m3", None), "weight_block_size": ([128, 128],),
            "activation_scheme": ("dynamic", None)}
    for key, allowed in want.items():
        if quant.get(key) not in allowed:
            problems.append(f"quantization_config.{key}={json.dumps(quant.get(key))} (megazero dequantises FP8 e4m3 "
                            "weights with one weight_scale_inv per 128 x 128 block)")


def _moe_settings(config: dict[str, Any], layers: int, depth: int, problems: list[str]) -> dict[str, Any]:
    """The router and experts: none when every layer (the MTP ones included) is dense."""
    first_moe, experts = _get(config, "first_k_dense_replace"), _get(config, "n_routed_experts")
    if depth and layers <= first_moe < layers + depth:
        problems.append(f"first_k_dense_replace={first_moe} with num_nextn_predict_layers={depth} (MTP layer "
                        f"model.layers.{layers + depth - 1} is a mixture of experts after dense layers; megazero's "
                        "MTP blocks take the last layer's kind)")
    if first_moe >= layers:
        return {}
    k, groups, keep = _get(config, "num_experts_per_tok"), _get(config, "n_group") or 1, _get(config, "topk_group") or 1
    shared = _get(config, "n_shared_experts")
    checks = [
        (config.get("scoring_func", "sigmoid") != "sigmoid",
         f"scoring_func={json.dumps(config.get('scoring_func'))} (transformers' DeepseekV3 router scores by sigmoid)"),
        (config.get("topk_method", "noaux_tc") != "noaux_tc",
         f"topk_method={json.dumps(config.get('topk_method'))} (transformers routes as noaux_tc: group-limited top-k "
         "with the score-correction bias)"),
        (_get(config, "norm_topk_prob") != (k > 1),
         f"norm_topk_prob={json.dumps(_get(config, 'norm_topk_prob'))} with num_experts_per_tok={k} (megazero's "
         "sigmoid router renormalises the k weights exactly when k > 1)"),
        (not shared or shared < 1, f"n_shared_experts={json.dumps(shared)} (transformers always adds the shared "
                                   "expert: at least 1)"),
        (experts % groups != 0, f"n_group={groups} (it must divide n_routed_experts={experts})"),
        (keep < groups and k // keep != 2,
         f"topk_group={keep} with num_experts_per_tok={k} (transformers scores a group by its best 2 experts, "
         f"megazero by its best k // topk_group = {k // keep})"),
    ]
    problems += [why for bad, why in checks if bad]
    width = _get(config, "moe_intermediate_size")
    grouped = keep < groups
    pattern = [int(i >= first_moe) for i in range(layers)]
    return dict(num_experts=experts, moe_router_topk=k, moe_ffn_hidden_size=width,
                moe_layer_freq=None if first_moe <= 0 else [f"[{','.join(map(str, pattern))}]"],
                moe_shared_expert_intermediate_size=width * (shared or 1), moe_router_score_function="sigmoid",
                moe_router_topk_scaling_factor=float(_get(config, "routed_scaling_factor")),
                moe_router_num_groups=groups if grouped else None, moe_router_group_topk=keep if grouped else None,
                moe_router_enable_expert_bias=True)


def _rope_settings(config: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """Plain or YaRN RoPE from rope_parameters (transformers 5) or rope_scaling + rope_theta (the hub's)."""
    params, legacy = config.get("rope_parameters") or {}, config.get("rope_scaling") or {}
    name, rope = ("rope_parameters", params) if params else ("rope_scaling", legacy)
    kind = rope.get("rope_type", rope.get("type", "default"))
    out: dict[str, Any] = {"rotary_base": float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))}
    if kind not in ("default", "yarn"):
        problems.append(f"{name}.rope_type={json.dumps(kind)} (megazero converts default or yarn RoPE for MLA)")
        return out
    known = {"rope_type", "type", "rope_theta", *(YARN_KEYS if kind == "yarn" else ())}
    for key, value in rope.items():
        if key == "truncate" and value in (True, None) or key == "partial_rotary_factor" and value in (1.0, None):
            continue
        if key not in known and value is not None:
            problems.append(f"{name}.{key}={json.dumps(value)} (not used by megazero's {kind} RoPE)")
    if kind == "default":
        return out
    if rope.get("factor") is None or rope.get("original_max_position_embeddings") is None:
        problems.append(f"{name} lacks factor or original_max_position_embeddings (YaRN needs both)")
        return out
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if not all_dim and mscale not in (None, 1, 1.0):
        problems.append(f"{name}.mscale={json.dumps(mscale)} without mscale_all_dim (transformers then ignores it; "
                        "megazero refuses a scale that acts on nothing)")
    if all_dim and not mscale:
        problems.append(f"{name}.mscale_all_dim={json.dumps(all_dim)} without mscale (transformers' cos/sin scale "
                        "is then mscale(factor) alone, which megazero does not compute)")
    out.update(rope_scaling_type="yarn", rope_scaling_factor=float(rope["factor"]),
               rope_scaling_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
               rope_scaling_beta_fast=float(rope.get("beta_fast") or 32.0),
               rope_scaling_beta_slow=float(rope.get("beta_slow") or 1.0),
               rope_scaling_mscale=float(mscale or 1.0), rope_scaling_mscale_all_dim=float(all_dim or 0.0))
    return out


def _export_problems(cfg: ModelConfig) -> list[str]:
    """The settings of an MLA model DeepseekV3ForCausalLM cannot compute, as 'flag (why)'."""
    pattern = cfg.moe_layer_pattern(cfg.num_layers)
    first_moe = next((i for i, moe in enumerate(pattern) if moe), len(pattern))  # the leading dense layers
    latent_eps = cfg.norm_epsilon if cfg.mla_latent_norm_epsilon is None else cfg.mla_latent_norm_epsilon
    checks = [
        (latent_eps != LATENT_NORM_EPS, f"--mla-latent-norm-epsilon {latent_eps:g} (transformers normalises the MLA "
                                        f"latents with {LATENT_NORM_EPS}: pass --mla-latent-norm-epsilon 1e-6)"),
        (cfg.rope_scaling_type not in (None, "yarn"),
         f"--rope-scaling-type {cfg.rope_scaling_type} (megazero exports default or yarn RoPE for MLA)"),
        (any(pattern[first_moe:]) and not all(pattern[first_moe:]),
         "--moe-layer-freq with a dense layer after an MoE one (DeepseekV3 has first_k_dense_replace dense layers, "
         "then MoE)"),
    ]
    if cfg.num_experts is not None and any(pattern):
        checks += _moe_export_checks(cfg)
    return [why for bad, why in checks if bad]


def _moe_export_checks(cfg: ModelConfig) -> list[tuple[bool, str]]:
    shared, width, k = cfg.moe_shared_expert_intermediate_size, cfg.moe_ffn_size, cfg.moe_router_topk
    keep = cfg.moe_router_group_topk
    return [
        (cfg.moe_router_score_function != "sigmoid",
         "--moe-router-score-function softmax (DeepseekV3's router scores by sigmoid: pass sigmoid)"),
        (shared is None or shared % width != 0,
         f"--moe-shared-expert-intermediate-size {shared} (DeepseekV3 has n_shared_experts x "
         f"moe_intermediate_size = a multiple of {width})"),
        (keep is not None and k // keep != 2,
         f"--moe-router-group-topk {keep} with --moe-router-topk {k} (transformers scores a group by its best 2 "
         f"experts, megazero by its best k // group-topk = {k // (keep or 1)})"),
        (cfg.moe_router_force_balance, "--moe-router-force-balance (a debug router; HF routes by score)"),
        (cfg.moe_expert_capacity_factor is not None,
         "--moe-expert-capacity-factor (HF is dropless: it would keep the tokens megazero drops)"),
    ]


def deepseek_config_fields(cfg: ModelConfig) -> dict[str, Any]:
    """DeepseekV3Config fields of an MLA model; raises naming every setting DeepseekV3ForCausalLM cannot compute."""
    problems = _export_problems(cfg)
    if problems:
        raise ValueError(f"{ARCHITECTURE} cannot compute what this model does: {'; '.join(problems)}; convert a model "
                         "without them.")
    depth = getattr(cfg, "mtp_depth", 0)
    pattern = cfg.moe_layer_pattern(cfg.num_layers)
    moe = cfg.num_experts is not None and any(pattern)
    first_moe = pattern.index(True) if moe else cfg.num_layers + depth  # dense: the MTP layers too
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling_type == "yarn":
        rope.update(rope_type="yarn", factor=cfg.rope_scaling_factor,
                    original_max_position_embeddings=cfg.rope_scaling_original_max_position_embeddings,
                    beta_fast=cfg.rope_scaling_beta_fast, beta_slow=cfg.rope_scaling_beta_slow,
                    mscale=cfg.rope_scaling_mscale, mscale_all_dim=cfg.rope_scaling_mscale_all_dim)
    out = dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size, num_hidden_layers=cfg.num_layers,
               num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
               q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_head_dim,
               qk_rope_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim,
               max_position_embeddings=cfg.position_table_size, rms_norm_eps=cfg.norm_epsilon, rope_parameters=rope,
               rope_interleave=True, hidden_act="silu", attention_bias=False, attention_dropout=cfg.attention_dropout,
               first_k_dense_replace=first_moe, num_nextn_predict_layers=depth, output_router_logits=False)
    if not moe:  # no layer routes: transformers builds no router, the fields only have to be consistent
        return {**out, "n_routed_experts": 1, "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1,
                "n_shared_experts": 1, "moe_intermediate_size": cfg.ffn_size, "norm_topk_prob": False}
    grouped = cfg.moe_router_num_groups is not None
    return {**out, "n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.moe_router_topk,
            "n_group": cfg.moe_router_num_groups if grouped else 1,
            "topk_group": cfg.moe_router_group_topk if grouped else 1,
            "n_shared_experts": (cfg.moe_shared_expert_intermediate_size or 0) // cfg.moe_ffn_size,
            "moe_intermediate_size": cfg.moe_ffn_size, "norm_topk_prob": cfg.moe_router_topk > 1,
            "routed_scaling_factor": cfg.moe_router_topk_scaling_factor or 1.0}
