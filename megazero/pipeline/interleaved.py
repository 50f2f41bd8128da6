"""Interleaved 1F1B over v model chunks per rank (Narayanan et al., 2021, section 2.2).

The m micro-batches run in groups of p: a rank forwards a group through chunk 0,
then the same group through chunk 1, ..., before the next group - so virtual
step k (0 <= k < m*v) is micro-batch ``(k // (p*v)) * p + k % p`` on chunk
``(k % (p*v)) // p`` (backwards visit the chunks in reverse). This needs m
divisible by p (validated in ``RunPlan.resolve``). Like 1F1B it has a
warm-up, a steady phase in which each forward is paired with a backward (the
forward's transfers fly while the backward computes), and a cool-down. The
ends of the pipeline depend on the chunk here, so the phases call the stage
link's verbs directly, saying what to send and receive.

Each transfer is decided from the *other* side's position: the first stage
receives from the last stage the output of the forward the last stage ran p-1
virtual steps earlier, hence the ``k - (p - 1)`` below (as in Megatron-LM).
"""
from __future__ import annotations

import torch

from .runner import StepRunner


class _Interleaved:
    """Per-chunk queues of inputs, outputs and output gradients, consumed oldest first."""

    def __init__(self, run: StepRunner) -> None:
        self.run = run
        self.pp, self.rank, self.vp, self.m = run.pstate.pp, run.pstate.pp_rank, run.vp, run.m
        assert self.m % self.pp == 0, f"interleaving needs micro-batches ({self.m}) divisible by pp ({self.pp})"
        self.total = self.m * self.vp
        self.inputs: list[list[torch.Tensor | None]] = [[] for _ in range(self.vp)]
        self.outputs: list[list[torch.Tensor]] = [[] for _ in range(self.vp)]
        self.grads: list[list[torch.Tensor | None]] = [[] for _ in range(self.vp)]

    def chunk_id(self, k: int, forward: bool) -> int:
        c = (k % (self.pp * self.vp)) // self.pp
        return c if forward else self.vp - 1 - c

    def forward(self, k: int) -> torch.Tensor | None:
        """Forward virtual step k; returns what to send on (None from the very last virtual stage)."""
        c = self.chunk_id(k, True)
        if self.run.first and c == 0:
            self.inputs[c].append(None)  # token ids come from the data, not a neighbour
        y = self.run.forward(c, self.inputs[c][-1])
        self.outputs[c].append(y)
        return None if (self.run.last and c == self.vp - 1) else y

    def backward(self, k: int) -> torch.Tensor | None:
        """Backward virtual step k; returns the input gradient to send (None from the very first)."""
        c = self.chunk_id(k, False)
        if self.run.last and c == self.vp - 1:
            self.grads[c].append(None)  # the loss starts its own backward
        dx = self.run.backward(c, self.inputs[c].pop(0), self.outputs[c].pop(0), self.grads[c].pop(0))
        return None if (self.run.first and c == 0) else dx

    def warmup_steps(self) -> int:
        if self.m == self.pp:
            return self.total  # every forward before the first backward
        return min((self.pp - self.rank - 1) * 2 + (self.vp - 1) * self.pp, self.total)

    def run_warmup(self, warmup: int) -> None:
        link, run = self.run.link, self.run
        if not run.first:
            self.inputs[0].append(link.recv_forward())
        for k in range(warmup):
            y = self.forward(k)
            next_chunk = self.chunk_id(k + 1, True)
            recv_prev = not (run.first and next_chunk == 0) and k != self.total - 1
            # the last warm-up step also fetches the first output gradient for the steady phase
            recv_next = k == warmup - 1 and warmup < self.total and not run.last
            got = link.send_forward_recv_forward_backward(y, recv_forward=recv_prev, recv_backward=recv_next)
            if recv_prev:
                self.inputs[next_chunk].append(got.activation)
            if recv_next:
                self.grads[self.vp - 1].append(got.grad)

    def run_steady(self, warmup: int) -> None:
        link, run, pp = self.run.link, self.run, self.pp
        steady = self.total - warmup
        for i in range(steady):
            fk = i + warmup
            y = self.forward(fk)
            recv_prev, recv_next = i != steady - 1, True
            if run.first:  # the last stage's forward of p-1 steps ago feeds our next chunk
                next_fwd = self.chunk_id(fk - (pp - 1), True)
                recv_prev = recv_prev and next_fwd != self.vp - 1
                next_fwd += 1
            else:
                next_fwd = self.chunk_id(fk + 1, True)
            if run.last:  # the first stage's backward of p-1 steps ago feeds our previous chunk
                next_bwd = self.chunk_id(i - (pp - 1), False)
                recv_next = next_bwd != 0
                next_bwd -= 1
            else:
                next_bwd = self.chunk_id(i + 1, False)
            # the forward's transfers fly while this step's backward computes (Megatron's overlap_p2p_comm)
            forward_transfer = link.start_send_forward_recv_forward(y, recv=recv_prev)
            dx = self.backward(i)
            dy = link.send_backward_recv_backward(dx, recv=recv_next)
            x = forward_transfer.wait().activation
            if recv_prev:
                self.inputs[next_fwd].append(x)
            if recv_next:
                self.grads[next_bwd].append(dy)

    def run_cooldown(self, warmup: int) -> None:
        link, run = self.run.link, self.run
        if warmup == self.total and not run.last:
            self.grads[self.vp - 1].append(link.recv_backward())
        for k in range(self.total - warmup, self.total):
            dx = self.backward(k)
            next_chunk = self.chunk_id(k + 1, False)
            recv_next = not (run.last and next_chunk == self.vp - 1) and k != self.total - 1
            dy = link.send_backward_recv_backward(dx, recv=recv_next)
            if recv_next:
                self.grads[next_chunk].append(dy)


def interleaved_1f1b(run: StepRunner) -> None:
    """Interleaved 1F1B: warm-up, steady one-forward-one-backward, cool-down, over v chunks."""
    sched = _Interleaved(run)
    warmup = sched.warmup_steps()
    sched.run_warmup(warmup)  # forwards only, filling every chunk of the pipeline
    sched.run_steady(warmup)  # one forward and one backward per virtual step
    sched.run_cooldown(warmup)  # the remaining backwards
