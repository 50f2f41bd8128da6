"""Pretrain a GPT-style model: `torchrun --nproc_per_node 4 pretrain_gpt.py --tp 2 --config configs/tiny.yaml`.

Parses flags (and the YAML preset they name), then hands the validated config
to megazero.training. Bad input exits with status 2 and one line naming the
flag and the fix, on every rank, before any collective; a file-system error
(OSError) or a lost peer rank exits with status 1 and one line (set
MEGAZERO_DEBUG=1 for the traceback). Under torchrun that line is printed once
(``training/entry_errors.py``) and is the root cause torchrun's summary names.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from megazero.arguments import parse_config
from megazero.parallel.state import world_size_from_env
from megazero.training.entry_errors import report_error
from megazero.training.run import run, with_checkpoint_model

DRY_RUN_FLAGS = [
    ("--dry-run", {"action": "store_true", "help": "Print the per-rank memory plan of this configuration and exit "
                   "without building anything (see tools/plan_memory.py)."}),
    ("--dp", {"type": int, "default": None, "help": "With --dry-run: data-parallel size to plan for "
              "(default: WORLD_SIZE / (tp x cp x pp))."}),
]


def _lost_peer(err: RuntimeError) -> bool:
    """A collective failed because another rank died or timed out (gloo raises a plain RuntimeError)."""
    return isinstance(err, dist.DistError) or "/gloo/" in str(err)


def _check_dry_run_flags(ns) -> None:
    """--dp only plans a layout; a run's data-parallel size is WORLD_SIZE / (tp x cp x pp)."""
    if ns.dp is not None and not ns.dry_run:
        raise ValueError(f"--dp {ns.dp} only applies with --dry-run (a run's data-parallel size is WORLD_SIZE / "
                         f"(tp x cp x pp), set by torchrun --nproc_per_node/--nnodes); drop --dp or add --dry-run.")
    if ns.dp is not None and ns.dp < 1:
        raise ValueError(f"--dp must be >= 1, got {ns.dp}; pass the data-parallel size to plan for.")


class UsageError(Exception):
    """argparse's own one-line error (an unknown flag, a bad choice), already worded as printed."""


def _parse(argv: list[str] | None):
    """``parse_config``, with argparse's error line caught rather than printed by every rank."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            parsed = parse_config(argv, extra=DRY_RUN_FLAGS)
    except SystemExit as stop:
        if stop.code:
            raise UsageError(captured.getvalue().strip()) from None
        raise
    sys.stderr.write(captured.getvalue())  # anything else parsing said
    return parsed


@record  # an unexpected exception's traceback goes to torchrun's error file
def main(argv: list[str] | None = None) -> int:
    try:
        cfg, ns = _parse(argv)
        _check_dry_run_flags(ns)
        if ns.dry_run:  # the memory plan of this configuration; no process group, no model
            from megazero.memory import format_plan, plan_for_run, planned_world

            world = planned_world(cfg, ns.dp) if ns.dp else world_size_from_env()
            cfg = with_checkpoint_model(cfg)
            cfg.refuse_inapplicable()
            print(format_plan(plan_for_run(cfg, world)))
            return 0
        run(cfg)
    except UsageError as err:
        report_error(str(err))
        return 2
    except ValueError as err:
        if os.environ.get("MEGAZERO_DEBUG"):
            raise
        report_error(f"pretrain_gpt.py: error: {err}")
        return 2
    except OSError as err:  # disk full, permissions, a path under a file: the path and the OS reason
        if os.environ.get("MEGAZERO_DEBUG"):
            raise
        where = f"{err.filename}: " if err.filename else ""
        report_error(f"pretrain_gpt.py: error: {where}{err.strerror or err} (errno {err.errno}); fix the path or "
                     "free space, or set MEGAZERO_DEBUG=1 for the traceback.")
        return 1
    except RuntimeError as err:  # a peer died or hung past --distributed-timeout-minutes
        if os.environ.get("MEGAZERO_DEBUG") or not _lost_peer(err):
            raise
        first = (str(err).strip().splitlines() or [type(err).__name__])[0].split("] ", 1)[-1][:300]
        report_error(f"pretrain_gpt.py: error: a collective failed, a peer rank died or was stuck longer than "
                     f"--distributed-timeout-minutes ({first}).")
        sys.stdout.flush()
        os._exit(1)  # the group is broken: tearing it down, or a normal exit, can abort in gloo's threads
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_code = main() or 0  # record() turns --help's SystemExit(0) into None
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written and the process group destroyed; skip the interpreter's teardown, where
    # tearing down gloo's C++ threads intermittently aborts ("terminate called without an active
    # exception", about 1 run in 25 at 4 ranks here) after a run that succeeded.
    os._exit(exit_code)
