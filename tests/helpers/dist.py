"""Start real torch.distributed worlds on gloo and collect each rank's result.

`spawn(fn, world_size, tp=..., pp=..., cp=..., ep=..., etp=...)` runs ``fn(pstate, *args)`` on every
rank of a fresh world and returns the per-rank return values (anything
torch.save can write). Ranks come from a forkserver that has already
imported torch, so starting a world costs ~1 s rather than an import per
rank. A failing rank's traceback is re-raised in the test; a hung world is
killed after ``timeout`` seconds.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from typing import Any, Callable

import torch

CONTEXT = mp.get_context("forkserver")
# torch._dynamo too: building a model imports it (torch's meta-device init runs through _disable_dynamo), ~1.7 s
# of CPU that each rank would otherwise pay again; pretrain_gpt for the ranks tests/helpers/launch.py forks
CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "einops", "megazero.model.gpt",
                                "pretrain_gpt", "pytest"])  # test modules a rank unpickles import pytest


def _worker(fn: Callable, rank: int, world_size: int, grid: tuple[int, int, int, int, int, int | None], init_file: str,
            out: str, args: tuple, test_id: str) -> None:
    import torch.distributed as dist

    from megazero.parallel.layout import Layout
    from megazero.parallel.state import ParallelState

    torch.set_num_threads(1)
    os.environ["PYTEST_CURRENT_TEST"] = test_id  # the forkserver started under an earlier test
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        tp, pp, cp, cp_a2a, ep, etp = grid
        pstate = ParallelState.build(Layout.from_world(world_size, tp, pp, cp, ep=ep, etp=etp), "cpu", cp_a2a=cp_a2a)
        result = fn(pstate, *args)
        torch.save({"ok": True, "result": result}, out)
    except BaseException:  # noqa: BLE001 - ship every failure back to the test
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args: Any, tp: int = 1, pp: int = 1, cp: int = 1, cp_a2a: int = 1,
          ep: int = 1, etp: int | None = None, timeout: float = 300) -> list[Any]:
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        outs = [os.path.join(tmp, f"rank{r}.pt") for r in range(world_size)]
        grid, test_id = (tp, pp, cp, cp_a2a, ep, etp), os.environ.get("PYTEST_CURRENT_TEST", "")
        procs = [CONTEXT.Process(target=_worker, args=(fn, r, world_size, grid, init_file, outs[r], args, test_id))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        results = []
        for r, path in enumerate(outs):
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} of {world_size} left no result (hung: {hung})")
            payload = torch.load(path, weights_only=False)
            if not payload["ok"]:
                raise RuntimeError(f"rank {r} of {world_size} failed:\n{payload['error']}")
            results.append(payload["result"])
        if hung:
            raise RuntimeError(f"ranks {hung} of {world_size} did not finish in {timeout} s")
        return results
