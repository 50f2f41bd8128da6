"""The routers' auxiliary losses reach their gradients with the LM loss's scaling in every split (issue 33,
"Auxiliary losses"): the router weights' gradient from aux + z-loss is the same, within 1e-6, at tp 1/2
(with SP), cp 1/2, pp 1/2, dp 1/2, ep 1/2 and 1 vs 4 micro-batches.

The part a router's gradient owes to its balance losses is isolated as (the reduced gradient with the
coefficients on) - (the same step with them off): the routing, and so the LM loss's gradient, does not
depend on the coefficients. Every micro-batch of every DP rank is the same sample, so the global batch's
mean over micro-batches equals that one micro-batch's loss whatever m and dp are, and every layout must
give the one-process, one-micro-batch gradient. Gradients are read after the engine's reduction
(``main_grad`` at ZeRO 0, summed over TP for the sequence-parallel router weight, averaged over dp x cp),
i.e. what the optimizer would step with. Both pipeline stages hold MoE layers, so pp 2 checks that the
first stage's losses reach their gradients too.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from megazero.config import Config
from megazero.model.chunk import routers_of
from megazero.parallel.layout import Layout
from megazero.parallel.state import ParallelState
from megazero.pipeline.schedules import build_schedule
from megazero.run_plan import RunPlan
from tests.helpers.dist import spawn
from tests.helpers.optimizer_harness import build
from tests.helpers.tiny_config import degrees, family, tiny_config

SEQ, MBS, VOCAB = 16, 2, 128
TOL = 1e-6  # of the largest entry of the reference gradient: fp32 sums in another order
OPTIMIZER_DEFAULTS = dict(lr_decay_style="cosine", adam_eps=1e-8, weight_decay=0.01)  # no step is taken


def make_cfg(*, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, micro_batches: int = 1,
             dp: int = 1) -> Config:
    return tiny_config(**degrees(tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, sp=tp > 1), **family("llama"),
                       num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1.0, moe_z_loss_coeff=0.1,
                       seq_length=SEQ, vocab_size=VOCAB, **OPTIMIZER_DEFAULTS, micro_batch_size=MBS,
                       global_batch_size=MBS * micro_batches * dp, train_iters=1)


def router_grads(pstate: ParallelState, cfg: Config) -> dict[str, torch.Tensor]:
    """The reduced router-weight gradients of one step on identical micro-batches, by parameter name."""
    plan = RunPlan.resolve(cfg, pstate.layout.world_size)
    model = build(pstate, cfg)
    chunks, optimizer = model.chunks, model.optimizer
    try:
        sample = torch.randint(VOCAB, (MBS, SEQ + 1), generator=torch.Generator().manual_seed(3))
        optimizer.zero_grad()
        build_schedule(plan)(chunks, [sample] * plan.micro_batches, pstate, optimizer.no_sync)
        model.engine.finish()
        grads = {}
        for chunk in chunks:
            names = {p: n for n, p in chunk.named_parameters()}
            grads.update({names[r.weight]: r.weight.main_grad.detach().clone() for r in routers_of(chunk)})
        return grads
    finally:
        optimizer.close()


def aux_part(pstate: ParallelState, cfg: Config) -> dict[str, torch.Tensor]:
    """The balance losses' share of the router gradients: coefficients on minus off."""
    off = replace(cfg, model=replace(cfg.model, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0))
    on, off = router_grads(pstate, cfg), router_grads(pstate, off)
    return {name: on[name] - off[name] for name in on}


# (name, layout kwargs (tp, cp, pp, ep, etp), micro-batches): each in a 4-rank world, dp filling it
LAYOUTS = [("tp2.sp.dp2", dict(tp=2), 1), ("cp2.dp2.m4", dict(cp=2), 4), ("pp2.dp2.m4", dict(pp=2), 4),
           ("dp4.ep2", dict(ep=2), 1), ("tp2.cp2.m4", dict(tp=2, cp=2), 4),
           ("tp2.pp2.ep2.etp1", dict(tp=2, pp=2, ep=2, etp=1), 1),
           ("cp2.pp2.ep2.m4", dict(cp=2, pp=2, ep=2), 4)]
WORLD = 4


def _world(pstate: ParallelState) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for name, grid, m in LAYOUTS:
        layout = Layout.from_world(WORLD, tp=grid.get("tp", 1), pp=grid.get("pp", 1), cp=grid.get("cp", 1),
                                   ep=grid.get("ep", 1), etp=grid.get("etp"))
        mine = ParallelState.build(layout, "cpu")  # collective: every rank builds every layout in order
        out[name] = aux_part(mine, make_cfg(**grid, micro_batches=m, dp=layout.dp))
    return out


def test_aux_loss_gradient_is_the_same_in_every_split():
    torch.set_num_threads(1)
    reference = aux_part(ParallelState.serial(), make_cfg())
    four = aux_part(ParallelState.serial(), make_cfg(micro_batches=4))
    assert set(reference) == {"layers.0.mlp.router.weight", "layers.1.mlp.router.weight"}
    peak = max(g.abs().max().item() for g in reference.values())
    assert peak > 1e-3, "the balance losses must move the router's gradient for this test to mean anything"

    def check(tag: str, got: dict[str, torch.Tensor]) -> None:
        for name, grad in got.items():
            err = (grad - reference[name]).abs().max().item() / peak
            assert err <= TOL, f"{tag} {name}: {err:.2e} of the largest entry"

    check("serial.m4", four)
    results = spawn(_world, WORLD)
    for name, _, _ in LAYOUTS:
        seen: set[str] = set()
        for rank_out in results:
            check(f"{name} rank", rank_out[name])
            seen |= set(rank_out[name])
        assert seen == set(reference), f"{name}: the routers of every stage took part ({seen})"


def test_aux_scale_follows_the_fp16_loss_scale():
    """fp16: the LM loss's gradient is multiplied by the dynamic loss scale (unscaled by the optimizer), so the
    routers' is too, at the scale of the step that runs (it changes between steps)."""
    cfg = make_cfg(micro_batches=4)
    cfg = replace(cfg, training=replace(cfg.training, fp16=True))
    model = build(ParallelState.serial(), cfg)
    chunks, optimizer = model.chunks, model.optimizer
    try:
        sample = torch.randint(VOCAB, (MBS, SEQ + 1), generator=torch.Generator().manual_seed(3))
        for scale in (1024.0, 8.0):
            optimizer.scaler.scale = scale
            with torch.no_grad():
                chunks[0](sample[:, :-1], sample[:, 1:])
            assert [r.aux_scale for r in routers_of(chunks[0])] == [scale / 4] * 2
    finally:
        optimizer.close()
