"""Dynamic loss scaling for fp16: scale the loss up so small gradients survive fp16.

The scale enters backward through a forward hook on each model chunk: when
a chunk returns the (0-dim) loss, the hook wraps it in ``_ScaleGrad``, which
is the identity forward and multiplies the incoming gradient by the scale in
backward. The loss value the schedule records is therefore unchanged, and
no pipeline schedule needs to know about loss scaling; stages that do not
compute the loss receive already-scaled gradients from their successor.

After backward the optimizer unscales the gradients, and all ranks agree on
whether any of them overflowed. On overflow the step is skipped and the
scale halves; after ``window`` clean steps it doubles (the scheme of
Micikevicius et al., "Mixed Precision Training", and Megatron-LM).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


class _ScaleGrad(torch.autograd.Function):
    """forward: identity / backward: multiply the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class DynamicLossScaler:
    def __init__(self, initial_scale: float, min_scale: float = 1.0, window: int = 1000,
                 growth: float = 2.0, backoff: float = 0.5) -> None:
        self.scale, self.min_scale, self.window = float(initial_scale), float(min_scale), window
        self.growth, self.backoff = growth, backoff
        self.clean_steps = 0

    def update(self, found_inf: bool) -> None:
        """Halve the scale on overflow; double it after ``window`` clean steps in a row."""
        if found_inf:
            self.scale = max(self.min_scale, self.scale * self.backoff)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.window:
            self.scale *= self.growth
            self.clean_steps = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])

    def attach(self, modules: list[nn.Module]) -> list[RemovableHandle]:
        """Scale the backward of every 0-dim (loss) output of these chunks by the current scale."""

        def hook(module: nn.Module, args: tuple, output):
            if isinstance(output, torch.Tensor) and output.ndim == 0 and output.requires_grad:
                return _ScaleGrad.apply(output, self.scale)
            return output

        return [m.register_forward_hook(hook) for m in modules]
