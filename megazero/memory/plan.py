"""Per-rank memory of a model and a parallel layout, stage by stage.

``plan_memory(spec)`` adds up, for every pipeline stage (the ranks of one
stage are alike): model state (``params``; gradients at the optimizer's
high-water mark in a step, ``grads``: ZeRO 2's full-size bucket gradients
included, all of them while micro-batches accumulate unless ``RunPlan.grad_reduction``
reduces every micro-batch; ZeRO 3's gathered units and bucket gradients at its peak,
``zero3.py``), activations held by the schedule (``activations``) and the
largest short-lived working set (``transient``: one block rebuilt under full
recompute, or the logits and their fp32 copy on the last stage).
The rank that needs the most is the one to size the GPU for. With offload
(``offload.py``) the optimizer state, and under ZeRO 3 the parameter shards,
leave the device: each stage also reports the host and disk bytes per rank.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..config import Config, ConfigError, ModelConfig, Placement
from ..dtypes import DTYPE_NAMES
from ..run_plan import RunPlan, UnitGathering, ZeroStage
from .activations import (ActivationSpec, chunk_activation_bytes, cp_working_bytes, head_working_bytes,
                          in_flight_micro_batches, recompute_working_bytes)
from .documents import document_lines, planned_document_length
from .grads import grad_bytes, unit_buckets
from .offload import OffloadHardware, describe, offload_bytes, offload_seconds
from .params import (bytes_per_param, chunk_param_numels, chunk_param_units, chunk_params,
                     embedding_shared_across_stages, model_state_bytes, num_parameters)
from .moe_plan import ExpertStage, add_experts, expert_stage, expert_words, moe_lines
from .muon_plan import muon_lines, ns_workspace_bytes, optimizer_state_bytes, with_one_moment
from .muon_traffic import muon_step_bytes
from .mtp_plan import embedding_copy_in_gradient_order, mtp_expert_activation_bytes
from .zero3 import PeakState, zero3_bytes

GIB = 2**30
PLANNED_PATH = "(planned)"  # stands in for --offload-path in a planned disk tier: the planner opens no file


@dataclass(frozen=True)
class PlanSpec:
    """What the planner sizes: a ``RunPlan`` (for a layout a run would launch, or one it only considers)
    and the ``Config`` it was resolved from, which alone says the model, the recompute mode and the
    bucket size; ``device`` ("cuda" or "cpu") picks the attention kernel the activations follow."""

    cfg: Config
    run: RunPlan
    device: str = "cuda"

    @classmethod
    def from_plan(cls, cfg: Config, plan: RunPlan, device: str = "cuda") -> "PlanSpec":
        """The spec of ``plan``, resolved from ``cfg``; the vocabulary must be known."""
        if plan.vocab_size is None:
            raise ConfigError("the memory plan needs the vocabulary: pass --vocab-size (or --tokenizer-model).")
        return cls(cfg, plan, device)

    @classmethod
    def for_world(cls, cfg: Config, world_size: int, device: str = "cuda", **settings: Any) -> "PlanSpec":
        """``cfg`` with the flat ``settings`` applied, resolved on ``world_size`` ranks (dp = world / (tp x pp))."""
        cfg = cfg.updated(**settings) if settings else cfg
        return cls.from_plan(cfg, RunPlan.resolve(cfg, world_size), device)

    def updated(self, **settings: Any) -> "PlanSpec":
        """The same world with flat config ``settings`` changed (an offload placement, a ZeRO stage ...)."""
        return PlanSpec.for_world(self.cfg, self.run.world_size, self.device, **settings)

    @property
    def model(self) -> ModelConfig:
        return self.cfg.model

    @property
    def sequence_parallel(self) -> bool:
        """Sequence parallelism in effect (the flag changes nothing at tp = 1)."""
        return self.run.sequence_parallel and self.run.tp > 1

    @property
    def schedule(self) -> str:
        """The schedule's name in the tables: pp = 1 holds one micro-batch under any, shown as 1f1b."""
        return self.run.schedule if self.run.pp > 1 else "1f1b"

    @property
    def gathering(self) -> UnitGathering:
        """ZeRO 3's unit gathering (the defaults for the other stages, which gather nothing)."""
        return self.run.gathering or UnitGathering()

    @property
    def offloaded(self) -> bool:
        return self.run.placement.optimizer_state.offloaded or self.run.placement.parameters.offloaded

    def bytes_per_param(self) -> tuple[int, int, int]:
        """(w, g, K) of ``params.bytes_per_param`` for the plan's dtypes, K the optimizer's (``muon_plan``)."""
        w, g, k = bytes_per_param(DTYPE_NAMES[self.run.compute_dtype], DTYPE_NAMES[self.run.main_grads_dtype])
        return w, g, optimizer_state_bytes(k, self.cfg)

    def activation_spec(self) -> ActivationSpec:
        t = self.cfg.training
        assert t.recompute != "auto", "resolve --recompute auto first (memory/recompute_choice.py)"
        return ActivationSpec(seq_length=self.model.seq_length, micro_batch_size=self.run.micro_batch_size,
                              tp=self.run.tp, sequence_parallel=self.sequence_parallel, recompute=t.recompute,
                              dtype_bytes=self.run.compute_dtype.itemsize, device=self.device, cp=self.run.cp,
                              cp_comm_type=self.run.cp_comm_type, cp_a2a=self.run.cp_split.a2a,
                              ce_chunk_size=t.cross_entropy_chunk_size,
                              document_length=planned_document_length(self.cfg))

    @property
    def shard_ranks(self) -> int:
        """Ranks holding the same weights, over which gradients reduce and ZeRO shards: dp x cp."""
        return self.run.dp * self.run.cp

    def layout_dict(self) -> dict[str, Any]:
        """The plan's layout and choices as the planner's JSON records them."""
        r, t, g, where = self.run, self.cfg.training, self.gathering, self.run.placement
        return {"tp": r.tp, "cp": r.cp, "cp_comm_type": r.cp_comm_type, "pp": r.pp, "dp": r.dp, "zero": int(r.zero),
                "micro_batch_size": r.micro_batch_size, "num_micro_batches": r.micro_batches,
                "sequence_parallel": self.sequence_parallel,
                "recompute": t.recompute, "recompute_num_layers": t.recompute_num_layers,
                "schedule": self.schedule, "vp": r.virtual_stages, "precision": DTYPE_NAMES[r.compute_dtype],
                "main_grads_dtype": DTYPE_NAMES[r.main_grads_dtype], "bucket_size": self.cfg.parallel.bucket_size,
                "device": self.device, "layers_per_unit": g.layers_per_unit, "prefetch": g.prefetch,
                "ep": r.ep, "etp": r.etp, "edp": r.layout.expert.edp,
                "reshard_after_forward": g.reshard_after_forward, "grad_reduction": r.grad_reduction.value,
                "offload_optimizer": where.optimizer_state.flag_word, "offload_params": where.parameters.flag_word,
                "offload_buffers": where.offload_buffers, "offload_buffer_size": where.offload_buffer_size,
                "document_length": planned_document_length(self.cfg), "optimizer": self.cfg.optimizer.optimizer}


@dataclass
class StagePlan:
    stage: int
    params_on_rank: int
    in_flight: int
    params_bytes: float
    grads_bytes: float  # peak in a step: persistent buffer or shard + ZeRO-2 full-size buckets / step copies
    optimizer_bytes: float
    activations_bytes: float
    transient_bytes: float
    persistent_bytes: float = 0.0  # model state between steps: buffers, shards, optimizer state
    params_peak_bytes: float = 0.0  # ZeRO 3: most parameter bytes at any moment (params_bytes: at the peak)
    shard_elements: int = 0  # optimizer-state elements of this rank (padded buckets' shards)
    optimizer_host_bytes: float = 0.0  # offload: state in host memory (the disk tier's buffers)
    optimizer_disk_bytes: float = 0.0  # offload to disk: the rank's state file
    params_host_bytes: float = 0.0  # ZeRO 3 + --offload-params: shards (or staged units) on the host
    params_disk_bytes: float = 0.0
    experts: ExpertStage = field(default_factory=ExpertStage)  # MoE: the experts' share, included above (moe_plan)
    ns_workspace_bytes: float = 0.0  # Muon: NS of the stage's largest matrix, in the step, after the backward
    muon_step_bytes: int = 0  # Muon: bytes its busiest rank's gathers and scatters send per step (ledger: send.muon)

    @property
    def host_bytes(self) -> float:
        return self.optimizer_host_bytes + self.params_host_bytes

    @property
    def disk_bytes(self) -> float:
        return self.optimizer_disk_bytes + self.params_disk_bytes

    @property
    def in_step_bytes(self) -> float:
        """Model state a step adds on top of the persistent state (bucket grads, gathered units, copies)."""
        return self.model_state_bytes - self.persistent_bytes

    @property
    def model_state_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> float:
        """Model state plus the larger of what forward and backward hold and the optimizer step's NS workspace."""
        return self.model_state_bytes + max(self.activations_bytes + self.transient_bytes, self.ns_workspace_bytes)


@dataclass
class MemoryPlan:
    spec: PlanSpec
    num_parameters: int
    stages: list[StagePlan] = field(default_factory=list)

    @property
    def peak(self) -> StagePlan:
        return max(self.stages, key=lambda s: s.total_bytes)

    def offload_seconds(self, hw: OffloadHardware = OffloadHardware()) -> float:
        """Assumed seconds per step the slowest stage spends on offload (``offload.py``; 0 without)."""
        s, where = self.spec, self.spec.run.placement
        w, g, _ = s.bytes_per_param()
        return max(offload_seconds(st.shard_elements, w, g, s.run.micro_batches, s.gathering.reshard_after_forward,
                                   where.optimizer_state, where.parameters, hw) for st in self.stages)

    def to_dict(self) -> dict:
        """One JSON object: the peak stage's figures at the top level, every stage under ``stages``."""
        top = self.peak
        stages = [{**asdict(s), "total_bytes": s.total_bytes, "host_bytes": s.host_bytes,
                   "disk_bytes": s.disk_bytes} for s in self.stages]
        return {"num_parameters": self.num_parameters, **{k: v for k, v in stages[top.stage].items()},
                "offload_seconds_assumed": self.offload_seconds(),
                "layout": self.spec.layout_dict(), "model": asdict(self.spec.model), "stages": stages}


def _stage(spec: PlanSpec, stage: int) -> StagePlan:
    cfg, a, run, where = spec.model, spec.activation_spec(), spec.run, spec.run.placement
    blocks = cfg.num_layers // (run.pp * run.virtual_stages)
    first, last = stage == 0, stage == run.pp - 1
    chunks = [(c == 0 and first, c == run.virtual_stages - 1 and last, (c * run.pp + stage) * blocks)
              for c in range(run.virtual_stages)]  # (embedding?, head?, first layer)
    params = sum(chunk_params(cfg, run.tp, blocks, pre, post, layer) for pre, post, layer in chunks)
    in_flight = in_flight_micro_batches(spec.schedule, run.pp, stage, run.micro_batches, run.virtual_stages)
    moe = expert_stage(spec.cfg, run, a, stage, in_flight, spec.bytes_per_param())
    state = add_experts(_model_state(spec, params, blocks, chunks, in_flight), moe)
    w, _, _ = spec.bytes_per_param()
    shards = _state_shards(spec, blocks, chunks) + moe.shards
    off = offload_bytes(shards, w, where.optimizer_state, where.parameters, where.offload_buffers,
                        where.offload_buffer_size)
    layers = [first_layer + i for *_, first_layer in chunks for i in range(blocks)]  # this stage's blocks
    state, off = with_one_moment(spec.cfg, run, layers, state, off)  # Muon: one moment for its matrices
    optimizer = 0.0 if where.optimizer_state.offloaded else state.optimizer  # on the device
    per_chunk_forward = chunk_activation_bytes(cfg, a, blocks, False, False, spec.cfg.training.recompute_num_layers)
    with_extras = -(-in_flight // run.virtual_stages)  # chunk-forwards of the chunk holding the embedding or head
    activations = in_flight * per_chunk_forward + moe.activations_bytes
    for pre, post, _ in chunks:  # the last chunk's MTP blocks follow its blocks (full recompute's first N)
        extras = chunk_activation_bytes(cfg, a, blocks, pre, post, spec.cfg.training.recompute_num_layers) \
            - per_chunk_forward if (pre or post) else 0
        activations += with_extras * extras
        activations += with_extras * mtp_expert_activation_bytes(spec.cfg, run, a, blocks) if post else 0
    # the logits (all of them, or one chunk with --cross-entropy-chunk-size) and their fp32 copy
    transient = max(recompute_working_bytes(cfg, a) + cp_working_bytes(cfg, a) + moe.transient_bytes,
                    head_working_bytes(cfg, a) if last else 0)
    moved = state.optimizer - optimizer + off.params_device  # offload: state the device no longer holds
    return StagePlan(stage=stage, params_on_rank=params, in_flight=in_flight,
                     params_bytes=state.params - off.params_device, grads_bytes=state.grads,
                     optimizer_bytes=optimizer, activations_bytes=activations,
                     transient_bytes=transient, persistent_bytes=state.persistent - moved,
                     params_peak_bytes=state.params_peak - off.params_device, shard_elements=sum(shards),
                     optimizer_host_bytes=off.optimizer_host, optimizer_disk_bytes=off.optimizer_disk,
                     params_host_bytes=off.params_host, params_disk_bytes=off.params_disk, experts=moe,
                     ns_workspace_bytes=ns_workspace_bytes(spec.cfg, layers),
                     muon_step_bytes=muon_step_bytes(spec.cfg, run, stage))


def _model_state(spec: PlanSpec, params: int, blocks: int, chunks: list[tuple[bool, bool, int]],
                 in_flight: int) -> PeakState:
    """Params, grads and optimizer bytes at the step's high-water mark, and the persistent state."""
    run = spec.run
    w, g, k = spec.bytes_per_param()
    if run.zero.shards_parameters:
        # parameters on disk: a prefetch only starts the read; the unit is gathered when it is needed
        on_disk = run.placement.parameters is Placement.DISK
        gathering = replace(spec.gathering, prefetch=0) if on_disk else spec.gathering
        return zero3_bytes(_chunk_buckets(spec, blocks, chunks), spec.shard_ranks, w, g, k, gathering,
                           pinned=in_flight > 1)
    precision, main_grads = DTYPE_NAMES[run.compute_dtype], DTYPE_NAMES[run.main_grads_dtype]
    state = model_state_bytes(params, spec.shard_ranks, run.zero, precision, main_grads)
    grads = grad_bytes(params, [[n for _, n in c] for c in _chunk_buckets(spec, blocks, chunks)], spec.shard_ranks,
                       run.zero, run.micro_batches, g, run.grad_reduction)
    return PeakState(params=state.params, grads=grads.peak, optimizer=state.optimizer,
                     persistent=state.params + grads.persistent + state.optimizer, params_peak=state.params)


def _chunk_buckets(spec: PlanSpec, blocks: int, chunks: list[tuple[bool, bool, int]]) -> list[list[tuple[int, int]]]:
    """(unit, padded size) of each chunk's buckets on this stage in the order their gradients arrive
    (ZeRO 3's units cut them; ZeRO 2 needs them unless full-size gradients accumulate, ZeRO 0/1 never)."""
    run = spec.run
    if not run.zero.shards_gradients or (run.grad_reduction.keeps_full_grads and run.micro_batches > 1):
        return []
    return _bucket_layout(spec, blocks, chunks)


def _bucket_layout(spec: PlanSpec, blocks: int, chunks: list[tuple[bool, bool, int]]) -> list[list[tuple[int, int]]]:
    """(unit, padded size) of every bucket of each chunk on this stage, in backward order."""
    cfg, run = spec.model, spec.run
    tied = embedding_shared_across_stages(cfg, run.pp)  # tied, or the MTP depths' copy
    out = []
    for pre, post, layer in chunks:
        numels = chunk_param_numels(cfg, run.tp, blocks, pre, post, layer)
        units = chunk_param_units(cfg, blocks, pre, post, spec.gathering.layers_per_unit, layer) \
            if run.zero.shards_parameters else [0] * len(numels)
        buckets = unit_buckets(numels, units, spec.cfg.parallel.bucket_size, _num_shards(run), tied and (pre or post))
        if tied and post and not pre:  # the embedding copy's gradient: first, or after the MTP depths' (mtp_plan)
            buckets = embedding_copy_in_gradient_order(cfg, buckets, numels, units, spec.cfg.parallel.bucket_size,
                                                       _num_shards(run))
        out.append(buckets)
    return out


def _num_shards(run: RunPlan) -> int:
    """Ranks a bucket's optimizer state is split over (its padding follows): dp x cp once ZeRO shards it."""
    return run.dp * run.cp if run.zero.shards_optimizer_state else 1


def _state_shards(spec: PlanSpec, blocks: int, chunks: list[tuple[bool, bool, int]]) -> list[int]:
    """Shard elements of every bucket this rank's optimizer holds (the whole padded bucket under ZeRO 0)."""
    return [n // _num_shards(spec.run) for c in _bucket_layout(spec, blocks, chunks) for _, n in c]


def plan_memory(spec: PlanSpec) -> MemoryPlan:
    """Memory per rank of every pipeline stage of ``spec`` (already validated: ``RunPlan.resolve``)."""
    return MemoryPlan(spec=spec, num_parameters=num_parameters(spec.model, spec.run.tp),
                      stages=[_stage(spec, r) for r in range(spec.run.pp)])


def format_plan(plan: MemoryPlan) -> str:
    """A human table: one row per pipeline stage, GiB per rank, the peak stage marked."""
    s, r, m = plan.spec, plan.spec.run, plan.spec.model
    lines = [f"model: {m.arch}, {plan.num_parameters / 1e9:.3f} B parameters, {m.num_layers} layers, "
             f"hidden {m.hidden_size}, seq {m.seq_length}",
             f"layout: {_layout_words(r)}, zero {int(r.zero)}{_zero3_knobs(s)}{_zero2_grads(r)}, "
             f"{DTYPE_NAMES[r.compute_dtype]}, "
             f"micro-batch {r.micro_batch_size} x {r.micro_batches}, schedule {s.schedule}"
             f"{f' vp={r.virtual_stages}' if r.virtual_stages > 1 else ''}, recompute {s.cfg.training.recompute}, "
             f"sp {s.sequence_parallel}",
             *_offload_lines(plan), *muon_lines(s.cfg, plan.peak.ns_workspace_bytes, plan.stages),
             *document_lines(s.cfg, r.cp_split.ring), *moe_lines(s.cfg, r, plan.peak.experts),
             "per rank (GiB):",
             f"{'stage':>5} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'in-flight':>9} "
             f"{'transient':>9} {'total':>8}"]
    peak = plan.peak.stage
    for st in plan.stages:
        lines.append(f"{st.stage:>5} {st.params_bytes / GIB:8.2f} {st.grads_bytes / GIB:8.2f} "
                     f"{st.optimizer_bytes / GIB:8.2f} {st.activations_bytes / GIB:8.2f} {st.in_flight:>9} "
                     f"{st.transient_bytes / GIB:9.2f} {st.total_bytes / GIB:8.2f}"
                     f"{'  <- peak' if st.stage == peak and r.pp > 1 else ''}")
    return "\n".join(lines)


def _offload_lines(plan: MemoryPlan) -> list[str]:
    """Where the offloaded state goes (peak stage, GiB per rank) and the assumed cost, when there is any."""
    s, st, where = plan.spec, plan.peak, plan.spec.run.placement
    if not s.offloaded:
        return []
    buffers = (f" (disk tier: {where.offload_buffers} buffers of {where.offload_buffer_size:,} elements)"
               if Placement.DISK in (where.optimizer_state, where.parameters) else "")
    return [f"offload: optimizer {where.optimizer_state.flag_word}, params {where.parameters.flag_word}{buffers}; "
            f"off the device, per rank: host {st.host_bytes / GIB:.2f} GiB (optimizer "
            f"{st.optimizer_host_bytes / GIB:.2f}, params {st.params_host_bytes / GIB:.2f}), "
            f"disk {st.disk_bytes / GIB:.2f} GiB",
            f"offload cost per step: {plan.offload_seconds():.2f} s ({describe()})"]


def format_rows(plans: list[MemoryPlan]) -> str:
    """One row per plan (its peak stage), GiB per rank: ``shards`` is the model state kept between
    steps (for ZeRO 3 the paper's (w + g + K) / dp), ``+step`` what a step adds at the model state's
    high-water mark (bucket gradients, gathered units, fp32 copies), ``state`` their sum."""
    offload = any(p.spec.offloaded for p in plans)  # then host / disk GiB and the assumed seconds too
    lines = [f"{'tp':>3} {'cp':>3} {'pp':>3} {'dp':>4} {'zero':>4} {'mbs':>4} {'m':>4} {'recompute':>9} {'shards':>7} "
             f"{'+step':>7} {'state':>7} {'activ':>7} {'peak':>7}"
             + (f" {'offload':>14} {'host':>7} {'disk':>7} {'offl s*':>7}" if offload else "")]
    for plan in plans:
        r, st = plan.spec.run, plan.peak
        lines.append(f"{r.tp:>3} {r.cp:>3} {r.pp:>3} {r.dp:>4} {_zero_cell(r):>4} {r.micro_batch_size:>4} "
                     f"{r.micro_batches:>4} {plan.spec.cfg.training.recompute:>9} {st.persistent_bytes / GIB:7.2f} "
                     f"{st.in_step_bytes / GIB:7.2f} {st.model_state_bytes / GIB:7.2f} "
                     f"{st.activations_bytes / GIB:7.2f} {st.total_bytes / GIB:7.2f}"
                     + (f" {offload_label(plan.spec):>14} {st.host_bytes / GIB:7.2f} {st.disk_bytes / GIB:7.2f} "
                        f"{plan.offload_seconds():7.2f}" if offload else ""))
    first = plans[0].spec  # the assumptions (the MoE line: the first plan's peak stage)
    lines += muon_lines(first.cfg, plans[0].peak.ns_workspace_bytes, plans[0].stages)
    lines += document_lines(first.cfg, first.run.cp_split.ring) + moe_lines(first.cfg, first.run, plans[0].peak.experts)
    if offload:
        lines.append(f"* offload seconds per step, {describe()}")
    if any(p.spec.run.zero == ZeroStage.GRADIENTS and p.spec.run.micro_batches > 1 for p in plans):
        lines.append("zero 2: grads reduced once per step (full-size while micro-batches accumulate); "
                     "2/mb: every micro-batch (--reduce-every-micro-batch)")
    return "\n".join(lines)


def _zero_cell(r: RunPlan) -> str:
    """The zero column: the stage, '2/mb' for ZeRO 2 reducing every micro-batch."""
    every = r.zero == ZeroStage.GRADIENTS and not r.grad_reduction.keeps_full_grads
    return f"{int(r.zero)}/mb" if every else str(int(r.zero))


def offload_label(s: PlanSpec) -> str:
    """'opt:cpu', 'opt:disk+p:cpu', ... or '-' (what a table's offload column shows)."""
    where = s.run.placement
    parts = [f"{name}:{p.flag_word}" for name, p in (("opt", where.optimizer_state), ("p", where.parameters))
             if p.offloaded]
    return "+".join(parts) or "-"


def _layout_words(r: RunPlan) -> str:
    """'tp=2 cp=4 (p2p) pp=1 dp=2 (world 16)': the degrees, cp with its attention variant."""
    cp = f"{r.cp} ({r.cp_comm_type}{f' U={r.cp_split.a2a}' if r.cp_comm_type == 'a2a+p2p' else ''})" \
        if r.cp > 1 else "1"
    return f"tp={r.tp} cp={cp} pp={r.pp} dp={r.dp}{expert_words(r)} (world {r.world_size})"


def _zero2_grads(r: RunPlan) -> str:
    """ZeRO 2 reduces once per step or every micro-batch (``--reduce-every-micro-batch``): say which is planned."""
    return f" (grads reduced {r.grad_reduction.value})" if r.zero == ZeroStage.GRADIENTS else ""


def _zero3_knobs(s: PlanSpec) -> str:
    if not s.run.zero.shards_parameters:
        return ""
    g = s.gathering
    return (f" (units of {g.layers_per_unit} block{'s' if g.layers_per_unit > 1 else ''}, prefetch {g.prefetch}, "
            f"{'reshard' if g.reshard_after_forward else 'keep'} after forward)")
