"""The scale of the MoE routers' auxiliary losses: the one the LM loss gets, under every split.

Target: each router's weight receives ``coeff x`` the mean, over the m x dp micro-batches of the global
batch, of each micro-batch's aux (and z) loss gradient, times the fp16 loss scale s like every other
gradient (the optimizer unscales them all by s).

What the LM loss gets: each micro-batch's loss is multiplied by s (the scaler's hook) and 1/m (the
schedule), and the engine sums the gradients over dp x cp and divides by dp x cp. Under CP a rank's LM
loss is the mean over its own S/cp tokens, so that dp x cp mean is the global token mean.

What a router's loss is: a *partial* loss. Each of the tp x cp ranks sharing a sequence adds its own
tokens' terms, with the whole-sequence counts (``moe/balance.py``), so the partials *sum* to the
micro-batch's loss: over tp through the SP-partial gradient sum of the router weight (MoE under tp needs
sequence parallelism), over cp through the engine's dp x cp sum, which then divides by cp as well.
With ``router.aux_scale`` = a the router weight's gradient is therefore

    a x (1 / (dp cp)) x sum over dp ranks and micro-batches of d(aux)

and the target is s x (1 / (m dp)) x the same sum, so

    a = s x cp / m.

tp, pp and dp do not appear: pp because the loss is attached inside the stage's own graph (every
stage's backward delivers its routers' losses), dp because both means divide by it.
"""
from __future__ import annotations

from typing import Callable

from torch import nn
from torch.utils.hooks import RemovableHandle

from .chunk import routers_of


def aux_loss_scale(micro_batches: int, cp: int, loss_scale: float = 1.0) -> float:
    """``router.aux_scale`` for a step of ``micro_batches`` per DP rank at context parallelism ``cp`` (see above)."""
    return loss_scale * cp / micro_batches


class AuxLossScaling:
    """Sets every router's ``aux_scale`` before each forward of its chunk, reading the current fp16 loss scale
    (``loss_scale``: the scaler's, or 1.0), which changes between steps."""

    def __init__(self, micro_batches: int, cp: int, loss_scale: Callable[[], float] = lambda: 1.0) -> None:
        self.micro_batches, self.cp, self.loss_scale = micro_batches, cp, loss_scale

    def attach(self, chunks: list[nn.Module]) -> list[RemovableHandle]:
        """A forward pre-hook on each chunk that holds routers (none on a dense model)."""
        handles = []
        for chunk in chunks:
            routers = routers_of(chunk)
            if routers:
                handles.append(chunk.register_forward_pre_hook(self._hook(routers)))
        return handles

    def _hook(self, routers: list) -> Callable[[nn.Module, tuple], None]:
        def hook(module: nn.Module, args: tuple) -> None:
            scale = aux_loss_scale(self.micro_batches, self.cp, self.loss_scale())
            for router in routers:
                router.aux_scale = scale
        return hook
