"""Compare two folders of step records (``MEGAZERO_RECORD_STEPS``): every run must be bit-identical.

    MEGAZERO_RECORD_STEPS=/tmp/before make test    # on the old code
    MEGAZERO_RECORD_STEPS=/tmp/after make test     # on the new code
    python tools/compare_step_records.py /tmp/before /tmp/after

A run is one process's sequence of (iteration, loss, grad norm) under one test and rank. Runs are
matched per (test, rank) as multisets; a run cut short (a test that kills a rank) matches any run
it is a prefix of. Exit 0 when every run of each side has its bit-identical partner in the other.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys

Run = tuple[tuple[int, str, str | None], ...]


def load(folder: str) -> dict[tuple[str, int], list[Run]]:
    runs: dict[tuple[str, int], list[Run]] = collections.defaultdict(list)
    for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
        per_key: dict[tuple[str, int], list] = collections.defaultdict(list)
        with open(path) as fh:
            for line in fh:
                r = json.loads(line)
                seq = per_key[r["test"], r["rank"]]
                if seq and r["iteration"] <= seq[-1][-1][0]:  # a new Trainer in the same process
                    seq.append([])
                if not seq:
                    seq.append([])
                seq[-1].append((r["iteration"], r["loss"], r["grad_norm"]))
        for key, seqs in per_key.items():
            runs[key].extend(tuple(s) for s in seqs)
    return runs


def _matches(a: Run, b: Run) -> bool:
    n = min(len(a), len(b))
    return n > 0 and a[:n] == b[:n]


def unmatched(left: list[Run], right: list[Run]) -> list[Run]:
    pool, missing = list(right), []
    for run in sorted(left, key=len, reverse=True):
        hit = next((i for i, other in enumerate(pool) if _matches(run, other)), None)
        if hit is None:
            missing.append(run)
        else:
            pool.pop(hit)
    return missing


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="compare_step_records.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="folder of step records written by the old code")
    parser.add_argument("after", help="folder of step records written by the new code")
    args = parser.parse_args(argv)
    before, after = load(args.before), load(args.after)
    problems = 0
    for key in sorted(set(before) | set(after)):
        for side, a, b in (("before", before[key], after[key]), ("after", after[key], before[key])):
            for run in unmatched(a, b):
                problems += 1
                print(f"{key[0]} rank {key[1]}: a run {side} has no identical partner: {run[:3]}...")
    total = sum(len(v) for v in before.values())
    print(f"{total} runs before, {sum(len(v) for v in after.values())} after, {problems} without a partner")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
