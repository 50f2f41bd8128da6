"""Mixture-of-experts parameter arithmetic: what an MoE layer holds, densely and in its experts, per rank.

An MoE layer (``cfg.is_moe_layer``) replaces the dense MLP of its block by (``moe/layer.py``):

    router          E h                                   dense, replicated over tp (sequence-parallel)
    shared expert   the dense MLP's parameters at width F_s (--moe-shared-expert-intermediate-size),
                    split over tp as the dense MLP          dense
    experts         llama: 3 E h F (fc1, gate, fc2)       expert weights, E / ep per rank, F split over etp
                    gpt2:  E (2 h F + F + h) (+ biases; the fc2 bias [E, h] is whole on every etp rank)

with F = --moe-ffn-hidden-size (or the dense width). Dense parameters live in the chunk's dense buffer and
reduce over dp x cp; expert weights fill a buffer of their own, reduced and sharded over the
expert-data-parallel group (edp = world / (etp x ep x pp)), padded as every buffer is
(``data_parallel/bucketing.py``). Active parameters (what one token runs through, what MFU counts) keep k
of the E experts of each MoE layer.
"""
from __future__ import annotations

from ..config import ModelConfig


def moe_layer_count(cfg: ModelConfig, layers: range) -> int:
    """How many of ``layers`` (global indices; past the last layer, MTP blocks: ``cfg.is_moe_layer``) are MoE."""
    pattern = cfg.moe_layer_pattern(cfg.num_layers)
    return sum(pattern[min(i, cfg.num_layers - 1)] for i in layers)


def mlp_split_params(cfg: ModelConfig, width: int) -> int:
    """TP-split parameters of a dense MLP of ``width`` (gpt2: fc1, its bias, fc2; llama: fc1, gate, fc2)."""
    h = cfg.hidden_size
    return 2 * width * h + width if cfg.arch == "gpt2" else 3 * width * h


def moe_mlp_params(cfg: ModelConfig) -> tuple[int, int]:
    """(TP-split, replicated) dense parameters of one MoE layer's MLP slot: the router and the shared expert."""
    assert cfg.num_experts is not None, "an MoE layer needs --num-experts"
    shared = cfg.moe_shared_expert_intermediate_size or 0
    split = mlp_split_params(cfg, shared) if shared else 0
    replicated = cfg.num_experts * cfg.hidden_size + (cfg.hidden_size if shared and cfg.arch == "gpt2" else 0)
    return split, replicated


def moe_mlp_numels(cfg: ModelConfig, tp: int) -> list[int]:
    """One MoE layer's dense MLP-slot parameters on one TP rank, in registration order (router, shared expert)."""
    assert cfg.num_experts is not None, "an MoE layer needs --num-experts"
    h, numels = cfg.hidden_size, [cfg.num_experts * cfg.hidden_size]
    shared = cfg.moe_shared_expert_intermediate_size
    if shared:
        f = shared // tp
        numels += [f * h, f, h * f, h] if cfg.arch == "gpt2" else [f * h, f * h, h * f]
    return numels


def one_expert_params(cfg: ModelConfig) -> int:
    """Parameters of one routed expert (llama 3 h F; gpt2 2 h F + F + h)."""
    f, h = cfg.moe_ffn_size, cfg.hidden_size
    return 3 * h * f if cfg.arch == "llama" else 2 * h * f + f + h


def expert_numels(cfg: ModelConfig, ep: int, etp: int) -> list[int]:
    """One MoE layer's expert weights on one rank, in registration order (``moe/experts.py``: fc1, gate, fc2,
    then the gpt2 biases): E / ep experts, F split over etp (the fc2 bias whole)."""
    assert cfg.num_experts is not None, "an MoE layer needs --num-experts"
    local, h, f = cfg.num_experts // ep, cfg.hidden_size, cfg.moe_ffn_size // etp
    if cfg.arch == "llama":
        return [local * h * f] * 3
    return [local * h * f, local * f * h, local * f, local * h]


def expert_params(cfg: ModelConfig) -> int:
    """Routed-expert parameters of the whole model (every MoE layer, the MTP blocks' too, all E experts)."""
    if cfg.num_experts is None:
        return 0
    return moe_layer_count(cfg, range(cfg.num_layers + cfg.mtp_depth)) * cfg.num_experts * one_expert_params(cfg)


def inactive_params(cfg: ModelConfig) -> int:
    """Expert parameters a token does not run through: E - k experts of every MoE layer, MTP blocks included (0
    for a dense model)."""
    if cfg.num_experts is None:
        return 0
    idle = cfg.num_experts - cfg.moe_router_topk
    return moe_layer_count(cfg, range(cfg.num_layers + cfg.mtp_depth)) * idle * one_expert_params(cfg)
