"""The forward-only walk: one step's micro-batches through every stage, no backward (evaluation).

Each micro-batch walks the virtual stages in order (stage k = chunk k // pp of
pipeline rank k % pp); the rank that owns a stage receives its input from the
previous one, runs it and sends the output on. Without a backward there is
nothing to overlap, so no schedule is needed. Packed documents are found and
scaled as the training schedule does (``runner.step_documents``), so a
forward-only loss is the one training would record for the same batch.

Multi-token prediction (``model/mtp.py``): the model computes its depths' losses only when it trains (they
ride on the LM loss's gradient), so here the last stage takes them itself, inside the chunk's forward (where
ZeRO 3 holds the head and embedding gathered), from the final norm's input h^0, with the scales the schedule
would give them. The LM loss is computed as without MTP.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, cast

import torch
from torch import nn

from ..model.documents import Documents, PackingRule
from ..model.mtp import mtp_depth_of
from ..parallel.state import ParallelState
from .p2p import StageLink
from .runner import step_documents


@dataclass
class WalkLosses:
    """The last stage's fp32 losses of one step, per micro-batch (both empty on other stages)."""

    lm: list[torch.Tensor] = field(default_factory=list)  # the LM loss, as the schedule returns it
    mtp: list[torch.Tensor] = field(default_factory=list)  # [D]: each MTP depth's, as training records them


@torch.no_grad()
def forward_only(chunks: list[nn.Module], micro_batches: list[torch.Tensor], pstate: ParallelState,
                 stage_shape: tuple[int, int, int], dtype: torch.dtype,
                 packing: PackingRule | None = None) -> WalkLosses:
    """The last stage's losses of each [b, s+1] micro-batch of one step.

    ``stage_shape`` and ``dtype`` are the activations' between stages (``RunPlan.stage_shape``,
    ``RunPlan.compute_dtype``) and ``packing`` the run's document flags, as the schedule's.
    """
    documents = ([None] * len(micro_batches) if packing is None
                 else step_documents(packing, micro_batches, pstate, mtp_depth_of(chunks)))
    out = WalkLosses()
    for tokens, docs in zip(micro_batches, documents):
        _walk(chunks, tokens, docs, pstate, stage_shape, dtype, out)
    return out


def _walk(chunks: list[nn.Module], tokens: torch.Tensor, documents: Documents | None, pstate: ParallelState,
          stage_shape: tuple[int, int, int], dtype: torch.dtype, out: WalkLosses) -> None:
    """One micro-batch through this rank's stages; the last stage adds its losses to ``out``."""
    def run(chunk: nn.Module, x: torch.Tensor | None) -> torch.Tensor:
        args = (tokens[:, :-1] if chunk.pre_process else x, tokens[:, 1:] if chunk.post_process else None)
        return chunk(*args) if documents is None else chunk(*args, documents=documents)

    pp, vp = pstate.pp, len(chunks)
    link = StageLink(pstate, stage_shape, dtype)
    x = None
    for k in range(pp * vp):
        if k % pp != pstate.pp_rank:
            continue
        chunk = chunks[k // pp]
        if k > 0:
            x = link.recv_forward().detach()
        if chunk.post_process:
            with mtp_depth_losses(chunk, tokens[:, 1:], documents, out.mtp):
                out.lm.append(run(chunk, x).float())
        else:
            link.send_forward(run(chunk, x))
    link.flush()


@contextlib.contextmanager
def mtp_depth_losses(chunk: nn.Module, labels: torch.Tensor, documents: Documents | None,
                     rows: list[torch.Tensor]) -> Iterator[None]:
    """While a last-stage ``chunk`` runs on ``labels`` (whole samples), add its MTP depths' losses to ``rows``
    (nothing without MTP): taken from its final norm's input, h^0, as the model's own training forward does."""
    stack = getattr(chunk, "mtp", None)
    if stack is None:
        yield
        return

    def after_final_norm(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        rows.append(torch.stack(stack.depth_losses(chunk, args[0], labels, documents)).float())

    handle = cast(nn.Module, chunk.final_norm).register_forward_hook(after_final_norm)
    try:
        yield
    finally:
        handle.remove()
