"""The all-to-all dispatcher hides every exchange behind work (issue 33: blocked time <= 10% of the layer's).

At ep 2, one dropless forward + backward of the dispatcher on real gloo ranks, with every all-to-all of
the ep group and every matrix product (forward and backward, seen by a ``TorchDispatchMode``) recorded in
the order they happen. Each exchange must be issued asynchronously (the count exchange too: the send rows
are gathered while it travels), and each of the four row exchanges (tokens out, outputs home, and their
gradients the other way in backward) must have expert GEMMs between its issue and its wait: this rank's
own rows run while the others' travel, on both trips and in both directions.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megazero.moe.context import ExpertContext
from megazero.moe.dispatch import AllToAllDispatcher
from megazero.parallel import collectives as C
from tests.helpers.dist import spawn
from tests.helpers.moe import built_experts, moe_config, stand_in_routing

TOKENS, EXPERTS, TOPK = 64, 8, 2
PRODUCTS = {torch.ops.aten._grouped_mm.default, torch.ops.aten.mm.default}


class Products(TorchDispatchMode):
    """Appends "gemm" to ``events`` at every matrix product, forward or backward."""

    def __init__(self, events: list[tuple]) -> None:
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in PRODUCTS:
            self.events.append(("gemm",))
        return func(*args, **(kwargs or {}))


class _NotedWait:
    """An async collective's handle that notes its wait in ``events`` before waiting."""

    def __init__(self, work, kind: str, events: list[tuple]) -> None:
        self.work, self.kind, self.events = work, kind, events

    def wait(self, *args):
        self.events.append(("wait", self.kind))
        return self.work.wait(*args)


def _recording_all_to_all(events: list[tuple]):
    """The real ``all_to_all_single``, its issue and (for an async one) its wait appended to ``events``."""
    real = C.all_to_all_single

    def all_to_all_single(out, t, group, async_op=False, **splits):
        kind = "rows" if t.is_floating_point() else "counts"
        events.append(("issue", kind, async_op))
        work = real(out, t, group, async_op=async_op, **splits)
        return _NotedWait(work, kind, events) if async_op else work

    return all_to_all_single


def record_exchanges(pstate) -> list[tuple]:
    ctx, rank = ExpertContext.of(pstate), dist.get_rank()
    experts = built_experts(moe_config("llama"), ctx, torch.float32)
    x = torch.randn(TOKENS, 16, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    experts_TK, probs_TK = stand_in_routing(rank, TOKENS, EXPERTS, TOPK, rare=False)
    events: list[tuple] = []
    C.all_to_all_single = _recording_all_to_all(events)
    with Products(events):
        AllToAllDispatcher(EXPERTS, ctx, None)(x, probs_TK, experts_TK, experts).square().sum().backward()
    return events


def _hidden_row_exchanges(events: list[tuple]) -> int:
    """How many row exchanges had a GEMM between their issue and their wait (blocking ones never do)."""
    hidden, open_since = 0, None
    for i, event in enumerate(events):
        if event[:2] == ("issue", "rows"):
            open_since = i
        elif event == ("wait", "rows"):
            hidden += open_since is not None and ("gemm",) in events[open_since:i]
            open_since = None
    return hidden


def test_every_exchange_is_asynchronous_with_expert_work_while_rows_travel():
    for rank, events in enumerate(spawn(record_exchanges, 2, ep=2)):
        issues = [e for e in events if e[0] == "issue"]
        assert [kind for _, kind, _ in issues] == ["counts"] + ["rows"] * 4, f"rank {rank}: {issues}"
        assert all(async_op for *_, async_op in issues), f"rank {rank}: a blocking exchange: {issues}"
        assert _hidden_row_exchanges(events) == 4, f"rank {rank}: {[e for e in events if e[0] != 'gemm']}"
