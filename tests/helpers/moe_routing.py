"""Independent references for the MoE router tests: routing and balance losses written with plain torch ops.

They follow the papers' formulas token by token (explicit loops over tokens, groups and sequences), not
the router's vectorised code, so a shared mistake is unlikely.
"""
from __future__ import annotations

import torch

from megazero.config import ModelConfig
from megazero.moe.router import Router

HIDDEN = 16


def router_cfg(**moe) -> ModelConfig:
    """A small model config with experts; ``moe`` overrides the MoE fields (8 experts, top-2 by default)."""
    moe.setdefault("num_experts", 8)
    return ModelConfig(hidden_size=HIDDEN, num_attention_heads=2, num_layers=2, **moe)


def make_router(cfg: ModelConfig, dtype: torch.dtype = torch.float64, seed: int = 0) -> Router:
    router = Router(cfg, 0, dtype=dtype)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(seed)))
    return router


def tokens(count: int, dtype: torch.dtype = torch.float64, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def reference_choice(scores_E: torch.Tensor, k: int, groups: int | None, group_topk: int | None) -> list[int]:
    """One token's k experts, best first; with groups, only among the best ``group_topk`` groups, a group
    scored by the sum of its best k // group_topk members."""
    allowed = list(range(scores_E.numel()))
    if groups:
        size = scores_E.numel() // groups
        def group_score(g: int) -> float:
            members = sorted(scores_E[g * size:(g + 1) * size].tolist(), reverse=True)
            return sum(members[:k // group_topk])
        kept = sorted(range(groups), key=group_score, reverse=True)[:group_topk]
        allowed = [e for e in allowed if e // size in kept]
    return sorted(allowed, key=lambda e: float(scores_E[e]), reverse=True)[:k]


def reference_weights(logits_E: torch.Tensor, chosen: list[int], cfg: ModelConfig) -> torch.Tensor:
    """The k weights of one token's chosen experts, from its logits (with autograd)."""
    idx = torch.tensor(chosen)
    if cfg.moe_router_score_function == "sigmoid":
        picked = 1.0 / (1.0 + torch.exp(-logits_E[idx]))
        weights = picked / picked.sum() if len(chosen) > 1 else picked
    elif cfg.moe_router_pre_softmax:
        weights = torch.exp(logits_E[idx]) / torch.exp(logits_E).sum()
    else:
        weights = torch.exp(logits_E[idx]) / torch.exp(logits_E[idx]).sum()
    return weights * (cfg.moe_router_topk_scaling_factor or 1.0)


def reference_route(x_TH: torch.Tensor, weight_EH: torch.Tensor, cfg: ModelConfig,
                    bias_E: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [T, k], weights [T, k]) token by token."""
    logits = x_TH @ weight_EH.t()
    experts, weights = [], []
    for logits_E in logits:
        if cfg.moe_router_score_function == "sigmoid":
            scores = 1.0 / (1.0 + torch.exp(-logits_E))
        else:
            scores = torch.exp(logits_E) / torch.exp(logits_E).sum() if cfg.moe_router_pre_softmax else logits_E
        scores = scores.detach() + (0 if bias_E is None else bias_E.to(scores.dtype))
        chosen = reference_choice(scores, cfg.moe_router_topk, cfg.moe_router_num_groups, cfg.moe_router_group_topk)
        experts.append(chosen)
        weights.append(reference_weights(logits_E, chosen, cfg))
    return torch.tensor(experts), torch.stack(weights)


def _probabilities(logits_E: torch.Tensor, score_function: str) -> torch.Tensor:
    scores = torch.exp(logits_E) if score_function == "softmax" else 1.0 / (1.0 + torch.exp(-logits_E))
    return scores / scores.sum()


def reference_switch_loss(logits_TE: torch.Tensor, experts_TK: torch.Tensor, score_function: str) -> torch.Tensor:
    """E * sum_e f_e P_e over all tokens: f_e the fraction of the T k assignments to e, P_e e's mean probability."""
    tokens, experts = logits_TE.shape
    k = experts_TK.shape[1]
    total = logits_TE.new_zeros(())
    for e in range(experts):
        f_e = (experts_TK == e).sum().item() / (tokens * k)
        p_e = sum(_probabilities(logits_TE[t], score_function)[e] for t in range(tokens)) / tokens
        total = total + f_e * p_e
    return experts * total


def reference_seq_loss(logits_TE: torch.Tensor, experts_TK: torch.Tensor, score_function: str,
                       batch: int) -> torch.Tensor:
    """The Switch loss of each sequence (token t of a flattened [s, b] belongs to t % b), averaged."""
    per_sequence = [reference_switch_loss(logits_TE[b::batch], experts_TK[b::batch], score_function)
                    for b in range(batch)]
    return torch.stack(per_sequence).mean()


def reference_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.log(torch.exp(row).sum()) ** 2 for row in logits_TE]).mean()
