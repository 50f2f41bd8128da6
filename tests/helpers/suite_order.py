"""The suite's order: costliest modules first, so the two xdist workers do not end on one long test.

``--dist worksteal`` hands each worker a contiguous half of the collection and lets an idle one steal from the
back of the other's queue; whatever runs last decides how long one worker waits alone. Putting the modules
with the most CPU-seconds (``tests/module_costs.txt``, from a ``--cpu-report`` run's
``--write-module-costs``) at the front makes the tail the cheap in-process tests. A module keeps its own
order, so module-scoped fixtures are built once; a module the file does not know is costed by its tier.
"""
from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

ROOT_DIR = Path(__file__).resolve().parents[2]
COSTS_FILE = str(ROOT_DIR / "tests" / "module_costs.txt")
# CPU-seconds per test of a module the costs file does not list yet, by tier (the suite's means, 2026-12-02)
PER_TEST = {"launch": 1.1, "spawn": 2.4, "in-process": 0.1}
# A module above this many CPU-seconds is marked ``heavy``: ``make test-quick`` leaves it out with the launches,
# so the quick tier (in-process tests and the cheaper spawned worlds) fits in ~4 minutes on 2 cores.
HEAVY_CPU_S = 20.0


def read_costs(path: str = COSTS_FILE) -> dict[str, float]:
    """Module path (relative to the repo) -> its CPU-seconds, from ``CPU-SECONDS PATH`` lines."""
    if not os.path.exists(path):
        return {}
    costs = {}
    with open(path) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                cpu, module = line.split()
                costs[module] = float(cpu)
    return costs


def module_costs(test_costs: list[tuple[str, str, float]]) -> dict[str, float]:
    """Per module, the CPU-seconds of its tests (``(nodeid, tier, cpu)`` as ``cpu_meter`` collects them)."""
    out: dict[str, float] = defaultdict(float)
    for nodeid, _, cpu in test_costs:
        out[nodeid.split("::")[0]] += cpu
    return dict(out)


def write_costs(costs: dict[str, float], path: str) -> None:
    lines = [f"{cpu:.1f} {module}" for module, cpu in sorted(costs.items(), key=lambda c: (-c[1], c[0]))]
    with open(path, "w") as f:
        f.write("# CPU-seconds per test module (pytest --cpu-report N --write-module-costs PATH); the suite's "
                "order (tests/helpers/suite_order.py)\n" + "\n".join(lines) + "\n")


def module_cost(module: str, tier: str, count: int, costs: dict[str, float]) -> float:
    """``module``'s CPU-seconds from the costs file, or its tier's mean per test x its test count."""
    return costs.get(module, PER_TEST[tier] * count)


def costliest_first(modules: list[str], tiers: dict[str, str], counts: dict[str, int],
                    costs: dict[str, float]) -> list[str]:
    """``modules`` by cost, highest first (ties: collection order); unknown ones by tier x test count."""
    # sorted is stable: equal costs keep their order
    return sorted(modules, key=lambda m: -module_cost(m, tiers[m], counts[m], costs))
