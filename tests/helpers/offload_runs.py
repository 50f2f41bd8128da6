"""Offload runs: train, record the optimizer's memory, close, and compare bit for bit.

Shared by the optimizer-state offload tests and the parameter offload tests.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from megazero.config import Config
from megazero.optimizer.accounting import measured_state_bytes
from megazero.parallel.state import ParallelState
from tests.helpers.optimizer_harness import train


def train_closed(pstate: ParallelState, cfg: Config) -> dict[str, Any]:
    """``optimizer_harness.train``, the memory record after it, then close(): the disk tier must remove its files
    (the optimizer-state file and, with --offload-params disk, the parameter-shard files)."""
    seen: list = []
    out = train(pstate, cfg, hook=lambda model, ps: seen.append(model))
    opt = seen[0].optimizer
    out["memory"] = measured_state_bytes(opt)
    paths = [getattr(store, "path", None) for store in (opt.store, *(buf.param_store for buf in opt.buffers))]
    opt.close()
    out["files_left"] = [p for p in paths if p is not None and os.path.exists(p)]
    return out


def differences(run: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """Everything in which ``run`` is not bitwise ``ref``: per-iteration loss/grad norm/eval, weights."""
    bad = [f"records {i}" for i, (a, b) in enumerate(zip(run["records"], ref["records"]))
           if (a.get("loss"), a.get("grad_norm")) != (b.get("loss"), b.get("grad_norm"))]
    bad += [f"eval {i}" for i, (a, b) in enumerate(zip(run.get("evals", []), ref.get("evals", []))) if a != b]
    bad += [name for name, value in ref["params"].items() if not torch.equal(run["params"][name], value)]
    return bad + (["record count"] if len(run["records"]) != len(ref["records"]) else [])
