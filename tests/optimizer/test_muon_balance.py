"""NS work per rank under Muon's owner assignment (issue 42, "NS calls": within 10% of the mean for the llama-7B
preset at dp 8). The matrices are the preset's own, by the optimizer's rules (``muon_plan.block_matrix_shapes``
reads them from blocks built on the meta device: q, k, v split out of the fused weight, the MLP's three), costed
by ``muon.ns_cost`` and packed by ``muon_shards.assign_owners`` as every rank of the run packs them; and measured:
the NS cost each rank of a spawned dp-4 world runs, counted at the call."""
from __future__ import annotations

import os

import megazero.optimizer.muon_shards as shards
from megazero.arguments import parse_config
from megazero.memory.muon_plan import block_matrix_shapes
from megazero.memory.muon_traffic import muon_step_bytes
from megazero.memory.params import num_parameters
from megazero.optimizer.muon import ns_cost
from megazero.optimizer.muon_shards import assign_owners
from megazero.run_plan import RunPlan
from tests.helpers.dist import spawn
from tests.helpers.launch import ROOT
from tests.helpers.optimizer_harness import make_cfg, train
from tests.helpers.tiny_config import family

BOUND = 1.10  # the issue's: the busiest rank's NS work at most 10% over the mean


def rank_loads(costs: list[int], ranks: int) -> list[int]:
    loads = [0] * ranks
    for cost, owner in zip(costs, assign_owners(costs, ranks)):
        loads[owner] += cost
    return loads


def test_llama_7b_owner_assignment_at_dp8_balances_ns_work() -> None:
    cfg = parse_config(["--config", os.path.join(ROOT, "configs", "llama-7b.yaml")])[0]
    shapes = [s for layer in range(cfg.model.num_layers) for s in block_matrix_shapes(cfg.model, layer)]
    assert len(shapes) == 7 * cfg.model.num_layers  # q, k, v, o, gate, up, down per block
    loads = rank_loads([ns_cost(s) for s in shapes], 8)
    mean = sum(loads) / len(loads)
    assert max(loads) / mean <= BOUND, (max(loads) / mean, loads)


def test_balance_bound_can_fail() -> None:
    """The bound is not vacuous: two equal matrices over three ranks leave one idle (max / mean 1.5)."""
    loads = rank_loads([10, 10], 3)
    assert max(loads) / (sum(loads) / 3) > BOUND


# The measured half: the NS work each rank of a spawned dp-4 world actually runs in a step, counted at the call.
WORLD, ITERS = 4, 2


def _balance_config(layers: int, hidden: int):
    return make_cfg(iters=ITERS, layers=layers, hidden=hidden, zero=1, mbs=2, **family("llama"), optimizer="muon",
                    lr=0.02, muon_adam_lr=1e-3)


def _ns_work(pstate, layers: int, hidden: int) -> int:
    """This rank's NS cost summed over the run's calls (``ns_cost`` of each matrix it orthogonalised)."""
    work, original = [0], shards.newton_schulz

    def counted(G, *args, **kwargs):
        work[0] += ns_cost(tuple(G.shape))
        return original(G, *args, **kwargs)

    shards.newton_schulz = counted  # a counter around the real NS (no collective involved)
    try:
        train(pstate, _balance_config(layers, hidden))
    finally:
        shards.newton_schulz = original
    return work[0]


def test_ns_work_measured_per_rank_at_dp4_is_the_assignments() -> None:
    layers, hidden = 4, 64
    work = spawn(_ns_work, WORLD, layers, hidden)
    cfg = _balance_config(layers, hidden)
    costs = [ns_cost(s) for i in range(layers) for s in block_matrix_shapes(cfg.model, i)]
    assert sum(work) == ITERS * sum(costs)  # every matrix once per step, on one rank
    assert sorted(work) == sorted(ITERS * c for c in rank_loads(costs, WORLD))  # the packing's loads, as run
    ratio = max(work) / (sum(work) / WORLD)
    print(f"measured NS work per rank at dp 4, {layers} layers x {hidden}: max / mean {ratio:.3f}")
    assert ratio <= BOUND, (ratio, work)


def test_gpt2_small_muon_traffic_at_dp8_is_within_moonlights_bound() -> None:
    """Issue 42's traffic claim, by the planner's formula (``muon_traffic``, which the ledger is tested to equal):
    gpt2-small's shape at dp 8, ZeRO 1 and 2, fp32: the busiest rank's Muon sends plus AdamW's reduce-scatter and
    all-gather ((N-1)/N of P each, 4 bytes) at most 1.25x AdamW's alone."""
    for zero in (1, 2):
        cfg = parse_config(["--config", os.path.join(ROOT, "configs", "gpt2-small.yaml"), "--optimizer", "muon",
                            "--zero", str(zero)])[0]
        run = RunPlan.resolve(cfg, 8)
        adamw = 4 * 2 * 7 / 8 * num_parameters(cfg.model)
        muon = muon_step_bytes(cfg, run, 0)
        mean = sum(muon_step_bytes(cfg, run, 0, r) for r in range(8)) / 8
        print(f"gpt2-small dp 8 ZeRO {zero}: busiest rank {(adamw + muon) / adamw:.3f}x AdamW, "
              f"mean {(adamw + mean) / adamw:.3f}x")
        assert 1.0 < (adamw + muon) / adamw <= 1.25, (zero, muon, adamw)
