"""The bytes Muon's owner-only gathers and scatters send per step, per rank, from the config alone:
docs/optimizers.md's traffic formula.

``optimizer/muon_shards.py`` counts what it sends at its point-to-point ops (``ShardedMuon.step_bytes``, the
ledger's ``send.muon``); this module predicts the same number before any process starts, for ``--dry-run`` and
``tools/plan_memory.py``. Per holder set of a rank (its stage's dense weights; in a MoE model its expert-parallel
rank's experts), with R the reduction group's ranks (dp x cp; edp), tp its TP group's (tp; etp) and S the ranks
a bucket is sharded over (R at ZeRO >= 1, else 1): each matrix's direction elements go from the rank holding
them to the matrix's owner, and the owner's NS output elements back to every rank holding them
(``optimizer/muon_routes.py``), so a rank sends, in fp32 elements,

    (its shard's Muon elements of matrices others own) + (its owned matrices' elements other ranks hold)

which at ZeRO >= 1 and tp 1 is about 2 (R - 1) / R of its shard's Muon elements. The owners are
``muon_shards.assign_owners`` over the set's matrices, numbered as the optimizer numbers them (bucket by bucket
in buffer order, weight by weight, ``muon.matrices_of`` within a weight); the buckets are
``data_parallel.bucketing.cut_buckets``' on the planner's parameter counts (``params.chunk_param_numels``,
``experts.expert_numels``), a parameter's offset the sum of the bucket's earlier ones (the buffer's layout), so
the prediction is the real cut; which parameters are Muon's is read from blocks built on the meta device.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ..config import Config, ModelConfig
from ..data_parallel.bucketing import cut_buckets
from ..model.transformer import TPContext, TransformerBlock
from ..optimizer.muon import Matrix, matrices_of, matrix_shape, ns_cost, takes_muon
from ..optimizer.muon_routes import Routes, WeightGeometry, gather_routes, scatter_routes
from ..optimizer.muon_shards import assign_owners
from ..run_plan import RunPlan
from ..tensor_parallel.layers import spec_of
from .experts import expert_numels
from .moe_plan import held_layer_ranges
from .params import (block_param_numels, chunk_param_numels, chunk_param_units, embedding_shared_across_stages,
                     holds_word_embedding)

# one parameter's (full TP-joined shape, split dim, Muon matrices); None for an AdamW one
Geometry = tuple[tuple[int, ...], int | None, tuple[Matrix, ...]] | None


@lru_cache(maxsize=1024)
def block_geometry(cfg: ModelConfig, layer_id: int, experts: bool, ep: int = 1) -> tuple[Geometry, ...]:
    """Per dense (``experts``: routed-expert) parameter of block ``layer_id``, in registration order, its
    geometry (an expert weight's: one expert-parallel rank's E / ``ep`` experts)."""
    with torch.device("meta"):
        block = TransformerBlock(cfg, TPContext(), layer_id=layer_id)
    out: list[Geometry] = []
    for name, p in block.named_parameters():
        if spec_of(p).expert != experts:
            continue
        shape = (p.shape[0] // ep, *p.shape[1:]) if experts else tuple(p.shape)
        out.append((shape, spec_of(p).split_dim, tuple(matrices_of(name, shape, cfg))) if takes_muon(name, p)
                   else None)
    return tuple(out)


def _chunk_dense(cfg: ModelConfig, tp: int, blocks: int, pre: bool, post: bool, first: int) -> list[Geometry]:
    """Each dense parameter's geometry, parallel to ``chunk_param_numels`` (embeddings, head, norms: None)."""
    shapes: list[Geometry] = []
    if holds_word_embedding(cfg, pre, post):
        shapes += [None] * (2 if pre and cfg.arch == "gpt2" else 1)
    for layer in range(first, first + blocks):
        here = block_geometry(cfg, layer, False)
        assert len(here) == len(block_param_numels(cfg, tp, layer)), "the planner's block differs from the model's"
        shapes += here
    if post:
        shapes += [None] * ((2 if cfg.arch == "gpt2" else 1) + (0 if cfg.tied_embeddings else 1)) + _mtp_dense(cfg)
    return shapes


def _mtp_dense(cfg: ModelConfig) -> list[Geometry]:
    """The MTP modules' geometries, parallel to ``params.mtp_param_numels`` (eh_proj: a replicated Muon matrix)."""
    shape = (cfg.hidden_size, 2 * cfg.hidden_size)
    return [g for k in range(cfg.mtp_depth) for g in
            [None, None, (shape, None, tuple(matrices_of(f"mtp.{k}.eh_proj.weight", shape, cfg))),
             *block_geometry(cfg, cfg.num_layers + k, False), None]]


Buckets = list[tuple[int, list[tuple[int, Geometry]]]]  # (padded numel, its parameters' (numel, geometry))


def _set_sent(buckets: Buckets, shards: int, tp: int, reduction: int) -> list[int]:
    """The formula for one holder set: the fp32 elements each of its ``reduction`` x ``tp`` ranks sends."""
    ranks = reduction * tp
    shapes: list[tuple[int, int]] = []
    placed: list[tuple[list[WeightGeometry], int]] = []
    for n, params in buckets:
        weights, offset = [], 0
        for numel, geometry in params:
            if geometry is not None:
                full, dim, matrices = geometry
                weights.append(WeightGeometry(offset, full, dim, matrices, len(shapes)))
                shapes += [matrix_shape(full, m) for m in matrices]
            offset += numel
        if weights:
            placed.append((weights, n))
    out = [0] * ranks
    if not shapes:
        return out
    owners = assign_owners([ns_cost(s) for s in shapes], ranks)
    for weights, n in placed:
        for routes in (gather_routes(weights, n, owners, reduction, tp, shards),
                       scatter_routes(weights, n, owners, reduction, tp, shards)):
            _add_sent(out, routes)
    return out


def _add_sent(out: list[int], routes: Routes) -> None:
    for (src, dst), pieces in routes.items():
        if src != dst:
            out[src] += sum(hi - lo for *_, lo, hi in pieces)


def _dense_buckets(cfg: Config, run: RunPlan, stage: int) -> Buckets:
    m, sharded = cfg.model, run.zero.shards_optimizer_state
    shards = run.dp * run.cp if sharded else 1
    blocks = m.num_layers // (run.pp * run.virtual_stages)
    tied = embedding_shared_across_stages(m, run.pp)
    out = []
    for c in range(run.virtual_stages):
        pre, post, first = c == 0 and stage == 0, c == run.virtual_stages - 1 and stage == run.pp - 1, \
            (c * run.pp + stage) * blocks
        numels = chunk_param_numels(m, run.tp, blocks, pre, post, first)
        shapes = list(zip(numels, _chunk_dense(m, run.tp, blocks, pre, post, first)))
        units = chunk_param_units(m, blocks, pre, post, run.gathering.layers_per_unit, first) \
            if run.zero.shards_parameters and run.gathering else [0] * len(numels)
        flags = [tied and (pre or post) and i == len(numels) - 1 for i in range(len(numels))]
        rev = shapes[::-1]
        out += [(cut.numel, rev[cut.start:cut.stop])
                for cut in cut_buckets(numels[::-1], cfg.parallel.bucket_size, shards, tied=flags, units=units[::-1])]
    return out


def _expert_buckets(cfg: Config, run: RunPlan, stage: int) -> Buckets:
    m = cfg.model
    if m.num_experts is None:
        return []
    edp = run.layout.expert.edp
    shards = edp if run.zero.shards_optimizer_state else 1
    out = []
    for layers in held_layer_ranges(cfg, run, stage):  # the last stage's MTP blocks too
        numels: list[int] = []
        shapes: list[tuple[int, Geometry]] = []
        units: list[int] = []
        for i, layer in enumerate(layers):
            if m.is_moe_layer(layer):
                mine = expert_numels(m, run.ep, run.etp)
                numels += mine
                shapes += list(zip(mine, block_geometry(m, layer, True, run.ep)))
                per_unit = run.gathering.layers_per_unit if run.gathering else 1
                units += [1 + i // per_unit if run.zero.shards_parameters else 0] * len(mine)
        rev = shapes[::-1]
        out += [(cut.numel, rev[cut.start:cut.stop])
                for cut in cut_buckets(numels[::-1], cfg.parallel.bucket_size, shards, units=units[::-1])]
    return out


def muon_step_bytes(cfg: Config, run: RunPlan, stage: int, rank: int | None = None) -> int:
    """Bytes global rank ``rank`` (of pipeline stage ``stage``) sends per step along Muon's routes; ``rank``
    None: the stage's busiest rank. 0 for AdamW."""
    if cfg.optimizer.optimizer != "muon":
        return 0
    sharded, layout = run.zero.shards_optimizer_state, run.layout
    dense = _set_sent(_dense_buckets(cfg, run, stage), run.dp * run.cp if sharded else 1, run.tp,
                      run.dp * run.cp)
    edp = layout.expert.edp
    experts = _set_sent(_expert_buckets(cfg, run, stage), edp if sharded else 1, run.etp, edp)

    def of(r: int) -> int:
        c, e = layout.coords(r), layout.expert.coords(r)
        return dense[(c.cp + layout.cp * c.dp) * run.tp + c.tp] + experts[e.edp * run.etp + e.etp]

    ranks = [rank] if rank is not None else [r for r in range(layout.world_size) if layout.coords(r).pp == stage]
    return 4 * max(of(r) for r in ranks)
