"""The mixture-of-experts layer: router -> dispatch -> grouped experts -> combine (+ a dense shared expert).

Legend: s sequence, b batch, h hidden, T = s * b tokens on this rank. Input and output are [s, b, h]
([s/tp, b, h] under sequence parallelism), so the layer replaces a dense MLP in a block.

Each rank routes its own tokens: under TP that needs sequence parallelism (the TP ranks would otherwise
hold the same tokens and each expert would compute them tp times; the run plan refuses MoE under --tp
without --sequence-parallel, as Megatron does), and the router's weight is then SP-replicated.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, scaled_init_std
from .context import ExpertContext
from .dispatch import AllGatherDispatcher, AllToAllDispatcher, Capacity
from .experts import GroupedExperts
from .router import Router


class SharedExpert(nn.Module):
    """The dense expert every token passes through (--moe-shared-expert-intermediate-size), tensor-parallel as
    the dense MLP: llama down(silu(gate) * up); gpt2 fc2(GELU(tanh)(fc1)) with biases."""

    def __init__(self, cfg: ModelConfig, ctx: ExpertContext, device=None, dtype=None) -> None:
        super().__init__()
        width = cfg.moe_shared_expert_intermediate_size
        assert width is not None, "a shared expert needs --moe-shared-expert-intermediate-size"
        self.gated = cfg.arch == "llama"
        column = dict(tp_group=ctx.tp_group, bias=not self.gated, sequence_parallel=ctx.sequence_parallel,
                      init_std=cfg.init_method_std, device=device, dtype=dtype)
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, width, **column)
        self.gate = ColumnParallelLinear(cfg.hidden_size, width, **column) if self.gated else None
        self.fc2 = RowParallelLinear(width, cfg.hidden_size, tp_group=ctx.tp_group, bias=not self.gated,
                                     sequence_parallel=ctx.sequence_parallel, device=device, dtype=dtype,
                                     init_std=scaled_init_std(cfg.init_method_std, cfg.num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.fc2(F.silu(self.gate(x)) * self.fc1(x))
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def capacity_of(cfg: ModelConfig) -> Capacity | None:
    """The token-dropping settings, or None for dropless."""
    if cfg.moe_expert_capacity_factor is None:
        return None
    return Capacity(cfg.moe_expert_capacity_factor, cfg.moe_token_drop_policy,  # type: ignore[arg-type]
                    cfg.moe_pad_expert_input_to_capacity)


class MoELayer(nn.Module):
    """x [s, b, h] -> the weighted sum of each token's top-k experts (+ the shared expert), same shape.

    ``tokens_per_expert`` holds this rank's routed counts [E] of the last forward, for logging.
    """

    def __init__(self, cfg: ModelConfig, ctx: ExpertContext, layer_id: int, device=None, dtype=None) -> None:
        super().__init__()
        if cfg.num_experts is None:
            raise ValueError("an MoE layer needs --num-experts; set it or use a dense MLP.")
        capacity = capacity_of(cfg)
        if capacity is not None and capacity.pad and ctx.dispatcher == "allgather":
            raise ValueError("--moe-pad-expert-input-to-capacity needs --moe-token-dispatcher-type alltoall (the "
                             "all-gather dispatcher's exchanges have a fixed size already); drop one of them.")
        assert ctx.tp == 1 or ctx.sequence_parallel, "MoE under TP needs sequence parallelism (the run plan says so)"
        self.ctx, self.layer_id = ctx, layer_id
        self.router = Router(cfg, layer_id, sequence_parallel=ctx.sequence_parallel, device=device, dtype=dtype)
        self.experts = GroupedExperts(cfg, ctx, device=device, dtype=dtype)
        dispatcher = AllGatherDispatcher if ctx.dispatcher == "allgather" else AllToAllDispatcher
        self.dispatcher = dispatcher(cfg.num_experts, ctx, capacity)
        self.shared_expert = (SharedExpert(cfg, ctx, device=device, dtype=dtype)
                              if cfg.moe_shared_expert_intermediate_size else None)
        self.tokens_per_expert: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return f"layer {self.layer_id}, dispatcher={self.ctx.dispatcher}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        x_TH = x.reshape(s * b, h)  # s-major: the b of each position are adjacent rows
        routing = self.router(x_TH, self.ctx.tp_cp_group, batch=b)
        self.tokens_per_expert = routing.tokens_per_expert
        y = self.dispatcher(x_TH, routing.probs, routing.experts, self.experts).view(s, b, h)
        return y if self.shared_expert is None else y + self.shared_expert(x)
