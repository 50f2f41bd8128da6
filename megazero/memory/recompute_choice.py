"""``--recompute auto``: the cheapest activation recompute whose planned peak fits the memory budget.

Recompute costs compute (selective re-runs the attention core, full every block's forward), so
the modes are tried cheapest first, none -> selective -> full, and the first whose predicted
peak per rank (``plan_memory``, the stage that needs the most) fits ``1 - MARGIN`` of the
budget wins. The margin covers what the plan leaves out: the allocator's fragmentation and
cached blocks, CUDA's context and workspaces, the planner's own error (docs/memory_planner.md).
When no mode fits, full (the least memory) is chosen and the line says so: the plan is an
estimate, so the run is tried rather than refused.

The budget per rank: ``--memory-budget-gb`` when given; on CUDA the GPU's total memory; on the
CPU this node's MemAvailable divided by the ranks on it (torchrun's LOCAL_WORLD_SIZE). A run
agrees on the smallest budget over its ranks before choosing, so every rank picks the same mode.

The planner (``plan_for_cluster``) plans for a cluster from any machine, so it never asks this
machine's device: its budget is --memory-budget-gb or the GPU memory it was told, and without
one it plans every mode and says so.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import RECOMPUTE_MODES, Config, ConfigError
from ..run_plan import RunPlan
from .assumed import planned_device, with_vocabulary
from .plan import GIB, MemoryPlan, PlanSpec, plan_memory

MARGIN = 0.10  # of the budget, left free


@dataclass(frozen=True)
class RecomputeChoice:
    """The mode chosen, and the predicted peak per rank (bytes) of every mode tried, in order."""

    mode: str
    budget_bytes: float
    source: str  # where the budget came from, in words
    tried: tuple[tuple[str, float], ...]

    @property
    def usable_bytes(self) -> float:
        return (1 - MARGIN) * self.budget_bytes

    def describe(self) -> str:
        """One line: the choice and why (each mode's predicted peak against the usable budget)."""
        usable = self.usable_bytes / GIB
        marks = ", ".join(f"{m} {peak / GIB:.2f} {'<=' if peak <= self.usable_bytes else '>'} {usable:.2f} GiB"
                          for m, peak in self.tried)
        why = "it fits" if self.tried[-1][1] <= self.usable_bytes else "nothing fits; full needs the least"
        return (f"megazero: --recompute auto chose {self.mode} ({why}): predicted peak per rank {marks} "
                f"(budget {self.budget_bytes / GIB:.2f} GiB from {self.source}, less a {MARGIN:.0%} margin)")


def choose_recompute(cfg: Config, run: RunPlan, device: str, budget_bytes: float, source: str) -> RecomputeChoice:
    """The first of none, selective, full whose planned peak per rank fits ``1 - MARGIN`` of the budget."""
    if not budget_bytes > 0:
        raise ConfigError(f"--recompute auto needs a memory budget above 0 ({source} gave {budget_bytes:.0f} "
                          f"bytes); pass --memory-budget-gb.")
    tried: list[tuple[str, float]] = []
    for mode in RECOMPUTE_MODES:
        peak = plan_memory(PlanSpec.from_plan(_with_mode(cfg, mode), run, device)).peak.total_bytes
        tried.append((mode, peak))
        if peak <= (1 - MARGIN) * budget_bytes:
            break
    return RecomputeChoice(mode=tried[-1][0], budget_bytes=budget_bytes, source=source, tried=tuple(tried))


def device_budget(cfg: Config, device: str, ranks_on_node: int = 1) -> tuple[float, str]:
    """(bytes per rank, where from): --memory-budget-gb, the GPU's total memory, or MemAvailable / ranks."""
    gb = cfg.training.memory_budget_gb
    if gb is not None:
        return gb * GIB, "--memory-budget-gb"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--recompute auto plans for a GPU but none is visible here; pass --memory-budget-gb "
                              "(the GPU's memory in GiB).")
        return float(torch.cuda.mem_get_info()[1]), f"the GPU's total memory ({torch.cuda.get_device_name()})"
    available = _mem_available()
    if available is None:
        raise ConfigError("--recompute auto cannot read this host's available memory (/proc/meminfo); pass "
                          "--memory-budget-gb.")
    return available / ranks_on_node, f"MemAvailable / {ranks_on_node} rank(s) on this node"


def _mem_available() -> float | None:
    """Linux's estimate of the memory new allocations can get without swapping, in bytes."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return None


def resolve_recompute(cfg: Config, run: RunPlan, device: str, ranks_on_node: int = 1,
                      agree: Callable[[float], float] = lambda b: b) -> tuple[Config, RecomputeChoice | None]:
    """``cfg`` with --recompute auto replaced by the chosen mode, and the choice (None when not auto).

    ``agree`` turns this rank's budget into the one every rank uses (a run: the minimum over ranks).
    """
    if cfg.training.recompute != "auto":
        return cfg, None
    budget, source = device_budget(cfg, device, ranks_on_node)
    agreed = agree(budget)
    if agreed < budget:
        source += ", the smallest over the ranks"
    choice = choose_recompute(cfg, run, device, agreed, source)
    return _with_mode(cfg, choice.mode), choice


def _with_mode(cfg: Config, mode: str) -> Config:
    """``cfg`` with a concrete recompute mode (the budget only means something to auto, so it goes, and
    --recompute-num-layers only to full)."""
    layers = cfg.training.recompute_num_layers if mode == "full" else None
    return cfg.updated(recompute=mode, memory_budget_gb=None, recompute_num_layers=layers)


def plan_for_run(cfg: Config, world_size: int) -> MemoryPlan:
    """The plan of a training run on ``world_size`` ranks (the trainer's ``RunPlan.resolve``); with
    --recompute auto, of the mode the run would choose (--memory-budget-gb, or this machine's memory)."""
    spec = PlanSpec.for_world(with_vocabulary(cfg), world_size, planned_device(cfg))
    ranks_on_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    cfg, choice = resolve_recompute(spec.cfg, spec.run, spec.device, ranks_on_node)
    return plan_memory(PlanSpec.from_plan(cfg, spec.run, spec.device) if choice else spec)


def plan_for_cluster(cfg: Config, world_size: int,
                     gpu_memory_gib: float | None = None) -> tuple[list[MemoryPlan], str | None]:
    """The planner's plans of ``cfg`` on ``world_size`` ranks, and the line saying how --recompute auto was
    planned (None for a concrete mode).

    A laptop plans for a cluster, so this machine's device is never asked: auto's budget is
    --memory-budget-gb, else ``gpu_memory_gib`` (the planner's --gpu-memory), and the one plan is of the mode
    a run with that budget chooses. With neither, one plan per mode, cheapest compute first.
    """
    spec = PlanSpec.for_world(with_vocabulary(cfg), world_size, planned_device(cfg))
    cfg = spec.cfg
    if cfg.training.recompute != "auto":
        return [plan_memory(spec)], None
    budget = _planner_budget(cfg, gpu_memory_gib)
    if budget is None:
        plans = [plan_memory(PlanSpec.from_plan(_with_mode(cfg, m), spec.run, spec.device)) for m in RECOMPUTE_MODES]
        return plans, (f"--recompute auto: no memory budget given (--gpu-memory GB or --memory-budget-gb GB), so "
                       f"every mode is planned; a run takes the first of {', '.join(RECOMPUTE_MODES)} whose peak fits "
                       f"{1 - MARGIN:.0%} of its budget (--memory-budget-gb, else its GPU's memory)")
    choice = choose_recompute(cfg, spec.run, spec.device, budget[0] * GIB, budget[1])
    chosen = PlanSpec.from_plan(_with_mode(cfg, choice.mode), spec.run, spec.device)
    return [plan_memory(chosen)], choice.describe()


def _planner_budget(cfg: Config, gpu_memory_gib: float | None) -> tuple[float, str] | None:
    """(GiB per rank, the flag it came from) for the planner's --recompute auto, or None when it was given none."""
    if cfg.training.memory_budget_gb is not None:
        return cfg.training.memory_budget_gb, "--memory-budget-gb"
    return None if gpu_memory_gib is None else (gpu_memory_gib, "--gpu-memory")
