"""The forward-only walk: one step's micro-batches through every stage, no backward (evaluation).

Each micro-batch walks the virtual stages in order (stage k = chunk k // pp of
pipeline rank k % pp); the rank that owns a stage receives its input from the
previous one, runs it and sends the output on. Without a backward there is
nothing to overlap, so no schedule is needed. Packed documents are found and
scaled as the training schedule does (``runner.step_documents``), so a
forward-only loss is the one training would record for the same batch.
"""
from __future__ import annotations

import torch
from torch import nn

from ..model.documents import Documents, PackingRule
from ..parallel.state import ParallelState
from .p2p import StageLink
from .runner import step_documents


@torch.no_grad()
def forward_only(chunks: list[nn.Module], micro_batches: list[torch.Tensor], pstate: ParallelState,
                 stage_shape: tuple[int, int, int], dtype: torch.dtype,
                 packing: PackingRule | None = None) -> list[torch.Tensor]:
    """The last stage's fp32 loss of each [b, s+1] micro-batch of one step (empty on other stages).

    ``stage_shape`` and ``dtype`` are the activations' between stages (``RunPlan.stage_shape``,
    ``RunPlan.compute_dtype``) and ``packing`` the run's document flags, as the schedule's.
    """
    documents = [None] * len(micro_batches) if packing is None else step_documents(packing, micro_batches, pstate)
    losses = [_walk(chunks, tokens, docs, pstate, stage_shape, dtype)
              for tokens, docs in zip(micro_batches, documents)]
    return [loss.float() for loss in losses if loss is not None]


def _walk(chunks: list[nn.Module], tokens: torch.Tensor, documents: Documents | None, pstate: ParallelState,
          stage_shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor | None:
    """One micro-batch through this rank's stages: its loss on the last stage, None elsewhere."""
    def run(chunk: nn.Module, x: torch.Tensor | None) -> torch.Tensor:
        args = (tokens[:, :-1] if chunk.pre_process else x, tokens[:, 1:] if chunk.post_process else None)
        return chunk(*args) if documents is None else chunk(*args, documents=documents)

    pp, vp = pstate.pp, len(chunks)
    link = StageLink(pstate, stage_shape, dtype)
    loss, x = None, None
    for k in range(pp * vp):
        if k % pp != pstate.pp_rank:
            continue
        chunk = chunks[k // pp]
        if k > 0:
            x = link.recv_forward().detach()
        out = run(chunk, x)
        if chunk.post_process:
            loss = out
        else:
            link.send_forward(out)
    link.flush()
    return loss
