"""megazero ZeRO 3 against FSDP2 ``fully_shard`` and DeepSpeed ZeRO-3 (gloo, dp = 2; not run in CI).

    .venv/bin/python -m bench.bench_zero3 [--repeats 3] [--out bench/RESULTS_zero3.md]

The shared benchmark workload and launcher (``bench/common.py``, ``bench/run.py``):
every entry trains the same seeded GPT-2 on the same synthetic global batch with
the same AdamW, each of 2 ranks on half of it, entries round-robin so machine
noise hits all alike, tokens/s the median. megazero runs ``--zero 3`` with
``reshard_after_forward`` True and False (default prefetch), each against the
peer that makes the same choice (FSDP2 ``reshard_after_forward``; DeepSpeed's
defaults, ``stage3_max_reuse_distance`` 1e9, keep a small model's parameters
gathered from forward to backward, so it is compared with reshard=False). Rows with 4 micro-batches per step show the
accumulation trade-off: megazero reduce-scatters every micro-batch (4x the
gradient traffic, only a 1/dp grad shard kept); FSDP2 does the same by default
or, with ``set_requires_gradient_sync(False)`` until the last micro-batch,
keeps full-size gradients and reduce-scatters once.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from bench import common
from bench.harness import DP_PEERS, DS, MZ, ROOT, Entry, launch, mib, pair_checks, run_group
from bench.results import results_header

DS_MODULE = "bench.peers.deepspeed_zero"
MB4 = ", 4 micro-batches"


def _fsdp(reshard: bool, micro: str = "", no_sync: bool = False) -> Entry:
    mode = "fsdp2-reshard" if reshard else "fsdp2"
    args = ["--mode", mode] + (["--micro-batches", "4"] if micro else []) + (["--no-sync-accum"] if no_sync else [])
    suffix = micro + (", no_sync" if no_sync else ", sync each" if micro else "")
    return Entry(f"FSDP2 reshard={reshard}{suffix}", DP_PEERS, args, 2)


NOTES = """\
How measured. Model state: storage bytes (each storage once) of parameters, gradients and
optimizer state on the rank holding the most, the larger of the figures taken after each
micro-batch's backward and after the step. FSDP2 also counts its per-parameter records
(unsharded parameters, and the full-size gradients accumulated while gradient sync is off);
DeepSpeed the engine's optimizer (partitions, fp32 copy, persistent parameters, reduce
bucket). Bytes: the ``torch.distributed`` calls, counted alike for every entry
(``bench/comm_count.py``). Every loss sequence matches the single-process run to ~2e-7.

Model state at the end of a backward. gloo reports no completion of a reduce-scatter before
``wait()``, so the last buckets' reductions are still in flight when a backward ends; megazero
retires them in a callback queued with autograd at the end of every backward (as FSDP2 does),
so their full-size bucket gradients never live on into the next forward or the step. Before
that callback the megazero rows measured 43.06 MiB (two buckets, 10.7 MiB, alive until step()).

Gradient accumulation, the trade-off. megazero reduce-scatters every micro-batch into its 1/dp
grad shard: 4 x 8.09 MiB of reduce-scatter per step at 4 micro-batches, and no full-size
gradient outlives its bucket. FSDP2 with sync on every micro-batch makes the same choice (same
bytes); with ``set_requires_gradient_sync(False)`` until the last micro-batch it reduce-scatters
once (8.09 MiB) but holds the full-size gradients across the micro-batches (+16.17 MiB of
model state: 48.53 MiB). The "more bytes" verdicts against the no_sync rows are that choice.

reshard=True. megazero keeps the root unit (embeddings, final norm, tied head: 1.08M
parameters) gathered from its forward to its backward, since the head runs last in forward
and first in backward; FSDP2 reshards the root as well, so megazero gathers 14.11 MiB per
step against 16.18 (56.46 against 64.71 at 4 micro-batches).

DeepSpeed ZeRO-3 (0.19.8, DS_ACCELERATOR=cpu, gloo) runs with its own stage-3 defaults, except
``reduce_bucket_size`` 1e6 (the default 5e8 elements allocates a 2 GB flat bucket, 1949 MiB of
counted storage). Its ``stage3_max_reuse_distance`` and ``stage3_max_live_parameters`` (1e9)
keep this small model's parameters gathered from forward to backward, hence one all-gather
pass per micro-batch and the comparison with megazero reshard=False only. Parameters under
``stage3_param_persistence_threshold`` (1e5 elements: biases, norms, position table, the
256x256 attention projections) stay whole on every rank and are never gathered: fewer
all-gather bytes (30.59 against 32.36 MiB at 4 micro-batches) for more state (45.44 MiB, which
also holds an fp32 copy of the partition in this fp32 run).

Speed. Two ranks share two cores. With other jobs on the machine single repeats of one entry
spread by up to 3x (an earlier 3-repeat run the same day at load 5.6-8: megazero reshard=False
1708-5034 tokens/s), and tokens per CPU-second of the busiest rank is the steadier figure;
that run gave megazero 1.06-1.30x tokens/s and 1.07-1.31x tokens/CPU-s against every peer.
"""


def entries() -> list[Entry]:
    """megazero rows (with the peers each is compared with), then the peers."""
    out = []
    for micro in ("", MB4):
        accumulate = ["--micro-batches", "4"] if micro else []
        ds = Entry(f"DeepSpeed ZeRO-3{micro}", DS_MODULE, ["--stage", "3", *accumulate], 2,
                   requires="deepspeed", env=DS)
        peers = []
        for reshard in (True, False):
            fsdp = [_fsdp(reshard, micro)] + ([_fsdp(reshard, micro, no_sync=True)] if micro else [])
            args = ["--zero", "3", *([] if reshard else ["--no-reshard"]), *accumulate]
            out.append(Entry(f"megazero zero 3 reshard={reshard}{micro}", MZ, args, 2, True,
                             peer_of=[e.name for e in fsdp] + ([] if reshard else [ds.name])))
            peers += fsdp
        out += peers + [ds]
    return out


def compare(results: dict[str, dict], reference: list[float]) -> list[dict]:
    """Per (megazero row, peer): tokens/s ratios, and whether model state and bytes are no higher."""
    return pair_checks(results, reference, lambda name, r, peer, p: {
        "state_ok": r["model_state_bytes"] <= p["model_state_bytes"],
        "bytes_ok": r["comm_bytes_per_step"] <= p["comm_bytes_per_step"]})


def verdict(checks: list[dict]) -> list[str]:
    """One line per (megazero row, peer) pair: the ratio and which properties fail."""
    lines = []
    for c in checks:
        if "ratio" not in c:
            lines.append(f"- {c['megazero']} vs {c['peer']}: peer {c['status']}")
            continue
        failed = [w for w, bad in (("slower", c["ratio"] < 1.0), ("more model state", not c["state_ok"]),
                                   ("more bytes", not c["bytes_ok"])) if bad]
        lines.append(f"- {c['megazero']} vs {c['peer']}: {c['ratio']:.2f}x tokens/s ({c['cpu_ratio']:.2f}x per "
                     f"CPU-s); {'fails: ' + ', '.join(failed) if failed else 'all three hold'}")
    return lines


def table(results: dict[str, dict]) -> list[str]:
    lines = ["| entry | tokens/s | tokens/CPU-s | model state/rank MiB | comm/step/rank MiB | all-gather MiB "
             "| reduce-scatter MiB | loss rel err vs serial |", "|" + "---|" * 8]
    for name, r in results.items():
        if r.get("status") != "ok":
            lines.append(f"| {name} | {r.get('status')} | | | | | | |")
            continue
        kinds = r["comm_kinds_rank0"]
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {r['tokens_per_cpu_s']:.0f} "
                     f"| {mib(r['model_state_bytes'])} | {mib(r['comm_bytes_per_step'])} "
                     f"| {mib(kinds.get('all_gather', 0))} | {mib(kinds.get('reduce_scatter', 0))} "
                     f"| {r.get('loss_rel_err', float('nan')):.1e} |")
    return lines


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def write(path: str, results: dict[str, dict], checks: list[dict], repeats: int, seconds: float) -> str:
    lines = ["# ZeRO 3 against FSDP2 and DeepSpeed ZeRO-3 (bench/bench_zero3.py)", "",
             results_header("bench.bench_zero3"), "",
             f"At commit {_commit()}: gloo on CPU, dp = 2, one thread per rank; model {common.MODEL}, "
             f"global batch {common.GLOBAL_BATCH}, {repeats} repeats round-robin (median tokens/s), "
             f"{seconds:.0f} s in all, load taken at the end.", "",
             *table(results), "", "megazero against each peer:", *verdict(checks), "", NOTES]
    text = "\n".join(lines)
    with open(path, "w") as fh:
        fh.write(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--only", default=None, help="comma-separated substrings of entry names to run")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "RESULTS_zero3.md"))
    args = parser.parse_args()
    extra = ["--steps", str(args.steps)] if args.steps else []
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    serial = launch(Entry("serial", MZ, [], 1), extra)
    if "error" in serial:
        raise SystemExit(f"the single-process reference failed: {serial['error']}")
    chosen = [e for e in entries() if args.only is None or any(s in e.name for s in args.only.split(","))]
    started = time.time()
    results = run_group(chosen, args.repeats, extra, log)
    checks = compare(results, serial["losses"])
    print(write(args.out, results, checks, args.repeats, time.time() - started))


if __name__ == "__main__":
    main()
