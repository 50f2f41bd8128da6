"""megatron-core 0.16.1's ``MoELayer`` (all-to-all dispatcher, dropless) on CPU ranks over gloo.

megatron-core targets CUDA: its all-to-all dispatcher makes a side stream for device-to-host copies of
the split sizes, records and waits on events, and allocates exchange buffers on
``torch.cuda.current_device()``. On CPU those calls are made harmless (``cpu_shim``): streams and events
become no-ops, the current device is the CPU, and the split sizes (already host tensors) are turned into
the host lists ``all_to_all_single`` takes. Without Transformer Engine the experts are its
``SequentialMLP`` (one ColumnParallel/RowParallel pair per local expert; its grouped GEMM needs CUDA
packages) and the router GEMM is plain torch (``moe_utils.te_general_gemm = None``).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F


class _NoStream:
    """What megatron-core asks of a CUDA stream or event, doing nothing (CPU work is synchronous)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args) -> None:
        pass

    def record_event(self, *args) -> "_NoStream":
        return self

    def synchronize(self) -> None:
        pass


def _host_list(value):
    """A split-size tensor as the list of ints gloo's ``all_to_all_single`` takes; anything else unchanged."""
    return value.tolist() if torch.is_tensor(value) and value.dim() == 1 else value


def cpu_shim() -> None:
    """Make megatron-core's MoE CUDA calls no-ops on CPU (call before building the layer)."""
    torch.cuda.Stream = _NoStream  # type: ignore[misc]
    torch.cuda.Event = _NoStream  # type: ignore[misc]
    torch.cuda.current_stream = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.te_general_gemm = None
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    original = dispatcher._maybe_dtoh_and_synchronize

    def host_splits(self, point, tokens_per_expert=None):
        out = original(self, point, tokens_per_expert)
        self.input_splits, self.output_splits = _host_list(self.input_splits), _host_list(self.output_splits)
        self.output_splits_tp = _host_list(self.output_splits_tp)
        return out

    dispatcher._maybe_dtoh_and_synchronize = host_splits


def build(weights: dict[str, torch.Tensor], ep: int, ep_rank: int, topk: int) -> Callable:
    """This rank's megatron-core MoE layer holding ``weights`` (full [E, ...] tensors: router [E, H], gate and
    up [E, H, F], down [E, F, H]; SwiGLU experts); returns f(x [s, b, h]) -> y [s, b, h]."""
    cpu_shim()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    num_experts, hidden, ffn = weights["gate"].shape
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=4, ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn,
        num_moe_experts=num_experts, moe_router_topk=topk, moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="alltoall", expert_model_parallel_size=ep,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
        use_cpu_initialization=True, perform_initialization=False, params_dtype=torch.float32)
    spec = get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=False)
    layer = MoELayer(config, spec.submodules)
    local = num_experts // ep
    with torch.no_grad():
        layer.router.weight.copy_(weights["router"])
        for i, expert in enumerate(layer.experts.local_experts):
            e = ep_rank * local + i
            # fc1 holds [gate; up] as rows: the first half goes through the activation (megatron's GLU)
            expert.linear_fc1.weight.copy_(torch.cat([weights["gate"][e].T, weights["up"][e].T]))
            expert.linear_fc2.weight.copy_(weights["down"][e].T)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return layer(x)[0]

    forward.parameters = layer.parameters  # type: ignore[attr-defined]
    return forward
