"""Measured pipeline bubble of 1F1B and interleaved 1F1B beside the theory (not run in CI).

    .venv/bin/python -m bench.bench_pipeline [--pp 4 2] [--steps 4] [--out bench/RESULTS_pipeline.md]

For pp = 4 (and pp = 2, which fits a 2-core laptop) and m = 4, 8, 16 micro-batches, trains a balanced model (8 layers,
small vocabulary so the head costs little) on gloo/CPU with ``--timeline``
recording, and computes each step's bubble from every rank's forward/backward
spans: window = first compute start to last compute end over all ranks; idle =
window - busy per rank. Narayanan et al. (2021) give the bubble relative to the
ideal (busy) time, (p-1)/m for 1F1B and (p-1)/(v*m) for interleaving with v
chunks; the table shows that ratio measured (median over the timed steps) and
the share of the window spent idle, beside the theory. With fewer cores than
ranks, ranks that compute at the same time slow each other down, which the
theory (fixed per-micro-batch cost) does not model; the file says so.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench.harness import ROOT
from bench.results import results_header
from megazero.config import Config
from megazero.pipeline.schedules import build_schedule, schedule_timeline
from megazero.pipeline.timeline import bubble_of_step
from megazero.run_plan import RunPlan
from megazero.training.metrics import MetricsLog
from megazero.training.parallelize import build_training_model
from megazero.training.trainer import Trainer
from tests.helpers.dist import spawn
from tests.helpers.tiny_config import degrees

WARMUP_STEPS = 1
MODEL = dict(arch="gpt2", num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=256)


class Tokens:
    """Seeded random micro-batches (the bubble does not depend on the data)."""

    def __init__(self, m: int, seq: int) -> None:
        self.m, self.seq, self.consumed_samples, self.step = m, seq, 0, 0

    def next_step(self) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(self.step)
        self.step += 1
        self.consumed_samples += self.m
        return list(torch.randint(0, MODEL["vocab_size"], (self.m, 1, self.seq + 1), generator=gen))


def make_cfg(pp: int, m: int, vp: int, steps: int) -> Config:
    """Not the tests' tiny config (``tests/helpers/tiny_config.py``): a wider model, the defaults otherwise."""
    return Config().updated(**degrees(pp=pp, vp=vp), **MODEL, lr=1e-4, micro_batch_size=1, global_batch_size=m,
                            train_iters=steps, device="cpu", log_interval=1, timeline="unused.json")


def rank_spans(pstate, cfg: Config) -> list[list[tuple[float, float]]]:
    """Train ``train_iters`` steps with the timeline on; this rank's compute spans per step."""
    plan = RunPlan.resolve(cfg, pstate.layout.world_size)
    model = build_training_model(cfg, plan, pstate)
    schedule = build_schedule(plan, timeline=schedule_timeline(cfg.logging, pstate))
    trainer = Trainer(cfg, pstate, model, schedule,
                      Tokens(cfg.training.global_batch_size, cfg.model.seq_length), MetricsLog(None, False))
    for _ in range(cfg.training.train_iters):
        trainer.train_step()
    return [[(s.start, s.end) for s in spans] for _, _, spans in schedule.timeline.steps]


def measure(pp: int, m: int, vp: int, steps: int) -> tuple[float, float]:
    """Median (bubble ratio, idle fraction) over the timed steps."""
    cfg = make_cfg(pp, m, vp, WARMUP_STEPS + steps)
    per_rank = spawn(rank_spans, pp, cfg, pp=pp, timeout=600)
    timed = range(WARMUP_STEPS, WARMUP_STEPS + steps)
    per_step = [bubble_of_step([spans[step] for spans in per_rank]) for step in timed]
    return statistics.median(r for r, _ in per_step), statistics.median(f for _, f in per_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[4, 2])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "RESULTS_pipeline.md"))
    args = parser.parse_args()
    rows = ["| p | schedule | v | m | theory (p-1)/(v m) | measured idle/busy | measured idle/window |",
            "|---|---|---|---|---|---|---|"]
    for p in args.pp:
        for name, vp in (("1f1b", 1), ("interleaved", 2)):
            for m in args.micro_batches:
                ratio, fraction = measure(p, m, vp, args.steps)
                theory = (p - 1) / (vp * m)
                rows.append(f"| {p} | {name} | {vp} | {m} | {theory:.3f} | {ratio:.3f} | {fraction:.3f} |")
                print(rows[-1], flush=True)
    cores = os.cpu_count() or 1
    header = (f"# Pipeline bubble (bench/bench_pipeline.py)\n\n{results_header('bench.bench_pipeline')}\n\n"
              f"gloo on CPU, one thread per rank; model {MODEL}, micro-batch 1, "
              f"{WARMUP_STEPS} untimed + {args.steps} timed steps, median over steps. "
              f"idle/busy is the paper's measure (theory column); idle/window the share of the step idle.\n\n")
    if any(p > cores for p in args.pp):
        header += (f"Caveat: rows with p > {cores} ran more ranks than cores, so ranks computing at the same "
                   f"time (the steady phase) slow each other down and the measured bubble is inflated, most "
                   f"for interleaving, whose chunks are smaller; compare schedules on the rows with p <= "
                   f"{cores}.\n\n")
    with open(args.out, "w") as fh:
        fh.write(header + "\n".join(rows) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
