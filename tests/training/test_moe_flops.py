"""MoE FLOPs count the active parameters (router, k experts, shared expert), never all E experts."""
from __future__ import annotations

import dataclasses

from megazero.config import ModelConfig
from megazero.model.flops import flops_per_token, mlp_forward_flops

DENSE = dict(num_layers=2, hidden_size=4, num_attention_heads=2, seq_length=8, vocab_size=10)


def test_moe_layer_hand_count():
    # gpt2, h=4, E=8, k=2, expert width F=6, layers [1, 0] MoE / dense (dense f = 16). Per token, forward:
    #   MoE MLP: router 2*4*8 = 64, experts 2 * (2 matmuls * 2*4*6 = 96) = 192 -> 256; dense MLP 2*2*4*16 = 256.
    #   attention per layer (test_flops_lr's count) 96 + 128 + 32 = 256; head 80.
    cfg = ModelConfig(arch="gpt2", ffn_hidden_size=16, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=6,
                      moe_layer_freq=["[1,0]"], **DENSE)
    assert mlp_forward_flops(cfg, 0) == 256 and mlp_forward_flops(cfg, 1) == 256
    assert flops_per_token(cfg) == 3 * (256 + 256 + 256 + 256 + 80)
    # full recompute of the first layer only: the MoE layer's forward again
    assert flops_per_token(cfg, "full", 1) == 3 * 1104 + 512
    # llama: SwiGLU experts (3 matmuls) and a shared expert of width 5: 64 + 3*2*4*(2*6 + 5) = 472
    llama = dataclasses.replace(cfg, arch="llama", moe_shared_expert_intermediate_size=5)
    assert mlp_forward_flops(llama, 0) == 64 + 3 * 2 * 4 * 17


def test_moe_equals_dense_of_the_active_width_plus_router():
    """An MoE model costs a dense one with f = k x F (+ the shared width), plus the router's 2 h E per layer."""
    for arch, shared in (("gpt2", None), ("llama", 12)):
        moe = ModelConfig(arch=arch, ffn_hidden_size=64, num_experts=8, moe_router_topk=3, moe_ffn_hidden_size=10,
                          moe_shared_expert_intermediate_size=shared, **DENSE)
        dense = ModelConfig(arch=arch, ffn_hidden_size=3 * 10 + (shared or 0), **DENSE)
        router = 2 * 4 * 8
        for mode in ("none", "selective", "full"):
            extra = 2 * router if mode == "full" else 0  # full recompute runs both routers forward again
            assert flops_per_token(moe, mode) == flops_per_token(dense, mode) + 3 * 2 * router + extra
