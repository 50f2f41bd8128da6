"""What reference runs and parity checks need from the model and optimizer, and training never calls.

- ``full_logits``: the whole model's logits over the full vocabulary, to compare with HF's forward;
- ``param_groups``: ``torch.optim`` groups with megazero's decay rule, for a ``torch.optim.AdamW`` reference;
- ``sync_replicated_grads``: the sums the gradient-sync engine does for replicated parameters, done on
  plain ``.grad`` / ``main_grad`` tensors, for a model trained without the ZeRO optimizer.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from megazero.model.gpt import GPTModel
from megazero.parallel.collectives import all_reduce_coalesced
from megazero.parallel.state import ParallelState
from megazero.tensor_parallel.comm import gather_from_tensor_parallel_region
from megazero.tensor_parallel.layers import spec_of


@torch.no_grad()
def full_logits(model: GPTModel, ids_bs: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [b, s, V] (padding dropped) of a model whose one stage holds every layer."""
    assert model.pre_process and model.post_process, "full_logits needs the whole model on one stage"
    logits = gather_from_tensor_parallel_region(model.forward(ids_bs), model.ctx.group)
    return logits[..., : model.cfg.vocab_size].transpose(0, 1)


def param_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """``torch.optim`` groups with the decay rule of ``ParamSpec.weight_decay``."""
    decay = [p for p in params if spec_of(p).weight_decay]
    no_decay = [p for p in params if not spec_of(p).weight_decay]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient a reference optimizer reads: the fp32 main grad when there is one, else ``.grad``."""
    return getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad


@torch.no_grad()
def sync_replicated_grads(params: Iterable[torch.nn.Parameter], pstate: ParallelState) -> None:
    """Sum sequence-parallel grads over TP and tied-embedding grads over the embedding group."""
    params = [p for p in params if grad_of(p) is not None]
    if pstate.tp_group is not None:
        all_reduce_coalesced([grad_of(p) for p in params if spec_of(p).sequence_parallel], pstate.tp_group)
    if pstate.embedding_group is not None:
        tied = [grad_of(p) for p in params if spec_of(p).tied_role is not None]
        all_reduce_coalesced(tied, pstate.embedding_group)
