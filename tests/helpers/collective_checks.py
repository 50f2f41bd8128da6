"""megazero's collectives run on a rank, and their results checked against the same arithmetic done locally.

The NCCL test (tests/cuda/test_gpu_kernels.py) and its gloo counterpart (tests/cuda/test_gpu_readiness.py)
run the same check, so the check itself is exercised on machines without GPUs.
"""
from __future__ import annotations

import torch


def collective_results(pstate) -> dict:
    """megazero's collectives over this rank's TP group (every rank), sync and async; results on the CPU."""
    from megazero.parallel import collectives as C

    group, device, rank, world = pstate.tp_group, pstate.device, pstate.rank, pstate.tp
    pstate.ledger.enabled = True
    x = torch.arange(8, dtype=torch.float32, device=device) + rank
    C.all_reduce(x, group)
    y = torch.full((8,), float(rank), device=device)
    C.all_reduce(y, group, async_op=True).wait()
    full = torch.arange(8 * world, dtype=torch.float32, device=device) * (rank + 1)
    scattered = torch.empty(8, device=device)
    C.reduce_scatter_tensor(scattered, full, group)
    gathered = torch.empty(8 * world, device=device)
    C.all_gather_into_tensor(gathered, torch.full((8,), float(rank), device=device), group, async_op=True).wait()
    return {"all_reduce": x.cpu(), "async_all_reduce": y.cpu(), "reduce_scatter": scattered.cpu(),
            "all_gather": gathered.cpu(), "bytes": pstate.ledger.take()}


def collective_problems(results: list[dict]) -> list[str]:
    """Every difference between ``collective_results`` of each rank and the same arithmetic done locally."""
    world = len(results)
    ramp, ranks = torch.arange(8, dtype=torch.float32), torch.arange(world, dtype=torch.float32)
    expected = {"all_reduce": world * ramp + ranks.sum(), "async_all_reduce": torch.full((8,), float(ranks.sum())),
                "all_gather": ranks.repeat_interleave(8)}
    problems: list[str] = []
    for rank, got in enumerate(results):
        want = {**expected, "reduce_scatter": torch.arange(8 * rank, 8 * rank + 8) * float(ranks.add(1).sum())}
        problems += [f"rank {rank} {k}: {got[k].tolist()} != {v.tolist()}" for k, v in want.items()
                     if not torch.equal(got[k], v)]
        if set(got["bytes"]) != {"all_reduce/tp", "reduce_scatter/tp", "all_gather/tp"}:
            problems.append(f"rank {rank}: the ledger saw {got['bytes']}")
    return problems
