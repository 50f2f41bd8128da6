"""Mixture-of-experts models to and from HF transformers: Mixtral and Qwen3-MoE.

Both are the llama family with routed SwiGLU experts. Qwen3-MoE adds per-head q/k RMSNorm
(--qk-layernorm), a choice of renormalising the top-k weights (``norm_topk_prob``) and dense layers
(``decoder_sparse_step``, ``mlp_only_layers``); Mixtral routes in every layer and always renormalises.
Softmax over all E, top-k, renormalise (HF) equals top-k of the logits, softmax over the k (megazero's
--moe-router-pre-softmax off); without renormalising it is megazero's --moe-router-pre-softmax.

Expert weights come in two layouts: the hub's one tensor per expert and projection
(``experts.E.w1/w2/w3`` for Mixtral under ``block_sparse_moe``, ``experts.E.gate_proj/up_proj/down_proj``
for Qwen3-MoE), which ``save_pretrained`` of transformers 5 still writes, and transformers 5's in-memory
stacked form (``experts.gate_up_proj`` [E, 2F, H], gate rows first, and ``experts.down_proj`` [E, H, F]).
Both are read; the hub layout is written. megazero stores [E, H, F] (fc1 = up, gate) and [E, F, H] (fc2).
"""
from __future__ import annotations

import json
from typing import Any

import torch

from ..config import ModelConfig

State = dict[str, torch.Tensor]

MOE_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# HF names of one expert's (gate, up, down) projections
_PROJECTIONS = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}
# The MoE fields read into ModelConfig (Qwen3-MoE's num_experts is num_local_experts in transformers 5's dicts).
MOE_MAPPED = {
    "mixtral": {"num_local_experts", "num_experts_per_tok"},
    "qwen3_moe": {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"},
}
# Training-only fields HF ignores unless output_router_logits is true (which is refused, see below).
MOE_HARMLESS = frozenset({"router_aux_loss_coef"})


def moe_kind(cfg: ModelConfig) -> str:
    """The HF model_type of a megazero MoE model: Qwen3-MoE has q/k head norms, Mixtral none."""
    return "qwen3_moe" if cfg.qk_layernorm else "mixtral"


def _export_problems(cfg: ModelConfig, kind: str) -> list[str]:
    """The MoE settings of ``cfg`` the HF class of ``kind`` cannot compute, as 'flag (why)'."""
    checks = [
        (cfg.arch != "llama", f"--arch {cfg.arch} (HF's MoE classes have SwiGLU experts: use --arch llama)"),
        (cfg.moe_router_score_function != "softmax", "--moe-router-score-function sigmoid (HF routes by softmax)"),
        (cfg.moe_router_topk_scaling_factor not in (None, 1.0),
         f"--moe-router-topk-scaling-factor {cfg.moe_router_topk_scaling_factor} (HF does not scale the weights)"),
        (cfg.moe_router_num_groups is not None, "--moe-router-num-groups (HF has no group-limited routing)"),
        (cfg.moe_router_enable_expert_bias, "--moe-router-enable-expert-bias (HF's router has no expert bias)"),
        (cfg.moe_router_force_balance, "--moe-router-force-balance (a debug router; HF routes by score)"),
        (cfg.moe_expert_capacity_factor is not None,
         "--moe-expert-capacity-factor (HF is dropless: it would keep the tokens megazero drops)"),
        (cfg.moe_shared_expert_intermediate_size is not None,
         f"--moe-shared-expert-intermediate-size ({MOE_ARCHITECTURES[kind]} has no shared expert)"),
    ]
    if kind == "mixtral":
        checks += [(cfg.moe_router_pre_softmax, "--moe-router-pre-softmax (Mixtral renormalises the top-k; "
                                                "add --qk-layernorm for Qwen3-MoE's norm_topk_prob false)"),
                   (not all(cfg.moe_layer_pattern(cfg.num_layers)),
                    "--moe-layer-freq with dense layers (Mixtral routes in every layer)")]
    return [why for bad, why in checks if bad]


def moe_config_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The HF config fields of ``cfg``'s experts; raises naming every setting the HF class cannot express."""
    kind = moe_kind(cfg)
    problems = _export_problems(cfg, kind)
    if problems:
        raise ValueError(f"{MOE_ARCHITECTURES[kind]} cannot compute what this model does: {'; '.join(problems)}; "
                         "convert a model without them.")
    common = dict(num_experts_per_tok=cfg.moe_router_topk, output_router_logits=False)
    if kind == "mixtral":  # every layer routes: the dense width is unused, intermediate_size is the experts'
        return dict(num_local_experts=cfg.num_experts, intermediate_size=cfg.moe_ffn_size, router_jitter_noise=0.0,
                    sliding_window=None, **common)
    dense = [i for i, moe in enumerate(cfg.moe_layer_pattern(cfg.num_layers)) if not moe]
    return dict(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_ffn_size, decoder_sparse_step=1,
                mlp_only_layers=dense, norm_topk_prob=not cfg.moe_router_pre_softmax, **common)


def moe_settings_from_hf(config: dict[str, Any], kind: str, problems: list[str]) -> dict[str, Any]:
    """ModelConfig MoE settings of a Mixtral or Qwen3-MoE config; appends to ``problems`` what it cannot take."""
    if config.get("output_router_logits"):
        problems.append("output_router_logits=true (HF's load-balancing loss pools every layer's counts and does "
                        "not divide by k, so router_aux_loss_coef has no exact megazero equivalent: set it false; "
                        "megazero's balancing loss is --moe-aux-loss-coeff)")
    if config.get("router_jitter_noise"):
        problems.append(f"router_jitter_noise={json.dumps(config['router_jitter_noise'])} (megazero's router "
                        "scales no input by noise)")
    if kind == "mixtral":
        return dict(num_experts=config["num_local_experts"], moe_router_topk=config["num_experts_per_tok"])
    experts = {config[k] for k in ("num_experts", "num_local_experts") if config.get(k) is not None}
    if len(experts) != 1:
        problems.append(f"num_experts/num_local_experts={json.dumps(sorted(experts))} (one expert count needed)")
        return {}
    layers, step = config["num_hidden_layers"], config.get("decoder_sparse_step", 1)
    dense = set(config.get("mlp_only_layers") or ())
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    return dict(num_experts=experts.pop(), moe_router_topk=config["num_experts_per_tok"],
                moe_ffn_hidden_size=config["moe_intermediate_size"],
                moe_router_pre_softmax=not config.get("norm_topk_prob", False),
                moe_layer_freq=None if all(pattern) else [f"[{','.join(map(str, pattern))}]"])


def _hf_prefix(i: int, kind: str) -> str:
    """Where the hub keeps layer ``i``'s router and experts."""
    return f"model.layers.{i}.{'block_sparse_moe' if kind == 'mixtral' else 'mlp'}."


def moe_layer_to_hf(src: State, i: int, cfg: ModelConfig) -> State:
    """Layer ``i``'s router and experts in the hub layout (one tensor per expert and projection)."""
    kind = moe_kind(cfg)
    p, o = f"layers.{i}.mlp.", _hf_prefix(i, kind)
    out = {o + "gate.weight": src[p + "router.weight"]}
    ours = (src[p + "experts.gate_weight"], src[p + "experts.fc1_weight"], src[p + "experts.fc2_weight"])
    for name, stacked in zip(_PROJECTIONS[kind], ours):
        out.update({f"{o}experts.{e}.{name}.weight": w.t() for e, w in enumerate(stacked)})
    return out


def moe_layer_from_hf(src: Any, i: int, cfg: ModelConfig) -> State:
    """Layer ``i``'s router and experts from the hub layout or transformers 5's stacked one.

    ``src`` is the caller's read-tracking view of the HF state: a key it lacks raises naming the key.
    """
    kind = moe_kind(cfg)
    p = f"layers.{i}.mlp."
    stacked = f"model.layers.{i}.mlp."  # transformers 5 renames Mixtral's block_sparse_moe to mlp in memory
    o = _hf_prefix(i, kind) if _hf_prefix(i, kind) + "gate.weight" in src else stacked
    if stacked + "experts.gate_up_proj" in src:
        gate, up = src[stacked + "experts.gate_up_proj"].transpose(1, 2).chunk(2, dim=2)
        down = src[stacked + "experts.down_proj"].transpose(1, 2)
    else:
        gate, up, down = (torch.stack([src[f"{o}experts.{e}.{name}.weight"].t() for e in range(cfg.num_experts or 0)])
                          for name in _PROJECTIONS[kind])
    return {p + "router.weight": src[o + "gate.weight"], p + "experts.gate_weight": gate,
            p + "experts.fc1_weight": up, p + "experts.fc2_weight": down}
