"""Point-to-point transfers between adjacent pipeline stages.

Activations travel forward (to the next stage) and their gradients backward
(to the previous stage), always as tensors of one shape both sides computed
from the config: [s, b, h], or [s/tp, b, h] under sequence parallelism. The
receiver allocates that buffer; the sender asserts its tensor has that shape.

One ``exchange`` call posts up to four ops as one batch (``batch_isend_irecv``),
always in the order: activation send, activation receive, gradient send,
gradient receive. Both backends match messages between a pair of ranks in
the order they were posted, so this fixed order keeps the two streams apart
even when the previous and next stage are the same rank (pp = 2, interleaved);
activations and gradients also carry different tags, which gloo matches on.
Neighbours wrap around (rank pp-1's next is rank 0): the interleaved schedule
sends a chunk's output from the last stage to the first stage's next chunk.

Receives run one ahead on gloo. gloo moves a message only once both sides
have posted it, so a receive posted when its data is needed costs a round
trip on the critical path; when the schedule says how many tensors will come
from each side (``expect``), the link posts the next receive of a stream as
soon as the current one is taken, and the data lands while the stage
computes. NCCL runs a batch as one stream-ordered operation, where an early
receive would hold back the sends queued after it, so there it stays off.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import Config, ConfigError
from ..parallel import collectives as C
from ..parallel.state import ParallelState

MAX_PENDING_SENDS = 4
ACTIVATION_TAG, GRADIENT_TAG = 1, 2
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}


def stage_shape(cfg: Config) -> tuple[int, int, int]:
    """[s, b, h] of the hidden states between stages ([s/tp, b, h] with sequence parallelism)."""
    seq, tp = cfg.model.seq_length, cfg.parallel.tp
    if cfg.parallel.sequence_parallel:
        if seq % tp != 0:
            raise ConfigError(f"--seq-length ({seq}) must be divisible by --tp ({tp}) with --sequence-parallel.")
        seq //= tp
    return (seq, cfg.training.micro_batch_size, cfg.model.hidden_size)


@dataclass
class PendingExchange:
    """Receives in flight; ``wait()`` returns (from_prev, from_next) once they have arrived."""

    receives: list
    from_prev: torch.Tensor | None
    from_next: torch.Tensor | None

    def wait(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        for work in self.receives:
            work.wait()
        return self.from_prev, None if self.from_next is None else self.from_next.detach()


@dataclass
class StageLink:
    """This rank's connection to its pipeline neighbours for tensors of one shape and dtype."""

    pstate: ParallelState
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        pp, r = self.pstate.pp_size, self.pstate.pp_rank
        self.next_rank = self.pstate.stage_rank((r + 1) % pp)
        self.prev_rank = self.pstate.stage_rank((r - 1) % pp)
        # Sends in flight, with their tensors kept alive. Waiting for a send right away would
        # stall this stage until the neighbour posts the matching receive (lockstep stages);
        # instead they are reaped later, and at most MAX_PENDING_SENDS stay outstanding.
        self.pending_sends: list[tuple[object, torch.Tensor]] = []
        group = self.pstate.pp_group
        self.lookahead = group is not None and dist.get_backend(group) == "gloo"
        # per stream ("prev": activations in, "next": gradients in): receives still to come
        # this schedule call, and the one already posted ahead (work, buffer)
        self.expected = {"prev": 0, "next": 0}
        self.ahead: dict[str, tuple[object, torch.Tensor] | None] = {"prev": None, "next": None}

    def expect(self, from_prev: int, from_next: int) -> None:
        """The schedule will take ``from_prev`` activations and ``from_next`` gradients this call."""
        self.expected = {"prev": from_prev, "next": from_next}

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.pstate.device, requires_grad=True)

    def _check(self, t: torch.Tensor, what: str) -> torch.Tensor:
        assert tuple(t.shape) == self.shape and t.dtype == self.dtype, (
            f"pipeline stage {self.pstate.pp_rank} sends {what} of shape {tuple(t.shape)} {t.dtype}, "
            f"but stages agreed on {self.shape} {self.dtype}")
        return t.detach().contiguous()

    def exchange(self, send_next: torch.Tensor | None = None, recv_prev: bool = False,
                 send_prev: torch.Tensor | None = None, recv_next: bool = False
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Post the requested sends/receives as one batch and wait; returns (from_prev, from_next).

        ``send_next`` is an activation for the next stage, ``recv_prev`` asks for one from the
        previous stage; ``send_prev`` is an input gradient for the previous stage, ``recv_next``
        asks for an output gradient from the next stage.
        """
        return self.post(send_next, recv_prev, send_prev, recv_next).wait()

    def post(self, send_next: torch.Tensor | None = None, recv_prev: bool = False,
             send_prev: torch.Tensor | None = None, recv_next: bool = False) -> "PendingExchange":
        """``exchange`` without the wait: compute can run while the transfers are in flight."""
        group = self.pstate.pp_group
        ops: list[dist.P2POp] = []
        receives, buffers = [], {}

        def receive(stream: str, peer: int, tag: int) -> None:
            if self.ahead[stream] is not None:  # posted earlier: its data may be here already
                work, buffers[stream] = self.ahead[stream]
                self.ahead[stream] = None
                receives.append(work)
            else:
                buffers[stream] = self._buffer()
                ops.append(dist.P2POp(dist.irecv, buffers[stream].data, peer, group, tag))

        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, self._check(send_next, "an activation"), self.next_rank, group,
                                  ACTIVATION_TAG))
        if recv_prev:
            receive("prev", self.prev_rank, ACTIVATION_TAG)
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, self._check(send_prev, "a gradient"), self.prev_rank, group,
                                  GRADIENT_TAG))
        if recv_next:
            receive("next", self.next_rank, GRADIENT_TAG)
        if ops:
            works = C.batch_isend_irecv(ops, group)
            if len(works) != len(ops):  # one coalesced handle (NCCL): nothing to defer
                receives.extend(works)
            else:
                for op, work in zip(ops, works):
                    if op.op is dist.isend:
                        self.pending_sends.append((work, op.tensor))
                    else:
                        receives.append(work)
            self._reap_sends()
        for stream in [s for s, wanted in (("prev", recv_prev), ("next", recv_next)) if wanted]:
            self.expected[stream] -= 1
            if self.lookahead and self.expected[stream] > 0:
                self._post_ahead(stream)
        return PendingExchange(receives, buffers.get("prev"), buffers.get("next"))

    def _post_ahead(self, stream: str) -> None:
        """Post the next receive of ``stream`` now, so its data arrives while this stage computes."""
        buffer = self._buffer()
        peer, tag = (self.prev_rank, ACTIVATION_TAG) if stream == "prev" else (self.next_rank, GRADIENT_TAG)
        work = C.batch_isend_irecv([dist.P2POp(dist.irecv, buffer.data, peer, self.pstate.pp_group, tag)],
                                   self.pstate.pp_group)[0]
        self.ahead[stream] = (work, buffer)

    def _reap_sends(self) -> None:
        self.pending_sends = [(w, t) for w, t in self.pending_sends if not w.is_completed()]
        while len(self.pending_sends) > MAX_PENDING_SENDS:
            self.pending_sends.pop(0)[0].wait()

    def flush(self) -> None:
        """Wait for every send still in flight (end of a schedule call)."""
        assert all(a is None for a in self.ahead.values()), "a receive was posted ahead that no step took"
        for work, _ in self.pending_sends:
            work.wait()
        self.pending_sends.clear()


def verify_stage_shapes(pstate: ParallelState, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Every stage must expect the same activation shape; raise on all ranks if not, before any send.

    One all-gather of (shape, dtype) over the pipeline group, so a rank started with a
    different --seq-length, --micro-batch-size or --hidden-size is caught everywhere at once.
    """
    if pstate.pp_group is None:
        return
    mine = torch.tensor([*shape, DTYPE_CODES.get(dtype, -1)], dtype=torch.int64, device=pstate.device)
    everyone = torch.empty(pstate.pp_size * mine.numel(), dtype=torch.int64, device=pstate.device)
    C.all_gather_into_tensor(everyone, mine, pstate.pp_group)
    rows = everyone.view(pstate.pp_size, -1).tolist()
    if any(row != rows[0] for row in rows):
        described = "; ".join(f"stage {i}: [s, b, h]={row[:-1]} dtype code {row[-1]}" for i, row in enumerate(rows))
        raise ConfigError(f"pipeline stages disagree on the activation shape ({described}); launch every rank "
                          f"with the same --seq-length, --micro-batch-size, --hidden-size and precision.")
