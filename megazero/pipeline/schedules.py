"""The forward/backward schedules over one step's micro-batches, and picking the run's one.

p stages, m micro-batches per step; F = forward, B = backward:

    no-pipelining  pp = 1: F then B for each micro-batch in turn.
    gpipe          all m forwards, then all m backwards: m activations in flight.
    1f1b           warm-up of p-1-rank forwards, then one F + one B at a time, then
                   cool-down backwards: at most p activations in flight.
    interleaved    1F1B over v model chunks per rank (``interleaved.py``): the bubble
                   shrinks by v at the cost of v times more point-to-point traffic.

Each is a function of a ``StepRunner`` (``runner.py``), which supplies the forward,
the backward and the transfer verbs; ``build_schedule`` wraps the plan's one in a
``Schedule``, the callable the trainer runs.
"""
from __future__ import annotations

from collections import deque

from ..config import LoggingConfig
from ..model.documents import PackingRule
from ..parallel.state import ParallelState
from ..run_plan import RunPlan
from .interleaved import interleaved_1f1b
from .runner import Schedule, StepFn, StepRunner
from .timeline import NO_TIMELINE, NullTimeline, Timeline


def no_pipelining(run: StepRunner) -> None:
    """pp = 1: forward and backward each micro-batch in turn, accumulating gradients."""
    assert run.first and run.last, "no-pipelining runs the whole model on one stage"
    for _ in range(run.m):
        y = run.forward(0, None)
        run.backward(0, None, y, None)


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
    pp, rank = run.pstate.pp, run.pstate.pp_rank
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
        dy = run.send_forward_recv_backward(y)
        inputs.append(x)
        outputs.append(y)
        dx = run.backward(0, inputs.popleft(), outputs.popleft(), dy)
        if i == steady - 1:
            run.send_backward(dx)
        else:
            x = run.send_backward_recv_forward(dx)
    # cool-down: drain the backwards of the warm-up micro-batches
    for _ in range(warmup):
        dy = run.recv_backward()
        run.send_backward(run.backward(0, inputs.popleft(), outputs.popleft(), dy))


SCHEDULES: dict[str, StepFn] = {"no-pipelining": no_pipelining, "gpipe": gpipe, "1f1b": one_f_one_b,
                                "interleaved": interleaved_1f1b}


def build_schedule(plan: RunPlan, *, timeline: Timeline | NullTimeline = NO_TIMELINE,
                   packing: PackingRule | None = None) -> Schedule:
    """The plan's schedule, passing activations of ``plan.stage_shape`` in ``plan.compute_dtype``;
    ``packing``: the run's document flags (``model.documents.packing_rule``), None without them."""
    assert plan.schedule in SCHEDULES, f"unknown pipeline schedule {plan.schedule!r}"
    return Schedule(plan.schedule, SCHEDULES[plan.schedule], plan.stage_shape, plan.compute_dtype, timeline,
                    chunks_per_rank=plan.virtual_stages, packing=packing)


def schedule_timeline(logging: LoggingConfig, pstate: ParallelState) -> Timeline | NullTimeline:
    """A timeline for ``--timeline`` (written to a file) or ``--log-timers`` with a pipeline (the bubble
    fraction in the log line); one that records nothing when neither asks for one."""
    if not (logging.timeline or (logging.log_timers and pstate.pp > 1)):
        return NO_TIMELINE
    return Timeline(pstate.rank, pstate.pp_rank, cuda=pstate.device.type == "cuda")
