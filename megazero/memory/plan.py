"""Per-rank memory of a model and a parallel layout, stage by stage.

``plan_memory(spec)`` adds up, for every pipeline stage (the ranks of one
stage are alike): model state (``params``; gradients at the optimizer's
high-water mark in a step, ``grads``: ZeRO 2's full-size bucket gradients
included; ZeRO 3's gathered units and bucket gradients at its peak,
``zero3.py``), activations held by the schedule (``activations``) and the
largest short-lived working set (``transient``: one block rebuilt under full
recompute, or the logits and their fp32 copy on the last stage).
The rank that needs the most is the one to size the GPU for. With offload
(``offload.py``) the optimizer state, and under ZeRO 3 the parameter shards,
leave the device: each stage also reports the host and disk bytes per rank.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from ..config import Config, ConfigError, ModelConfig
from ..parallel.layout import Layout
from ..run_plan import DTYPE_NAMES, Placement, RunPlan, UnitGathering
from .activations import (ActivationSpec, chunk_activation_bytes, in_flight_micro_batches,
                          recompute_working_bytes)
from .grads import grad_bytes, unit_buckets
from .offload import OffloadHardware, check_offload, describe, offload_bytes, offload_seconds
from .params import (bytes_per_param, chunk_param_numels, chunk_param_units, chunk_params, model_state_bytes,
                     num_parameters)
from .zero3 import PeakState, zero3_bytes

GIB = 2**30
_OFFLOAD_NAMES = {Placement.DEVICE: "none", Placement.HOST: "cpu", Placement.DISK: "disk"}  # the flags' words


@dataclass(frozen=True)
class PlanSpec:
    """A model and a parallel layout: everything the memory figures depend on."""

    model: ModelConfig
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    micro_batch_size: int = 1
    num_micro_batches: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    recompute_num_layers: int | None = None
    schedule: str = "1f1b"
    vp: int = 1
    precision: str = "bf16"
    main_grads_dtype: str = "fp32"
    bucket_size: int = 10_000_000
    device: str = "cuda"
    layers_per_unit: int = 1  # ZeRO 3: blocks per gathered unit (the root unit is one more per chunk)
    prefetch: int = 1  # ZeRO 3: units gathered ahead of the one computing
    reshard_after_forward: bool = True  # ZeRO 3: False keeps every unit gathered from forward to backward
    offload_optimizer: str = "none"  # none | cpu | disk: where the fp32 master and Adam moments live
    offload_params: str = "none"  # none | cpu | disk: where ZeRO 3's parameter shards live between uses
    offload_buffers: int = 2  # offload to disk: host buffers (one piece of state each) the step streams through
    offload_buffer_size: int = 2_000_000  # offload to disk: shard elements per host buffer

    @classmethod
    def from_plan(cls, cfg: Config, plan: RunPlan, device: str = "cuda") -> "PlanSpec":
        """The spec of a training run: its resolved plan, plus the model and the run-time choices of ``cfg``."""
        if plan.vocab_size is None:
            raise ConfigError("the memory plan needs the vocabulary: pass --vocab-size (or --tokenizer-model).")
        t, gathering, where = cfg.training, plan.gathering or UnitGathering(), plan.placement
        params = _OFFLOAD_NAMES[where.parameters] if where.parameters != Placement.DEVICE else \
            getattr(cfg.parallel, "offload_params", "none")  # the flag may be newer than this planner
        return cls(model=cfg.model, tp=plan.tp, pp=plan.pp, dp=plan.dp, zero=int(plan.zero),
                   micro_batch_size=plan.micro_batch_size, num_micro_batches=plan.micro_batches,
                   sequence_parallel=plan.sequence_parallel and plan.tp > 1, recompute=t.recompute,
                   recompute_num_layers=t.recompute_num_layers,
                   schedule=plan.schedule if plan.pp > 1 else "1f1b",  # pp = 1 holds one micro-batch either way
                   vp=plan.virtual_stages, precision=DTYPE_NAMES[plan.compute_dtype],
                   main_grads_dtype=DTYPE_NAMES[plan.main_grads_dtype], bucket_size=cfg.parallel.bucket_size,
                   device=device, layers_per_unit=gathering.layers_per_unit, prefetch=gathering.prefetch,
                   reshard_after_forward=gathering.reshard_after_forward,
                   offload_optimizer=_OFFLOAD_NAMES[where.optimizer_state], offload_params=params,
                   offload_buffers=where.offload_buffers, offload_buffer_size=where.offload_buffer_size)

    @property
    def offloaded(self) -> bool:
        return self.offload_optimizer != "none" or self.offload_params != "none"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def gathering(self) -> UnitGathering:
        return UnitGathering(layers_per_unit=self.layers_per_unit, prefetch=self.prefetch,
                             reshard_after_forward=self.reshard_after_forward)

    def activation_spec(self) -> ActivationSpec:
        return ActivationSpec(seq_length=self.model.seq_length, micro_batch_size=self.micro_batch_size, tp=self.tp,
                              sequence_parallel=self.sequence_parallel, recompute=self.recompute,
                              dtype_bytes=4 if self.precision == "fp32" else 2, device=self.device)


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
        return self.model_state_bytes + self.activations_bytes + self.transient_bytes


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
        s = self.spec
        w, g, _ = bytes_per_param(s.precision, s.main_grads_dtype)
        return max(offload_seconds(st.shard_elements, w, g, s.num_micro_batches, s.reshard_after_forward,
                                   s.offload_optimizer, s.offload_params, hw) for st in self.stages)

    def to_dict(self) -> dict:
        """One JSON object: the peak stage's figures at the top level, every stage under ``stages``."""
        spec = {k: v for k, v in asdict(self.spec).items() if k != "model"}
        top = self.peak
        stages = [{**asdict(s), "total_bytes": s.total_bytes, "host_bytes": s.host_bytes,
                   "disk_bytes": s.disk_bytes} for s in self.stages]
        return {"num_parameters": self.num_parameters, **{k: v for k, v in stages[top.stage].items()},
                "offload_seconds_assumed": self.offload_seconds(),
                "layout": spec, "model": asdict(self.spec.model), "stages": stages}


def _stage(spec: PlanSpec, stage: int) -> StagePlan:
    cfg, a = spec.model, spec.activation_spec()
    blocks = cfg.num_layers // (spec.pp * spec.vp)
    first, last = stage == 0, stage == spec.pp - 1
    chunks = [(c == 0 and first, c == spec.vp - 1 and last) for c in range(spec.vp)]
    params = sum(chunk_params(cfg, spec.tp, blocks, pre, post) for pre, post in chunks)
    in_flight = in_flight_micro_batches(spec.schedule, spec.pp, stage, spec.num_micro_batches, spec.vp)
    state = _model_state(spec, params, blocks, chunks, in_flight)
    w, _, _ = bytes_per_param(spec.precision, spec.main_grads_dtype)
    shards = _state_shards(spec, blocks, chunks)
    off = offload_bytes(shards, w, spec.offload_optimizer, spec.offload_params, spec.offload_buffers,
                        spec.offload_buffer_size)
    optimizer = 0.0 if spec.offload_optimizer != "none" else state.optimizer  # on the device
    per_chunk_forward = chunk_activation_bytes(cfg, a, blocks, False, False, spec.recompute_num_layers)
    with_extras = -(-in_flight // spec.vp)  # chunk-forwards of the chunk holding the embedding or the head
    activations = in_flight * per_chunk_forward
    for pre, post in chunks:
        extras = chunk_activation_bytes(cfg, a, 0, pre, post) if (pre or post) else 0
        activations += with_extras * extras
    logits = a.seq_length * a.micro_batch_size * cfg.padded_vocab_size(spec.tp) // spec.tp * (a.dtype_bytes + 4)
    transient = max(recompute_working_bytes(cfg, a), logits if last else 0)
    moved = state.optimizer - optimizer + off.params_device  # offload: state the device no longer holds
    return StagePlan(stage=stage, params_on_rank=params, in_flight=in_flight,
                     params_bytes=state.params - off.params_device, grads_bytes=state.grads,
                     optimizer_bytes=optimizer, activations_bytes=activations,
                     transient_bytes=transient, persistent_bytes=state.persistent - moved,
                     params_peak_bytes=state.params_peak - off.params_device, shard_elements=sum(shards),
                     optimizer_host_bytes=off.optimizer_host, optimizer_disk_bytes=off.optimizer_disk,
                     params_host_bytes=off.params_host, params_disk_bytes=off.params_disk)


def _model_state(spec: PlanSpec, params: int, blocks: int, chunks: list[tuple[bool, bool]],
                 in_flight: int) -> PeakState:
    """Params, grads and optimizer bytes at the step's high-water mark, and the persistent state."""
    w, g, k = bytes_per_param(spec.precision, spec.main_grads_dtype)
    if spec.zero == 3:
        # parameters on disk: a prefetch only starts the read; the unit is gathered when it is needed
        gathering = replace(spec.gathering, prefetch=0) if spec.offload_params == "disk" else spec.gathering
        return zero3_bytes(_chunk_buckets(spec, blocks, chunks), spec.dp, w, g, k, gathering,
                           pinned=in_flight > 1)
    state = model_state_bytes(params, spec.dp, spec.zero, spec.precision, spec.main_grads_dtype)
    grads = grad_bytes(params, [[n for _, n in c] for c in _chunk_buckets(spec, blocks, chunks)], spec.dp,
                       spec.zero, spec.num_micro_batches, g)
    return PeakState(params=state.params, grads=grads.peak, optimizer=state.optimizer,
                     persistent=state.params + grads.persistent + state.optimizer, params_peak=state.params)


def _chunk_buckets(spec: PlanSpec, blocks: int, chunks: list[tuple[bool, bool]]) -> list[list[tuple[int, int]]]:
    """(unit, padded size) of each chunk's buckets on this stage in the order their gradients arrive
    (ZeRO 3's units cut them; ZeRO 2 needs them only with one micro-batch, ZeRO 0/1 never)."""
    if spec.zero < 2 or (spec.zero == 2 and spec.num_micro_batches > 1):
        return []
    return _bucket_layout(spec, blocks, chunks)


def _bucket_layout(spec: PlanSpec, blocks: int, chunks: list[tuple[bool, bool]]) -> list[list[tuple[int, int]]]:
    """(unit, padded size) of every bucket of each chunk on this stage, in backward order."""
    cfg, tied = spec.model, spec.pp > 1 and spec.model.tied_embeddings
    num_shards = spec.dp if spec.zero >= 1 else 1
    out = []
    for pre, post in chunks:
        numels = chunk_param_numels(cfg, spec.tp, blocks, pre, post)
        units = chunk_param_units(cfg, blocks, pre, post, spec.layers_per_unit) if spec.zero == 3 \
            else [0] * len(numels)
        buckets = unit_buckets(numels, units, spec.bucket_size, num_shards, tied and (pre or post))
        if tied and post and not pre:  # the last stage's embedding copy is the head: its gradient comes first
            buckets = buckets[-1:] + buckets[:-1]
        out.append(buckets)
    return out


def _state_shards(spec: PlanSpec, blocks: int, chunks: list[tuple[bool, bool]]) -> list[int]:
    """Shard elements of every bucket this rank's optimizer holds (the whole padded bucket under ZeRO 0)."""
    num_shards = spec.dp if spec.zero >= 1 else 1
    return [n // num_shards for c in _bucket_layout(spec, blocks, chunks) for _, n in c]


def plan_memory(spec: PlanSpec) -> MemoryPlan:
    """Memory per rank of every pipeline stage of ``spec``."""
    cfg = spec.model
    check_offload(spec.zero, spec.offload_optimizer, spec.offload_params)
    if cfg.num_layers % (spec.pp * spec.vp) != 0:
        raise ConfigError(f"--num-layers ({cfg.num_layers}) must be divisible by --pp ({spec.pp}) x "
                          f"virtual stages ({spec.vp}); change one of them.")
    return MemoryPlan(spec=spec, num_parameters=num_parameters(cfg, spec.tp),
                      stages=[_stage(spec, r) for r in range(spec.pp)])


def format_plan(plan: MemoryPlan) -> str:
    """A human table: one row per pipeline stage, GiB per rank, the peak stage marked."""
    s = plan.spec
    lines = [f"model: {s.model.arch}, {plan.num_parameters / 1e9:.3f} B parameters, {s.model.num_layers} layers, "
             f"hidden {s.model.hidden_size}, seq {s.model.seq_length}",
             f"layout: tp={s.tp} pp={s.pp} dp={s.dp} (world {s.world_size}), zero {s.zero}{_zero3_knobs(s)}, "
             f"{s.precision}, "
             f"micro-batch {s.micro_batch_size} x {s.num_micro_batches}, schedule {s.schedule}"
             f"{f' vp={s.vp}' if s.vp > 1 else ''}, recompute {s.recompute}, sp {s.sequence_parallel}",
             *_offload_lines(plan),
             "per rank (GiB):",
             f"{'stage':>5} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'in-flight':>9} "
             f"{'transient':>9} {'total':>8}"]
    peak = plan.peak.stage
    for st in plan.stages:
        lines.append(f"{st.stage:>5} {st.params_bytes / GIB:8.2f} {st.grads_bytes / GIB:8.2f} "
                     f"{st.optimizer_bytes / GIB:8.2f} {st.activations_bytes / GIB:8.2f} {st.in_flight:>9} "
                     f"{st.transient_bytes / GIB:9.2f} {st.total_bytes / GIB:8.2f}"
                     f"{'  <- peak' if st.stage == peak and s.pp > 1 else ''}")
    return "\n".join(lines)


def _offload_lines(plan: MemoryPlan) -> list[str]:
    """Where the offloaded state goes (peak stage, GiB per rank) and the assumed cost, when there is any."""
    s, st = plan.spec, plan.peak
    if not s.offloaded:
        return []
    buffers = (f" (disk tier: {s.offload_buffers} buffers of {s.offload_buffer_size:,} elements)"
               if "disk" in (s.offload_optimizer, s.offload_params) else "")
    return [f"offload: optimizer {s.offload_optimizer}, params {s.offload_params}{buffers}; off the device, per rank: "
            f"host {st.host_bytes / GIB:.2f} GiB (optimizer {st.optimizer_host_bytes / GIB:.2f}, params "
            f"{st.params_host_bytes / GIB:.2f}), disk {st.disk_bytes / GIB:.2f} GiB",
            f"offload cost per step: {plan.offload_seconds():.2f} s ({describe()})"]


def format_rows(plans: list[MemoryPlan]) -> str:
    """One row per plan (its peak stage), GiB per rank: ``shards`` is the model state kept between
    steps (for ZeRO 3 the paper's (w + g + K) / dp), ``+step`` what a step adds at the model state's
    high-water mark (bucket gradients, gathered units, fp32 copies), ``state`` their sum."""
    offload = any(p.spec.offloaded for p in plans)  # then host / disk GiB and the assumed seconds too
    lines = [f"{'tp':>3} {'pp':>3} {'dp':>4} {'zero':>4} {'mbs':>4} {'m':>4} {'recompute':>9} {'shards':>7} "
             f"{'+step':>7} {'state':>7} {'activ':>7} {'peak':>7}"
             + (f" {'offload':>14} {'host':>7} {'disk':>7} {'offl s*':>7}" if offload else "")]
    for plan in plans:
        s, st = plan.spec, plan.peak
        lines.append(f"{s.tp:>3} {s.pp:>3} {s.dp:>4} {s.zero:>4} {s.micro_batch_size:>4} {s.num_micro_batches:>4} "
                     f"{s.recompute:>9} {st.persistent_bytes / GIB:7.2f} {st.in_step_bytes / GIB:7.2f} "
                     f"{st.model_state_bytes / GIB:7.2f} {st.activations_bytes / GIB:7.2f} "
                     f"{st.total_bytes / GIB:7.2f}"
                     + (f" {offload_label(s):>14} {st.host_bytes / GIB:7.2f} {st.disk_bytes / GIB:7.2f} "
                        f"{plan.offload_seconds():7.2f}" if offload else ""))
    if offload:
        lines.append(f"* offload seconds per step, {describe()}")
    return "\n".join(lines)


def offload_label(s: PlanSpec) -> str:
    """'opt:cpu', 'opt:disk+p:cpu', ... or '-' (what a table's offload column shows)."""
    parts = [f"{name}:{v}" for name, v in (("opt", s.offload_optimizer), ("p", s.offload_params)) if v != "none"]
    return "+".join(parts) or "-"


def _zero3_knobs(s: PlanSpec) -> str:
    if s.zero != 3:
        return ""
    return (f" (units of {s.layers_per_unit} block{'s' if s.layers_per_unit > 1 else ''}, prefetch {s.prefetch}, "
            f"{'reshard' if s.reshard_after_forward else 'keep'} after forward)")


def plan_for_run(cfg: Config, world_size: int) -> MemoryPlan:
    """The plan of a training run on ``world_size`` ranks (dp derived as the trainer derives it)."""
    if cfg.model.vocab_size is None and cfg.data.tokenizer_model:
        from ..data.tokenizer import load_tokenizer

        cfg = cfg.updated(vocab_size=load_tokenizer(cfg.data.tokenizer_model).vocab_size)
    run_plan = RunPlan.resolve(cfg, Layout.from_world(world_size, cfg.parallel.tp, cfg.parallel.pp))
    device = "cpu" if cfg.training.device == "cpu" else "cuda"
    return plan_memory(PlanSpec.from_plan(cfg, run_plan, device))
