"""Pretrain a GPT-style model: `torchrun --nproc_per_node 4 pretrain_gpt.py --tp 2 --config configs/tiny.yaml`.

Parses flags (and the YAML preset they name), then hands the validated config
to megazero.training. Bad input exits with status 2 and one line naming the
flag and the fix, on every rank, before any collective (set MEGAZERO_DEBUG=1
for the traceback).
"""
from __future__ import annotations

import os
import sys

import torch.distributed as dist

from megazero.arguments import parse_config
from megazero.parallel.state import world_size_from_env
from megazero.training.setup import run

DRY_RUN_FLAGS = [
    ("--dry-run", {"action": "store_true", "help": "Print the per-rank memory plan of this configuration and exit "
                   "without building anything (see tools/plan_memory.py)."}),
    ("--dp", {"type": int, "default": None, "help": "With --dry-run: data-parallel size to plan for "
              "(default: WORLD_SIZE / (tp x pp))."}),
]


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, ns = parse_config(argv, extra=DRY_RUN_FLAGS)
        if ns.dry_run:  # the memory plan of this configuration; no process group, no model
            from megazero.memory import format_plan, plan_for_run

            world = cfg.parallel.tp * cfg.parallel.pp * ns.dp if ns.dp else world_size_from_env()
            print(format_plan(plan_for_run(cfg, world)))
            return 0
        run(cfg)
    except ValueError as err:
        if os.environ.get("MEGAZERO_DEBUG"):
            raise
        print(f"pretrain_gpt.py: error: {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
