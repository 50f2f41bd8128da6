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
from megazero.training.setup import run


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, _ = parse_config(argv)
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
