"""ZeRO 2 with ``--reduce-every-micro-batch`` against ZeRO 2 reducing once per step, 4 micro-batches.

One gloo world per layout (dp 2; tp 2 x pp 2 x dp 2), both modes trained in it:

- losses and grad norms (fp32) agree within 1e-6 relative, final weights within the parity
  tolerance (the two modes sum the same gradients in another order: micro-batches first, or
  ranks first);
- traffic per step, counted at the collective calls (``comm_bytes``, bytes this rank sends per
  kind and axis): the per-micro-batch mode reduce-scatters m = 4 times the bucket bytes, the
  default once, and both all-gather the weights once: (N-1)/N x (m g + w) bytes per parameter,
  where DDP's all-reduce sends 2 (N-1)/N x g;
- memory, in the ZeRO paper's mixed precision (``--bf16 --main-grads-dtype bf16``) at dp 2: the
  model state this rank holds when each micro-batch's forward starts (params + main grads +
  optimizer state, read from the tensors' storage by ``accounting.measured_state_bytes``; "grads"
  there are the persistent grad shard plus every full-size bucket gradient alive) is 2 + 14/N
  bytes per parameter within 1% - the grads are exactly the 1/N shard, 2 Psi / N bytes - while
  the default mode holds a full-size gradient more (2 Psi) from the second micro-batch on;
- the planner's gradient peak for both modes, against the peak sampled during real steps
  (``step_meter``), with the in-flight band of ``tests/memory/test_step_peak.py``.
"""
from __future__ import annotations


from megazero.config import Config
from megazero.data_parallel.engine import MAX_INFLIGHT_BUCKETS
from megazero.memory import PlanSpec, plan_memory
from megazero.optimizer.accounting import measured_state_bytes
from megazero.run_plan import RunPlan
from tests.helpers.dist import spawn
from tests.helpers.optimizer_harness import compare_runs, failures, make_cfg, tolerance, train
from tests.helpers.step_meter import run_metered

M, BUCKET = 4, 20_000  # micro-batches per step; buckets large enough that padding stays < 0.5%
MODES = {"once": False, "every": True}


def parity_cfg(every: bool, tp: int = 1, pp: int = 1) -> Config:
    """fp32, 4 micro-batches of 1 sample per DP rank (gbs 8 over dp 2)."""
    return make_cfg(zero=2, tp=tp, pp=pp, mbs=1, gbs=M * 2, bucket=BUCKET, layers=2 * pp).updated(
        reduce_every_micro_batch=every)


def memory_cfg(every: bool, precision: str) -> Config:
    grads = "bf16" if precision == "paper" else "fp32"
    return Config.from_flat({
        "arch": "gpt2", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16,
        "vocab_size": 1000, "zero": 2, "bf16": precision != "fp32", "main_grads_dtype": grads,
        "micro_batch_size": 1, "global_batch_size": M * 2, "device": "cpu", "bucket_size": BUCKET, "seed": 5,
        "reduce_every_micro_batch": every})


def _bucket_elements(store: dict):
    """A ``train`` hook: remember the padded elements of this rank's buckets (what the collectives move)."""

    def hook(model, pstate) -> None:
        store["elements"] = sum(buf.numel for buf in model.optimizer.buffers)

    return hook


def train_modes(pstate, tp: int, pp: int) -> dict:
    out: dict = {}
    for name, every in MODES.items():
        sizes: dict = {}
        out[name] = train(pstate, parity_cfg(every, tp, pp), hook=_bucket_elements(sizes))
        out[name]["elements"] = sizes["elements"]
    return out


def measure_memory(pstate, cfg: Config) -> dict:
    """Two real steps: the model state at every forward's start, and the step's peak (``StepStateMeter``)."""
    at_forward: list[dict] = []

    def sample_each_forward(chunks, opt) -> None:
        def sample(module, args) -> None:
            held = measured_state_bytes(opt)
            live = sum(b.grad is not None for buf in opt.buffers for b in buf.buckets)
            at_forward.append({**held, "live_buckets": live})

        for chunk in chunks:
            chunk.register_forward_pre_hook(sample)

    _, peak = run_metered(pstate, cfg, on_built=sample_each_forward)
    return {"at_forward": at_forward, "peak": peak}


def run_dp2(pstate) -> dict:
    return {"train": train_modes(pstate, 1, 1),
            "memory": {(name, precision): measure_memory(pstate, memory_cfg(every, precision))
                       for name, every in MODES.items() for precision in ("paper", "fp32")}}


def check_traffic(res: dict, n: int, grad_bytes: int, weight_bytes: int) -> list[str]:
    """Reduce-scatters m times per step in the per-micro-batch mode, once in the default; one all-gather."""
    bad = []
    for name, times in (("once", 1), ("every", M)):
        run = res["train"][name]
        comm, elements = run["records"][-1]["comm_bytes"], run["elements"]
        expected = {"reduce_scatter/dp": times * (n - 1) / n * elements * grad_bytes,
                    "all_gather/dp": (n - 1) / n * elements * weight_bytes}
        for key, want in expected.items():
            if comm.get(key) != round(want):
                bad.append(f"{name}: {key} sent {comm.get(key)} B per step, expected {want:.0f} B")
    return bad


def check_parity(res: dict, tp: int) -> list[str]:
    errs = compare_runs(res["train"]["every"], res["train"]["once"], "every-vs-once")
    curves = {k: v for k, v in errs.items() if ".loss[" in k or ".grad_norm[" in k}
    return [f"{k}: {v:.2e}" for k, v in {**failures(curves, 1e-6), **failures(errs, tolerance(tp))}.items()]


def test_dp2_parity_traffic_and_memory():
    results = spawn(run_dp2, 2)
    bad = []
    for rank, res in enumerate(results):
        bad += [f"rank {rank} {b}" for b in check_parity(res, 1) + check_traffic(res, 2, 4, 4)]
        bad += [f"rank {rank} {b}" for b in check_memory(res["memory"])]
    assert not bad, "\n".join(bad)


def check_memory(memory: dict) -> list[str]:
    bad = []
    for (name, precision), rec in memory.items():
        cfg = memory_cfg(MODES[name], precision)
        plan = plan_memory(PlanSpec.from_plan(cfg, RunPlan.resolve(cfg, 2), "cpu"))
        bad += [f"{name} {precision}: {b}" for b in _check_planned_peak(cfg, plan, rec)]
        if precision == "paper":
            bad += [f"{name}: {b}" for b in _check_paper_bytes(name, plan.num_parameters, rec["at_forward"])]
    return bad


def _check_paper_bytes(name: str, psi: int, samples: list[dict]) -> list[str]:
    """2 + 14/N bytes per parameter held at every forward's start (the default: 2 more from the second on)."""
    n, bad = 2, []
    later = [s for i, s in enumerate(samples) if i % M]  # forwards after a backward of the same step
    for s in later:
        total = s["params_bytes"] + s["grads_bytes"] + s["optimizer_bytes"]
        paper = (2 + 14 / n) * psi + (2 * psi if name == "once" else 0)
        if abs(total - paper) > 0.01 * paper:
            bad.append(f"holds {total / psi:.3f} bytes/param at a forward, expected {paper / psi:.3f}")
        grads = (2 / n + (2 if name == "once" else 0)) * psi
        if abs(s["grads_bytes"] - grads) > 0.01 * grads:
            bad.append(f"grads {s['grads_bytes']} B at a forward, expected {grads:.0f} B")
    if name == "every" and any(s["live_buckets"] for s in samples):
        bad.append(f"a full-size bucket gradient outlived its backward: {[s['live_buckets'] for s in samples]}")
    return bad


def _check_planned_peak(cfg: Config, plan, rec: dict) -> list[str]:
    """Planned grads peak = measured (reducing every micro-batch: within the in-flight band)."""
    stage, measured = plan.stages[0], rec["peak"]["grads_bytes"]
    g = 2 if cfg.training.main_grads_dtype == "bf16" else 4
    slack = MAX_INFLIGHT_BUCKETS * BUCKET * g if cfg.parallel.reduce_every_micro_batch else 0
    if not (stage.grads_bytes - slack) * 0.99 <= measured <= stage.grads_bytes * 1.01:
        return [f"grads peak planned {stage.grads_bytes:.0f} B (band {slack} B), measured {measured} B"]
    return []


def run_3d(pstate) -> dict:
    return {"train": train_modes(pstate, 2, 2)}


def test_tp2_pp2_dp2_parity_and_traffic():
    results = spawn(run_3d, 8, tp=2, pp=2)
    bad = []
    for rank, res in enumerate(results):
        bad += [f"rank {rank} {b}" for b in check_parity(res, 2) + check_traffic(res, 2, 4, 4)]
    assert not bad, "\n".join(bad)
