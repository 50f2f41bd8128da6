"""``--optimizer muon`` on the ZeRO shards (``megazero/optimizer/muon_shards.py``) trains what one process trains.

- One process: megazero's Muon through the ``DistributedOptimizer`` (dp 1, llama with GQA, clipping on) equals
  ``SerialMuon`` + ``torch.optim.AdamW(fused=True)`` (test_muon_reference's reference, itself
  ``torch.optim.Muon``'s arithmetic) in weights bit for bit over 20 steps (issue 42 asks 1e-6), one NS call per
  unfused matrix per step; a step with a non-finite gradient is skipped before Muon (no NS call, weights and
  momentum untouched).
- One spawned world of 2 ranks, several layouts in it (the pieces ``pretrain_gpt.py`` uses,
  ``optimizer_harness.train``): dp 2 at ZeRO 0, 1 and 2 (ZeRO 2 with 2 micro-batches and clipping), tp 2 with
  and without sequence parallelism, bf16 and fp16 at dp 2 and tp 2. Every rank's loss and grad norm of every one
  of 20 iterations within 1e-5 relative of the same config trained in one process (16-bit: half a unit
  roundoff); a rerun bitwise; the NS calls summed over the ranks
  exactly one per Muon matrix per step, and each rank making some of them (the work is shared); the bytes of
  Muon's gathers and scatters counted at the collectives equal the documented formula every step, and the planner's
  prediction of them from the config alone (``memory/muon_traffic.py``).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from megazero.config import Config
from megazero.data_parallel.engine import EngineSettings, GradSyncEngine
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from megazero.optimizer.grads import clip_coefficient
from megazero.optimizer.muon import SerialMuon, matrices_of, muon_hyper, split_parameters
from megazero.memory.muon_traffic import muon_step_bytes
from megazero.optimizer.zero import DistributedOptimizer
from megazero.parallel.state import ParallelState
from megazero.run_plan import RunPlan
from megazero.tensor_parallel.layers import initialize_parameters
from tests.helpers.compare import rel_err
from tests.helpers.dist import spawn
from tests.helpers.moe_runs import serial_records, state_for
from tests.helpers.muon_runs import ADAM_LR, ITERS, MUON_LR, muon_cfg, records
from tests.helpers.muon_runs import muon_bytes as muon_bytes_of
from tests.helpers.optimizer_harness import SyntheticBatches, train
from tests.helpers.reference import param_groups
from tests.helpers.tiny_config import degrees

CLIP = 0.05


def test_one_process_is_serial_muon_with_adamw():
    cfg = muon_cfg(clip_grad=CLIP)
    models = []
    for _ in range(2):
        model = GPTModel(cfg.model, TPContext(group=None))
        initialize_parameters(model, cfg.training.seed, None)
        models.append(model)
    names = {p: n for n, p in models[0].named_parameters()}
    ours = DistributedOptimizer(GradSyncEngine([models[0]], ParallelState.serial(), EngineSettings(bucket_size=3000)),
                                cfg.optimizer, muon=(cfg.model, names))
    muon_named, adam_named = split_parameters(models[1].named_parameters())
    theirs = SerialMuon(muon_named, cfg.model, muon_hyper(cfg.optimizer, MUON_LR))
    o = cfg.optimizer
    theirs_adam = torch.optim.AdamW(param_groups([p for _, p in adam_named], o.weight_decay), lr=ADAM_LR,
                                    betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, fused=True)
    batches = SyntheticBatches(cfg, 0, 1)
    start = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    for _ in range(ITERS):
        tokens = torch.cat(batches.next_step())
        ours.zero_grad()
        models[0](tokens[:, :-1], tokens[:, 1:]).backward()
        norm = ours.step(MUON_LR).grad_norm
        models[1].zero_grad()
        models[1](tokens[:, :-1], tokens[:, 1:]).backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(models[1].parameters(), float("inf")))  # (no clipping)
        for p in models[1].parameters():  # clipped by our coefficient: the norm is checked, the update compared
            p.grad.mul_(clip_coefficient(norm, CLIP))
        theirs.step()
        theirs_adam.step()
        assert abs(norm - ref_norm) <= 1e-6 * ref_norm, (norm, ref_norm)
    matrices = sum(len(matrices_of(n, p.shape, cfg.model)) for n, p in muon_named)
    assert matrices == 14 and ours.muon is not None  # q, k, v, proj, fc1, gate, fc2 in each of 2 layers
    assert ours.muon.ns_calls == theirs.ns_calls == ITERS * matrices
    errs = {n: rel_err(p, q) for (n, p), q in zip(models[0].named_parameters(), models[1].parameters())}
    bad = {n: e for n, e in errs.items() if e != 0.0}  # the same kernels on the same ranges: bit for bit
    assert not bad, bad
    assert all(rel_err(p, start[n]) > 1e-3 for n, p in muon_named), "the Muon weights moved"
    # a non-finite gradient skips the step before Muon: no NS call, weights and momentum untouched
    before = [p.detach().clone() for p in models[0].parameters()]
    momentum = [t.clone() for state in ours.store.states for t in state.tensors()]
    tokens = torch.cat(batches.next_step())
    ours.zero_grad()
    models[0](tokens[:, :-1], tokens[:, 1:]).backward()
    next(p for n, p in models[0].named_parameters() if n.endswith("qkv.weight")).main_grad[0, 0] = float("nan")
    result = ours.step(MUON_LR)
    assert result.skipped and result.nonfinite and ours.muon.ns_calls == ITERS * matrices
    assert all(torch.equal(p, q) for p, q in zip(models[0].parameters(), before))
    assert all(torch.equal(t, u) for t, u in zip([t for state in ours.store.states for t in state.tensors()],
                                                 momentum))


# 16-bit runs at Muon lr 0.01: at 0.02 this tiny model trains chaotically enough that the 16-bit roundings a TP
# layout moves grow to ~0.9 u of the loss in 20 steps (AdamW at that lr: hundreds of u); at 0.01, 0.15-0.18 u
BF16 = dict(bf16=True, lr=0.01, clip_grad=1.0)
FP16 = dict(fp16=True, initial_loss_scale=1024.0, lr=0.01, clip_grad=1.0)
RUNS = [  # (key, config, trained twice: the second bitwise the first); one layout's runs together (a layout built
    # later names the world group in its own ledger)
    ("dp2.z0", muon_cfg(**degrees(zero=0)), False),
    ("dp2.z1", muon_cfg(**degrees(zero=1)), True),
    ("dp2.z2.acc.clip", muon_cfg(**degrees(zero=2), micro_batch_size=2, clip_grad=CLIP), False),
    ("dp2.z2.fp16", muon_cfg(**degrees(zero=2), **FP16), False),
    ("tp2.sp.z1", muon_cfg(**degrees(tp=2, sp=True, zero=1)), False),
    ("tp2.z0.gpt2", muon_cfg("gpt2", **degrees(tp=2, zero=0)), False),
    ("tp2.sp.z1.bf16", muon_cfg(**degrees(tp=2, sp=True, zero=1), **BF16), False),
    ("tp2.sp.z2.fp16", muon_cfg(**degrees(tp=2, sp=True, zero=2), **FP16), False),
]
# fp32 to 1e-5; bf16 and fp16 (fp32 master weights, momentum and NS) to half their unit roundoff, as
# test_reduced_precision_parity.py compares AdamW: a layout moves only where 16-bit roundings happen
TOLERANCE = {"bf16": 2.0 ** -9, "fp16": 2.0 ** -12}


def tolerance(key: str) -> float:
    return TOLERANCE.get(key.rsplit(".", 1)[-1], 1e-5)


def run_many(pstate: ParallelState, runs: list[tuple[str, Config, bool]]) -> dict[str, list[dict[str, Any]]]:
    """Every rank trains every run (twice where asked), building each new layout's groups collectively; per run
    the records, this rank's NS calls and the Muon matrices of its chunks."""
    states: dict[Any, ParallelState] = {}
    out = {}
    for key, cfg, rerun in runs:
        state = state_for(states, cfg, pstate.layout.world_size)
        out[key] = []
        for _ in range(2 if rerun else 1):
            seen: list[Any] = []
            result = train(state, cfg, hook=lambda model, _: seen.append(model.optimizer.muon))
            muon_bytes = [muon_bytes_of(r) for r in result["records"]]
            out[key].append({"records": records(result), "ns_calls": seen[0].ns_calls,
                             "matrices": seen[0].matrices, "muon_bytes": muon_bytes, "formula": seen[0].step_bytes()})
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, list[dict[str, Any]]]]:
    return spawn(run_many, 2, RUNS)


def test_two_ranks_train_what_one_process_trains(world):
    # one thread, as every spawned rank runs; once per session per config, shared with every file that asks
    # moe_runs.serial_records for the same one-process config (test_muon_offload's)
    serial = dict(zip([key for key, _, _ in RUNS], serial_records([cfg for _, cfg, _ in RUNS])))
    bad = {}
    for rank, per_run in enumerate(world):
        for key, runs in per_run.items():
            assert len(runs[0]["records"]) == ITERS, key
            for it, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(runs[0]["records"], serial[key])):
                for what, got, want in (("loss", loss, ref_loss), ("grad_norm", norm, ref_norm)):
                    if not abs(got - want) <= tolerance(key) * abs(want):
                        bad[f"rank{rank}.{key}.{what}[{it}]"] = (got, want)
            if len(runs) > 1:
                assert runs[1]["records"] == runs[0]["records"], f"rank{rank}.{key}: the rerun is not bitwise"
    assert not bad, f"{len(bad)} mismatches, e.g. {dict(list(bad.items())[:8])}"


def test_the_gathers_muon_adds_move_the_documented_bytes(world):
    """The ledger's send.muon bytes of every step equal docs/optimizers.md's formula (``step_bytes``)."""
    for rank, per_run in enumerate(world):
        for key, runs in per_run.items():
            run = runs[0]
            assert run["formula"] > 0 and run["muon_bytes"] == [run["formula"]] * ITERS, (rank, key, run["formula"],
                                                                                          run["muon_bytes"][:3])


def test_the_planner_predicts_the_bytes_the_gathers_move(world):
    """``memory.muon_traffic.muon_step_bytes``, from the config alone, equals every rank's ledger count every step."""
    for key, cfg, _ in RUNS:
        for rank, per_run in enumerate(world):
            planned = muon_step_bytes(cfg, RunPlan.resolve(cfg, 2), 0, rank)
            assert per_run[key][0]["muon_bytes"] == [planned] * ITERS, (rank, key, planned,
                                                                        per_run[key][0]["muon_bytes"][:2])


def test_each_matrix_is_orthogonalised_once_per_step(world):
    for key, _, _ in RUNS:
        runs = [per_run[key][0] for per_run in world]
        matrices = {r["matrices"] for r in runs}
        assert len(matrices) == 1, (key, matrices)  # every rank numbers the whole model's matrices
        calls = [r["ns_calls"] for r in runs]
        assert sum(calls) == ITERS * matrices.pop(), (key, calls)
        assert all(c > 0 for c in calls), (key, calls)  # shared, not all on one rank
