"""Training time blocked per checkpoint save: synchronous ``save_checkpoint`` against ``--async-save``.

Issue 25 asks that a save stall training for at most 10% of what a synchronous save costs, on a model with
at least 1 GB of checkpoint. One process trains ``MODEL`` (gpt2, ~91M fp32 parameters: 4 bytes of weights
and 12 of master copy and Adam moments per parameter = ~1.46 GB per checkpoint) on seeded synthetic tokens
and saves every ``--steps-between`` steps, ``--saves`` times, in each mode:

- ``sync``: the blocked time is the whole ``save_checkpoint`` call (write, vote, publish).
- ``async``: the blocked time is the ``AsyncCheckpointer`` call (the stamp broadcast and the copy to host
  memory; the first save also allocates the host buffers the later ones reuse). The steps in between poll,
  as the trainer does, and go on at least until the previous save is published (so no save waits for the
  one before: a real --save-interval is far longer than one write); the wait at the end of the run for the
  last save (``finish``) is reported on its own.

The step times while a background write runs are reported too (on a 2-core machine the writer thread
competes with the step for the cores). Nothing here is asserted by the tests; results:
bench/RESULTS_speed.md, "## Async checkpoint save".

    .venv/bin/python -m bench.bench_async_save [--dir /path/on/the/disk/to/test] [--saves 3] [--steps-between 4]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from bench.results import results_header

MODEL = dict(arch="gpt2", num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=64, vocab_size=8192)
BATCH = 1  # samples per step (one micro-batch): short steps, so saves are a large share of the run


def _build():
    """The model, its ZeRO-0 optimizer and the pieces a save needs, built as pretrain_gpt.py builds them."""
    from megazero.config import Config
    from megazero.parallel.state import ParallelState
    from megazero.pipeline.schedules import build_schedule
    from megazero.run_plan import RunPlan
    from megazero.tensor_parallel.random import seed_everything
    from megazero.training.parallelize import build_training_model

    cfg = Config.from_flat({**MODEL, "micro_batch_size": BATCH, "global_batch_size": BATCH, "device": "cpu",
                            "lr": 1e-4, "lr_decay_style": "constant", "seed": 1234})
    plan, pstate = RunPlan.resolve(cfg, 1), ParallelState.serial("cpu")
    seed_everything(1234, 0)
    return cfg, plan, pstate, build_training_model(cfg, plan, pstate), build_schedule(plan)


def _run(mode: str, root: str, saves: int, between: int) -> dict:
    from megazero.checkpoint.async_save import AsyncCheckpointer
    from megazero.checkpoint.save import CheckpointContext, save_checkpoint

    cfg, plan, pstate, model, schedule = _build()
    chunks, opt = model.chunks, model.optimizer
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, MODEL["vocab_size"], (BATCH, MODEL["seq_length"] + 1), generator=g)
    quiet = lambda *_: None  # noqa: E731
    ctx = CheckpointContext(root, cfg, plan, pstate, model, keep_last=1, log=quiet)
    saver = AsyncCheckpointer(ctx) if mode == "async" else None

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad()
        schedule(chunks, [data], pstate, opt.no_sync)
        opt.step(1e-4)
        if saver is not None:
            saver.poll()
        return time.perf_counter() - start

    step()  # warm-up: the Adam state exists from here on
    blocked, steps_writing, steps_idle, it = [], [], [], 1
    for _ in range(saves):
        done = 0  # a real --save-interval is far longer than a write: train on until the last save is published
        while done < between or (saver is not None and saver.pending is not None):
            writing = saver is not None and saver.pending is not None
            (steps_writing if writing else steps_idle).append(step())
            it, done = it + 1, done + 1
        start = time.perf_counter()
        if saver is None:
            save_checkpoint(ctx, it, 0)
        else:
            saver.save(it, 0)
        blocked.append(time.perf_counter() - start)
    start = time.perf_counter()
    if saver is not None:
        saver.finish()
    final_wait = time.perf_counter() - start
    folder = os.path.join(root, open(os.path.join(root, "latest")).read().strip())
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    return {"mode": mode, "steps": it - 1, "blocked_s": [round(b, 3) for b in blocked],
            "blocked_median_s": statistics.median(blocked),
            "final_wait_s": round(final_wait, 3), "checkpoint_bytes": size,
            "step_s_idle": round(statistics.median(steps_idle), 3) if steps_idle else None,
            "step_s_while_writing": round(statistics.median(steps_writing), 3) if steps_writing else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--steps-between", type=int, default=4)
    parser.add_argument("--modes", default="sync,async")
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))  # one core left to the writer thread
    base = tempfile.mkdtemp(prefix="mz-async-bench-", dir=args.dir)
    rows = []
    try:
        for mode in args.modes.split(","):
            rows.append(_run(mode, os.path.join(base, mode), args.saves, args.steps_between))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\n{results_header('bench.bench_async_save')}\n\ndir {base} (other work competes with both modes)")
    print("| mode | checkpoint | blocked per save (median) | blocked per save (each) | end-of-run wait | "
          "step idle | step while writing |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['checkpoint_bytes'] / 1e9:.2f} GB | {r['blocked_median_s']:.3f} s | "
              f"{', '.join(f'{b:.3f}' for b in r['blocked_s'])} | {r['final_wait_s']:.3f} s | "
              f"{r['step_s_idle']} s | {r['step_s_while_writing']} s |")
    if len(rows) == 2:
        ratio = rows[1]["blocked_median_s"] / rows[0]["blocked_median_s"]
        print(f"\nasync blocked / sync blocked (medians): {ratio:.1%}")


if __name__ == "__main__":
    main()
