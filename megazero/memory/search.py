"""Search the layouts that fit a cluster, ranked by a simple step-time model.

Cost model (per optimizer step; every term is charged in full, no overlap, so
it ranks layouts rather than predicting wall time to the percent):

    FLOPs   training FLOPs per token, ``megazero.model.flops.flops_per_token`` (the
            trainer's MFU formula) with the padded vocabulary: 3 x forward, plus one
            more block forward (full recompute) or attention core (selective); under
            --reset-attention-mask the attention core scaled by the planned documents'
            attended share on the busiest ring rank (``documents.py``)
    t_mb    one micro-batch through one stage (s_l = s / cp tokens of a sample per rank) =
              FLOPs x b s / (pp tp cp) / (peak x efficiency)   (the balanced CP split)
            + TP: 4 collectives per block (6 with full recompute) of s_l b h e bytes,
              ring cost 2 (tp-1)/tp x bytes / intra-node bandwidth
            + CP, per block (``cp_seconds``), with kv = 2 s_l b g/t d e (this rank's K and V):
              p2p: (cp-1) K/V sends forward, (cp-1) K/V and (cp-1) fp32 dK/dV backward, the
              forward's again with recompute, each hop only the rows some rank ahead uses, under a
              document mask those of the planned documents (``documents.ring_hop_shares``);
              a2a: 4 all-to-alls forward and 4 backward of (cp-1)/cp of the local q, k, v, out
              (8 more with recompute); a2a+p2p: both, over
              U and cp/U ranks; intra-node bandwidth when tp x cp fits in a node
            + PP: 2 x s_l b h e / r bytes sent per stage boundary at inter-node bandwidth
            + EP (MoE, ``moe_plan.dispatch_seconds``): per MoE layer 4 all-to-alls (6 with full recompute) of
              the (ep-1)/ep of the k T rows of H that leave the rank (balanced routing assumed when
              dropless), intra-node when etp x ep fits in a node
    step    t_mb x (m + (pp - 1) / vp)                  (the 1F1B/interleaved bubble)
            + DP over the dp x cp ranks that share the weights (D = dp cp): zero 0 all-reduce
              2 (D-1)/D P g; zero 1/2 reduce-scatter (D-1)/D P g (m times with --reduce-every-micro-batch)
              + all-gather (D-1)/D P w; zero 3
              per micro-batch: reduce-scatter (D-1)/D P g + all-gathers (D-1)/D P w, twice with
              reshard-after-forward (forward, backward) (under pipelining kept units may be
              gathered once for several micro-batches: an upper bound); intra-node bandwidth when
              tp x cp x dp fits in a node. Expert weights (MoE): the same over their edp ranks, with P
              the expert weights per rank, intra-node when a stage's ranks fit in a node.
            + offload (``offload.py``; ASSUMED bandwidths, no overlap): host<->device copies,
              the CPU AdamW, the disk tier's reads and writes.

With ``offload=True`` a layout that does not fit on the device is tried again with
the optimizer state on the host or on disk (and under ZeRO 3 the parameter shards
too); the fastest variant whose device, host and disk bytes fit is listed, marked
``offload_only``. Host and disk budgets are per GPU. A layout or placement the run's optimizer refuses
(``--optimizer muon``: ``Config.refuse_unbuilt_muon``, called, not copied) is never listed.

Defaults describe an H100 SXM node: 989 TFLOP/s bf16 dense at 45% efficiency,
450 GB/s NVLink per direction, 50 GB/s (400 Gb/s InfiniBand) per GPU between nodes;
for offload a DGX H100's 2 TB of host memory over 8 GPUs (256 GiB each) and one 3.84 TB
NVMe drive per GPU, with the bandwidths of ``OffloadHardware``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import RECOMPUTE_MODES, Config, ConfigError, ModelConfig, Placement
from ..model.flops import flops_per_token
from ..run_plan import ZeroStage
from .activations import kv_heads_per_rank
from .documents import document_lines, planned_attended_share, ring_hop_shares
from .offload import OffloadHardware, describe
from .moe_plan import dispatch_seconds, expert_layouts
from .muon_plan import muon_lines
from .assumed import planned_device
from .plan import GIB, PLANNED_PATH, MemoryPlan, PlanSpec, offload_label, plan_memory

DEVICE, HOST, DISK = Placement.DEVICE, Placement.HOST, Placement.DISK
# (optimizer, params) placements a layout is retried with when it does not fit on the device; the
# parameter shards move only under ZeRO 3 (keyed by ``ZeroStage.shards_parameters``)
OFFLOAD_VARIANTS = {False: ((HOST, DEVICE), (DISK, DEVICE)),
                    True: ((HOST, DEVICE), (DISK, DEVICE), (HOST, HOST), (DISK, HOST), (DISK, DISK))}


@dataclass(frozen=True)
class Hardware:
    gpus: int
    gpu_memory_gib: float
    gpus_per_node: int = 8
    peak_flops: float = 989e12
    efficiency: float = 0.45
    intra_node_bandwidth: float = 450e9
    inter_node_bandwidth: float = 50e9
    headroom: float = 0.1  # fraction of GPU memory kept free: CUDA context, allocator fragmentation
    host_memory_gib: float = 256.0  # per GPU, for offload (DGX H100: 2 TB per node of 8)
    disk_gib: float = 3576.0  # per GPU, for offload to disk (one 3.84 TB NVMe drive)
    offload: OffloadHardware = field(default_factory=OffloadHardware)  # assumed offload bandwidths

    @property
    def usable_bytes(self) -> float:
        return self.gpu_memory_gib * GIB * (1 - self.headroom)

    def fits(self, plan: MemoryPlan) -> bool:
        """Every stage within the device budget, and the offloaded state within host and disk."""
        host = self.host_memory_gib * GIB * (1 - self.headroom)
        return all(s.total_bytes <= self.usable_bytes and s.host_bytes <= host and s.disk_bytes <= self.disk_gib * GIB
                   for s in plan.stages)


def cp_seconds(spec: PlanSpec, hw: Hardware) -> float:
    """Context-parallel exchange of one block for one micro-batch, forward and backward (module docstring)."""
    a, run, cfg = spec.activation_spec(), spec.run, spec.model
    if run.cp == 1:
        return 0.0
    replays = 1 if spec.cfg.training.recompute in ("selective", "full") else 0  # recompute replays the exchange
    s, b, e, d = a.tokens, a.micro_batch_size, a.dtype_bytes, cfg.head_dim
    kv_heads = kv_heads_per_rank(cfg, a)
    moved = 0.0  # bytes each rank sends
    ring, u = run.cp // a.cp_a2a, a.cp_a2a
    if u > 1:  # q, k, v, out (and their gradients), (U-1)/U of each leaves the rank
        local = s * b * (2 * cfg.num_attention_heads // run.tp + 2 * kv_heads) * d * e
        moved += (2 + replays) * (u - 1) / u * local
    if ring > 1:  # this rank's K/V (gathered to U s tokens of g'/U heads in the hybrid: the same bytes)
        kv = 2 * s * b * kv_heads * d * e
        hops, accumulators = ring_hop_shares(cfg.seq_length, ring, a.document_length)
        moved += hops * kv * (2 + replays) + accumulators * kv * 4 / e
    bw = hw.intra_node_bandwidth if run.tp * run.cp <= hw.gpus_per_node else hw.inter_node_bandwidth
    return moved / bw


def step_time(spec: PlanSpec, plan: MemoryPlan, hw: Hardware) -> float:
    """Estimated seconds per optimizer step (see the module docstring)."""
    cfg, a, run, t = spec.model, spec.activation_spec(), spec.run, spec.cfg.training
    share = planned_attended_share(cfg.seq_length, a.document_length, a.ring)  # None: no document mask
    flops = flops_per_token(cfg, t.recompute, t.recompute_num_layers, run.padded_vocab_size, attended_share=share)
    tokens_mb = run.micro_batch_size * cfg.seq_length
    compute = flops * tokens_mb / (run.pp * run.tp * run.cp) / (hw.peak_flops * hw.efficiency)
    act = run.micro_batch_size * a.tokens * cfg.hidden_size * a.dtype_bytes
    layers = cfg.num_layers // run.pp
    tp_comm = 0.0
    if run.tp > 1:
        per = 2 * (run.tp - 1) / run.tp * act / hw.intra_node_bandwidth
        tp_comm = layers * (6 if t.recompute == "full" else 4) * per
    pp_comm = 2 * act / a.shard / hw.inter_node_bandwidth if run.pp > 1 else 0.0
    moe_layers = max(s.experts.moe_layers for s in plan.stages)
    ep_bw = hw.intra_node_bandwidth if run.etp * run.ep <= hw.gpus_per_node else hw.inter_node_bandwidth
    t_mb = (compute + tp_comm + layers * cp_seconds(spec, hw) + pp_comm
            + dispatch_seconds(spec.cfg, run, a, moe_layers, ep_bw))
    pipeline = t_mb * (run.micro_batches + (run.pp - 1) / run.virtual_stages)
    dense = _sync_seconds(spec, max(s.params_on_rank for s in plan.stages), spec.shard_ranks,
                          run.tp * spec.shard_ranks, hw)  # dp x cp ranks hold the same dense weights
    experts = _sync_seconds(spec, max(s.experts.params_on_rank for s in plan.stages), run.layout.expert.edp,
                            run.world_size // run.pp, hw)
    return pipeline + dense + experts + plan.offload_seconds(hw.offload)


def _sync_seconds(spec: PlanSpec, params: int, shared: int, span: int, hw: Hardware) -> float:
    """Gradient reductions and parameter gathers of ``params`` weights per rank over the ``shared`` ranks holding
    them, ``span`` consecutive ranks apart at most (intra-node when they fit in a node; module docstring)."""
    run = spec.run
    w, g, _ = spec.bytes_per_param()
    bw = hw.intra_node_bandwidth if span <= hw.gpus_per_node else hw.inter_node_bandwidth
    frac = (shared - 1) / shared
    reduce_scatters = 1 if run.grad_reduction.keeps_full_grads else run.micro_batches  # --reduce-every-micro-batch
    sharded = frac * params * (reduce_scatters * g + w)
    dp_bytes = sharded if run.zero.shards_optimizer_state else 2 * frac * params * g
    if run.zero.shards_parameters:
        dp_bytes = run.micro_batches * frac * params * (g + w * (2 if spec.gathering.reshard_after_forward else 1))
    return dp_bytes / bw


# the parallel degrees a search holds when given: (axis, the flat setting that gives it)
HELD_SETTINGS = (("tp", "tensor_model_parallel_size"), ("cp", "context_parallel_size"),
                 ("pp", "pipeline_model_parallel_size"), ("ep", "expert_model_parallel_size"),
                 ("etp", "expert_tensor_parallel_size"))


@dataclass(frozen=True)
class HeldAxes:
    """Parallel degrees the user gave (None = searched): every layout the search lists has them."""

    tp: int | None = None
    cp: int | None = None
    pp: int | None = None
    dp: int | None = None
    ep: int | None = None
    etp: int | None = None

    @classmethod
    def given(cls, cfg: Config, dp: int | None = None) -> "HeldAxes":
        """The degrees ``cfg`` was given (a flag or a preset, ``Config.explicit``), and ``dp`` when not None."""
        held = {axis: getattr(cfg.parallel, name) for axis, name in HELD_SETTINGS if name in cfg.explicit}
        return cls(**held, dp=dp)

    def keeps(self, axis: str, value: int | None) -> bool:
        held = getattr(self, axis)
        return held is None or held == value

    def flags(self) -> str:
        """'--tp 2 --pp 4' (empty when nothing is held)."""
        return " ".join(f"--{axis} {value}" for axis, value in self.items())

    def items(self) -> list[tuple[str, int]]:
        return [(axis, getattr(self, axis)) for axis in ("tp", "cp", "pp", "dp", "ep", "etp")
                if getattr(self, axis) is not None]

    def check(self, hw: Hardware) -> None:
        """Held degrees the cluster cannot take, refused in one line (ValueError) before the search."""
        tp, gpus, node = self.tp or 1, hw.gpus, hw.gpus_per_node
        if tp > min(node, gpus):
            raise ValueError(f"--tp {tp} is more than the {min(node, gpus)} GPUs of a node (--gpus-per-node {node}, "
                             f"--gpus {gpus}); the search keeps tp inside a node: lower --tp or drop it to search.")
        grid = [(axis, value) for axis, value in self.items() if axis in ("tp", "cp", "pp", "dp")]
        product = 1
        for _, value in grid:
            product *= value
        whole = len(grid) == 4  # tp x cp x pp x dp all held: their product is the world
        if grid and (product != gpus if whole else gpus % product):
            shown = " x ".join(f"--{axis} {value}" for axis, value in grid) + (f" = {product}" if len(grid) > 1 else "")
            raise ValueError(f"{shown} (held as given) does not {'equal' if whole else 'divide'} --gpus {gpus}; "
                             f"pick degrees whose product {'is' if whole else 'divides'} the GPUs, or drop them to "
                             f"search.")


@dataclass
class Candidate:
    spec: PlanSpec
    plan: MemoryPlan
    step_seconds: float
    offload_only: bool = False  # fits only with its offload placement

    @property
    def peak_bytes(self) -> float:
        return self.plan.peak.total_bytes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_ok(cfg: ModelConfig, tp: int) -> bool:
    return all(v % tp == 0 for v in (cfg.num_attention_heads, cfg.query_groups, cfg.ffn_size, cfg.hidden_size))


def _cp_ok(cfg: ModelConfig, tp: int, cp: int) -> bool:
    """The ring's load-balanced split cuts each sample into 2 x cp chunks (and SP into tp x cp pieces);
    CP runs without attention dropout (``run_plan`` refuses it)."""
    return cp == 1 or (cfg.seq_length % (2 * cp) == 0 and cfg.seq_length % (tp * cp) == 0
                       and cfg.attention_dropout == 0)


def search_layouts(cfg: Config, hw: Hardware, micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8),
                   recomputes: tuple[str, ...] = RECOMPUTE_MODES,
                   offload: bool = False, held: HeldAxes = HeldAxes()) -> list[Candidate]:
    """Every layout of ``hw.gpus`` that fits ``cfg``'s model and global batch, fastest first (tp inside a
    node, context parallelism with the ring (p2p), 1F1B when pp > 1; each a ``RunPlan`` resolved for
    that layout); with ``offload``, also those that fit only with offload (the fastest such placement each).
    ``held``: the degrees every layout keeps (the ones the user gave)."""
    model, found, device = cfg.model, [], planned_device(cfg)
    global_batch_size = cfg.training.global_batch_size
    for tp in (d for d in _divisors(min(hw.gpus_per_node, hw.gpus))
               if _tp_ok(model, d) and hw.gpus % d == 0 and held.keeps("tp", d)):
        for cp in (c for c in _divisors(hw.gpus // tp) if _cp_ok(model, tp, c) and held.keeps("cp", c)):
            for pp in (d for d in _divisors(model.num_layers)
                       if hw.gpus % (tp * cp * d) == 0 and held.keeps("pp", d)):
                dp = hw.gpus // (tp * cp * pp)
                if not held.keeps("dp", dp):
                    continue
                for mbs in micro_batch_sizes:
                    if global_batch_size % (mbs * dp) != 0:
                        continue
                    if pp > 1 and global_batch_size // (mbs * dp) < pp:
                        continue  # 1F1B with fewer micro-batches than stages is all bubble
                    for ep, etp in (e for e in expert_layouts(cfg, tp, hw.gpus // pp)  # MoE: ep and etp too
                                    if held.keeps("ep", e[0]) and held.keeps("etp", e[1])):
                        found += _layouts(cfg, hw, offload, device, tp=tp, cp=cp, pp=pp, mbs=mbs, ep=ep, etp=etp,
                                          zeros=tuple(ZeroStage) if dp * cp > 1 else (ZeroStage.NONE,),
                                          recomputes=recomputes)
    return sorted(found, key=lambda c: (c.step_seconds, c.peak_bytes))


def _layouts(cfg: Config, hw: Hardware, offload: bool, device: str, *, tp: int, cp: int, pp: int, mbs: int,
             ep: int, etp: int | None, zeros: tuple[ZeroStage, ...], recomputes: tuple[str, ...]) -> list[Candidate]:
    """The fitting candidates of one (tp, cp, pp, micro-batch, ep, etp) over ZeRO stages and recompute modes."""
    found = []
    for zero in zeros:
        for rc in recomputes:
            layout = cfg.updated(tensor_model_parallel_size=tp, context_parallel_size=cp, cp_comm_type="p2p",
                                 cp_a2a_size=None, pipeline_model_parallel_size=pp, zero=int(zero),
                                 micro_batch_size=mbs, sequence_parallel=tp > 1, recompute=rc,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                 recompute_num_layers=None, pipeline_schedule=None, virtual_pipeline_size=None,
                                 num_layers_per_virtual_pipeline_stage=None, offload_optimizer=DEVICE.flag_word,
                                 offload_params=DEVICE.flag_word, offload_path=None)  # offload: only if needed
            found += _fitting(PlanSpec.for_world(layout, hw.gpus, device), hw, offload)
    return found


def trains(cfg: Config) -> bool:
    """Whether the run's optimizer takes this layout: ``Config.refuse_unbuilt_muon``, the check a run makes (so
    the search follows when a refusal is lifted); AdamW takes every layout."""
    try:
        cfg.refuse_unbuilt_muon()
    except ConfigError:
        return False
    return True


def _fitting(spec: PlanSpec, hw: Hardware, offload: bool) -> list[Candidate]:
    """``spec`` as it is if it fits; else, with ``offload``, its fastest offload placement that fits. A placement
    the optimizer refuses (``trains``) is never proposed."""
    spec = _placed(spec, DEVICE, DEVICE)
    plan = plan_memory(spec) if trains(spec.cfg) else None
    if plan is not None and hw.fits(plan):
        return [Candidate(spec, plan, step_time(spec, plan, hw))]
    if not offload:
        return []
    options = []
    for opt, params in OFFLOAD_VARIANTS[spec.run.zero.shards_parameters]:
        variant = _placed(spec, opt, params)
        if not trains(variant.cfg):
            continue
        plan = plan_memory(variant)
        if hw.fits(plan):
            options.append(Candidate(variant, plan, step_time(variant, plan, hw), offload_only=True))
    return [min(options, key=lambda c: (c.step_seconds, c.peak_bytes))] if options else []


def _placed(spec: PlanSpec, optimizer: Placement, params: Placement) -> PlanSpec:
    """``spec`` with the optimizer state and parameter shards placed so (a disk tier needs no real path)."""
    where = spec.run.placement
    if (where.optimizer_state, where.parameters) == (optimizer, params):
        return spec
    path = PLANNED_PATH if DISK in (optimizer, params) else None
    return spec.updated(offload_optimizer=optimizer.flag_word, offload_params=params.flag_word, offload_path=path)


def format_candidates(cands: list[Candidate], hw: Hardware, top: int = 20, held: HeldAxes = HeldAxes()) -> str:
    """Table of the ``top`` fastest feasible layouts; the best is marked with '*'. A line first names the
    degrees ``held`` as given, when there are any."""
    kept = held.flags()
    if not cands:
        return (f"no layout {f'with {kept} (held as given) ' if kept else ''}fits {hw.gpus} x "
                f"{hw.gpu_memory_gib:g} GiB (usable {hw.usable_bytes / GIB:.1f} GiB per GPU); add GPUs, shorten "
                f"--seq-length or lower --global-batch-size{', or drop a held degree to search it' if kept else ''}.")
    offload = any(c.offload_only for c in cands[:top])  # columns of the offload placement, when one is listed
    moe = cands[0].spec.model.num_experts is not None  # the ep and etp columns
    best = cands[0].spec.run
    tokens = cands[0].spec.model.seq_length * best.micro_batch_size * best.micro_batches * best.dp
    lines = [f"{len(cands)} feasible layouts on {hw.gpus} GPUs x {hw.gpu_memory_gib:g} GiB "
             f"(usable {hw.usable_bytes / GIB:.1f} GiB each); global batch {tokens} tokens; fastest first",
             *([f"held as given: {kept}; every listed layout has them"] if kept else []),
             *document_lines(cands[0].spec.cfg, best.cp_split.ring),  # the share shown is the best layout's
             *muon_lines(cands[0].spec.cfg, cands[0].plan.peak.ns_workspace_bytes),  # the best layout's workspace
             f"  {'tp':>3} {'cp':>3} {'pp':>3} {'dp':>4}{' ep'.rjust(4) + ' etp' if moe else ''} {'zero':>4} "
             f"{'mbs':>4} {'m':>4} {'recompute':>9} "
             f"{'state':>7} {'activ':>7} {'peak':>7} {'step s':>7} {'tok/s/gpu':>9}"
             + (f" {'offload':>14} {'host':>6} {'disk':>6} {'offl s':>6}" if offload else "")]
    for i, c in enumerate(cands[:top]):
        r, st = c.spec.run, c.plan.peak
        lines.append(f"{'*' if i == 0 else ' '} {r.tp:>3} {r.cp:>3} {r.pp:>3} {r.dp:>4}"
                     f"{f' {r.ep:>3} {r.etp:>3}' if moe else ''} {int(r.zero):>4} "
                     f"{r.micro_batch_size:>4} {r.micro_batches:>4} {c.spec.cfg.training.recompute:>9} "
                     f"{st.model_state_bytes / GIB:7.1f} {st.activations_bytes / GIB:7.1f} {st.total_bytes / GIB:7.1f} "
                     f"{c.step_seconds:7.2f} {tokens / c.step_seconds / hw.gpus:9.0f}"
                     + (_offload_cells(c, hw) if offload else ""))
    if offload:
        lines.append(f"offload: listed only when a layout does not fit on the device; host, disk: GiB per GPU; "
                     f"'offl s' (in 'step s'): {describe(hw.offload)}")
    return "\n".join(lines)


def _offload_cells(c: Candidate, hw: Hardware) -> str:
    st = c.plan.peak
    if not c.offload_only:
        return f" {'-':>14} {'-':>6} {'-':>6} {'-':>6}"
    return (f" {offload_label(c.spec):>14} {st.host_bytes / GIB:6.1f} {st.disk_bytes / GIB:6.1f} "
            f"{c.plan.offload_seconds(hw.offload):6.2f}")
