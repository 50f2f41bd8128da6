"""Mixture-of-experts gradient sync, exactly (issue 33, "Groups"): dense gradients reduce over dp x cp, expert
gradients over their expert-data-parallel group, both with the net factor 1 / (dp x cp); the grad norm counts
every expert shard once; ZeRO 1-3 (both reshard modes, host and disk offload, overlapped gathers) gather expert
parameters back over that group.

Every rank sets element i of every gradient to (i + 1) x 2^rank (a linear loss), so each reduced value is
(i + 1) x (a sum of distinct powers of two) / (dp x cp): exact in fp32, as are the squares the fp64 norm adds.
The expected gradients and norm are computed here by hand from the rank arithmetic (Megatron's orders:
rank = tp + tp(cp + cp(dp + dp pp)) for the dense grid, etp + etp(ep + ep(edp + edp pp)) for the expert grid)
and compared with no tolerance. Each world builds layouts in which edp differs from dp x cp (edp 1 included:
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
from megazero.optimizer.scaler import DynamicLossScaler
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


def engine_runs(folder: str) -> dict[str, dict]:
    """The engine settings each layout runs (``folder``: the disk tier's --offload-path)."""
    return {"z0": dict(stage=0), "z1": dict(stage=1), "z1.overlap": dict(stage=1, overlap_param_gather=True),
            "z2": dict(stage=2), "z2.every": dict(stage=2, grad_reduction=GradReduction.EVERY_MICRO_BATCH),
            "z3": dict(stage=3, gathering=UnitGathering(reshard_after_forward=True)),
            "z3.keep": dict(stage=3, gathering=UnitGathering(reshard_after_forward=False)),
            "z3.host": dict(stage=3, placement=StatePlacement(optimizer_state=Placement.HOST,
                                                              parameters=Placement.HOST)),
            "z3.disk": dict(stage=3, placement=StatePlacement(optimizer_state=Placement.DISK, parameters=Placement.DISK,
                                                              offload_path=folder))}


def _param(name: str, value: float) -> nn.Parameter:
    shape, expert, split = PARAMS[name]
    data = value + torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    p = set_spec(nn.Parameter(data), split_dim=0 if split else None, expert=expert)
    p.toy_name = name  # which PARAMS entry: what _check_shards expects of it
    return p


class ToyBlock(TransformerBlock):
    """A block only by type (ZeRO 3 gathers each block as a unit): one dense and (``expert_id`` given) two
    expert parameters."""

    def __init__(self, expert_id: float | None) -> None:
        nn.Module.__init__(self)  # none of a real block's layers
        self.zero3_unit = None
        self.dense = _param("dense", 0.0)
        self.experts = nn.ParameterList([] if expert_id is None else
                                        [_param("expert_w", expert_id), _param("expert_b", expert_id)])

    def forward(self, h: torch.Tensor, scale: float) -> torch.Tensor:
        return h + sum(_linear(p, scale) for p in (self.dense, *self.experts))


def has_experts(pp_rank: int, pp: int) -> bool:
    """Of two pipeline stages the first is dense (as DeepSeek's first layers): every rank must still agree on
    the norm's sums."""
    return pp == 1 or pp_rank > 0


class ToyChunk(nn.Module):
    """A tp-split dense head outside the blocks (ZeRO 3's root unit) and ``BLOCKS`` blocks. Parameter values
    name the shard they are: the dense ones by tp rank, the expert ones by (etp, ep) rank."""

    def __init__(self, pstate: ParallelState) -> None:
        super().__init__()
        self.head = _param("head", 1000.0 * pstate.tp_rank)
        expert_id = 1000.0 * (1 + pstate.etp_rank + pstate.etp * pstate.ep_rank)
        experts = has_experts(pstate.pp_rank, pstate.pp)
        self.blocks = nn.ModuleList([ToyBlock(expert_id if experts else None) for _ in range(BLOCKS)])

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


def _run(pstate: ParallelState, settings: dict, poison: bool = False, fp16: bool = False) -> dict:
    """One step of a fresh chunk: the reduced shard of every parameter checked, the norm and the parameters
    (gathered back) returned. ``poison``: the last rank's first expert gradient is inf; ``fp16``: fp16 weights
    under a dynamic loss scale of 4."""
    model = ToyChunk(pstate).to(torch.float16 if fp16 else torch.float32)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    scaler = DynamicLossScaler(4.0) if fp16 else None
    if scaler is not None:
        scaler.attach([model])
    engine = GradSyncEngine([model], pstate, EngineSettings(bucket_size=8, **settings))
    opt = DistributedOptimizer(engine, OptimizerConfig(lr=0.0, clip_grad=0.0), scaler)
    try:
        opt.zero_grad()
        scale = float(2 ** pstate.rank)
        if poison and pstate.rank == pstate.layout.world_size - 1:
            model.blocks[0].experts[0].register_hook(lambda g: g.index_fill(1, torch.tensor([0]), float("inf")))
        model(scale).backward()
        result = opt.step(lr=0.0)
        covered = _check_shards(pstate, engine) if not poison else {}
        with torch.no_grad():  # overlapped gathers: each block waits for its buckets; ZeRO 3: gathers, frees
            model(scale)
        gathered = opt.host_copies(keep=True)
        names = {p: name for name, p in model.named_parameters()}
        changed = sorted(names[p] for p, v in gathered.items() if not torch.equal(v, initial[names[p]]))
        return {"norm": result.grad_norm, "skipped": result.skipped, "covered": covered, "changed": changed,
                "loss_scale": result.loss_scale}
    finally:
        opt.close()


def _check_shards(pstate: ParallelState, engine: GradSyncEngine) -> dict[str, int]:
    """Assert that each piece of a reduced grad shard is its expected value; returns elements seen per name."""
    covered: dict[str, int] = {}
    for buf, shards in zip(engine.buffers, engine.grad_shards()):
        for b, shard in zip(buf.buckets, shards):
            for seg in b.segments:
                name = seg.param.toy_name
                total = _group_sum(pstate.layout, pstate.rank, PARAMS[name][1])
                want = (torch.arange(seg.param_lo, seg.param_lo + seg.hi - seg.lo, dtype=torch.float32) + 1) * total
                got = shard[seg.lo:seg.hi]
                assert torch.equal(got, want / pstate.dp_cp), (name, pstate.rank, got, want)
                covered[name] = covered.get(name, 0) + seg.hi - seg.lo
    return covered


def _group_sum(layout: Layout, rank: int, expert: bool) -> int:
    """sum of 2^q over the ranks q that reduce ``rank``'s copy: in its pipeline stage, its dp x cp group (the
    same tp rank: the same q mod tp) or its expert-data-parallel group (the same q mod etp x ep)."""
    period, stage = (layout.expert_tp * layout.ep if expert else layout.tp), layout.world_size // layout.pp
    return sum(2 ** q for q in range(layout.world_size) if q % period == rank % period and q // stage == rank // stage)


def expected_norm(layout: Layout) -> float:
    """The global grad norm from the distinct pieces of each stage: a split copy per tp (etp x ep) rank, an
    unsplit one per tp group (ep rank), each counted once, whatever replicas or shards hold it."""
    total, stage = Fraction(0), layout.world_size // layout.pp
    for name, (shape, expert, split) in PARAMS.items():
        tps = range(layout.expert_tp if expert else layout.tp) if split else [0]
        in_stage = [t + layout.expert_tp * r for r in range(layout.ep) for t in tps] if expert else list(tps)
        for s in range(layout.pp) if not expert else [s for s in range(layout.pp) if has_experts(s, layout.pp)]:
            for owner in in_stage:
                value = Fraction(_group_sum(layout, s * stage + owner, expert), layout.dp * layout.cp)
                total += _copies(name) * sum((value * (i + 1)) ** 2 for i in range(math.prod(shape)))
    return math.sqrt(float(total))


def _copies(name: str) -> int:
    return 1 if name == "head" else BLOCKS


def _tag(grid: dict) -> str:
    return "tp{tp}.cp{cp}.pp{pp}.ep{ep}.etp{etp}".format(**grid)


def _all_layouts(pstate: ParallelState, grids: list[dict], folder: str) -> dict:
    out, runs = {}, engine_runs(folder)
    for grid in grids:
        mine = ParallelState.build(Layout.from_world(pstate.layout.world_size, **grid), "cpu")
        out.update({f"{_tag(grid)}.{name}": _run(mine, run) for name, run in runs.items()})
        out[f"{_tag(grid)}.inf"] = _run(mine, runs["z1"], poison=True)
        out[f"{_tag(grid)}.fp16.inf"] = _run(mine, runs["z0"], poison=True, fp16=True)
    return out


def _check_world(world: int, grids: list[dict], folder: str) -> None:
    results = spawn(_all_layouts, world, grids, folder)
    for grid in grids:
        layout, tag = Layout.from_world(world, **grid), _tag(grid)
        assert layout.expert.edp != layout.dp * layout.cp, "choose a grid where the two groups differ"
        for name, run in engine_runs(folder).items():
            for rank, res in enumerate(results):
                got = res[f"{tag}.{name}"]
                assert got["norm"] == expected_norm(layout) and not got["skipped"], (tag, name, rank, got)
                assert got["changed"] == [], (tag, name, rank, got["changed"])
            for pname, (shape, expert, _) in PARAMS.items():  # every element of every shard was checked
                holders = world // layout.pp * sum(has_experts(s, layout.pp) for s in range(layout.pp)) \
                    if expert else world
                shards = (layout.expert.edp if expert else layout.dp * layout.cp) if run["stage"] >= 1 else 1
                seen = sum(res[f"{tag}.{name}"]["covered"].get(pname, 0) for res in results)
                assert seen == _copies(pname) * math.prod(shape) * holders // shards, (tag, name, pname, seen)
        assert all(res[f"{tag}.inf"]["skipped"] for res in results), tag
        # fp16: one rank's inf expert gradient skips the step and halves the loss scale on every rank
        assert all(res[f"{tag}.fp16.inf"]["skipped"] and res[f"{tag}.fp16.inf"]["loss_scale"] == 2.0
                   for res in results), (tag, [res[f"{tag}.fp16.inf"] for res in results])


@pytest.mark.parametrize("world, grids", [
    # dp 4: edp 2, then edp 1; pp 2 x dp 2 with a dense first stage: edp 1
    (4, [dict(tp=1, cp=1, pp=1, ep=2, etp=1), dict(tp=1, cp=1, pp=1, ep=4, etp=1),
         dict(tp=1, cp=1, pp=2, ep=2, etp=1)]),
    (8, [dict(tp=2, cp=2, pp=1, ep=2, etp=2), dict(tp=2, cp=2, pp=1, ep=4, etp=1)]),  # dp 2 cp 2: edp 2
], ids=["world4", "world8_tp2_cp2"])
def test_expert_grads_reduce_over_edp_and_count_once_in_norm(world: int, grids: list[dict], tmp_path) -> None:
    _check_world(world, grids, str(tmp_path))
