"""DeepSpeed 0.19.8's ``deepspeed.moe.layer.MoE`` on CPU ranks over gloo (``DS_ACCELERATOR=cpu``).

DeepSpeed's gating is capacity-based: each expert takes a [capacity, H] block per rank and dispatch and
combine are dense einsums over [tokens, experts, capacity]. Its closest setting to dropless is
``drop_tokens=False`` (the capacity becomes the largest per-expert count on any rank of the expert
group, all-reduced each step, so no token is dropped), with ``use_rts=False`` (no random token
selection), no noisy gate and ``top2_2nd_expert_sampling=False`` (no Gumbel noise on the second
choice). Its top-2 gate is then Mixtral's: softmax over all experts, the best two, their weights
renormalised to sum 1 (the same as a softmax over the two chosen logits). It always computes its
Switch auxiliary loss (unused here). Experts: one SwiGLU module per local expert, run in a loop.

``deepspeed.comm.torch.build_shm_op`` (a shared-memory all-reduce op compiled with g++ on first use)
is replaced by a no-op: gloo carries every collective.
"""
from __future__ import annotations

import importlib
import os
from typing import Callable

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


class SwiGLU(nn.Module):
    """down(silu(x gate) * x up): the llama expert, weights stored as megazero's [in, out]."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.empty(hidden, ffn))
        self.up = nn.Parameter(torch.empty(hidden, ffn))
        self.down = nn.Parameter(torch.empty(ffn, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ self.gate) * (x @ self.up)) @ self.down


def build(weights: dict[str, torch.Tensor], ep: int, ep_rank: int, topk: int) -> Callable:
    """This rank's DeepSpeed MoE layer holding ``weights`` (full [E, ...] tensors: router [E, H], gate and up
    [E, H, F], down [E, F, H]); returns f(x [s, b, h]) -> y [s, b, h]."""
    import deepspeed
    from deepspeed.moe.layer import MoE

    # by module path: the attribute deepspeed.comm.torch is the torch package its __init__ imports
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    num_experts, hidden, ffn = weights["gate"].shape
    layer = MoE(hidden, SwiGLU(hidden, ffn), num_experts=num_experts, ep_size=ep, k=topk, capacity_factor=1.0,
                eval_capacity_factor=1.0, min_capacity=0, noisy_gate_policy=None, drop_tokens=False, use_rts=False,
                top2_2nd_expert_sampling=False)
    layer.set_deepspeed_parallelism()
    local = num_experts // ep
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(weights["router"])
        for i, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            e = ep_rank * local + i
            for name in ("gate", "up", "down"):
                getattr(expert, name).copy_(weights[name][e])

    def forward(x: torch.Tensor) -> torch.Tensor:
        return layer(x)[0]

    forward.parameters = layer.parameters  # type: ignore[attr-defined]
    return forward
