"""Training on packed documents with all three flags equals the one-process run in every layout.

The batches pack documents of random lengths (an EOD wherever a seeded draw is a multiple of 7: about
one token in seven), so documents straddle CP chunks and ranks and no length is a multiple of 2 x cp;
with --eod-mask-loss micro-batches and DP ranks keep different token counts, which the loss must
weigh by token, not by micro-batch. One 4-rank world: cp 2 (ring, all-to-all) and cp 4 (ring, hybrid),
cp2 x dp2 at ZeRO 3, tp2 with sequence parallelism, pp2 x dp2 with 1F1B, recompute full; gpt2 and
llama. Per-iteration loss and grad norm within 1e-5 (TP: the harness's TP bound) of one process.
"""
from __future__ import annotations

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

ITERS = 6


def train_packed(pstate: ParallelState, cfg, rule: PackingRule | None = PACKED_RULE) -> list[tuple[float, float]]:
    chunks, optimizer = build(pstate, cfg)
    schedule = build_schedule(RunPlan.resolve(cfg, pstate.layout.world_size), packing=rule)
    trainer = Trainer(cfg, pstate, chunks, optimizer, schedule, PackedBatches(cfg, pstate.dp_rank, pstate.dp),
                      MetricsLog(None, enabled=False))
    return [(r["loss"], r["grad_norm"]) for r in trainer.train()]


WORLD = 4  # dp fills it: cp 2, tp 2 and pp 2 run at dp 2 (one micro-batch each), cp 4 at dp 1 (two)
RUNS = [CPRun("gpt2.cp2.p2p.dp2.zero3", make_cfg("gpt2", cp=2, zero=3, iters=ITERS)),
        CPRun("llama.cp2.a2a.dp2", make_cfg("llama", cp=2, comm="a2a", iters=ITERS)),
        CPRun("llama.cp4.p2p.recompute", make_cfg("llama", cp=4, recompute="full", iters=ITERS)),
        CPRun("gpt2.cp4.hybrid", make_cfg("gpt2", cp=4, comm="a2a+p2p", a2a=2, iters=ITERS)),
        CPRun("llama.tp2.sp.dp2", make_cfg("llama", tp=2, sp=True, iters=ITERS)),
        CPRun("gpt2.pp2.dp2.1f1b", make_cfg("gpt2", pp=2, iters=ITERS))]


def _world(pstate) -> dict:
    states, out = {}, {}
    for run in RUNS:
        p = run.cfg.parallel
        key = (p.tp, WORLD // (p.tp * p.pp * p.cp), p.pp, p.cp, p.cp_a2a)
        if key not in states:  # collective: every rank builds every layout's groups in the same order
            states[key] = ParallelState.build(Layout(*key[:4]), "cpu", cp_a2a=p.cp_a2a)
        out[run.key] = train_packed(states[key], run.cfg)
    return out


def test_packed_training_matches_one_process_in_every_layout():
    results = spawn(_world, WORLD)
    bad = []
    for run in RUNS:
        serial = train_packed(ParallelState.serial(), serial_config(run.cfg))
        unmasked = train_packed(ParallelState.serial(), serial_config(run.cfg), rule=None)
        assert abs(unmasked[0][0] - serial[0][0]) > 1e-3, run.key  # the flags change what is trained
        tol = tolerance(run.cfg.parallel.tp)
        for rank, per_rank in enumerate(results):
            for i, (got, want) in enumerate(zip(per_rank[run.key], serial)):
                errs = [abs(g - w) / abs(w) for g, w in zip(got, want)]
                if max(errs) > tol:
                    bad.append(f"{run.key} rank {rank} iteration {i}: loss/grad-norm rel err {errs}")
    assert not bad, "\n".join(bad)
