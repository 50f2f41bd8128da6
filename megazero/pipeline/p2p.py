"""Point-to-point transfers between adjacent pipeline stages.

Activations travel forward (to the next stage) and their gradients backward
(to the previous stage), always as tensors of one shape and dtype that both
sides were given in advance (``RunPlan.stage_shape`` / ``compute_dtype``):
[s, b, h], or [s/tp, b, h] under sequence parallelism. The receiver allocates
that buffer; the sender asserts its tensor has that shape.

The schedules speak in verbs (``recv_forward``, ``send_forward``,
``recv_backward``, ``send_backward`` and the paired ``send_forward_recv_backward``
...). Each verb posts its ops as one batch (``batch_isend_irecv``), always in
the order: activation send, activation receive, gradient send, gradient
receive. Both backends match messages between a pair of ranks in the order
they were posted, so this fixed order keeps the two streams apart even when
the previous and next stage are the same rank (pp = 2, interleaved);
activations and gradients also carry different tags, which gloo matches on.
Neighbours wrap around (rank pp-1's next is rank 0): the interleaved schedule
sends a chunk's output from the last stage to the first stage's next chunk.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from ..config import ConfigError
from ..parallel import collectives as C
from ..parallel.state import ParallelState

MAX_PENDING_SENDS = 4
ACTIVATION_TAG, GRADIENT_TAG = 1, 2
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
PREV, NEXT = "prev", "next"  # the two receive streams: activations from the previous stage, grads from the next


class Received(NamedTuple):
    """What one transfer brought in (None where nothing was asked for)."""

    activation: torch.Tensor | None  # from the previous stage, for a forward
    grad: torch.Tensor | None  # from the next stage: the gradient of an output sent earlier


@dataclass
class PendingExchange:
    """Receives in flight; ``wait()`` returns what arrived once it has."""

    receives: list
    activation: torch.Tensor | None
    grad: torch.Tensor | None

    def wait(self) -> Received:
        for work in self.receives:
            work.wait()
        return Received(self.activation, None if self.grad is None else self.grad.detach())


PostReceive = Callable[[str], tuple[object, torch.Tensor]]


@dataclass
class ReceiveAhead:
    """Posts each stream's next receive as soon as the current one is taken (gloo only).

    Why: gloo moves a message only once both sides have posted it, so a receive
    posted when its data is needed costs a round trip on the critical path. When
    the schedule says how many tensors will come from each side (``expect``), the
    next receive goes out early and its data lands while the stage computes. NCCL
    runs a batch as one stream-ordered operation, where an early receive would hold
    back the sends queued after it, so there it stays off (``enabled`` False).
    """

    enabled: bool
    post_receive: PostReceive  # posts one receive of a stream on its own: (work, buffer)
    # per stream: receives still to come this schedule call, and the one already posted ahead
    expected: dict[str, int] = field(default_factory=lambda: {PREV: 0, NEXT: 0})
    ahead: dict[str, tuple[object, torch.Tensor] | None] = field(default_factory=lambda: {PREV: None, NEXT: None})

    def take(self, stream: str) -> tuple[object, torch.Tensor] | None:
        """The receive of ``stream`` posted earlier (its data may be here already), if there is one."""
        early, self.ahead[stream] = self.ahead[stream], None
        return early

    def taken(self, stream: str) -> None:
        """One receive of ``stream`` was issued; post the next one now if more are to come."""
        self.expected[stream] -= 1
        if self.enabled and self.expected[stream] > 0:
            self.ahead[stream] = self.post_receive(stream)

    def drained(self) -> bool:
        return all(a is None for a in self.ahead.values())


class StageLink:
    """This rank's connection to its pipeline neighbours for tensors of one shape and dtype."""

    def __init__(self, pstate: ParallelState, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.pstate, self.shape, self.dtype = pstate, tuple(shape), dtype
        pp, r = pstate.pp, pstate.pp_rank
        self.next_rank = pstate.stage_rank((r + 1) % pp)
        self.prev_rank = pstate.stage_rank((r - 1) % pp)
        # Sends in flight, with their tensors kept alive. Waiting for a send right away would
        # stall this stage until the neighbour posts the matching receive (lockstep stages);
        # instead they are reaped later, and at most MAX_PENDING_SENDS stay outstanding.
        self.pending_sends: list[tuple[object, torch.Tensor]] = []
        group = pstate.pp_group
        self.ahead = ReceiveAhead(group is not None and dist.get_backend(group) == "gloo", self._post_receive)

    def expect(self, from_prev: int, from_next: int) -> None:
        """The schedule will take ``from_prev`` activations and ``from_next`` gradients this call."""
        self.ahead.expected = {PREV: from_prev, NEXT: from_next}

    # -- the verbs (blocking unless named start_...) -------------------------------------------
    def recv_forward(self) -> torch.Tensor:
        """The activation from the previous stage."""
        return self._exchange(recv_prev=True).activation

    def send_forward(self, y: torch.Tensor) -> None:
        """Send an activation to the next stage."""
        self._exchange(send_next=y)

    def recv_backward(self) -> torch.Tensor:
        """The gradient of this stage's output, from the next stage."""
        return self._exchange(recv_next=True).grad

    def send_backward(self, dx: torch.Tensor) -> None:
        """Send the gradient of this stage's input to the previous stage."""
        self._exchange(send_prev=dx)

    def send_forward_recv_backward(self, y: torch.Tensor) -> torch.Tensor:
        """Send an activation on and receive the gradient of an earlier one (1F1B steady state)."""
        return self._exchange(send_next=y, recv_next=True).grad

    def send_backward_recv_forward(self, dx: torch.Tensor) -> torch.Tensor:
        """Send an input gradient back and receive the next activation (1F1B steady state)."""
        return self._exchange(recv_prev=True, send_prev=dx).activation

    def send_backward_recv_backward(self, dx: torch.Tensor | None, recv: bool) -> torch.Tensor | None:
        """Send ``dx`` back (None: nothing to send); receive a gradient when ``recv``."""
        return self._exchange(send_prev=dx, recv_next=recv).grad

    def send_forward_recv_forward_backward(self, y: torch.Tensor | None, recv_forward: bool,
                                           recv_backward: bool) -> Received:
        """Send ``y`` on (None: nothing to send); receive an activation and/or a gradient as asked."""
        return self._exchange(send_next=y, recv_prev=recv_forward, recv_next=recv_backward)

    def start_send_forward_recv_forward(self, y: torch.Tensor | None, recv: bool) -> PendingExchange:
        """``send_forward_recv_forward_backward`` without the wait (and no gradient): compute runs meanwhile."""
        return self._post(send_next=y, recv_prev=recv)

    # -- one batch of ops ------------------------------------------------------------------------
    def _exchange(self, send_next: torch.Tensor | None = None, recv_prev: bool = False,
                  send_prev: torch.Tensor | None = None, recv_next: bool = False) -> Received:
        return self._post(send_next, recv_prev, send_prev, recv_next).wait()

    def _post(self, send_next: torch.Tensor | None = None, recv_prev: bool = False,
              send_prev: torch.Tensor | None = None, recv_next: bool = False) -> PendingExchange:
        """Post the requested sends/receives as one batch, in the fixed order; does not wait."""
        group = self.pstate.pp_group
        ops: list[dist.P2POp] = []
        receives, buffers = [], {}

        def receive(stream: str, peer: int, tag: int) -> None:
            early = self.ahead.take(stream)
            if early is not None:
                work, buffers[stream] = early
                receives.append(work)
            else:
                buffers[stream] = self._buffer()
                ops.append(dist.P2POp(dist.irecv, buffers[stream].data, peer, group, tag))

        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, self._check(send_next, "an activation"), self.next_rank, group,
                                  ACTIVATION_TAG))
        if recv_prev:
            receive(PREV, self.prev_rank, ACTIVATION_TAG)
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, self._check(send_prev, "a gradient"), self.prev_rank, group,
                                  GRADIENT_TAG))
        if recv_next:
            receive(NEXT, self.next_rank, GRADIENT_TAG)
        if ops:
            self._issue(ops, receives)
        for stream in [s for s, wanted in ((PREV, recv_prev), (NEXT, recv_next)) if wanted]:
            self.ahead.taken(stream)
        return PendingExchange(receives, buffers.get(PREV), buffers.get(NEXT))

    def _issue(self, ops: list[dist.P2POp], receives: list) -> None:
        """Start ``ops``; their receives join ``receives``, their sends the pending sends."""
        works = C.batch_isend_irecv(ops, self.pstate.pp_group)
        if len(works) != len(ops):  # one coalesced handle (NCCL): nothing to defer
            receives.extend(works)
        else:
            for op, work in zip(ops, works):
                if op.op is dist.isend:
                    self.pending_sends.append((work, op.tensor))
                else:
                    receives.append(work)
        self._reap_sends()

    def _post_receive(self, stream: str) -> tuple[object, torch.Tensor]:
        """One receive of ``stream`` in a batch of its own (a look-ahead receive)."""
        buffer = self._buffer()
        peer, tag = (self.prev_rank, ACTIVATION_TAG) if stream == PREV else (self.next_rank, GRADIENT_TAG)
        work = C.batch_isend_irecv([dist.P2POp(dist.irecv, buffer.data, peer, self.pstate.pp_group, tag)],
                                   self.pstate.pp_group)[0]
        return work, buffer

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.pstate.device, requires_grad=True)

    def _check(self, t: torch.Tensor, what: str) -> torch.Tensor:
        assert tuple(t.shape) == self.shape and t.dtype == self.dtype, (
            f"pipeline stage {self.pstate.pp_rank} sends {what} of shape {tuple(t.shape)} {t.dtype}, "
            f"but stages agreed on {self.shape} {self.dtype}")
        return t.detach().contiguous()

    def _reap_sends(self) -> None:
        self.pending_sends = [(w, t) for w, t in self.pending_sends if not w.is_completed()]
        while len(self.pending_sends) > MAX_PENDING_SENDS:
            self.pending_sends.pop(0)[0].wait()

    def flush(self) -> None:
        """Wait for every send still in flight (end of a schedule call)."""
        assert self.ahead.drained(), "a receive was posted ahead that no step took"
        for work, _ in self.pending_sends:
            work.wait()
        self.pending_sends.clear()

    def undelivered(self) -> dict[str, int]:
        """Receives announced by ``expect`` but not taken (empty when the schedule took them all)."""
        return {s: n for s, n in self.ahead.expected.items() if n}


def verify_stage_shapes(pstate: ParallelState, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Every stage must expect the same activation shape; raise on all ranks if not, before any send.

    One all-gather of (shape, dtype) over the pipeline group, so a rank started with a
    different --seq-length, --micro-batch-size or --hidden-size is caught everywhere at once.
    """
    if pstate.pp_group is None:
        return
    mine = torch.tensor([*shape, DTYPE_CODES.get(dtype, -1)], dtype=torch.int64, device=pstate.device)
    everyone = torch.empty(pstate.pp * mine.numel(), dtype=torch.int64, device=pstate.device)
    C.all_gather_into_tensor(everyone, mine, pstate.pp_group)
    rows = everyone.view(pstate.pp, -1).tolist()
    if any(row != rows[0] for row in rows):
        described = "; ".join(f"stage {i}: [s, b, h]={row[:-1]} dtype code {row[-1]}" for i, row in enumerate(rows))
        raise ConfigError(f"pipeline stages disagree on the activation shape ({described}); launch every rank "
                          f"with the same --seq-length, --micro-batch-size, --hidden-size and precision.")
