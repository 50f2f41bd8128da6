"""Training on packed documents with all three flags equals the one-process run in every layout, 20 iterations.

The batches pack documents of random lengths (an EOD wherever a seeded draw is a multiple of 7: about
one token in seven), so documents straddle CP chunks and ranks and no length needs to be a multiple of
2 x cp (the test checks both of its own batches); with --eod-mask-loss micro-batches and DP ranks keep
different token counts, which the loss must weigh by token, not by micro-batch. One 4-rank world: cp 2
(ring, all-to-all; the hybrid needs 1 < U < cp, so cp >= 4) and cp 4 (ring, all-to-all, hybrid), cp2 x dp2
at ZeRO 3, tp2 with sequence parallelism at ZeRO 1, pp2 x dp2 with 1F1B at ZeRO 2, recompute full and
selective; gpt2 and llama. Per-iteration loss within 1e-5 of one process without recompute, grad norm within
the harness's bound (``tolerance``). The one-process references run once per architecture, on one thread (as
every spawned rank does).
"""
from __future__ import annotations

import torch

from megazero.context_parallel.split import CPSplit
from megazero.model.documents import PackingRule
from megazero.parallel.layout import Layout
from megazero.parallel.state import ParallelState
from megazero.pipeline.schedules import build_schedule
from megazero.run_plan import RunPlan
from megazero.training.metrics import MetricsLog
from megazero.training.trainer import Trainer
from tests.helpers.batches import PACKED_RULE, PackedBatches
from tests.helpers.cp_runs import CPRun, make_cfg, serial_config
from tests.helpers.dist import spawn
from tests.helpers.optimizer_harness import build, tolerance

ITERS = 20
LOSS_TOL = 1e-5  # the bound on the per-iteration loss, every layout


def train_packed(pstate: ParallelState, cfg, rule: PackingRule | None = PACKED_RULE) -> list[tuple[float, float]]:
    schedule = build_schedule(RunPlan.resolve(cfg, pstate.layout.world_size), packing=rule)
    trainer = Trainer(cfg, pstate, build(pstate, cfg), schedule, PackedBatches(cfg, pstate.dp_rank, pstate.dp),
                      MetricsLog(None, enabled=False))
    return [(r["loss"], r["grad_norm"]) for r in trainer.train()]


WORLD = 4  # dp fills it: cp 2, tp 2 and pp 2 run at dp 2 (one micro-batch each), cp 4 at dp 1 (two)
RUNS = [CPRun("gpt2.cp2.p2p.dp2.zero3", make_cfg("gpt2", cp=2, zero=3, iters=ITERS)),
        CPRun("llama.cp2.a2a.dp2", make_cfg("llama", cp=2, comm="a2a", iters=ITERS)),
        CPRun("llama.cp4.p2p.recompute", make_cfg("llama", cp=4, recompute="full", iters=ITERS)),
        CPRun("llama.cp4.a2a.selective", make_cfg("llama", cp=4, comm="a2a", recompute="selective", iters=ITERS)),
        CPRun("gpt2.cp4.hybrid", make_cfg("gpt2", cp=4, comm="a2a+p2p", a2a=2, iters=ITERS)),
        CPRun("llama.tp2.sp.dp2.zero1", make_cfg("llama", tp=2, sp=True, zero=1, iters=ITERS)),
        CPRun("gpt2.pp2.dp2.1f1b.zero2", make_cfg("gpt2", pp=2, zero=2, iters=ITERS))]


def _world(pstate) -> dict:
    states, out = {}, {}
    for run in RUNS:
        p = run.cfg.parallel
        key = (p.tp, WORLD // (p.tp * p.pp * p.cp), p.pp, p.cp, p.cp_a2a)
        if key not in states:  # collective: every rank builds every layout's groups in the same order
            states[key] = ParallelState.build(Layout(*key[:4]), "cpu", cp_a2a=p.cp_a2a)
        out[run.key] = train_packed(states[key], run.cfg)
    return out


def _reference(cfg):
    """The one-process run a layout must equal: no parallelism, ZeRO 0, no recompute."""
    return serial_config(cfg).updated(recompute="none")


def _one_thread_serial(cfgs: list, rule: PackingRule | None = PACKED_RULE) -> list[list[tuple[float, float]]]:
    """One-process runs on one thread: two threads contend with the other tests' ranks on two cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [train_packed(ParallelState.serial(), cfg, rule) for cfg in cfgs]
    finally:
        torch.set_num_threads(threads)


def _rank_straddles(split: CPSplit, seq: int, bounds) -> tuple[bool, bool]:
    """(a document holds tokens of two CP ranks, a document's length is no multiple of 2 x cp)."""
    owner = torch.empty(seq, dtype=torch.long)
    for rank in range(split.cp):
        owner[split.positions(seq, rank)] = rank
    docs = [(s, e) for cuts in bounds for s, e in zip(cuts[:-1], cuts[1:])]
    return (any(owner[s:e].unique().numel() > 1 for s, e in docs),
            any((e - s) % (2 * split.cp) for s, e in docs))


def test_packed_batches_straddle_cp_ranks_with_uneven_lengths():
    """The parity runs' own batches: under every CP split some document spans two ranks and some
    document's length is no multiple of 2 x cp (what Megatron's and ring-flash-attn's CP require)."""
    for run in (r for r in RUNS if r.cfg.parallel.cp > 1):
        p, seq = run.cfg.parallel, run.cfg.model.seq_length
        batches = PackedBatches(run.cfg, 0, 1)
        bounds = [PACKED_RULE.documents(mb[:, :-1]).bounds for _ in range(ITERS) for mb in batches.next_step()]
        found = [_rank_straddles(CPSplit(cp=p.cp, a2a=p.cp_a2a), seq, b) for b in bounds]
        assert any(s for s, _ in found) and any(u for _, u in found), run.key


def test_packed_training_matches_one_process_in_every_layout():
    results = spawn(_world, WORLD)
    serial_cfgs = list({repr(c): c for c in (_reference(run.cfg) for run in RUNS)}.values())
    serial = dict(zip(map(repr, serial_cfgs), _one_thread_serial(serial_cfgs)))
    first_only = [c.updated(train_iters=1) for c in serial_cfgs]
    for cfg, unmasked in zip(serial_cfgs, _one_thread_serial(first_only, rule=None)):
        assert abs(unmasked[0][0] - serial[repr(cfg)][0][0]) > 1e-3, cfg.model.arch  # the flags change the math
    bad = []
    for run in RUNS:
        want_run = serial[repr(_reference(run.cfg))]
        tols = (LOSS_TOL, tolerance(run.cfg.parallel.tp))
        for rank, per_rank in enumerate(results):
            assert len(per_rank[run.key]) == ITERS == len(want_run), run.key
            for i, (got, want) in enumerate(zip(per_rank[run.key], want_run)):
                errs = [abs(g - w) / abs(w) for g, w in zip(got, want)]
                if any(e > tol for e, tol in zip(errs, tols)):
                    bad.append(f"{run.key} rank {rank} iteration {i}: loss/grad-norm rel err {errs}")
    assert not bad, "\n".join(bad)
