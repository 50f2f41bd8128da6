"""The planner's mixture-of-experts share of a pipeline stage: expert state, dispatched activations, buffers.

Expert state per rank (``ExpertStage.state``). Each chunk's expert weights (``experts.py``: E / ep experts
per rank, F split over etp) fill a buffer of their own, cut into buckets by the buffers' rule
(``data_parallel/bucketing.py``) and padded to a multiple of edp x 16 elements once ZeRO shards it. They
follow the dense arithmetic (``params.py``, ``grads.py``, ``zero3.py``) with edp = world / (etp x ep x pp)
in place of dp x cp: ZeRO 1 shards their optimizer state over edp, ZeRO 2 their gradients too, ZeRO 3
their parameters (gathered with their block's unit); offload moves their shards as the dense ones. The
stage's model state is the dense figure plus this one: at ZeRO 3 the sum of two high-water marks,
an upper bound when they fall at different moments. MoE MTP blocks (an MoE last layer) put their experts
in the last stage's last chunk, after its own layers' (``held_layer_ranges``).

Activations an MoE layer keeps per micro-batch, beyond the dense block minus its MLP (measured with
saved-tensor hooks on ``moe/layer.py``). Legend: T tokens this rank routes (s b / cp, / tp under SP),
k, E, H, F' = F / etp, e bytes per activation element, A assignments that leave the rank, N rows
this rank's experts compute:

    expert input       etp N H e       (rows sorted by expert, gathered over etp; the grouped GEMMs keep them)
    expert FFN         etp N F' (4 llama | 2 gpt2) e   (as the dense MLP: fc1, gate, silu, product)
    combine            A H e + A H 4   (expert outputs back home; their fp32 product with the weights)
    router             T E 4 (fp32 logits); in bf16/fp16 the fp32 copy of its input T H 4, while the block's
                       MLP-input term is kept only by a shared expert
    indices            A (3 x 8 + 3 x 4) + N 16 (ep or etp > 1: the sort) + N 16 (gpt2: the bias rows)
    shared expert      the dense MLP's term at width F_s (--moe-shared-expert-intermediate-size)

Dropless routing (the default) has no bound on N: the figures ASSUME balanced tokens, N = A = k T (a
skewed router may send a rank up to ep x k T rows). With --moe-expert-capacity-factor cf each expert
takes at most cap = ceil(cf k T / E) assignments of each source rank, so N <= E cap and A <= min(k T,
E cap): an exact bound (equal with --moe-pad-expert-input-to-capacity). Full recompute keeps only the
block's input (the MoE terms go) and rebuilds one layer at a time (a transient); selective recompute
re-runs only the attention core, so the MoE terms stay.

Buffers while one MoE layer runs (a transient, an estimate, not a replay): the all-to-all's send and
receive rows and the receiver's sorted copy, (A + 2 N) H e; the all-gather dispatcher's gathered tokens
and the fp32 sum it reduce-scatters, ep T H (e + 4).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..config import Config, Placement
from ..dtypes import DTYPE_NAMES
from ..pipeline.partition import chunk_layer_ranges
from ..run_plan import RunPlan
from .activations import ActivationSpec
from .experts import expert_numels, moe_layer_count
from .grads import grad_bytes, unit_buckets
from .params import model_state_bytes
from .zero3 import PeakState, zero3_bytes

GIB = 2**30


@dataclass(frozen=True)
class ExpertStage:
    """The MoE share of one pipeline stage per rank (all 0 for a dense model)."""

    moe_layers: int = 0  # MoE layers on this stage
    params_on_rank: int = 0  # expert weights this rank holds (E / ep experts, F / etp)
    params_bytes: float = 0.0  # expert weights, gradients and optimizer state at the model state's peak
    grads_bytes: float = 0.0
    optimizer_bytes: float = 0.0  # before offload (``plan.py`` moves offloaded state off the device, experts' too)
    persistent_bytes: float = 0.0  # the expert buffers and optimizer state between steps
    shards: list[int] = field(default_factory=list)  # optimizer-state elements of each expert bucket
    layer_bytes: float = 0.0  # what one MoE layer keeps per micro-batch beyond the dense MLP it replaces
    activations_bytes: float = 0.0  # at the stage's peak (every in-flight micro-batch)
    transient_bytes: float = 0.0  # one MoE layer's dispatch buffers (+ its rebuilt activations, full recompute)
    rows: int = 0  # N: rows this rank's experts compute per MoE layer and micro-batch
    assignments: int = 0  # A: (token, expert) pairs that leave the rank


def routed_tokens(run: RunPlan, a: ActivationSpec) -> int:
    """T: tokens one rank routes per micro-batch (its own: s / cp, split over tp under sequence parallelism)."""
    return a.tokens * a.micro_batch_size // a.shard


def dispatched_rows(cfg: Config, tokens: int) -> tuple[int, int]:
    """(A, N): assignments leaving a rank, rows its experts compute; balanced when dropless (module docstring)."""
    m = cfg.model
    assert m.num_experts is not None, "dispatched rows need --num-experts"
    k, factor = m.moe_router_topk, m.moe_expert_capacity_factor
    if factor is None:
        return tokens * k, tokens * k
    bound = m.num_experts * math.ceil(factor * tokens * k / m.num_experts)
    return (bound if m.moe_pad_expert_input_to_capacity else min(tokens * k, bound)), bound


def moe_layer_terms(cfg: Config, run: RunPlan, a: ActivationSpec) -> dict[str, int]:
    """Bytes one MoE layer keeps for backward per micro-batch (module docstring), minus the dense MLP term."""
    m, e = cfg.model, a.dtype_bytes
    assert m.num_experts is not None, "MoE terms need --num-experts"
    tokens = routed_tokens(run, a)
    sent, rows = dispatched_rows(cfg, tokens)
    h, etp, mats = m.hidden_size, run.etp, (4 if m.arch == "llama" else 2)
    full_tokens = a.tokens * a.micro_batch_size
    shared = m.moe_shared_expert_intermediate_size or 0
    terms = {"expert_input": etp * rows * h * e, "expert_ffn": etp * rows * (m.moe_ffn_size // etp) * mats * e,
             "combine": sent * h * (e + 4), "router": tokens * m.num_experts * 4,
             "indices": sent * 36 + rows * 16 * (etp if run.ep > 1 or etp > 1 else 0)
             + (etp * rows * 16 if m.arch == "gpt2" else 0),
             "shared_expert": mats * full_tokens * shared * e // run.tp,
             "dense_mlp": -mats * full_tokens * m.ffn_size * e // run.tp}
    if e != 4:  # the router's fp32 copy of its input; without a shared expert nothing keeps the input itself
        terms["router"] += tokens * h * 4 - (0 if shared else tokens * h * e)
    return terms


def dispatch_buffer_bytes(cfg: Config, run: RunPlan, a: ActivationSpec) -> int:
    """Working set of one MoE layer's dispatch while it runs (module docstring)."""
    tokens, h, e = routed_tokens(run, a), cfg.model.hidden_size, a.dtype_bytes
    if cfg.parallel.moe_token_dispatcher_type == "allgather":
        return run.ep * tokens * h * (e + 4)
    sent, rows = dispatched_rows(cfg, tokens)
    return (sent + 2 * rows) * h * e


def _kept_moe_layers(cfg: Config, layers: range, recompute: str) -> int:
    """MoE layers of a chunk that keep their activations: all, or under full recompute the ones past the
    first --recompute-num-layers (none when every block is checkpointed)."""
    if recompute != "full":
        return moe_layer_count(cfg.model, layers)
    checkpointed = cfg.training.recompute_num_layers
    return 0 if checkpointed is None else moe_layer_count(cfg.model, layers[checkpointed:])


def _expert_buckets(cfg: Config, run: RunPlan, chunks: list[range]) -> list[list[tuple[int, int]]]:
    """(unit, padded size) of each chunk's expert buckets in backward order (ZeRO 3: a block's unit)."""
    layers_per_unit = (run.gathering.layers_per_unit if run.gathering else 1)
    shards = run.layout.expert.edp if run.zero.shards_optimizer_state else 1
    out = []
    for layers in chunks:
        numels: list[int] = []
        units: list[int] = []
        for i, layer in enumerate(layers):
            if cfg.model.is_moe_layer(layer):
                mine = expert_numels(cfg.model, run.ep, run.etp)
                numels += mine
                units += [1 + i // layers_per_unit if run.zero.shards_parameters else 0] * len(mine)
        out.append(unit_buckets(numels, units, cfg.parallel.bucket_size, shards, False) if numels else [])
    return out


def held_layer_ranges(cfg: Config, run: RunPlan, stage: int) -> list[range]:
    """The global layer ids whose weights each chunk of ``stage`` holds: the last stage's last chunk also holds
    the MTP blocks (ids num_layers .. num_layers + D - 1, after its own blocks, as ``blocks_of`` finds them)."""
    chunks = list(chunk_layer_ranges(cfg.model.num_layers, run.pp, run.virtual_stages)[stage])
    if stage == run.pp - 1:
        chunks[-1] = range(chunks[-1].start, chunks[-1].stop + cfg.model.mtp_depth)
    return chunks


def _expert_state(cfg: Config, run: RunPlan, buckets: list[list[tuple[int, int]]], in_flight: int,
                  bytes_per_param: tuple[int, int, int]) -> PeakState:
    """Expert params, grads and optimizer bytes at their high-water mark (the dense rules over edp)."""
    w, g, k = bytes_per_param
    edp, n = run.layout.expert.edp, sum(size for c in buckets for _, size in c)
    if run.zero.shards_parameters:
        gathering = run.gathering
        assert gathering is not None, "ZeRO 3 gathers units"
        if run.placement.parameters is Placement.DISK:  # a prefetch only starts the read (plan.py)
            gathering = replace(gathering, prefetch=0)
        return zero3_bytes([c for c in buckets if c], edp, w, g, k, gathering, pinned=in_flight > 1)
    state = model_state_bytes(n, edp, run.zero, DTYPE_NAMES[run.compute_dtype], DTYPE_NAMES[run.main_grads_dtype])
    keeps_full = run.grad_reduction.keeps_full_grads and run.micro_batches > 1
    cut = [] if not run.zero.shards_gradients or keeps_full else [[size for _, size in c] for c in buckets]
    grads = grad_bytes(n, cut, edp, run.zero, run.micro_batches, g, run.grad_reduction)
    return PeakState(params=state.params, grads=grads.peak, optimizer=state.optimizer,
                     persistent=state.params + grads.persistent + state.optimizer, params_peak=state.params)


def expert_stage(cfg: Config, run: RunPlan, a: ActivationSpec, stage: int, in_flight: int,
                 bytes_per_param: tuple[int, int, int]) -> ExpertStage:
    """The MoE share of pipeline stage ``stage`` (``in_flight`` chunk-forwards held at its peak)."""
    if cfg.model.num_experts is None:
        return ExpertStage()
    chunks = chunk_layer_ranges(cfg.model.num_layers, run.pp, run.virtual_stages)[stage]  # activations: mtp_plan
    held = held_layer_ranges(cfg, run, stage)
    moe_layers = sum(moe_layer_count(cfg.model, layers) for layers in held)
    if moe_layers == 0:
        return ExpertStage()
    buckets = _expert_buckets(cfg, run, held)
    state = _expert_state(cfg, run, buckets, in_flight, bytes_per_param)
    shards = run.layout.expert.edp if run.zero.shards_optimizer_state else 1
    per_layer = sum(moe_layer_terms(cfg, run, a).values())
    kept = max(_kept_moe_layers(cfg, layers, a.recompute) for layers in chunks)  # the fullest chunk (a bound)
    rebuilt = per_layer if a.recompute == "full" else 0  # full recompute rebuilds one layer at a time
    sent, rows = dispatched_rows(cfg, routed_tokens(run, a))
    weights = moe_layers * sum(expert_numels(cfg.model, run.ep, run.etp))
    return ExpertStage(moe_layers=moe_layers, params_on_rank=weights,
                       params_bytes=state.params, grads_bytes=state.grads, optimizer_bytes=state.optimizer,
                       persistent_bytes=state.persistent, shards=[size // shards for c in buckets for _, size in c],
                       layer_bytes=per_layer, activations_bytes=in_flight * kept * per_layer,
                       transient_bytes=dispatch_buffer_bytes(cfg, run, a) + rebuilt, rows=rows, assignments=sent)


def add_experts(dense: PeakState, experts: ExpertStage) -> PeakState:
    """The stage's model state: the dense peak plus the experts' (an upper bound at ZeRO 3: module docstring)."""
    return PeakState(params=dense.params + experts.params_bytes, grads=dense.grads + experts.grads_bytes,
                     optimizer=dense.optimizer + experts.optimizer_bytes,
                     persistent=dense.persistent + experts.persistent_bytes,
                     params_peak=dense.params_peak + experts.params_bytes)


def expert_words(run: RunPlan) -> str:
    """' ep=2 etp=1 edp=2' where the expert grid is not the dense one (ep > 1 or etp != tp), else ''."""
    return f" ep={run.ep} etp={run.etp} edp={run.layout.expert.edp}" if run.ep > 1 or run.etp != run.tp else ""


def moe_lines(cfg: Config, run: RunPlan, moe: ExpertStage) -> list[str]:
    """What the plan's MoE figures are and what they assume (nothing for a dense model)."""
    m = cfg.model
    if m.num_experts is None:
        return []
    k, e = m.moe_router_topk, m.num_experts
    rebuilt = " + a rebuilt layer" if cfg.training.recompute == "full" else ""
    routing = (f"capacity factor {m.moe_expert_capacity_factor:g}: an exact bound, each rank's experts compute at "
               f"most E x ceil(cf x k x T / E) = {moe.rows:,} rows" if m.moe_expert_capacity_factor is not None else
               f"dropless: ASSUMES balanced tokens, each rank's experts compute k x T = {moe.rows:,} rows (a skewed "
               f"router can send a rank up to ep x k x T)")
    return [f"experts: {e} per MoE layer, top-{k}; ep={run.ep} ({e // run.ep} experts per rank), etp={run.etp}, "
            f"edp={run.layout.expert.edp} (expert state sharded over edp from ZeRO 1); peak stage: {moe.moe_layers} "
            f"MoE layers, {moe.params_on_rank:,} expert weights per rank: params {moe.params_bytes / GIB:.2f}, "
            f"grads {moe.grads_bytes / GIB:.2f}, optim {moe.optimizer_bytes / GIB:.2f} GiB (in the table)",
            f"MoE activations: {moe.layer_bytes / GIB:.3f} GiB per MoE layer and micro-batch beyond the dense MLP "
            f"(rows of H {m.hidden_size} and F/etp {m.moe_ffn_size // run.etp}; {moe.activations_bytes / GIB:.2f} "
            f"GiB at the peak), transient {moe.transient_bytes / GIB:.3f} GiB (dispatch buffers{rebuilt}); {routing}"]


def expert_layouts(cfg: Config, tp: int, stage_ranks: int) -> list[tuple[int, int | None]]:
    """The (ep, etp) pairs the layout search tries on a stage of ``stage_ranks`` ranks: (1, None) for a dense
    model; else etp 1 or tp (where the expert width splits) with every ep that divides E and the stage / etp."""
    m = cfg.model
    if m.num_experts is None:
        return [(1, None)]
    pairs: list[tuple[int, int | None]] = []
    for etp in sorted({1, tp}):
        if m.moe_ffn_size % etp == 0 and stage_ranks % etp == 0:
            room = stage_ranks // etp
            pairs += [(ep, etp) for ep in range(1, room + 1) if room % ep == 0 and m.num_experts % ep == 0]
    return pairs


def dispatch_seconds(cfg: Config, run: RunPlan, a: ActivationSpec, moe_layers: int, bandwidth: float) -> float:
    """One micro-batch's token exchange on a stage of ``moe_layers`` MoE layers: 4 all-to-alls per layer
    (dispatch and combine, forward and backward; 6 with full recompute) of the (ep - 1) / ep of A H e bytes
    that leave the rank; the all-gather dispatcher gathers and reduce-scatters (ep - 1) T H e each way."""
    if run.ep == 1 or moe_layers == 0:
        return 0.0
    exchanges = 6 if a.recompute == "full" else 4
    tokens = routed_tokens(run, a)
    sent, _ = dispatched_rows(cfg, tokens)
    gathered = cfg.parallel.moe_token_dispatcher_type == "allgather"
    rows = (run.ep - 1) * tokens if gathered else sent * (run.ep - 1) / run.ep
    return moe_layers * exchanges * rows * cfg.model.hidden_size * a.dtype_bytes / bandwidth
