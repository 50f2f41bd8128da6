"""Peak RSS and step time of the optimizer-state tiers (``--offload-optimizer none|cpu|disk``), and DeepSpeed's
CPU offload.

Issue 16 asks for one measured fact: with the state on disk, the process RSS at the
step's peak falls by at least 80% of the optimizer-state bytes of the same run in
memory, on a model whose optimizer state is at least 1 GiB per rank. So every row is
one fresh process (RSS is per process and never shrinks back cleanly) running the same
single-rank fp32 Llama-style model (``MODEL``: ~137M parameters, 8 bytes/parameter of
Adam moments = ~1.1 GB; the fp32 master is the parameter itself in memory) on the same
seeded tokens: ``WARMUP`` untimed steps, then ``STEPS`` timed ones. A thread samples
``VmRSS`` every ``SAMPLE_S`` while the timed steps run, so "peak at the step" is the
largest resident set any timed step reached (VmHWM, the lifetime peak, is reported too:
start-up can exceed the steps).

The ZeRO 3 rows (``z3``, ``z3-cpu``, ``z3-disk``) run the same model with ``--zero 3`` in
memory, and with both the optimizer state and the parameter shards (``--offload-params``) on
the host or on disk; their RSS drop is against ``z3``, as a fraction of what they offload.

Every row runs under ``/usr/bin/time -v``: its maximum resident set size is the whole run's peak
(start-up included), and the table gives the drop of both peaks. ``--model big`` is issue 22's
194M-parameter model (1.45 GiB of Adam moments) at the trainer's default ``--bucket-size`` and
``--offload-buffer-size``: the disk tier's host buffers hold ``--offload-buffer-size`` elements of
state each, and a bucket shard larger than that streams through them in pieces.
DeepSpeed's row is ZeRO-2 with ``offload_optimizer: cpu`` (DS_ACCELERATOR=cpu, its CPUAdam JIT-built with g++)
around the same megazero model and weights; if it cannot run, its row records the error. Nothing here is asserted by the
test suite (numbers depend on the machine and its load); results: bench/RESULTS_offload.md.

    .venv/bin/python -m bench.bench_offload                 # all rows, prints a markdown table + JSON lines
    .venv/bin/python -m bench.bench_offload --rows disk     # one row
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from bench.harness import ROOT
from bench.results import results_header

MODEL = dict(arch="llama", num_layers=10, hidden_size=1024, num_attention_heads=16, num_query_groups=16,
             ffn_hidden_size=2816, seq_length=64, vocab_size=4096)
# --model big: issue 22's 194M-parameter fp32 Llama (vocab 32000: 1.45 GiB of Adam moments), at the
# trainer's default --bucket-size and --offload-buffer-size unless --bucket-size is given
MODELS = {"bench": MODEL, "big": {**MODEL, "vocab_size": 32000}}
MICRO_BATCH = 2
SEED, LR = 1234, 3e-4
WARMUP, STEPS = 1, 3
BUCKET_SIZE = 4_000_000  # elements: ~35 buckets of 48 MB of fp32 state each on disk
SAMPLE_S = 0.002
# row -> (zero stage, --offload-optimizer, --offload-params); each row's RSS drop is against BASE[zero]
TIERS = {"none": (2, "none", "none"), "cpu": (2, "cpu", "none"), "disk": (2, "disk", "none"),
         "z3": (3, "none", "none"), "z3-cpu": (3, "cpu", "cpu"), "z3-disk": (3, "disk", "disk")}
BASE = {2: "none", 3: "z3"}
ROWS = (*TIERS, "deepspeed-cpu")
TAG = "OFFLOAD_RESULT "


def vm_kib(field: str) -> int:
    """``VmRSS``/``VmHWM`` of this process, KiB (what the kernel counts as resident: mapped file pages too)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class RssSampler:
    """Samples VmRSS from a thread while armed; ``peak`` is the largest value seen (bytes)."""

    def __init__(self) -> None:
        self.peak, self.armed, self.stop = 0, False, False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            if self.armed:
                self.peak = max(self.peak, vm_kib("VmRSS") * 1024)
            time.sleep(SAMPLE_S)

    def close(self) -> None:
        self.stop = True
        self.thread.join()


def tokens(total: int):
    """Seeded token batches for ``total`` steps (``MODEL`` is set per worker by ``--model``)."""
    import torch

    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, MODEL["vocab_size"], (total, MICRO_BATCH, MODEL["seq_length"] + 1), generator=g)


def megazero_row(row: str, offload_dir: str, bucket_size: int | None = BUCKET_SIZE) -> dict:
    """One megazero run on one rank: ``TIERS[row]`` gives the ZeRO stage and where the state lives;
    ``bucket_size`` None keeps the trainer's default."""
    import torch

    from megazero.config import Config
    from megazero.optimizer.accounting import measured_state_bytes
    from megazero.parallel.state import ParallelState
    from megazero.pipeline.schedules import build_schedule
    from megazero.run_plan import RunPlan
    from megazero.tensor_parallel.random import seed_everything
    from megazero.training.host_memory import keep_freed_host_memory
    from megazero.training.parallelize import build_training_model

    keep_freed_host_memory()  # as the trainer does on CPU
    zero, optimizer, params = TIERS[row]
    settings = {**MODEL, "zero": zero, "micro_batch_size": MICRO_BATCH, "global_batch_size": MICRO_BATCH,
                "seed": SEED, "device": "cpu", "lr": LR, "lr_decay_style": "constant", "clip_grad": 1.0,
                "offload_optimizer": optimizer, "offload_params": params}
    if bucket_size is not None:
        settings["bucket_size"] = bucket_size
    if "disk" in (optimizer, params):
        settings["offload_path"] = offload_dir
    cfg = Config.from_flat(settings)
    pstate = ParallelState.serial("cpu")
    seed_everything(SEED, 0)
    plan = RunPlan.resolve(cfg, 1)
    model = build_training_model(cfg, plan, pstate)
    chunks, opt = model.chunks, model.optimizer
    schedule = build_schedule(plan)
    count = sum(p.numel() for c in chunks for p in c.parameters())

    def one_step(batch) -> float:
        opt.zero_grad()
        out = schedule(chunks, [batch], pstate, opt.no_sync)
        opt.step(LR)
        return float(torch.stack(out).mean())

    result = timed_loop(one_step)
    state = measured_state_bytes(opt)
    opt.close()
    return {**result, "params": count, **state}


def deepspeed_row(_: str) -> dict:
    """DeepSpeed ZeRO-2, ``offload_optimizer: cpu`` (its DeepSpeedCPUAdam), around megazero's serial model."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    import deepspeed
    import torch.distributed as dist

    from megazero.config import ModelConfig
    from megazero.model.gpt import GPTModel
    from megazero.model.transformer import TPContext
    from megazero.tensor_parallel.layers import initialize_parameters

    dist.init_process_group("gloo")
    model = GPTModel(ModelConfig(**MODEL), TPContext())
    initialize_parameters(model, SEED, None)
    config = {"train_batch_size": MICRO_BATCH, "train_micro_batch_size_per_gpu": MICRO_BATCH,
              "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                         "weight_decay": 0.01}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "overlap_comm": False,
                                    "reduce_bucket_size": BUCKET_SIZE, "allgather_bucket_size": BUCKET_SIZE},
              "fp16": {"enabled": False}, "bf16": {"enabled": False}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                           dist_init_required=False)

    def one_step(batch) -> float:
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    row = timed_loop(one_step)
    params = sum(p.numel() for p in model.parameters())
    dist.destroy_process_group()
    return {**row, "params": params}


def timed_loop(one_step) -> dict:
    """``WARMUP`` untimed steps, then ``STEPS`` timed ones with the RSS sampler armed."""
    data = tokens(WARMUP + STEPS)
    losses, sampler = [], RssSampler()
    for step in range(WARMUP):
        losses.append(one_step(data[step]))
    before = vm_kib("VmRSS") * 1024
    sampler.armed, start, cpu = True, time.perf_counter(), time.process_time()
    for step in range(WARMUP, WARMUP + STEPS):
        losses.append(one_step(data[step]))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    sampler.close()
    return {"step_s": elapsed / STEPS, "cpu_s_per_step": cpu / STEPS, "losses": losses,
            "rss_before_steps": before, "peak_step_rss": sampler.peak, "vm_hwm": vm_kib("VmHWM") * 1024}


def run_row(row: str, threads: int, model: str = "bench", bucket_size: int | None = BUCKET_SIZE) -> dict:
    """One row in a fresh process under ``/usr/bin/time -v`` (its "Maximum resident set size" is the
    whole run's peak, start-up included); a failed row returns its error (the last lines of stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "DS_ACCELERATOR": "cpu"}
    offload_dir = tempfile.mkdtemp(prefix="bench_offload_", dir=os.environ.get("BENCH_OFFLOAD_DIR", "/tmp"))
    timer = ["/usr/bin/time", "-v"] if os.path.exists("/usr/bin/time") else []
    cmd = [*timer, sys.executable, "-m", "bench.bench_offload", "--worker", row, "--offload-dir", offload_dir,
           "--threads", str(threads), "--model", model, "--bucket-size", str(bucket_size or 0)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    finally:
        shutil.rmtree(offload_dir, ignore_errors=True)
    for line in out.stdout.splitlines():
        if line.startswith(TAG):
            result = json.loads(line[len(TAG):])
            for err in out.stderr.splitlines():
                if "Maximum resident set size (kbytes):" in err:
                    result["time_max_rss"] = int(err.split(":")[-1]) * 1024
            return result
    tail = (out.stderr or out.stdout).strip().splitlines()[-6:]
    return {"row": row, "error": " | ".join(tail)}


def worker(row: str, offload_dir: str, threads: int, model: str, bucket_size: int | None) -> None:
    import torch

    global MODEL
    MODEL = MODELS[model]
    torch.set_num_threads(threads)
    result = deepspeed_row(offload_dir) if row == "deepspeed-cpu" else megazero_row(row, offload_dir, bucket_size)
    print(TAG + json.dumps({"row": row, "threads": threads, "model": model, **result}), flush=True)


def offloaded_bytes(row: str, base: dict) -> int:
    """What ``row`` moves off the device, measured in its in-memory base row: the optimizer state,
    plus the parameter shards with --offload-params."""
    _, _, params = TIERS.get(row, (2, "cpu", "none"))
    return base["optimizer_bytes"] + (base["params_bytes"] if params != "none" else 0)


def table(results: list[dict]) -> str:
    """Markdown rows; the RSS drop is against the row's in-memory base (``BASE``), as a fraction of
    the bytes it offloads: at the steps' peak (sampled VmRSS) and over the whole run (/usr/bin/time)."""
    ok = {r["row"]: r for r in results if "error" not in r}
    lines = ["| row | step s | CPU s/step | peak RSS in step GB | whole-run max RSS GB | step drop / offloaded "
             "| whole-run drop / offloaded | losses |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['row']} | failed: {r['error'][:300]} |||||||")
            continue
        base = ok.get(BASE[TIERS.get(r["row"], (2,))[0]])
        whole = r.get("time_max_rss", r["vm_hwm"])  # no /usr/bin/time: the worker's own VmHWM
        step_frac = whole_frac = float("nan")
        if base:
            state = offloaded_bytes(r["row"], base)
            step_frac = (base["peak_step_rss"] - r["peak_step_rss"]) / state
            whole_frac = (base.get("time_max_rss", base["vm_hwm"]) - whole) / state
        losses = ", ".join(f"{x:.4f}" for x in r["losses"])
        lines.append(f"| {r['row']} | {r['step_s']:.2f} | {r['cpu_s_per_step']:.2f} | {r['peak_step_rss'] / 1e9:.2f} "
                     f"| {whole / 1e9:.2f} | {step_frac:.0%} | {whole_frac:.0%} | {losses} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", choices=tuple(MODELS), default="bench",
                        help="bench: ~137M parameters; big: issue 22's 194M (1.45 GiB of Adam moments)")
    parser.add_argument("--bucket-size", type=int, default=None,
                        help=f"elements; 0 = the trainer's default (default: {BUCKET_SIZE:,} for --model bench, "
                             f"the trainer's default for big)")
    parser.add_argument("--worker", choices=ROWS, help=argparse.SUPPRESS)
    parser.add_argument("--offload-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    bucket = args.bucket_size if args.bucket_size is not None else (BUCKET_SIZE if args.model == "bench" else 0)
    if args.worker:
        return worker(args.worker, args.offload_dir, args.threads, args.model, bucket or None)
    results = []
    for row in args.rows:
        results.append(run_row(row, args.threads, args.model, bucket or None))
        print(json.dumps(results[-1]), flush=True)
    print(results_header("bench.bench_offload") + "\n\n" + table(results))


if __name__ == "__main__":
    main()
