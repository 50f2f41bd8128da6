"""Forward/backward schedules over the micro-batches of one step.

Every schedule has one signature:

    schedule(chunks, micro_batches, pstate, no_sync) -> list[Tensor]

``chunks`` are this rank's model chunks, ``micro_batches`` the step's
[mb, seq+1] token tensors, ``no_sync`` a context manager factory from the
optimizer, entered for every backward of a chunk but that chunk's last one
in the step, so gradient communication waits for the final micro-batch.
It returns the detached per-micro-batch losses on the last pipeline stage
(empty elsewhere). Each micro-batch's loss is scaled by 1/m before backward,
so accumulated grads are those of the mean loss.

Pipeline schedules (p stages, m micro-batches; F = forward, B = backward):

    gpipe        all m forwards, then all m backwards: m activations in flight.
    1f1b         warm-up of p-1-rank forwards, then one F + one B at a time, then
                 cool-down backwards: at most p activations in flight.
    interleaved  1F1B over v model chunks per rank (``interleaved.py``): the bubble
                 shrinks by v at the cost of v times more point-to-point traffic.
"""
from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch import nn

from ..config import Config
from ..parallel.state import ParallelState
from .p2p import StageLink
from .timeline import Timeline

NoSync = Callable[[], ContextManager]


def forward_backward_no_pipelining(chunks: list[nn.Module], micro_batches: list[torch.Tensor],
                                   pstate: ParallelState, no_sync: NoSync) -> list[torch.Tensor]:
    """pp = 1: forward and backward each micro-batch in turn, accumulating gradients."""
    assert len(chunks) == 1, "without pipeline parallelism a rank holds one model chunk"
    model, m = chunks[0], len(micro_batches)
    losses = []
    for i, tokens in enumerate(micro_batches):
        sync = contextlib.nullcontext() if i == m - 1 else no_sync()
        with sync:
            loss = model(tokens[:, :-1], tokens[:, 1:])
            (loss / m).backward()
        losses.append(loss.detach())
    return losses


@dataclass
class ScheduleStats:
    """What one schedule call did on this rank (tests read the schedule's own counts)."""

    forwards: int = 0
    backwards: int = 0
    in_flight: int = 0  # micro-batch forwards whose backward has not run yet
    max_in_flight: int = 0


class StepRunner:
    """One rank's state during one schedule call: its chunks, the data, the link, the counts.

    The four transfer verbs of the schedules are ``link.exchange`` calls; this class
    adds the forward and backward steps, which pick the right micro-batch per chunk.
    """

    def __init__(self, chunks: list[nn.Module], micro_batches: list[torch.Tensor], pstate: ParallelState,
                 no_sync: NoSync, timeline: Timeline | None) -> None:
        self.chunks, self.micro_batches, self.pstate = chunks, micro_batches, pstate
        self.no_sync, self.timeline = no_sync, timeline
        self.m, self.vp = len(micro_batches), len(chunks)
        self.first, self.last = pstate.is_first_stage, pstate.is_last_stage
        self.forward_count, self.backward_count = [0] * self.vp, [0] * self.vp
        self.losses: list[torch.Tensor] = []
        self.stats = ScheduleStats()
        model = chunks[0]
        b, s_plus_1 = micro_batches[0].shape
        assert s_plus_1 == model.cfg.seq_length + 1, (tuple(micro_batches[0].shape), model.cfg.seq_length)
        seq = model.cfg.seq_length // (model.ctx.size if model.ctx.sequence_parallel else 1)
        dtype = next(model.parameters()).dtype
        self.link = StageLink(pstate, (seq, b, model.cfg.hidden_size), dtype)
        # every chunk but the model's very first takes m activations, every one but its very last m gradients
        total = self.m * self.vp
        self.link.expect(from_prev=total - (self.m if self.first else 0),
                         from_next=total - (self.m if self.last else 0))

    def _span(self, kind: str, micro_batch: int, chunk: int) -> ContextManager:
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(kind, micro_batch, chunk)

    def forward(self, c: int, x: torch.Tensor | None) -> torch.Tensor:
        """Run chunk ``c`` on its next micro-batch: hidden states out, or the loss / m on the last stage."""
        model, mb = self.chunks[c], self.forward_count[c]
        self.forward_count[c] += 1
        tokens = self.micro_batches[mb]
        with self._span("F", mb, c):
            out = model(tokens[:, :-1] if model.pre_process else x, tokens[:, 1:] if model.post_process else None)
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

    # the four verbs (no-ops at the ends of the pipeline)
    def recv_forward(self) -> torch.Tensor | None:
        return self.link.exchange(recv_prev=not self.first)[0]

    def send_forward(self, y: torch.Tensor) -> None:
        self.link.exchange(send_next=None if self.last else y)

    def recv_backward(self) -> torch.Tensor | None:
        return self.link.exchange(recv_next=not self.last)[1]

    def send_backward(self, dx: torch.Tensor | None) -> None:
        self.link.exchange(send_prev=None if self.first else dx)


def gpipe(run: StepRunner) -> None:
    """All forwards, then all backwards (GPipe): simple, and m activations in flight."""
    inputs, outputs = deque(), deque()
    for _ in range(run.m):
        x = run.recv_forward()
        y = run.forward(0, x)
        run.send_forward(y)
        inputs.append(x)
        outputs.append(y)
    for _ in range(run.m):
        dy = run.recv_backward()
        run.send_backward(run.backward(0, inputs.popleft(), outputs.popleft(), dy))


def one_f_one_b(run: StepRunner) -> None:
    """1F1B (PipeDream-Flush): warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    pp, rank = run.pstate.pp_size, run.pstate.pp_rank
    warmup = min(pp - rank - 1, run.m)
    steady = run.m - warmup
    inputs, outputs = deque(), deque()
    # warm-up: fill the pipeline; stage r holds p-1-r activations before its first backward
    for _ in range(warmup):
        x = run.recv_forward()
        y = run.forward(0, x)
        run.send_forward(y)
        inputs.append(x)
        outputs.append(y)
    x = run.recv_forward() if steady > 0 else None
    # steady state: each forward's output goes out as the matching gradient comes in
    for i in range(steady):
        y = run.forward(0, x)
        dy = run.link.exchange(send_next=None if run.last else y, recv_next=not run.last)[1]
        inputs.append(x)
        outputs.append(y)
        dx = run.backward(0, inputs.popleft(), outputs.popleft(), dy)
        if i == steady - 1:
            run.send_backward(dx)
        else:
            x = run.link.exchange(recv_prev=not run.first, send_prev=None if run.first else dx)[0]
    # cool-down: drain the backwards of the warm-up micro-batches
    for _ in range(warmup):
        dy = run.recv_backward()
        run.send_backward(run.backward(0, inputs.popleft(), outputs.popleft(), dy))


class PipelineSchedule:
    """A named schedule as a callable with the common signature; keeps the last call's stats."""

    def __init__(self, name: str, timeline: Timeline | None = None) -> None:
        from .interleaved import interleaved_1f1b

        kinds = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b}
        assert name in kinds, f"unknown pipeline schedule {name!r}"
        self.name, self.run, self.timeline = name, kinds[name], timeline
        self.stats = ScheduleStats()

    def __call__(self, chunks: list[nn.Module], micro_batches: list[torch.Tensor], pstate: ParallelState,
                 no_sync: NoSync) -> list[torch.Tensor]:
        assert micro_batches, "a step needs at least one micro-batch"
        assert self.name == "interleaved" or len(chunks) == 1, "only the interleaved schedule runs several chunks"
        runner = StepRunner(chunks, micro_batches, pstate, no_sync, self.timeline)
        if self.timeline is not None:
            self.timeline.begin_step()
        self.run(runner)
        runner.link.flush()
        if self.timeline is not None:
            self.timeline.end_step()
        assert runner.stats.in_flight == 0 and runner.stats.forwards == runner.m * runner.vp, runner.stats
        assert not any(runner.link.expected.values()), f"receives announced but not taken: {runner.link.expected}"
        self.stats = runner.stats
        return runner.losses


def get_schedule(name: str | None, pstate: ParallelState, timeline: Timeline | None = None):
    """The schedule function for this run; pp = 1 without a timeline needs no pipeline machinery."""
    if pstate.pp_size == 1 and timeline is None and name != "interleaved":
        return forward_backward_no_pipelining
    return PipelineSchedule(name or "1f1b", timeline)


def build_schedule(cfg: Config, pstate: ParallelState):
    """The run's schedule from its config, recording a timeline for ``--timeline`` (written to a file)
    or ``--log-timers`` with a pipeline (the bubble fraction in the log line)."""
    wanted = cfg.logging.timeline or (cfg.logging.log_timers and pstate.pp_size > 1)
    timeline = Timeline(pstate.rank, pstate.pp_rank, cuda=pstate.device.type == "cuda") if wanted else None
    return get_schedule(cfg.parallel.schedule_name(cfg.model.num_layers), pstate, timeline)
