"""Build a run from a Config: groups, data, the training model (``build_training_model``), schedule, trainer.

Validation that needs no communication (flags, world size, batch arithmetic,
a --load folder's metadata) happens before any process group exists (``prepare_run``), so bad
input fails the same way on every rank and nothing can hang.
"""
from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..checkpoint import load as ckpt_load
from ..checkpoint import storage
from ..checkpoint.checkpointer import open_checkpointer
from ..checkpoint.overridable import document_change_line, overrides_line, preset_yield_line
from ..checkpoint.recorded_data import data_text, merge_data
from ..config import Config, ConfigError
from ..data import DataBundle, MicroBatchIterator, build_data, check_data_tokenizer
from ..memory.params import num_parameters
from ..memory.recompute_choice import resolve_recompute
from ..model.chunk import blocks_of
from ..model.compile import compile_report
from ..model.documents import packing_rule
from ..model.sdpa import describe_attention
from ..optimizer.accounting import memory_records
from ..parallel.layout import check_tp_inside_nodes, contiguous_nodes, describe_nodes
from ..parallel.state import (ParallelState, default_device, gather_nodes, init_distributed,
                              ranks_per_node_from_env, world_size_from_env)
from ..pipeline.partition import dropout_rng
from ..pipeline.schedules import build_schedule, schedule_timeline
from ..run_plan import RunPlan
from ..tensor_parallel.random import DropoutRNG, seed_everything
from .device_setup import apply_determinism, prepare_cuda_env
from .host_memory import keep_freed_host_memory
from .metrics import MetricsLog
from .ownership import own_folders
from .parallelize import TrainingModel, Weights, build_training_model
from .preflight import check_optional_packages, check_output_paths
from .run_identity import RunIdentity
from .startup_report import LoadTimer, report_model, report_start
from .trainer import Trainer
from .wandb_log import NullWandb, WandbRun, open_wandb


def validate(cfg: Config, world_size: int, ranks_per_node: int | None = None) -> RunPlan:
    """Every check that needs only the config, the world size and the ranks per node; raises ConfigError.

    The plan it returns may lack the vocabulary (the tokenizer is read once the groups exist).
    ``ranks_per_node`` (torchrun's LOCAL_WORLD_SIZE; None = one node) places ranks on nodes
    as torchrun numbers them, so a TP group that would span nodes is refused here.
    """
    cfg.refuse_inapplicable()  # what parsing left for a --load checkpoint's model (``Config.from_flat``)
    check_optional_packages(cfg)  # --wandb-project / --tensorboard-dir without their package
    if not cfg.checkpoint.skip_train:  # a model that cannot train still evaluates
        cfg.model.check_trainable()
    plan = RunPlan.resolve(cfg, world_size)
    check_tp_inside_nodes(plan.layout, contiguous_nodes(world_size, ranks_per_node or world_size),
                          cfg.parallel.allow_tp_across_nodes)
    return plan


def find_checkpoint(cfg: Config) -> tuple[str, dict[str, Any]] | None:
    """The --load folder and its metadata, read (and checked) by every rank before any collective.

    None without --load, and on the restart idiom's first start (--load equal to --save, which holds no
    checkpoint yet); a --load elsewhere that holds nothing raises (see ``ckpt_load.starts_fresh``).
    """
    ck = cfg.checkpoint
    _check_load_flags(cfg)
    if not ck.load or ckpt_load.starts_fresh(ck.load, ck.save):
        return None
    folder = storage.resolve(ck.load)
    return folder, storage.read_metadata(folder)


def _check_load_flags(cfg: Config) -> None:
    """--finetune and --skip-train settings that cannot work, refused before anything is read."""
    ck, t = cfg.checkpoint, cfg.training
    if ck.finetune and ck.save and os.path.realpath(ck.load) == os.path.realpath(ck.save):
        raise ConfigError(f"--finetune with --load equal to --save ({ck.save}) would start again from iteration 0 "
                          f"at every restart, from its own latest checkpoint; pass another --save folder.")
    if ck.skip_train and ck.save:  # (so --skip-train never takes the restart idiom's fresh start either)
        raise ConfigError(f"--skip-train only evaluates the --load checkpoint and saves nothing; drop --save "
                          f"{ck.save}.")
    if ck.skip_train and t.eval_iters < 1:
        raise ConfigError("--skip-train with --eval-iters 0 evaluates no batch; pass --eval-iters >= 1.")


def _data(cfg: Config, rank: int, say: Callable,
          found: tuple[str, dict[str, Any]] | None = None) -> tuple[Config, DataBundle]:
    """The datasets, sized for this run, and the config with the tokenizer's vocabulary when none was given.

    A resume needs consumed + remaining steps x the (maybe new) global batch.
    """
    t = cfg.training
    train_samples = t.train_iters * t.global_batch_size
    if found and not cfg.checkpoint.finetune:  # consumed samples carry over when --global-batch-size changed
        # (Megatron users ramp it this way); --finetune reads the data from its start
        done, consumed = int(found[1]["iteration"]), int(found[1]["consumed_samples"])
        train_samples = consumed + max(0, t.train_iters - done) * t.global_batch_size
    data = build_data(data_path=cfg.data.data_path, tokenizer_model=cfg.data.tokenizer_model, split=cfg.data.split,
                      seq_length=cfg.model.seq_length, train_samples=max(1, train_samples),
                      eval_samples=max(1, t.eval_iters) * t.global_batch_size if _evaluates(cfg) else 0,
                      seed=t.seed, is_builder=rank == 0, barrier=dist.barrier, log=say,
                      vocab_size=cfg.model.vocab_size, tokenizer_type=cfg.data.tokenizer_type,
                      data_cache_path=cfg.data.data_cache_path)
    if cfg.model.vocab_size is None:
        return cfg.updated(vocab_size=data.tokenizer.vocab_size), data
    if cfg.model.vocab_size < data.tokenizer.vocab_size:
        tokenizer = cfg.data.tokenizer_model or "the default corpus's tokenizer"
        if "vocab_size" in cfg.explicit or not found:
            raise ValueError(f"--vocab-size ({cfg.model.vocab_size}) is smaller than the vocabulary of "
                             f"{tokenizer} ({data.tokenizer.vocab_size}); raise it or leave it unset.")
        raise ValueError(f"the checkpoint's vocabulary ({cfg.model.vocab_size}, --load {cfg.checkpoint.load}) is "
                         f"smaller than that of {tokenizer} ({data.tokenizer.vocab_size}); pass the "
                         f"--tokenizer-model the checkpoint was trained with.")
    return cfg, data


def _resume(found: Weights, cfg: Config, plan: RunPlan, pstate: ParallelState, model: TrainingModel,
            rng: DropoutRNG, say: Callable) -> tuple[int, int]:
    """Load what the flags keep of the checkpoint besides its weights (loaded before the optimizer was built):
    optimizer state and generators; returns the (iteration, consumed samples) the run starts from."""
    folder, meta = found
    ck, seed = cfg.checkpoint, cfg.training.seed
    if ck.finetune:  # what a checkpoint converted from HF gives: weights only
        say(f"megazero: --finetune: only the model weights come from {folder}; a fresh optimizer and LR schedule, "
            f"iteration 0, the data from its start and every generator from --seed {seed}")
        return 0, 0
    iteration, consumed = int(meta["iteration"]), int(meta["consumed_samples"])
    if ck.skip_train:  # evaluation reads the weights alone
        return iteration, consumed
    if ck.load_optim:
        ckpt_load.load_optimizer_state(folder, meta, model, pstate)
    else:
        say(f"megazero: --no-load-optim: the optimizer starts fresh at iteration {iteration} (fp32 master weights "
            f"from the loaded weights, zero Adam moments, the initial loss scale)")
    if not ck.load_rng:
        say(f"megazero: --no-load-rng: seeding the default generator and the dropout streams from --seed {seed} "
            f"at iteration {iteration}; the checkpoint's are not restored.")
    elif reseeded := ckpt_load.resume_rng(folder, meta, plan, pstate, rng):  # the kinds a layout change kept
        say(reseeded)
    return iteration, consumed


def _wandb(cfg: Config, plan: RunPlan, pstate: ParallelState, log: MetricsLog) -> WandbRun | NullWandb:
    """The wandb run with --wandb-project (its line says where it is written), else one that logs nothing."""
    lg = cfg.logging
    if not lg.wandb_project:
        return NullWandb()
    run = open_wandb(enabled=pstate.is_logging_rank, project=lg.wandb_project, name=lg.wandb_name,
                     mode=lg.wandb_mode, config={**cfg.to_flat(), "layout": plan.layout_record()},
                     directory=lg.wandb_dir)
    log.print(run.describe())
    return run


def _evaluates(cfg: Config) -> bool:
    """Whether this run evaluates: every --eval-interval, or once with --skip-train."""
    return bool(cfg.training.eval_interval) or cfg.checkpoint.skip_train


def _nothing_to_do(cfg: Config, found: tuple[str, dict[str, Any]] | None) -> str | None:
    """The one line saying that the checkpoint to resume is already at or past --train-iters (then nothing
    trains and nothing is saved over it), else None. Every rank decides from the metadata it read itself."""
    ck = cfg.checkpoint
    if not found or ck.finetune or ck.skip_train or int(found[1]["iteration"]) < cfg.training.train_iters:
        return None  # --finetune starts again at iteration 0; --skip-train trains nothing
    done, wanted = int(found[1]["iteration"]), cfg.training.train_iters
    where = "already at" if done == wanted else "past"
    return (f"megazero: nothing to do: the checkpoint at iteration {done} ({found[0]}) is {where} --train-iters "
            f"{wanted}; raise --train-iters to train further")


def _start(cfg: Config, log_fn: Callable, plan: RunPlan | None = None) -> tuple[RunPlan, ParallelState, Callable]:
    """Validate (before any process group, so bad input fails alike on every rank) unless ``plan`` is the
    validated one, then build the groups."""
    plan = plan or validate(cfg, world_size_from_env(), ranks_per_node_from_env())
    cuda_env = prepare_cuda_env(cfg)  # before anything initialises CUDA (default_device, init_distributed)
    apply_determinism(cfg.training.deterministic)
    device = default_device(cfg.training.device)
    timeout = timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    init_distributed(device, timeout)  # under torchrun, on a store of this restart attempt's own (state.py)
    check_output_paths(cfg)  # an unusable --save/--metrics-file/... fails now, the same on every rank
    say = log_fn if dist.get_rank() == 0 else (lambda *_: None)
    say(f"megazero: building process groups for {plan.layout} on {device}")
    if cuda_env and device.type == "cuda":
        say("megazero: set " + ", ".join(f"{k}={v}" for k, v in cuda_env.items()) + " (see device_setup.py)")
    pstate = ParallelState.build(plan.layout, device, timeout, cp_a2a=plan.cp_split.a2a)
    nodes = gather_nodes(pstate)  # torchrun's node numbers: the same list, so the same verdict, on every rank
    check_tp_inside_nodes(plan.layout, nodes, cfg.parallel.allow_tp_across_nodes)
    if pstate.layout.world_size > 1:
        say(f"megazero: nodes: {describe_nodes(plan.layout, nodes)}")
    return plan, pstate, say


def with_checkpoint_model(cfg: Config) -> Config:
    """The config a run of ``cfg`` trains: with --load, the checkpoint's model (and data settings) merged in
    as ``run`` does (what --dry-run plans: a resume that omits the model flags plans the checkpoint's model)."""
    found = find_checkpoint(cfg)
    return merge_checkpoint(cfg, found, check_files=False)[0] if found else cfg


def merge_checkpoint(cfg: Config, found: tuple[str, dict[str, Any]],
                     check_files: bool = True) -> tuple[Config, list[str], list[str]]:
    """``cfg`` with the --load checkpoint's model, data and tokenizer where no flag gives them (before any
    check reads them); also the model settings it changed and the lines to print after the settings line
    (a preset's model settings it replaced, a data flag that differs from the checkpoint's)."""
    merged, taken = ckpt_load.merge_config(found[1], cfg)
    merged, notes = merge_data(found, merged, check_files)
    yielded = preset_yield_line(cfg, merged)
    return merged, taken, [yielded, *notes] if yielded else notes


@dataclass(frozen=True)
class PreparedRun:
    """What the checks before any process group leave: the config with the --load checkpoint's model, data and
    tokenizer merged in, the validated plan, the checkpoint (None: a fresh start) and what the merge changed
    (the model settings taken, the lines to print after the settings line)."""

    cfg: Config
    plan: RunPlan
    found: Weights | None
    taken: list[str]
    notes: list[str]


def prepare_run(cfg: Config, world_size: int, ranks_per_node: int | None,
                log: Callable[[str], None]) -> PreparedRun | None:
    """Every check of a run before its process groups: find the checkpoint, merge it, validate, nothing to do,
    the data's tokenizer. Raises ConfigError/ValueError on bad input; None when there is nothing to do (its
    line goes to ``log``, rank 0's printer: the run this command asks for is done, exit 0)."""
    found = find_checkpoint(cfg)
    taken: list[str] = []
    notes: list[str] = []
    if found:  # the model, data and tokenizer are the checkpoint's unless typed (before any check uses them)
        cfg, taken, notes = merge_checkpoint(cfg, found)
    plan = validate(cfg, world_size, ranks_per_node)
    idle = _nothing_to_do(cfg, found)
    if idle is not None:  # a requeued job ends here
        log(idle)
        return None
    check_data_tokenizer(cfg.data, log)
    return PreparedRun(cfg, plan, found, taken, notes)


def run(cfg: Config, log_fn=print) -> list[dict]:
    """Train with the world torchrun described; returns the logged records (the main entry point)."""
    first_rank = int(os.environ.get("RANK", "0")) == 0  # no group yet
    prepared = prepare_run(cfg, world_size_from_env(), ranks_per_node_from_env(),
                           log_fn if first_rank else lambda _: None)
    if prepared is None:
        return []
    cfg, found = prepared.cfg, prepared.found
    plan, pstate, say = _start(cfg, log_fn, prepared.plan)
    with ExitStack() as owned:  # every exit from here closes what the run made and releases its folders
        own_folders(cfg, owned)  # --save and --offload-path: one job at a time (ownership.py)
        cfg, plan, data = _prepare(cfg, plan, pstate, say, found, (prepared.taken, prepared.notes))
        report_start(cfg, plan, pstate, data, say)  # the resolved config (and config.yaml), data, offload
        rng = dropout_rng(cfg, pstate)  # the model draws from it; checkpoints save and restore it
        model, start, consumed = _model(cfg, plan, pstate, rng, found, owned, say)
        report_model(model, say)
        loaded = found[0] if found else None
        first_step = [compile_report(sum(len(blocks_of(c)) for c in model.chunks), say)] if cfg.training.compile else []
        trainer = _trainer(cfg, plan, pstate, model, rng, data, start, consumed, owned, loaded, first_step)
        if cfg.checkpoint.skip_train:
            say(f"megazero: --skip-train: evaluating {found[0]} at iteration {start} on --eval-iters "
                f"{cfg.training.eval_iters} batches of the validation split; nothing is trained or saved")
            return [trainer.evaluate()]
        return trainer.train()


def _model(cfg: Config, plan: RunPlan, pstate: ParallelState, rng: DropoutRNG, found: Weights | None,
           owned: ExitStack, say: Callable) -> tuple[TrainingModel, int, int]:
    """The training model (the --load weights in it; it closes with ``owned``) and, from the checkpoint, the
    optimizer state and generators: returns it with the (iteration, consumed samples) the run starts from."""
    load_timer = LoadTimer()
    if found:
        say(f"megazero: loading checkpoint {found[0]} (iteration {found[1]['iteration']})")
    model = build_training_model(cfg, plan, pstate, rng, found, load_timer)  # recompute, compile, DP engine, ...
    owned.callback(model.close)  # --offload-* disk: this rank's files go, on every exit path
    if pstate.device.type == "cpu" and not plan.zero.shards_parameters:  # after the build, whose freed copies
        keep_freed_host_memory()  # of the model go back to the kernel; ZeRO 3: see host_memory.py
    if not found:
        return model, 0, 0
    with load_timer:
        start, consumed = _resume(found, cfg, plan, pstate, model, rng, say)
    say(load_timer.line(found[0]))
    return model, start, consumed


def _prepare(cfg: Config, plan: RunPlan, pstate: ParallelState, say: Callable,
             found: tuple[str, dict[str, Any]] | None,
             merged: tuple[list[str], list[str]]) -> tuple[Config, RunPlan, DataBundle]:
    """The data, the run's plan (the vocabulary is known once the tokenizer is read) and the seeds.
    ``merged``: what ``merge_checkpoint`` changed and its lines."""
    taken, notes = merged
    cfg, data = _data(cfg, pstate.rank, say, found)
    plan = RunPlan.resolve(cfg, plan.world_size)
    cfg = _resolve_recompute(cfg, plan, pstate, say)  # --recompute auto: before the model is built
    if cfg.checkpoint.load and not found:  # the restart idiom, first start
        say(f"megazero: --load {cfg.checkpoint.load} is the --save folder and holds no checkpoint yet; "
            f"starting from scratch (a restart will resume from its latest checkpoint)")
    if found:
        say(f"megazero: model settings taken from the checkpoint's metadata"
            f"{' (' + ', '.join(taken) + ')' if taken else ' (the same as this run)'}; {data_text(cfg)}")
        for note in notes:
            say(note)
        if overridden := overrides_line(found[1], cfg):
            say(overridden)
        if documents := document_change_line(found[1], cfg):
            say(documents)
    if beside := _unloaded_save_line(cfg, found):
        say(beside)
    seed_everything(cfg.training.seed, pstate.pp_rank)
    say(f"megazero: building the {cfg.model.arch} model ({num_parameters(cfg.model, plan.tp) / 1e6:.2f}M "
        f"parameters), {plan.layout}, zero {int(plan.zero)}, {plan.micro_batches} micro-batches per step")
    say("megazero: " + describe_attention(cfg.model, plan.compute_dtype, pstate.device, plan.tp, plan.cp,
                                          plan.cp_comm_type))
    return cfg, plan, data


def _unloaded_save_line(cfg: Config, found: tuple[str, dict[str, Any]] | None) -> str | None:
    """One line when --save already holds a checkpoint this run does not continue: its saves go beside
    that run's, ``latest`` will name its own, and --keep-last counts the older ones too."""
    save = cfg.checkpoint.save
    held = storage.latest_target(save) if save else None
    if not save or not held or (found and os.path.samefile(os.path.dirname(os.path.abspath(found[0])), save)):
        return None
    how = f"--load {cfg.checkpoint.load}" if cfg.checkpoint.load else "no --load"
    rotation = f"; --keep-last {cfg.checkpoint.keep_last} counts those too" if cfg.checkpoint.keep_last else ""
    return (f"megazero: --save {save} already holds {os.path.basename(held)}, which this run does not continue "
            f"({how}): its saves go beside it and `latest` will name them{rotation}; pass --load {save} to "
            f"continue that run instead, or a new --save folder to keep the two apart")


def _resolve_recompute(cfg: Config, plan: RunPlan, pstate: ParallelState, say: Callable) -> Config:
    """--recompute auto: the planner's cheapest mode that fits the smallest budget over the ranks
    (``memory/recompute_choice.py``), so every rank chooses the same; one line on rank 0 says why."""
    def smallest(budget: float) -> float:
        t = torch.tensor([budget], dtype=torch.float64, device=pstate.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return float(t.item())

    cfg, choice = resolve_recompute(cfg, plan, pstate.device.type, ranks_per_node_from_env(), agree=smallest)
    if choice is not None:
        say(choice.describe())
    return cfg


def _trainer(cfg: Config, plan: RunPlan, pstate: ParallelState, model: TrainingModel, rng: DropoutRNG,
             data: DataBundle, start: int, consumed: int, owned: ExitStack, loaded: str | None,
             on_first_step: list[Callable[[], None]]) -> Trainer:
    """The loop over this run's batches; the metrics file, wandb and the checkpointer close with ``owned``
    (an error exit lets a pending --async-save's writer end and publishes nothing)."""
    batches = MicroBatchIterator.from_plan(data.train, plan, pstate.dp_rank, consumed_samples=consumed)
    eval_batches = None
    if data.valid is not None and _evaluates(cfg):
        eval_batches = lambda: MicroBatchIterator.from_plan(data.valid, plan, pstate.dp_rank)  # noqa: E731
    log = MetricsLog(cfg.logging.metrics_file, pstate.is_logging_rank, tensorboard_dir=cfg.logging.tensorboard_dir)
    owned.callback(log.close)
    identity = RunIdentity.agreed(cfg, loaded, pstate)  # a resume continues its checkpoint's run id
    log.record(identity.start_record(cfg, plan, start))  # marks where this run starts in the metrics file
    log.print(identity.line())
    for record in memory_records(model, pstate):  # model-state bytes of every rank
        log.record(record)
    wandb = _wandb(cfg, plan, pstate, log)
    owned.callback(wandb.finish)
    checkpointer = open_checkpointer(cfg, plan, pstate, model, rng, loaded, run_id=identity.run_id)
    owned.callback(checkpointer.close)
    schedule = build_schedule(plan, timeline=schedule_timeline(cfg.logging, pstate),
                              packing=packing_rule(cfg.data, data.tokenizer.eos_id))
    return Trainer(cfg, pstate, model, schedule, batches, log,
                   start_iteration=start, eval_batches=eval_batches, checkpointer=checkpointer, wandb=wandb,
                   on_first_step=on_first_step)
