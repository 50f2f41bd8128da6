"""What every schedule shares: the step runner and the ``Schedule`` object that drives it.

A schedule is a function ``step(run)`` that decides the order of forwards,
backwards and transfers for one step (``schedules.py``, ``interleaved.py``);
``StepRunner`` supplies the pieces it orders: ``forward`` / ``backward`` of a
chunk's next micro-batch, and the four transfer verbs with the ends of the
pipeline built in (the first stage receives no activation, the last sends
none). ``Schedule`` wraps a step function in the one call signature the
trainer uses:

    schedule(chunks, micro_batches, pstate, no_sync) -> list[Tensor]

``chunks`` are this rank's model chunks, ``micro_batches`` the step's
[b, s+1] token tensors, ``no_sync`` a context manager factory from the
optimizer, entered for every backward of a chunk but that chunk's last one
in the step, so gradient communication waits for the final micro-batch.
It returns the detached per-micro-batch losses on the last pipeline stage
(empty elsewhere). Each micro-batch's loss is scaled by 1/m before backward,
so accumulated grads are those of the mean loss.

Packed documents (``packing``, ``model.documents``): each micro-batch's
documents are found once, here, and go with it to every stage. With
--eod-mask-loss micro-batches keep different token counts, so a mean of
means would weigh tokens unequally: the kept tokens of the whole global batch
are counted (one all-reduce over DP) and each micro-batch's loss is its
masked sum x dp·cp·m / count, which the 1/m here, the gradient mean over
dp x cp and the trainer's loss mean turn into the global token mean.
``reduce_loss`` is that mean: the last stage's losses of a step (or of a
forward-only walk, ``forward_only.py``) averaged over dp x cp, known on every rank.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch import nn

from ..model.documents import Documents, PackingRule
from ..model.mtp import mtp_depth_of, mtp_token_counts
from ..parallel import collectives as C
from ..parallel.state import ParallelState
from .p2p import StageLink
from .timeline import NO_TIMELINE, NullTimeline, Timeline

NoSync = Callable[[], ContextManager]


@dataclass
class ScheduleStats:
    """What one schedule call did on this rank (tests read the schedule's own counts)."""

    forwards: int = 0
    backwards: int = 0
    in_flight: int = 0  # micro-batch forwards whose backward has not run yet
    max_in_flight: int = 0


def step_documents(packing: PackingRule, micro_batches: list[torch.Tensor],
                   pstate: ParallelState, mtp_depth: int = 0) -> list[Documents]:
    """Each micro-batch's documents; with a loss mask, scaled so the step's loss is the global token mean, and
    with ``mtp_depth`` MTP depths each depth's scale from its own global count (``model/mtp.py``)."""
    documents = [packing.documents(tokens[:, :-1]) for tokens in micro_batches]
    if not packing.eod_mask_loss and not mtp_depth:
        return documents
    counts = [sum(d.token_count() for d in documents)] if packing.eod_mask_loss else []
    if mtp_depth:
        batch, seq = micro_batches[0].shape[0], micro_batches[0].shape[1] - 1
        per_mb = [mtp_token_counts(d, batch, seq, mtp_depth, pstate.device) for d in documents]
        counts += [sum(column) for column in zip(*per_mb)]
    count = torch.tensor(counts, dtype=torch.float64, device=pstate.device)
    C.all_reduce(count, pstate.dp_group)  # CP ranks hold the same whole samples: counted once, over DP only
    scales = [pstate.dp_cp * len(micro_batches) / max(1.0, c) for c in count.tolist()]
    loss_scale = scales.pop(0) if packing.eod_mask_loss else 1.0
    return [dataclasses.replace(d, loss_scale=loss_scale, mtp_scales=tuple(scales)) for d in documents]


def reduce_loss(losses: list[torch.Tensor], pstate: ParallelState) -> float:
    """Mean of the last stage's micro-batch losses, averaged over DP and CP and known on every rank.

    A CP rank's loss is the mean over its S/cp tokens of each sample; the counts are equal, so the
    mean over the dp x cp group is the global token mean.
    """
    loss = torch.stack(losses).float().mean() if losses else torch.zeros((), device=pstate.device)
    if losses and pstate.dp_cp_group is not None:
        C.all_reduce(loss, pstate.dp_cp_group)
        loss /= pstate.dp_cp
    if pstate.pp_group is not None:  # only the last stage computed it
        C.broadcast(loss, pstate.stage_rank(pstate.pp - 1), pstate.pp_group)
    return float(loss)


class StepRunner:
    """One rank's state during one schedule call: its chunks, the data, the link, the counts."""

    def __init__(self, chunks: list[nn.Module], micro_batches: list[torch.Tensor], pstate: ParallelState,
                 no_sync: NoSync, timeline: Timeline | NullTimeline, link: StageLink,
                 documents: list[Documents] | None = None) -> None:
        self.chunks, self.micro_batches, self.pstate = chunks, micro_batches, pstate
        self.documents = documents
        self.no_sync, self.timeline, self.link = no_sync, timeline, link
        self.m, self.vp = len(micro_batches), len(chunks)
        self.first, self.last = pstate.is_first_stage, pstate.is_last_stage
        self.forward_count, self.backward_count = [0] * self.vp, [0] * self.vp
        self.losses: list[torch.Tensor] = []
        self.stats = ScheduleStats()
        # every chunk but the model's very first takes m activations, every one but its very last m gradients
        total = self.m * self.vp
        self.link.expect(from_prev=total - (self.m if self.first else 0),
                         from_next=total - (self.m if self.last else 0))

    def _span(self, kind: str, micro_batch: int, chunk: int) -> ContextManager:
        return self.timeline.span(kind, micro_batch, chunk)

    def forward(self, c: int, x: torch.Tensor | None) -> torch.Tensor:
        """Run chunk ``c`` on its next micro-batch: hidden states out, or the loss / m on the last stage."""
        model, mb = self.chunks[c], self.forward_count[c]
        self.forward_count[c] += 1
        tokens = self.micro_batches[mb]
        args = (tokens[:, :-1] if model.pre_process else x, tokens[:, 1:] if model.post_process else None)
        with self._span("F", mb, c):
            out = model(*args) if self.documents is None else model(*args, documents=self.documents[mb])
        if model.post_process:
            self.losses.append(out.detach())
            out = out / self.m
        self.stats.forwards += 1
        self.stats.in_flight += 1
        self.stats.max_in_flight = max(self.stats.max_in_flight, self.stats.in_flight)
        return out

    def backward(self, c: int, x: torch.Tensor | None, y: torch.Tensor, dy: torch.Tensor | None
                 ) -> torch.Tensor | None:
        """Backpropagate chunk ``c``'s oldest micro-batch; returns the input's gradient (None on stage 0)."""
        mb = self.backward_count[c]
        self.backward_count[c] += 1
        sync = contextlib.nullcontext() if mb == self.m - 1 else self.no_sync()
        with sync, self._span("B", mb, c):
            torch.autograd.backward(y, grad_tensors=dy)
        self.stats.backwards += 1
        self.stats.in_flight -= 1
        return None if x is None else x.grad

    # the transfer verbs of one-chunk schedules: no-ops at the ends of the pipeline
    def recv_forward(self) -> torch.Tensor | None:
        return None if self.first else self.link.recv_forward()

    def send_forward(self, y: torch.Tensor) -> None:
        if not self.last:
            self.link.send_forward(y)

    def recv_backward(self) -> torch.Tensor | None:
        return None if self.last else self.link.recv_backward()

    def send_backward(self, dx: torch.Tensor | None) -> None:
        if not self.first:
            self.link.send_backward(dx)

    def send_forward_recv_backward(self, y: torch.Tensor) -> torch.Tensor | None:
        return None if self.last else self.link.send_forward_recv_backward(y)

    def send_backward_recv_forward(self, dx: torch.Tensor | None) -> torch.Tensor | None:
        return None if self.first else self.link.send_backward_recv_forward(dx)


StepFn = Callable[[StepRunner], None]


class Schedule:
    """A named step function with the common call signature; keeps its timeline and the last call's stats.

    ``stage_shape`` and ``dtype`` are the activations' between stages (``RunPlan.stage_shape``,
    ``RunPlan.compute_dtype``); both neighbours allocate receive buffers from them.
    """

    def __init__(self, name: str, step: StepFn, stage_shape: tuple[int, int, int], dtype: torch.dtype,
                 timeline: Timeline | NullTimeline = NO_TIMELINE, *, chunks_per_rank: int = 1,
                 packing: PackingRule | None = None) -> None:
        self.name, self.step, self.timeline, self.packing = name, step, timeline, packing
        self.stage_shape, self.dtype, self.chunks_per_rank = stage_shape, dtype, chunks_per_rank
        self.stats = ScheduleStats()
        self.documents: list[Documents] | None = None  # the last step's (the trainer's FLOPs count them)

    def __call__(self, chunks: list[nn.Module], micro_batches: list[torch.Tensor], pstate: ParallelState,
                 no_sync: NoSync) -> list[torch.Tensor]:
        assert micro_batches, "a step needs at least one micro-batch"
        assert len(chunks) == self.chunks_per_rank, (
            f"the {self.name} schedule runs {self.chunks_per_rank} chunk(s) per rank, got {len(chunks)}")
        assert micro_batches[0].shape[0] == self.stage_shape[1], (
            f"micro-batches of {micro_batches[0].shape[0]} sequences, but the stages agreed on {self.stage_shape}")
        documents = (None if self.packing is None
                     else step_documents(self.packing, micro_batches, pstate, mtp_depth_of(chunks)))
        self.documents = documents
        run = StepRunner(chunks, micro_batches, pstate, no_sync, self.timeline,
                         StageLink(pstate, self.stage_shape, self.dtype), documents)
        self.timeline.begin_step()
        self.step(run)
        run.link.flush()
        self.timeline.end_step()
        assert run.stats.in_flight == 0 and run.stats.forwards == run.m * run.vp, run.stats
        assert not run.link.undelivered(), f"receives announced but not taken: {run.link.undelivered()}"
        self.stats = run.stats
        return run.losses
