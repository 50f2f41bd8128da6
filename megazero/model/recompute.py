"""Activation recomputation (checkpointing), applied to built model chunks from outside.

Modes (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models"):

- ``none``: autograd keeps every tensor the backward needs.
- ``selective``: the attention core (softmax(QK^T)V and its dropout) is re-run
  in backward; only its inputs q, k, v are kept. Cheap in FLOPs, and with a
  math (non-flash) attention kernel it drops every s^2 term.
- ``full``: each block keeps only its input and re-runs its whole forward in
  backward. ``num_layers`` limits this to the first N blocks of each chunk
  (Megatron's "block" method), trading memory for compute.

Recompute must draw the same dropout masks as the original forward. A
block draws from its own layer's streams (``DropoutRNG``: a shared and a
per-TP-rank one), which live outside torch, so ``checkpoint_with_rng``
rewinds them to the states they had when the region first ran, and
afterwards restores the states training has reached meanwhile (later
micro-batches of the same layer have drawn from them since). Without streams
(``ctx.rng`` None) dropout uses the default generator, which
``torch.utils.checkpoint`` rewinds itself (``preserve_rng_state``).
"""
from __future__ import annotations

import functools
import types
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..tensor_parallel.random import DropoutRNG
from .chunk import blocks_of

MODES = ("none", "selective", "full")


def checkpoint_with_rng(fn: Callable[..., Any], rng: DropoutRNG | None, streams: list[str], *args: Any) -> Any:
    """Non-reentrant ``checkpoint(fn, *args)`` whose recompute replays the dropout ``streams`` exactly."""
    if rng is None:
        return checkpoint(fn, *args, use_reentrant=False)
    start = rng.snapshot(streams)
    calls = [0]

    def run(*inner: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:  # the original forward: draw from the live streams
            return fn(*inner)
        resume = rng.snapshot(streams)  # recompute, in backward: rewind, replay, then put the live states back
        rng.restore(start)
        try:
            return fn(*inner)
        finally:
            rng.restore(resume)

    return checkpoint(run, *args, use_reentrant=False)


def block_body(block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A block's forward without recompute: its compiled body under --compile (``model/compile.py``)."""
    compiled = block.__dict__.get("compiled_forward")
    return compiled if compiled is not None else types.MethodType(type(block).forward, block)


def _checkpointed_block_forward(block: nn.Module, x: torch.Tensor, documents: Any = None) -> torch.Tensor:
    """Forward of a ``TransformerBlock`` that keeps only ``x`` (and the micro-batch's ``documents``) for backward."""
    body = block_body(block)
    if documents is not None:  # the recompute sees the same documents as the forward
        body = functools.partial(body, documents=documents)
    if not torch.is_grad_enabled():
        return body(x)
    streams = block.ctx.dropout_streams(block.layer_id)
    return checkpoint_with_rng(body, block.ctx.rng, streams, x)


def _checkpointed_core_attention(attention: nn.Module, q: torch.Tensor, k: torch.Tensor,
                                 v: torch.Tensor, bounds: Any = None) -> torch.Tensor:
    """``Attention.core_attention`` re-run in backward; keeps only q, k, v (and the documents' bounds)."""
    plain = type(attention).core_attention
    if not torch.is_grad_enabled():
        return plain(attention, q, k, v, bounds)
    streams = attention.ctx.dropout_streams(attention.layer_id)
    return checkpoint_with_rng(lambda *t: plain(attention, *t, bounds), attention.ctx.rng, streams, q, k, v)


def _reset(block: nn.Module) -> None:
    block.__dict__.pop("forward", None)
    block.attention.__dict__.pop("core_attention", None)


def apply_recompute(model: nn.Module, mode: str, num_layers: int | None = None) -> nn.Module:
    """Set the recompute mode on every block of ``model`` (a ``GPTModel`` chunk); returns it.

    selective: every block's attention core is checkpointed through the RNG-safe
    wrapper, which replays the layer's dropout streams. full: the first ``num_layers`` blocks of the
    chunk (all when None) are checkpointed whole. Calling it again replaces the mode.
    """
    if mode not in MODES:
        raise ValueError(f"--recompute must be one of {MODES}, got {mode!r}.")
    blocks = blocks_of(model)
    limit = len(blocks) if num_layers is None else num_layers
    for i, block in enumerate(blocks):
        _reset(block)
        if mode == "selective":
            block.attention.core_attention = types.MethodType(_checkpointed_core_attention, block.attention)
        elif mode == "full" and i < limit:
            block.forward = types.MethodType(_checkpointed_block_forward, block)
    return model
