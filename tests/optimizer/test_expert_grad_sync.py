"""Mixture-of-experts gradient sync, exactly (issue 33, "Groups"): dense gradients reduce over dp x cp, expert
gradients over their expert-data-parallel group, both with the net factor 1 / (dp x cp); the grad norm counts
every expert shard once; ZeRO 1-3 (both reshard modes, offload, overlapped gathers) gather expert parameters
back over that group.

Every rank sets element i of every gradient to (i + 1) x 2^rank (a linear loss), so each reduced value is
(i + 1) x (a sum of distinct powers of two) / (dp x cp): exact in fp32, as are the squares the fp64 norm adds.
The expected gradients and norm are computed here by hand from the rank arithmetic (Megatron's orders:
rank = tp + tp(cp + cp(dp + dp pp)) for the dense grid, etp + etp(ep + ep(edp + edp pp)) for the expert grid)
and compared with no tolerance. Each world builds two layouts in which edp differs from dp x cp (edp 1 included:
no collective, the factor alone).
"""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from torch import nn

from megazero.config import OptimizerConfig, Placement
from megazero.data_parallel.engine import EngineSettings, GradSyncEngine
from megazero.model.transformer import TransformerBlock
from megazero.optimizer.zero import DistributedOptimizer
from megazero.parallel.layout import Layout
from megazero.parallel.state import ParallelState
from megazero.run_plan import GradReduction, StatePlacement, UnitGathering
from megazero.tensor_parallel.layers import set_spec
from tests.helpers.dist import spawn

BLOCKS = 2
# name -> (local shape, expert, split): "split" is over tp (dense) or etp (expert); unsplit copies are replicas
PARAMS = {"head": ((3, 4), False, True), "dense": ((5,), False, False),
          "expert_w": ((2, 3), True, True), "expert_b": ((2, 2), True, False)}
RUNS = {"z0": dict(stage=0), "z1": dict(stage=1), "z1.overlap": dict(stage=1, overlap_param_gather=True),
        "z2": dict(stage=2),
        "z2.every": dict(stage=2, grad_reduction=GradReduction.EVERY_MICRO_BATCH),
        "z3": dict(stage=3, gathering=UnitGathering(reshard_after_forward=True)),
        "z3.keep": dict(stage=3, gathering=UnitGathering(reshard_after_forward=False)),
        "z3.offload": dict(stage=3, placement=StatePlacement(optimizer_state=Placement.HOST,
                                                             parameters=Placement.HOST))}


def _param(name: str, value: float) -> nn.Parameter:
    shape, expert, split = PARAMS[name]
    data = value + torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    return set_spec(nn.Parameter(data), split_dim=0 if split else None, expert=expert)


class ToyBlock(TransformerBlock):
    """A block only by type (ZeRO 3 gathers each block as a unit): one dense and two expert parameters."""

    def __init__(self, dense_id: float, expert_id: float) -> None:
        nn.Module.__init__(self)  # none of a real block's layers
        self.zero3_unit = None
        self.dense, self.expert_w = _param("dense", dense_id), _param("expert_w", expert_id)
        self.expert_b = _param("expert_b", expert_id)

    def forward(self, h: torch.Tensor, scale: float) -> torch.Tensor:
        return h + sum(_linear(p, scale) for p in (self.dense, self.expert_w, self.expert_b))


class ToyChunk(nn.Module):
    """A tp-split dense head outside the blocks (ZeRO 3's root unit) and ``BLOCKS`` blocks. Parameter values
    name the shard they are: the dense ones by tp rank, the expert ones by (etp, ep) rank."""

    def __init__(self, pstate: ParallelState) -> None:
        super().__init__()
        self.head = _param("head", 1000.0 * pstate.tp_rank)
        expert_id = 1000.0 * (1 + pstate.etp_rank + pstate.etp * pstate.ep_rank)
        self.blocks = nn.ModuleList([ToyBlock(0.0, expert_id) for _ in range(BLOCKS)])

    def forward(self, scale: float) -> torch.Tensor:
        h = _linear(self.head, scale)
        for block in self.blocks:
            h = block(h, scale)
        return h


def _linear(p: torch.Tensor, scale: float) -> torch.Tensor:
    """sum((i + 1) x scale x p[i]): its gradient is exactly (i + 1) x scale."""
    return (p * _ramp(p.numel(), scale).view_as(p)).sum()


def _ramp(n: int, scale: float) -> torch.Tensor:
    return torch.arange(1, n + 1, dtype=torch.float32) * scale


def _run(pstate: ParallelState, settings: dict, poison: bool) -> dict:
    """One step of a fresh chunk: the reduced shard of every parameter checked, the norm and the parameters
    (gathered back) returned. ``poison``: the last rank's first expert gradient is inf."""
    model = ToyChunk(pstate)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = DistributedOptimizer(GradSyncEngine([model], pstate, EngineSettings(bucket_size=8, **settings)),
                               OptimizerConfig(lr=0.0, clip_grad=0.0))
    try:
        opt.zero_grad()
        scale = float(2 ** pstate.rank)
        if poison and pstate.rank == pstate.layout.world_size - 1:
            model.blocks[0].expert_w.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), float("inf")))
        model(scale).backward()
        result = opt.step(lr=0.0)
        covered = _check_shards(pstate, model, opt) if not poison else {}
        with torch.no_grad():  # overlapped gathers: each block waits for its buckets; ZeRO 3: gathers, frees
            model(scale)
        gathered = opt.host_copies(keep=True)
        names = {p: name for name, p in model.named_parameters()}
        changed = sorted(names[p] for p, v in gathered.items() if not torch.equal(v, initial[names[p]]))
        return {"norm": result.grad_norm, "skipped": result.skipped, "covered": covered, "changed": changed}
    finally:
        opt.close()


def _check_shards(pstate: ParallelState, model: nn.Module, opt: DistributedOptimizer) -> dict[str, int]:
    """Assert that each piece of a reduced grad shard is its expected value; returns elements seen per name."""
    names = {p: name.rsplit(".", 1)[-1] for name, p in model.named_parameters()}
    covered: dict[str, int] = {}
    for buf, shards in zip(opt.buffers, opt.sync.grad_shards()):
        for b, shard in zip(buf.buckets, shards):
            for seg in b.segments:
                name = names[seg.param]
                total = _group_sum(pstate.layout, pstate.rank, PARAMS[name][1])
                want = (torch.arange(seg.param_lo, seg.param_lo + seg.hi - seg.lo, dtype=torch.float32) + 1) * total
                got = shard[seg.lo:seg.hi]
                assert torch.equal(got, want / pstate.dp_cp), (name, pstate.rank, got, want)
                covered[name] = covered.get(name, 0) + seg.hi - seg.lo
    return covered


def _group_sum(layout: Layout, rank: int, expert: bool) -> int:
    """sum of 2^q over the ranks q that reduce ``rank``'s copy: its dp x cp group (same tp rank; pp is 1), or
    its expert-data-parallel group (same etp and ep rank: the same q mod etp x ep)."""
    period = layout.expert_tp * layout.ep if expert else layout.tp
    return sum(2 ** q for q in range(layout.world_size) if q % period == rank % period)


def expected_norm(layout: Layout) -> float:
    """The global grad norm from the distinct pieces: a split copy per tp (etp x ep) rank, an unsplit one per
    tp group (ep rank), each counted once, whatever replicas or shards hold it."""
    total = Fraction(0)
    for name, (shape, expert, split) in PARAMS.items():
        n = math.prod(shape)
        owners = (range(layout.tp) if split else [0]) if not expert else \
            [e + layout.expert_tp * r for r in range(layout.ep) for e in (range(layout.expert_tp) if split else [0])]
        copies = 1 if name == "head" else BLOCKS
        for owner in owners:
            value = Fraction(_group_sum(layout, owner, expert), layout.dp * layout.cp)
            total += copies * sum((value * (i + 1)) ** 2 for i in range(n))
    return math.sqrt(float(total))


def _all_layouts(pstate: ParallelState, grids: list[dict]) -> dict:
    out = {}
    for grid in grids:
        world = pstate.layout.world_size
        mine = ParallelState.build(Layout.from_world(world, pp=1, **grid), "cpu")
        tag = "tp{tp}.cp{cp}.ep{ep}.etp{etp}".format(**grid)
        out.update({f"{tag}.{name}": _run(mine, run, poison=False) for name, run in RUNS.items()})
        out[f"{tag}.inf"] = _run(mine, RUNS["z1"], poison=True)
    return out


def _check_world(world: int, grids: list[dict]) -> None:
    results = spawn(_all_layouts, world, grids, tp=grids[0]["tp"], cp=grids[0]["cp"])
    for grid in grids:
        layout = Layout.from_world(world, pp=1, **grid)
        assert layout.expert.edp != layout.dp * layout.cp, "choose a grid where the two groups differ"
        tag = "tp{tp}.cp{cp}.ep{ep}.etp{etp}".format(**grid)
        for name, run in RUNS.items():
            sharded = run["stage"] >= 1
            for rank, res in enumerate(results):
                got = res[f"{tag}.{name}"]
                assert got["norm"] == expected_norm(layout) and not got["skipped"], (tag, name, rank, got)
                assert got["changed"] == [], (tag, name, rank, got["changed"])
            for pname, (shape, expert, _) in PARAMS.items():
                shards = (layout.expert.edp if expert else layout.dp * layout.cp) if sharded else 1
                seen = sum(res[f"{tag}.{name}"]["covered"].get(pname, 0) for res in results)
                copies = 1 if pname == "head" else BLOCKS
                assert seen == copies * math.prod(shape) * world // shards, (tag, name, pname, seen)
        assert all(res[f"{tag}.inf"]["skipped"] for res in results), tag


@pytest.mark.parametrize("world, grids", [
    (4, [dict(tp=1, cp=1, ep=2, etp=1), dict(tp=1, cp=1, ep=4, etp=1)]),  # dp 4: edp 2, then edp 1
    (8, [dict(tp=2, cp=2, ep=2, etp=2), dict(tp=2, cp=2, ep=4, etp=1)]),  # dp 2 cp 2: edp 2 (etp = tp, etp 1)
], ids=["world4", "world8_tp2_cp2"])
def test_expert_grads_reduce_over_edp_and_count_once_in_norm(world: int, grids: list[dict]) -> None:
    _check_world(world, grids)
