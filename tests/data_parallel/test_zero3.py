"""ZeRO 3 over real gloo worlds: parity with one process, memory freed, traffic and model state.

Five worlds (dp2, dp4, tp2 x dp2, pp2 x dp2, tp2 x pp2 x dp2 = 8 ranks) each run several
configurations; the parent compares every run with the serial run of the same global batch.

Parity (fp32): losses and grad norms per iteration, the final weights and the loss of an
evaluation pass after training within 1e-5 relative, as for ZeRO 0-2 (tests/optimizer/test_zero_parity.py):
only the order of fp32 summations differs (DP reduce-scatter, micro-batch accumulation into the
grad shard), worth ~1e-7 per step; measured <= 1.5e-6 after 3 steps.

Micro-batches per rank (global batch 8): dp2 mbs 4 = 1, mbs 2 = 2, mbs 1 = 4; dp4 mbs 2 = 1,
mbs 1 = 2, and global batch 16 with mbs 1 = 4 (against a serial run of that global batch).

Reduced precision, ZeRO 3 against ZeRO 2 in the same world (dp2): with one micro-batch the two
do the same arithmetic on every element (same reduce-scatter of two addends, same sharded AdamW),
so losses, loss scales, the evaluation loss and the weights must be BITWISE equal in fp32, bf16
and fp16 (loss scaling). Only the fp64 grad norm may differ, by an ulp or so: it adds per-bucket
partial sums, and ZeRO 3 closes buckets at unit boundaries (measured 1 ulp; allowed 1e-15).
With 4 micro-batches ZeRO 2 accumulates the bucket gradient and reduce-scatters once, ZeRO 3
reduce-scatters each micro-batch and adds into the shard: fp32 sums in another order. Tolerance:
1e-5 relative in fp32 (the parity bound; measured 7e-8); in bf16/fp16 u/8 of the unit roundoff
(losses and grad norms relative, weights norm-wise), since a weight may round to the other side
of a 16-bit boundary (measured: weights bitwise equal, grad norms 6e-11).

Memory (every ZeRO 3 run, see zero3_checks.UnitProbe): at every block's forward and
pre-backward each unit holds all its bytes or none, the computing unit is gathered, at most
1 + prefetch block units hold bytes when resharding (the root units kept), all of a chunk's
earlier block units when not; 0 bytes after every optimizer.step and after evaluation.

Traffic (dp4, N = 4, second step's ledger, per micro-batch): all-gather (N-1)/N x (2 x
block-unit bytes + root-unit bytes) with resharding - the root unit is kept from its forward to
its backward, so it is gathered once - and (N-1)/N x parameter bytes without; reduce-scatter
(N-1)/N x gradient bytes; all-reduce only the loss (fp32) and grad-norm (fp64) scalars. Bytes are
bucket numel x element size, padding included. The root unit (tied embedding) is 57% of this
tiny model, so resharding moves 2.43 x (N-1)/N x parameter bytes per step rather than 3; 2 without.
Model state (dp4, right after build, nothing gathered): within 2% of
model_state_bytes(local params, 4, zero=3, precision) - padding is the difference (measured 0%).
"""
from __future__ import annotations

import pytest
import torch

from megazero.parallel.state import ParallelState
from tests.helpers.dist import spawn
from tests.helpers.optimizer_harness import compare_runs, failures, make_cfg, tolerance
from tests.data_parallel.zero3_checks import (EVAL_BATCHES, PRECISION, STATE_PRECISIONS, TRAFFIC_RUNS, checked_run,
                                           run_all)

CLIP = 0.05  # well below the grad norms of this model (~1), so clipping is active every step
# ZeRO 3 vs ZeRO 2 with 4 micro-batches (module docstring): the parity tolerance in fp32, an eighth
# of the unit roundoff u (bf16 2^-8, fp16 2^-11) in 16-bit precisions
SEVERAL_MB_TOL = {"fp32": 1e-5, "bf16": 2.0 ** -8 / 8, "fp16": 2.0 ** -11 / 8}

DP2_RUNS = {  # global batch 8 over dp 2: mbs 4, 2, 1 = 1, 2, 4 micro-batches
    "1mb": dict(mbs=4), "4mb": dict(mbs=1), "4mb.clip": dict(mbs=1, clip=CLIP),
    "keep.2mb": dict(mbs=2, layers=4, reshard=False), "keep.4mb": dict(mbs=1, reshard=False),
    "prefetch0": dict(mbs=2, layers=4, prefetch=0), "prefetch2.clip": dict(mbs=2, layers=4, prefetch=2, clip=CLIP),
    "units2": dict(mbs=4, layers=4, unit_layers=2), "full": dict(mbs=2, layers=4, recompute="full", clip=CLIP),
    "selective": dict(mbs=1, recompute="selective"), "keep.full": dict(mbs=1, reshard=False, recompute="full"),
}
DP4_RUNS = {"1mb": dict(mbs=2), "keep.2mb": dict(mbs=1, reshard=False), "4mb": dict(mbs=1, gbs=16)}
TP_RUNS = {"sp.2mb.clip": dict(tp=2, sp=True, mbs=2, clip=CLIP),
           "sp.keep.1mb": dict(tp=2, sp=True, mbs=4, reshard=False),
           "4mb.prefetch2": dict(tp=2, mbs=1, layers=4, prefetch=2)}
PP_RUNS = {"1f1b.clip": dict(pp=2, mbs=2, clip=CLIP), "1f1b.keep.4mb": dict(pp=2, mbs=1, reshard=False),
           "interleaved.prefetch0.clip": dict(pp=2, vp=2, layers=4, mbs=1, prefetch=0, clip=CLIP),
           "interleaved.keep.full": dict(pp=2, vp=2, layers=4, mbs=1, reshard=False, recompute="full")}
# interleaved.keep: block-only chunks of 3 buckets, where a micro-batch's gradient once reached a
# bucket whose previous reduce-scatter was still in flight (grad norm 10% off; fixed in data_parallel/engine.py)
TP_PP_RUNS = {"sp.clip": dict(tp=2, pp=2, sp=True, mbs=2, clip=CLIP),
              "interleaved.keep": dict(tp=2, pp=2, vp=2, layers=4, mbs=1, reshard=False)}


def ref_key(kw: dict) -> tuple[float, int, int]:
    """What the serial reference of a run depends on: clipping, depth and global batch."""
    return kw.get("clip", 0.0), kw.get("layers", 2), kw.get("gbs", 8)


@pytest.fixture(scope="module")
def serial() -> dict[tuple[float, int, int], dict]:
    keys = {ref_key(kw) for runs in (DP2_RUNS, DP4_RUNS, TP_RUNS, PP_RUNS, TP_PP_RUNS) for kw in runs.values()}
    return {(clip, layers, gbs): checked_run(ParallelState.serial(),
                                             make_cfg(zero=0, mbs=gbs, gbs=gbs, clip=clip, layers=layers))
            for clip, layers, gbs in keys}


def expected_peak(kw: dict) -> int | None:
    """Block units a rank holds at its busiest: all of them when kept; 1 + prefetch (or all, when
    fewer) when resharding with one chunk per rank (interleaved: bounded only, checked by the probe)."""
    units = kw.get("layers", 2) // kw.get("pp", 1) // kw.get("unit_layers", 1)
    if not kw.get("reshard", True):
        return units
    if kw.get("vp") is None:
        return min(1 + kw.get("prefetch", 1), units)
    return None


def check_world(serial: dict, world: int, runs: dict[str, dict], extras: tuple[str, ...] = (), **grid) -> list[dict]:
    """Run ``runs`` (as ZeRO 3) in one world; assert parity and the probe's findings on every rank."""
    results = spawn(run_all, world, {name: {"zero": 3, **kw} for name, kw in runs.items()}, extras, **grid)
    bad: dict[str, object] = {}
    tp_pp = grid.get("tp", 1) * grid.get("pp", 1)
    for rank, per_run in enumerate(results):
        for name, kw in runs.items():
            run, ref, tag = per_run[name], serial[ref_key(kw)], f"rank{rank}.{name}"
            bad.update(failures(compare_runs(run, ref, tag), tolerance(grid.get("tp", 1))))
            bad.update(failures({f"{tag}.eval_loss": abs(run["eval_loss"] / ref["eval_loss"] - 1)}))
            probe, iters = run["probe"], len(ref["records"])
            peak, m = expected_peak(kw), kw.get("gbs", 8) // (kw.get("mbs", 4) * world // tp_pp)
            # every block on this rank: a forward and a pre-backward per micro-batch, one more forward in evaluation
            events = (2 * iters + EVAL_BATCHES) * m * kw.get("layers", 2) // kw.get("pp", 1)
            if probe["problems"] or probe["events"] != events or (peak is not None and probe["peak_blocks"] != peak):
                bad[f"{tag}.probe"] = {**probe, "expected_peak": peak, "expected_events": events}
            if probe["between_steps"] != [0] * iters or run["after_eval_bytes"] != 0:
                bad[f"{tag}.freed"] = (probe["between_steps"], run["after_eval_bytes"])
    assert not bad, f"world {world} {grid}: {len(bad)} mismatches, e.g. {dict(list(bad.items())[:6])}"
    return results


def test_dp2_parity_memory_and_reduced_precision(serial):
    results = check_world(serial, 2, DP2_RUNS, ("precision",))
    problems = []
    for rank, res in enumerate(results):
        runs = res["precision"]
        for p in PRECISION:
            one, several = (runs[f"{p}.z2.1mb"], runs[f"{p}.z3.1mb"]), (runs[f"{p}.z2.4mb"], runs[f"{p}.z3.4mb"])
            if not bitwise_equal(*one):
                problems.append(f"rank {rank} {p}: ZeRO 3 is not bitwise ZeRO 2 with one micro-batch")
            scalars, weights = reduced_errors(*several)
            if max(scalars, weights) > SEVERAL_MB_TOL[p]:
                problems.append(f"rank {rank} {p} 4 micro-batches: ZeRO 3 vs 2 differ by {scalars:.2g} (loss, "
                                f"grad norm), {weights:.2g} (weights); tolerance {SEVERAL_MB_TOL[p]:.2g}")
            if any(r["skipped"] for run in one + several for r in run["records"]):
                problems.append(f"rank {rank} {p}: a step was skipped")
    assert not problems, "\n".join(problems)


def bitwise_equal(z2: dict, z3: dict) -> bool:
    """Losses, loss scales, evaluation loss and weights bitwise; the fp64 grad norm to 4 ulps (its
    per-bucket partial sums follow bucket boundaries, which ZeRO 3 closes at unit boundaries)."""
    pairs = list(zip(z2["records"], z3["records"]))
    return (len(pairs) == len(z2["records"]) == len(z3["records"])
            and all((a["loss"], a["loss_scale"]) == (b["loss"], b["loss_scale"]) for a, b in pairs)
            and all(abs(a["grad_norm"] - b["grad_norm"]) <= 1e-15 * a["grad_norm"] for a, b in pairs)
            and z2["eval_loss"] == z3["eval_loss"] and z2["params"].keys() == z3["params"].keys()
            and all(torch.equal(w, z3["params"][name]) for name, w in z2["params"].items()))


def reduced_errors(z2: dict, z3: dict) -> tuple[float, float]:
    """(worst relative loss / grad-norm error over the steps, norm-wise relative error of the weights)."""
    scalars = max(abs(a[k] - b[k]) / abs(a[k]) for a, b in zip(z2["records"], z3["records"])
                  for k in ("loss", "grad_norm"))
    diff = sum(float((w.double() - z3["params"][n].double()).pow(2).sum()) for n, w in z2["params"].items())
    size = sum(float(w.double().pow(2).sum()) for w in z2["params"].values())
    return scalars, (diff / size) ** 0.5


def test_dp4_parity_traffic_and_model_state(serial):
    results = check_world(serial, 4, DP4_RUNS, ("traffic", "model_state"))
    problems = []
    for rank, res in enumerate(results):
        problems += traffic_problems(rank, res["traffic"], dp=4)
        for name, state in res["model_state"].items():
            measured = sum(state["measured"].values())
            if abs(measured - state["expected"]) > 0.02 * state["expected"] or state["gathered"]:
                problems.append(f"rank {rank} {name}: {measured / state['params']:.3f} bytes/param measured "
                                f"({state['gathered']} B gathered), arithmetic says "
                                f"{state['expected'] / state['params']:.3f}")
    assert set(results[0]["model_state"]) == set(STATE_PRECISIONS)
    assert not problems, "\n".join(problems)


def traffic_problems(rank: int, traffic: dict, dp: int) -> list[str]:
    """Each run's DP bytes per step against the collectives ZeRO 3 must issue (module docstring)."""
    share, problems = (dp - 1) / dp, []
    scalars = 2 * share * 4 + 2 * share * 8  # loss all-reduce (fp32) + grad-norm all-reduce (fp64)
    assert set(traffic) == set(TRAFFIC_RUNS)
    for name, t in traffic.items():
        b, m, comm = t["bytes"], t["micro_batches"], t["comm"]
        keep = not TRAFFIC_RUNS[name].get("reshard", True)
        params = b["root"] + b["block"]
        expected = {"all_gather.forward/dp": m * share * params, "reduce_scatter/dp": m * share * b["grads"],
                    "all_reduce/dp": scalars}
        if not keep:  # the root unit is kept until its backward: only blocks are gathered again
            expected["all_gather.backward/dp"] = m * share * b["block"]
        if comm.keys() != expected.keys() or any(abs(comm[k] - v) > 1 for k, v in expected.items()):
            problems.append(f"rank {rank} {name}: ledger {comm}, expected {expected}")
        gathered = comm["all_gather.forward/dp"] + comm.get("all_gather.backward/dp", 0)
        per_param = (gathered + comm["reduce_scatter/dp"]) / (m * share * params)
        if b["grads"] == params and not (per_param == 2 if keep else 2 < per_param <= 3):
            problems.append(f"rank {rank} {name}: {per_param:.3f} x (N-1)/N x parameter bytes")
    return problems


def test_tp2_dp2_sequence_parallel(serial):
    check_world(serial, 4, TP_RUNS, tp=2)


def test_pp2_dp2_1f1b_interleaved_tied_embeddings(serial):
    check_world(serial, 4, PP_RUNS, pp=2)


def test_tp2_pp2_dp2(serial):
    check_world(serial, 8, TP_PP_RUNS, tp=2, pp=2)
