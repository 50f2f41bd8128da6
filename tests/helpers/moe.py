"""Shared pieces of the MoE parity tests: expert groups, stand-in routing, and the dense reference.

The reference runs every expert on every token with the full (serial) weights and masks the result by
the routing, written here from the definitions and sharing no code with ``megazero/moe`` beyond the
weights it is handed.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megazero.config import ModelConfig
from megazero.moe.context import ExpertContext
from megazero.moe.experts import GroupedExperts
from megazero.tensor_parallel.layers import initialize_parameters, spec_of

SEED = 11
WEIGHTS = ("fc1_weight", "gate_weight", "fc2_weight", "fc1_bias", "fc2_bias")


def moe_config(arch: str, num_experts: int = 8, topk: int = 2, hidden: int = 16, ffn: int = 24,
               **moe) -> ModelConfig:
    """A one-layer MoE config; a large init std keeps outputs O(1), so tolerances test something."""
    return ModelConfig(arch=arch, num_layers=1, hidden_size=hidden, num_attention_heads=2, vocab_size=64,
                       num_experts=num_experts, moe_router_topk=topk, moe_ffn_hidden_size=ffn,
                       init_method_std=0.3, **moe)


def built_experts(cfg: ModelConfig, ctx: ExpertContext, dtype: torch.dtype) -> GroupedExperts:
    experts = GroupedExperts(cfg, ctx, dtype=dtype)
    initialize_parameters(experts, SEED, None)
    return experts


def local_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a full [E, ...] expert tensor, as ``param``'s spec places it."""
    spec = spec_of(param)
    local = full.narrow(0, spec.first_expert, param.shape[0])
    if spec.split_dim is not None:
        size = param.shape[spec.split_dim]
        local = local.narrow(spec.split_dim, spec.expert_tp_rank * size, size)
    return local


def stand_in_routing(rank: int, tokens: int, num_experts: int, topk: int,
                     rare: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct top-k choices and fp32 weights (a leaf with grad) for one rank's tokens.

    ``rare``: the last expert gets no token anywhere and the one before it exactly one (rank 0's token 0).
    """
    gen = torch.Generator().manual_seed(100 + rank)
    scores = torch.randn(tokens, num_experts, generator=gen)
    if rare:
        scores[:, num_experts - 2:] = -math.inf
    experts_TK = scores.topk(topk, dim=1).indices
    if rare and rank == 0:
        experts_TK[0, topk - 1] = num_experts - 2
    probs_TK = torch.softmax(torch.randn(tokens, topk, generator=gen), dim=1).requires_grad_()
    return experts_TK, probs_TK


def reference_keep(experts_TK: torch.Tensor, probs_TK: torch.Tensor, num_experts: int, factor: float | None,
                   policy: str) -> torch.Tensor:
    """Which assignments survive a capacity of ceil(factor * T * k / E) per expert, expert by expert."""
    if factor is None:
        return torch.ones_like(experts_TK, dtype=torch.bool)
    tokens, topk = experts_TK.shape
    cap = math.ceil(tokens * topk / num_experts * factor)
    keep = torch.zeros_like(experts_TK, dtype=torch.bool)
    for e in range(num_experts):
        ts, js = torch.nonzero(experts_TK == e, as_tuple=True)  # in token order
        if policy == "probs":
            best = torch.argsort(probs_TK.detach()[ts, js], descending=True, stable=True)
            ts, js = ts[best], js[best]
        keep[ts[:cap], js[:cap]] = True
    return keep


def reference_moe(x_TH: torch.Tensor, probs_TK: torch.Tensor, experts_TK: torch.Tensor, keep_TK: torch.Tensor,
                  w: dict[str, torch.Tensor], gated: bool) -> torch.Tensor:
    """Every expert on every token with the full weights, masked by the kept routing and weighted."""
    y = torch.zeros_like(x_TH)
    for e in range(w["fc1_weight"].shape[0]):
        if gated:
            out = (F.silu(x_TH @ w["gate_weight"][e]) * (x_TH @ w["fc1_weight"][e])) @ w["fc2_weight"][e]
        else:
            hidden = F.gelu(x_TH @ w["fc1_weight"][e] + w["fc1_bias"][e], approximate="tanh")
            out = hidden @ w["fc2_weight"][e] + w["fc2_bias"][e]
        weight_T = (probs_TK * ((experts_TK == e) & keep_TK)).sum(1)
        y = y + weight_T.to(x_TH.dtype).unsqueeze(1) * out
    return y


def shared_reference(x: torch.Tensor, w: dict[str, torch.Tensor], gated: bool) -> torch.Tensor:
    """The dense shared expert with its full weights ([out, in], as nn.Linear keeps them)."""
    if gated:
        return (F.silu(x @ w["gate.weight"].t()) * (x @ w["fc1.weight"].t())) @ w["fc2.weight"].t()
    hidden = F.gelu(x @ w["fc1.weight"].t() + w["fc1.bias"], approximate="tanh")
    return hidden @ w["fc2.weight"].t() + w["fc2.bias"]
