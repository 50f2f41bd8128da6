"""megazero ZeRO 3 against megazero's own ZeRO 2, side by side (gloo, dp = 2; not run in CI).

    .venv/bin/python -m bench.bench_zero3_vs_zero2 [--repeats 5] [--models small,medium] [--out FILE]

ZeRO 3 gathers every unit's parameters before its forward and (resharding) again
before its backward; ZeRO 2 holds them all and gathers once after the step. What
the prefetch hides is the gap between the two: the ratio ZeRO 3 / ZeRO 2 tokens/s
is the figure of merit (keep mode, ``--no-reshard``, sends exactly ZeRO 2's bytes).
Each entry is the shared benchmark workload (``bench/common.py``, run by
``bench/megazero_entry.py``) on one of ``MODELS``; within a model the entries run
round-robin (A B C A B C ...) so machine load hits all alike, and each repeat's
ratio is taken against the ZeRO 2 run of the same round. All entries use the same
bucket size. ``--worker`` is how the launcher runs one rank.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench import common
from bench.harness import MZ, Entry, launch, loss_error, mib
from bench.results import results_header

MODELS = {
    "small": dict(common.MODEL),  # gpt2, 4 layers, hidden 256 (~4.5M parameters)
    "medium": dict(arch="gpt2", num_layers=6, hidden_size=512, num_attention_heads=8, seq_length=128,
                   vocab_size=8192),  # ~23M parameters
}
BUCKET = "1000000"
ROWS = {  # name: megazero_entry arguments
    "zero 2": ["--zero", "2"],
    "zero 3 reshard": ["--zero", "3"],
    "zero 3 keep": ["--zero", "3", "--no-reshard"],
}


def worker() -> None:
    """One rank: ``--worker --model NAME`` then megazero_entry's own arguments."""
    argv = sys.argv[1:]
    argv.remove("--worker")
    at = argv.index("--model")
    name = argv[at + 1]
    del argv[at: at + 2]
    common.MODEL.clear()
    common.MODEL.update(MODELS[name])
    if hasattr(common, "SHAPES"):  # megazero_entry sets its workload from --shape (a copy without it: MODEL)
        common.SHAPES[f"zero3-vs-zero2.{name}"] = (MODELS[name], common.GLOBAL_BATCH)
        argv += ["--shape", f"zero3-vs-zero2.{name}"]
    sys.argv = [MZ, *argv]
    from bench import megazero_entry

    megazero_entry.main()


def run_model(model: str, repeats: int, extra: list[str], log, before: str | None) -> dict[str, list[dict]]:
    """Round-robin the rows on ``model`` (with ``before``: the ZeRO 3 rows on that copy of the repository
    too); every run's record per row."""
    entries = [Entry(name, "bench.bench_zero3_vs_zero2",
                     ["--worker", "--model", model, *args, "--bucket-size", BUCKET], 2, True)
               for name, args in ROWS.items()]
    if before:
        entries += [Entry(f"{e.name} (before)", e.module, e.args, 2, True, cwd=os.path.abspath(before))
                    for e in entries if "zero 3" in e.name]
    runs: dict[str, list[dict]] = {e.name: [] for e in entries}
    for r in range(repeats):
        for e in entries:
            res = launch(e, extra)
            if "error" in res:
                raise SystemExit(f"{model} {e.name}: {res['error']}")
            runs[e.name].append(res)
            log(f"  {model} [{r + 1}/{repeats}] {e.name}: {res['tokens_per_s']:.0f} tok/s")
    return runs


def summarize(model: str, runs: dict[str, list[dict]]) -> list[str]:
    """Table rows: median tokens/s and tokens/CPU-s, and the per-round ratio to ZeRO 2 (median, range)."""
    base = runs["zero 2"]
    rows = []
    for name, rs in runs.items():
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rs, base)]
        cpu = [r["tokens_per_s"] * r["step_s"] / max(r["cpu_s_per_step"]) for r in rs]
        cpu_base = [b["tokens_per_s"] * b["step_s"] / max(b["cpu_s_per_step"]) for b in base]
        kinds = rs[-1]["comm_kinds_rank0"]
        rows.append(f"| {model} | {name} | {statistics.median(r['tokens_per_s'] for r in rs):.0f} "
                    f"| {statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f}) "
                    f"| {statistics.median(c / b for c, b in zip(cpu, cpu_base)):.3f} "
                    f"| {mib(kinds.get('all_gather', 0))} | {mib(kinds.get('reduce_scatter', 0))} "
                    f"| {loss_error(rs[-1]['losses'], base[-1]['losses']):.1e} |")
    return rows


def main() -> None:
    if "--worker" in sys.argv:
        worker()
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--models", default="small,medium")
    parser.add_argument("--before", default=None, help="a copy of the repository to run the ZeRO 3 rows of too")
    args = parser.parse_args()
    extra = ["--steps", str(args.steps)] if args.steps else []
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    started, load0 = time.time(), os.getloadavg()[0]
    lines = ["| model | entry | tokens/s (median) | / zero 2, per round: median (range) | / zero 2 per CPU-s "
             "| all-gather MiB/step | reduce-scatter MiB/step | loss rel diff vs zero 2 |", "|" + "---|" * 8]
    for model in args.models.split(","):
        lines += summarize(model, run_model(model, args.repeats, extra, log, args.before))
    print(results_header("bench.bench_zero3_vs_zero2") + "\n")
    print(f"{args.repeats} repeats round-robin, {time.time() - started:.0f} s, load average "
          f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; models "
          + "; ".join(f"{m}: {MODELS[m]}" for m in args.models.split(",")))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
