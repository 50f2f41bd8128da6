"""The run plan: every fact derived from the validated config, resolved once.

``RunPlan.resolve(cfg, world_size)`` lays the world out (tp x dp x pp from
``--tp``/``--pp``), checks the config against it and fixes what the rest of the
code needs to know - the parallel degrees, the
virtual stages, the ZeRO stage and when it reduces gradients, the schedule, micro-batches per step, the
activation shape between pipeline stages, the dtypes, the padded vocabulary
and where each kind of training state lives. Partitioning, schedules, the
optimizer, checkpoints, the memory planner and the metrics records read these
fields; none of them derives a fact from the config again.

The plan is frozen, and so are the config sections it is built from: a change
(a vocabulary taken from the tokenizer, a model taken from a checkpoint) is a
``dataclasses.replace`` of the config followed by a new ``resolve``, so
validation always sees the values the run will use.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import Config, ParallelConfig, Placement, require
from .context_parallel.split import CPSplit
from .dtypes import DTYPES
from .parallel.layout import Layout
from .parallel.state import Degrees


class ZeroStage(enum.IntEnum):
    """What the distributed optimizer shards over the data-parallel group (``--zero``)."""

    NONE = 0  # DDP: every DP rank holds everything; gradients are all-reduced
    OPTIMIZER_STATE = 1  # fp32 master weights and Adam moments sharded
    GRADIENTS = 2  # ... and the gradients (no full-size gradient buffer kept between steps)
    PARAMETERS = 3  # ... and the compute-precision parameters (gathered one unit at a time)

    @property
    def shards_optimizer_state(self) -> bool:
        return self >= ZeroStage.OPTIMIZER_STATE

    @property
    def shards_gradients(self) -> bool:
        return self >= ZeroStage.GRADIENTS

    @property
    def shards_parameters(self) -> bool:
        return self >= ZeroStage.PARAMETERS


class GradReduction(enum.Enum):
    """When a step's gradients leave the buckets (ZeRO 2 chooses; ZeRO 3 always reduces every micro-batch)."""

    ONCE_PER_STEP = "once per step"  # micro-batches accumulate full-size; the last backward reduces them
    EVERY_MICRO_BATCH = "every micro-batch"  # each backward reduce-scatters its buckets into the shard

    @classmethod
    def of(cls, zero: ZeroStage, every_micro_batch: bool = False) -> "GradReduction":
        """ZeRO 3 shards gradients as they come; ZeRO 2 does with ``--reduce-every-micro-batch``."""
        per_micro_batch = zero.shards_parameters or (every_micro_batch and zero.shards_gradients)
        return cls.EVERY_MICRO_BATCH if per_micro_batch else cls.ONCE_PER_STEP

    @property
    def keeps_full_grads(self) -> bool:
        """Accumulating several micro-batches holds a full-size gradient until the step's last backward."""
        return self is GradReduction.ONCE_PER_STEP


@dataclass(frozen=True, kw_only=True)
class UnitGathering:
    """How ZeRO 3 gathers parameters (``data_parallel/zero3.py``)."""

    layers_per_unit: int = 1  # transformer blocks per unit; each chunk's embeddings + head are one more
    prefetch: int = 1  # units whose all-gather runs ahead of the one computing
    reshard_after_forward: bool = True  # False: keep a unit gathered from its forward to its backward


@dataclass(frozen=True, kw_only=True)
class StatePlacement:
    optimizer_state: Placement = Placement.DEVICE  # fp32 master weights + moments (ZeRO-Offload: HOST/DISK)
    parameters: Placement = Placement.DEVICE  # compute-precision parameter shards (ZeRO-3 + offload)
    offload_path: str | None = None  # DISK: folder of the per-rank optimizer-state (and parameter-shard) files
    offload_buffers: int = 2  # DISK: host buffers (one piece of state each) the step streams through
    offload_buffer_size: int = 2_000_000  # DISK: shard elements per host buffer (a larger bucket goes in pieces)


@dataclass(frozen=True, kw_only=True)
class RunPlan(Degrees):
    layout: Layout
    virtual_stages: int  # model chunks per pipeline rank (interleaved schedule when > 1)
    zero: ZeroStage
    schedule: str  # "no-pipelining" (pp = 1), "gpipe", "1f1b" or "interleaved"
    micro_batch_size: int
    global_batch_size: int
    micro_batches: int  # per step on each DP rank: global / (micro x dp)
    seq_length: int
    sequence_parallel: bool  # as given; it changes nothing at tp = 1
    stage_shape: tuple[int, int, int]  # [s/cp, b, h] between pipeline stages ([s/(cp tp), b, h] under SP)
    compute_dtype: torch.dtype
    main_grads_dtype: torch.dtype
    vocab_size: int | None  # None until the tokenizer (or --vocab-size, or a checkpoint) says
    padded_vocab_size: int | None  # a multiple of --make-vocab-size-divisible-by x tp
    placement: StatePlacement = field(default_factory=StatePlacement)
    gathering: UnitGathering | None = None  # ZeRO 3 only
    grad_reduction: GradReduction = GradReduction.ONCE_PER_STEP  # ZeRO 2: --reduce-every-micro-batch; ZeRO 3: every
    cp_comm_type: str = "p2p"  # context-parallel attention: p2p (ring), a2a (Ulysses) or a2a+p2p
    cp_split: CPSplit = CPSplit()  # which tokens of a sample each CP rank holds

    @classmethod
    def resolve(cls, cfg: Config, world_size: int) -> "RunPlan":
        """Lay ``world_size`` ranks out for ``cfg``, validate and derive the plan; raises ConfigError naming
        the flag. The planner passes the world of a layout it only considers (tp x cp x pp x dp)."""
        _check_experts(cfg)
        layout = Layout.from_world(world_size, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp,
                                   ep=cfg.parallel.ep, etp=cfg.parallel.expert_tensor_parallel_size)
        _check_tensor_parallel(cfg)
        cp_split = _check_context_parallel(cfg)
        micro_batches = _micro_batches(cfg, layout.dp)
        vp, schedule = _pipeline(cfg, layout.dp, micro_batches)
        t, m = cfg.training, cfg.model
        compute = torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32
        seq = m.seq_length // layout.cp
        seq = seq // layout.tp if cfg.parallel.sequence_parallel else seq
        schedule = schedule if layout.pp > 1 else "no-pipelining"
        return cls(layout=layout, virtual_stages=vp, zero=ZeroStage(cfg.parallel.zero), schedule=schedule,
                   micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
                   micro_batches=micro_batches, seq_length=m.seq_length,
                   sequence_parallel=cfg.parallel.sequence_parallel,
                   stage_shape=(seq, t.micro_batch_size, m.hidden_size), compute_dtype=compute,
                   main_grads_dtype=DTYPES[t.main_grads_dtype] if compute != torch.float32 else torch.float32,
                   vocab_size=m.vocab_size,
                   padded_vocab_size=None if m.vocab_size is None else m.padded_vocab_size(layout.tp),
                   placement=_placement(cfg), gathering=_gathering(cfg),
                   grad_reduction=GradReduction.of(ZeroStage(cfg.parallel.zero), cfg.parallel.reduce_every_micro_batch),
                   cp_comm_type=cfg.parallel.cp_comm_type, cp_split=cp_split)

    def layout_record(self) -> dict[str, Any]:
        """The parallel layout as metrics, wandb and checkpoint metadata record it."""
        return layout_record(self.layout, self.zero, self.virtual_stages)


def layout_record(layout: Layout, zero: int, virtual_stages: int) -> dict[str, Any]:
    """The one schema of a recorded layout (a converter writes it for a layout it never runs)."""
    return {"tp": layout.tp, "cp": layout.cp, "pp": layout.pp, "dp": layout.dp, "ep": layout.ep,
            "etp": layout.expert_tp, "zero": int(zero), "virtual_stages": virtual_stages}


def _placement(cfg: Config) -> StatePlacement:
    p = cfg.parallel
    return StatePlacement(optimizer_state=Placement.from_flag_word(p.offload_optimizer),
                          parameters=Placement.from_flag_word(p.offload_params),
                          offload_path=p.offload_path, offload_buffers=p.offload_buffers,
                          offload_buffer_size=p.offload_buffer_size)


def _gathering(cfg: Config) -> UnitGathering | None:
    p = cfg.parallel
    if not ZeroStage(p.zero).shards_parameters:
        return None
    return UnitGathering(layers_per_unit=p.zero3_unit_layers, prefetch=p.zero3_prefetch,
                         reshard_after_forward=p.reshard_after_forward)


def _micro_batches(cfg: Config, dp: int) -> int:
    """Micro-batches per step for this DP size; raises unless the batch splits evenly."""
    t = cfg.training
    require(t.global_batch_size % (t.micro_batch_size * dp) == 0,
             f"--global-batch-size ({t.global_batch_size}) must be divisible by --micro-batch-size "
             f"({t.micro_batch_size}) x data-parallel size ({dp}); adjust one of them.")
    return t.global_batch_size // (t.micro_batch_size * dp)


def _pipeline(cfg: Config, dp: int, micro_batches: int) -> tuple[int, str]:
    """Layers must split evenly into pp x vp chunks; interleaving needs m divisible by pp.

    Returns (vp, schedule name); ``micro_batches`` is ``_micro_batches``'s answer.
    """
    pp, layers = cfg.parallel.pp, cfg.model.num_layers
    require(pp <= layers, f"--pipeline-model-parallel-size/--pp ({pp}) exceeds --num-layers ({layers}); "
                           f"every stage needs at least one layer, so lower --pp.")
    require(layers % pp == 0, f"--num-layers ({layers}) must be divisible by --pp ({pp}); "
                               f"choose a --pp that divides the layer count.")
    vp = _virtual_stages(cfg.parallel, layers)
    require(layers % (pp * vp) == 0,
             f"--num-layers ({layers}) must be divisible by --pp ({pp}) x --virtual-pipeline-size ({vp}); "
             f"change one of them.")
    schedule, m = _schedule_name(cfg.parallel, vp), micro_batches
    if schedule == "interleaved":
        require(pp >= 2, "the interleaved schedule needs --pp >= 2; drop the virtual-stage flags.")
        require(m % pp == 0,
                 f"the interleaved schedule needs micro-batches per step ({m} = --global-batch-size "
                 f"{cfg.training.global_batch_size} / (--micro-batch-size {cfg.training.micro_batch_size} "
                 f"x dp {dp})) divisible by --pp ({pp}); adjust --global-batch-size.")
    return vp, schedule


def _virtual_stages(p: ParallelConfig, num_layers: int) -> int:
    """Model chunks per pipeline rank, from either virtual-stage flag (they must agree)."""
    per_stage, vp = p.num_layers_per_virtual_pipeline_stage, p.virtual_pipeline_size
    if per_stage is None:
        return vp or 1
    require(num_layers % (p.pp * per_stage) == 0,
             f"--num-layers ({num_layers}) must be divisible by --pp ({p.pp}) x "
             f"--num-layers-per-virtual-pipeline-stage ({per_stage}); change one of them.")
    derived = num_layers // (p.pp * per_stage)
    require(vp is None or vp == derived,
             f"--virtual-pipeline-size ({vp}) disagrees with --num-layers-per-virtual-pipeline-stage "
             f"({per_stage}), which gives {derived} chunks; pass only one of them.")
    return derived


def _schedule_name(p: ParallelConfig, vp: int) -> str:
    """The schedule to run with ``vp`` chunks per rank: the flag, or 1f1b / interleaved by default."""
    name = p.pipeline_schedule or ("interleaved" if vp > 1 else "1f1b")
    require(name != "interleaved" or vp > 1,
             "--pipeline-schedule interleaved needs --virtual-pipeline-size (or "
             "--num-layers-per-virtual-pipeline-stage) giving >= 2 chunks per rank.")
    require(name == "interleaved" or vp == 1,
             f"--pipeline-schedule {name} runs one chunk per rank; drop the virtual-stage flags or use "
             f"--pipeline-schedule interleaved.")
    return name


def _check_tensor_parallel(cfg: Config) -> None:
    """The model must split evenly over TP ranks (heads, query groups, MLP width)."""
    tp, m = cfg.parallel.tp, cfg.model
    for what, value in (("--hidden-size", m.hidden_size), ("--num-attention-heads", m.num_attention_heads),
                        ("--num-query-groups", m.query_groups), ("--ffn-hidden-size", m.ffn_size)):
        require(value % tp == 0, f"{what} ({value}) must be divisible by --tensor-model-parallel-size "
                                  f"({tp}); choose a --tp that divides it.")
    cp = cfg.parallel.cp
    require(not cfg.parallel.sequence_parallel or m.seq_length % (tp * cp) == 0,
             f"--seq-length ({m.seq_length}) must be divisible by --tp ({tp})"
             f"{f' x --cp ({cp})' if cp > 1 else ''} with --sequence-parallel.")


def _check_experts(cfg: Config) -> None:
    """The expert grid must suit the model: experts split evenly over --ep, expert widths over --etp, and
    sequence parallelism under TP (as Megatron requires: the MoE layer takes its tokens sequence-sharded)."""
    p, m = cfg.parallel, cfg.model
    experts = m.num_experts
    if experts is None:
        for name, value, unset in (("--ep", p.ep, 1), ("--etp", p.expert_tensor_parallel_size, None)):
            require(value == unset, f"{name} {value} needs a mixture-of-experts model; pass --num-experts E or "
                                    f"drop {name}.")
        return
    require(experts % p.ep == 0, f"--num-experts ({experts}) must be divisible by --expert-model-parallel-size/--ep "
                                 f"({p.ep}); pick an --ep that divides E.")
    for what, width, axis, size in (  # the shared expert is a dense MLP, split over tp like the others
            ("--moe-ffn-hidden-size", m.moe_ffn_size, "--etp", p.etp),
            ("--moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size, "--tp", p.tp)):
        require(width is None or width % size == 0, f"{what} ({width}) must be divisible by {axis} ({size}); "
                                                    f"choose a width that splits evenly.")
    require(p.tp == 1 or p.sequence_parallel, f"--num-experts with --tp {p.tp} needs --sequence-parallel (the MoE "
                                              f"layer routes sequence-sharded tokens, as in Megatron); add it.")
    require(not (m.moe_pad_expert_input_to_capacity and p.moe_token_dispatcher_type == "allgather"),
            "--moe-pad-expert-input-to-capacity needs --moe-token-dispatcher-type alltoall (the all-gather "
            "dispatcher's exchanges have a fixed size already); drop one of them.")


def _check_context_parallel(cfg: Config) -> CPSplit:
    """The sequence and the heads must split as the CP attention variant needs; returns the token split."""
    p, m = cfg.parallel, cfg.model
    split = CPSplit(cp=p.cp, a2a=p.cp_a2a)
    if p.cp == 1:
        return split
    split.check(m.seq_length)
    heads, groups = m.num_attention_heads // p.tp, m.query_groups // p.tp
    if p.cp_a2a > 1:
        require(heads % p.cp_a2a == 0,
                f"--cp-comm-type {p.cp_comm_type} splits each TP rank's {heads} attention heads (--num-attention-"
                f"heads {m.num_attention_heads} / --tp {p.tp}) over {p.cp_a2a} ranks, which does not divide them; "
                f"use --cp-comm-type p2p, a smaller {'--cp' if p.cp_comm_type == 'a2a' else '--cp-a2a-size'}, "
                f"or a head count divisible by it.")
        require(groups % p.cp_a2a == 0 or p.cp_a2a % groups == 0,
                f"--cp-comm-type {p.cp_comm_type}: each TP rank's {groups} key/value heads (--num-query-groups "
                f"{m.query_groups} / --tp {p.tp}) neither divide among nor replicate evenly over {p.cp_a2a} ranks; "
                f"use --cp-comm-type p2p or a --num-query-groups that divides or is divided by it.")
    require(m.attention_dropout == 0.0,
            f"--attention-dropout ({m.attention_dropout}) is not supported with --cp {p.cp}: each rank sees only "
            f"blocks of the attention matrix; set --attention-dropout 0 (Megatron's default for long context).")
    return split
