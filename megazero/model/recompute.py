"""Activation recomputation (checkpointing): the blocks' ``recompute`` fields and what their forward runs.

Modes (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models"):

- ``none``: autograd keeps every tensor the backward needs.
- ``selective``: the attention core (softmax(QK^T)V and its dropout) is re-run
  in backward; only its inputs q, k, v are kept. Cheap in FLOPs, and with a
  math (non-flash) attention kernel it drops every s^2 term.
- ``full``: each block keeps only its input and re-runs its whole forward in
  backward. ``num_layers`` limits this to the first N blocks of each chunk
  (Megatron's "block" method), trading memory for compute.

The mode is a field of each block (``TransformerBlock.recompute``, ``Attention.recompute_core``),
set by ``apply_recompute`` (from ``training/parallelize.py``) and read by the block's own forward,
which calls ``checkpointed_block`` / ``checkpointed_core`` below.

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
from typing import Any, Callable, Protocol, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from ..config import RECOMPUTE_MODES
from ..tensor_parallel.random import DropoutRNG


class Layer(Protocol):
    """What checkpointing reads of a block or its attention (``transformer.py``, which imports this module)."""

    ctx: Any  # its TPContext: the dropout streams to replay
    layer_id: int


class Block(Layer, Protocol):
    recompute: str
    compiled_body: Callable[..., torch.Tensor] | None
    attention: Any  # its Attention, whose ``recompute_core`` selective recompute sets



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


def checkpointed_block(block: Layer, body: Callable[..., torch.Tensor], x: torch.Tensor,
                       documents: Any = None) -> torch.Tensor:
    """Full recompute: ``body(x)`` (the block's compiled body under --compile) keeping only ``x`` (and the
    micro-batch's ``documents``, which the recompute sees as the forward did) for backward."""
    if documents is not None:
        body = functools.partial(body, documents=documents)
    streams = block.ctx.dropout_streams(block.layer_id)
    return checkpoint_with_rng(body, block.ctx.rng, streams, x)


def checkpointed_core(attention: Layer, core: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, bounds: Any = None) -> torch.Tensor:
    """Selective recompute: the attention ``core`` re-run in backward; keeps only q, k, v (and the bounds)."""
    streams = attention.ctx.dropout_streams(attention.layer_id)
    return checkpoint_with_rng(lambda *t: core(*t, bounds), attention.ctx.rng, streams, q, k, v)


def apply_recompute(blocks: Sequence[Block], mode: str, num_layers: int | None = None) -> None:
    """Set the recompute fields of ``blocks`` (a chunk's, ``model.chunk.blocks_of``), read by their forward.

    selective: every block's attention core is checkpointed. full: the first ``num_layers`` blocks (all when
    None) are checkpointed whole. Calling it again replaces the mode. Raises once a block is compiled: what
    runs eager inside a compiled body is chosen from the recompute mode (``compile.eager_sites``).
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"--recompute must be one of {RECOMPUTE_MODES}, got {mode!r}.")
    if any(block.compiled_body is not None for block in blocks):
        raise ValueError("recompute is set before compile (training/parallelize.py): a compiled block's "
                         "graph breaks were chosen for the recompute mode it had then.")
    limit = len(blocks) if num_layers is None else num_layers
    for i, block in enumerate(blocks):
        block.recompute = "full" if mode == "full" and i < limit else ("selective" if mode == "selective" else "none")
        block.attention.recompute_core = mode == "selective"
