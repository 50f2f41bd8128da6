"""The training loop: one global batch per step through the schedule and the optimizer.

Around the step it logs (console line, metrics file, wandb), evaluates on
held-out batches every ``--eval-interval``, saves every ``--save-interval``,
and on SIGTERM/SIGINT finishes the current step, logs and saves it and returns, so a
preempted job leaves a checkpoint (and a record) at the iteration it reached; a second
signal ends the process at once, even inside a collective (``stop_signal``). Every orderly
stop (the end, a signal, a diverged run) concludes a pending --async-save
before it leaves and says what ``latest`` names.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from ..checkpoint.checkpointer import Checkpointer, NullCheckpointer
from ..config import Config
from ..data.sampler import to_device
from ..model.documents import attended_share
from ..model.flops import flops_per_token
from ..optimizer.lr import LRSchedule
from ..optimizer.protocol import TrainingOptimizer
from ..optimizer.qk_clip import qk_clip_step
from ..parallel.state import ParallelState, group_rank, group_size
from ..parallel.timer import DeviceTimer
from ..pipeline.runner import Schedule, reduce_loss
from .evaluate import evaluate
from .flops import achieved_tflops, device_peak_tflops
from .metrics import MetricsLog, OptimizerFields, format_eval, format_iteration, peak_memory_bytes
from .moe_step import moe_step
from .mtp_step import mtp_step
from .parallelize import TrainingModel
from .progress import Progress, summary
from .stop_signal import StopSignal
from .step_record import StepRecorder
from .wandb_log import NullWandb, WandbRun

NO_CHECKPOINTS, NO_WANDB = NullCheckpointer(), NullWandb()  # the defaults: a run that saves and logs nothing


class AgreedStop(ValueError):
    """An error every rank raises at the same point of the same step (a diverged run), so the way out may
    still run collectives; one that only some ranks raise must not (``Checkpointer.close``)."""


class Trainer:
    """The loop over one run's steps of ``model`` (``build_training_model``). Its optional parts are objects that
    may do nothing: ``checkpointer`` (``NullCheckpointer``: no --save), ``wandb`` (``NullWandb``),
    ``on_first_step`` (callbacks run once, after this run's first step: the --compile report)."""

    def __init__(self, cfg: Config, pstate: ParallelState, model: TrainingModel, schedule: Schedule, batches: Any,
                 log: MetricsLog, *, start_iteration: int = 0, eval_batches: Callable[[], Any] | None = None,
                 checkpointer: Checkpointer = NO_CHECKPOINTS, wandb: WandbRun | NullWandb = NO_WANDB,
                 on_first_step: Sequence[Callable[[], None]] = ()) -> None:
        self.cfg, self.pstate, self.model, self.chunks = cfg, pstate, model, model.chunks
        self.optimizer: TrainingOptimizer = model.optimizer
        self.schedule, self.batches, self.log = schedule, batches, log
        self.eval_batches, self.checkpointer, self.wandb = eval_batches, checkpointer, wandb
        self.on_first_step = on_first_step
        # evaluation is decided once: every --eval-interval when the run has a validation split
        self.eval_interval = cfg.training.eval_interval if eval_batches is not None else 0
        self.lr = LRSchedule(cfg.optimizer, cfg.training.train_iters)
        self.iteration = start_iteration
        self.start = (start_iteration, batches.consumed_samples)  # where this run began, for the summary
        self.progress = Progress(start_iteration, cfg.training.train_iters)  # elapsed_s, eta_s
        self.skipped = self.nan_iterations = self.consecutive_skips = 0  # see _count
        t = cfg.training
        self.flops_per_token = flops_per_token(cfg.model, t.recompute, t.recompute_num_layers)  # what runs
        self.model_flops_per_token = flops_per_token(cfg.model)  # MFU's numerator leaves recompute out (PaLM)
        self.peak_tflops = device_peak_tflops(pstate.device)
        ring = (group_rank(pstate.cp_ring_group), group_size(pstate.cp_ring_group))
        self.ring = ring if ring[1] > 1 else None  # under a ring, this rank counts its own queries' pairs
        self.step_record = StepRecorder(pstate.rank)  # only with $MEGAZERO_RECORD_STEPS (bitwise refactor checks)
        self.moe = moe_step(cfg.model, pstate, self.chunks)  # expert bias updates, balance records; null when dense
        self.mtp = mtp_step(cfg.model, pstate, self.chunks)  # each MTP depth's loss; null without --mtp-num-layers
        self.qk_clip = qk_clip_step(cfg, pstate, self.chunks, model.optimizer)  # MuonClip; null without the flag
        self.optimizer_fields = OptimizerFields(cfg.optimizer.optimizer)  # its name; Muon's NS time per step
        pstate.ledger.enabled = True  # bytes sent per collective kind and group, taken per step
        pstate.ledger.timing = cfg.logging.log_timers

    def train_step(self) -> tuple[float, Any, float]:
        """Run one global batch; returns (mean loss over the global batch, optimizer result, lr)."""
        micro_batches = [to_device(mb, self.pstate.device) for mb in self.batches.next_step()]
        for chunk in self.chunks:
            chunk.train()
        self.optimizer.zero_grad()
        self.qk_clip.start_step()  # the step's max logits collect from here; the step clips them
        losses = self.schedule(self.chunks, micro_batches, self.pstate, self.optimizer.no_sync)
        lr = self.lr(self.iteration + 1)
        result = self.optimizer.step(lr)
        self.moe.after_step()  # the step's token counts, reduced: the aux-loss-free bias update
        self.mtp.after_step()  # the step's MTP losses, per depth
        return reduce_loss(losses, self.pstate), result, lr

    def _count(self, loss: float, result: Any) -> bool:
        """Update the counters; True when this iteration was a NaN iteration.

        ``skipped_iterations``: steps not applied, any reason (fp16 loss-scale search included).
        ``nan_iterations``: the loss or grad norm was non-finite for a reason the fp16 loss scale
        does not explain (``result.nonfinite``, or a non-finite loss). ``consecutive_skips``: NaN
        iterations skipped in a row; an applied step resets it, a loss-scale search skip leaves it.
        """
        nonfinite = result.nonfinite or not math.isfinite(loss)
        self.skipped += int(result.skipped)
        self.nan_iterations += int(nonfinite)
        if not result.skipped:
            self.consecutive_skips = 0
        elif nonfinite:
            self.consecutive_skips += 1
        return nonfinite

    def _check_skips(self, loss: float, result: Any) -> None:
        """Stop a diverged run (every rank agrees: the skip decision and the loss are agreed)."""
        limit = self.cfg.training.max_skipped_steps
        if limit and self.consecutive_skips >= limit:
            raise AgreedStop(
                f"training stopped at iteration {self.iteration}: {self.consecutive_skips} consecutive steps "
                f"were skipped because the loss ({loss}) or the global grad norm ({result.grad_norm}) was not "
                f"finite; lower --lr (now peak {self.cfg.optimizer.lr}) or check the data, or raise "
                f"--max-skipped-steps (now {limit}; 0 = never stop).")

    def _step_flops(self) -> tuple[float, float]:
        """(FLOPs per token as run, model FLOPs per token) of the step just taken. Under --reset-attention-mask
        the attention core counts only the pairs the mask left in this rank's micro-batches (their boundaries,
        found once by the schedule); otherwise the fixed full-causal counts."""
        docs = self.schedule.documents
        if not docs or docs[0].bounds is None:
            return self.flops_per_token, self.model_flops_per_token
        share = attended_share([d.bounds for d in docs if d.bounds is not None], self.ring)
        t = self.cfg.training
        return (flops_per_token(self.cfg.model, t.recompute, t.recompute_num_layers, attended_share=share),
                flops_per_token(self.cfg.model, attended_share=share))

    def _mfu(self, model_flops_token: float, tokens_per_step: int, elapsed: float) -> float | None:
        """Model FLOPs (no recomputation) per second per device over the device's peak; None without one."""
        if not self.peak_tflops:
            return None
        model = achieved_tflops(model_flops_token, tokens_per_step, elapsed, self.pstate.layout.world_size)
        return model / self.peak_tflops

    def _record(self, loss: float, result: Any, lr: float, elapsed: float) -> dict[str, Any]:
        t = self.cfg.training
        tokens_per_step = t.global_batch_size * self.cfg.model.seq_length
        run_flops, model_flops = self._step_flops()
        tflops = achieved_tflops(run_flops, tokens_per_step, elapsed, self.pstate.layout.world_size)
        moe = self.moe.fields()  # collectives on every rank; their bytes count in this step's comm_bytes
        moe.update(self.mtp.fields())  # the same: each MTP depth's global mean loss
        record = {
            "iteration": self.iteration, "train_iters": t.train_iters,
            "consumed_samples": self.batches.consumed_samples, "loss": loss, "lr": lr,
            "grad_norm": result.grad_norm, "loss_scale": result.loss_scale, "skipped": result.skipped,
            "skipped_iterations": self.skipped, "nan_iterations": self.nan_iterations,
            "step_time_ms": 1000 * elapsed, "tokens_per_sec": tokens_per_step / elapsed,
            "tflops_per_device": tflops, "mfu": self._mfu(model_flops, tokens_per_step, elapsed),
            "peak_memory_bytes": peak_memory_bytes(self.pstate.device), "comm_bytes": self.pstate.ledger.take(),
            **self.progress.fields(self.iteration), **moe, **self.optimizer_fields.fields(),
            **self.qk_clip.fields(),
        }
        if self.cfg.logging.log_timers:
            record["comm_wait_s"] = self.pstate.ledger.take_wait_seconds()
        record.update(self.schedule.timeline.step_fields())  # a pipeline's bubble: this rank's idle share
        return record

    def _emit(self, record: dict[str, Any], line: str) -> None:
        if self.pstate.is_logging_rank:
            self.log.record(record)
            self.log.print(line)
            self.wandb.log(record, step=record["iteration"])

    def evaluate(self) -> dict[str, Any]:
        """Validation loss and perplexity at this iteration, logged and recorded (also all --skip-train does)."""
        result = evaluate(self.chunks, self.eval_batches(), self.cfg.training.eval_iters, self.pstate,
                          self.schedule.stage_shape, self.schedule.dtype, self.schedule.packing)
        record = {"event": "eval", "iteration": self.iteration, **result}
        self._emit(record, format_eval(record))
        return record

    def _stop_agreed(self, err: AgreedStop) -> AgreedStop:
        """An error every rank raised at the same point: collectives still work, so a pending --async-save
        is concluded as at the end of training (published if every rank's write finished, else refused on
        every rank, said in one line); the error leaves saying what ``latest`` names on disk."""
        try:
            self.checkpointer.finish()
        except Exception as failed:  # noqa: BLE001 - the save's vote: every rank raised (its own or the reported)
            self.log.print(f"megazero: stopping: {failed}")
        latest = self.checkpointer.latest()
        return AgreedStop(f"{err} {latest}." if latest else str(err))

    def train(self) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = []
        stop = StopSignal(self.pstate.rank)
        if self.checkpointer.saves:  # with nothing to save first, a signal keeps its default action
            stop.install()
        try:
            try:  # every orderly stop concludes a pending --async-save before it leaves
                signalled = self._loop(records, stop)
                self.checkpointer.finish()  # the end of training or a signal's save: wait, vote, publish
            except AgreedStop as err:
                raise self._stop_agreed(err) from err
            if self.cfg.logging.timeline:  # before the outputs line that names it
                self.schedule.timeline.write(self.cfg.logging.timeline)
            for line in summary(records, self.cfg, self.start, self.progress.elapsed(), self.checkpointer.latest(),
                                world_size=self.pstate.layout.world_size, wandb=self.wandb.where()):
                self.log.print(line)  # before a signal's last line, which says what was saved
            if signalled:
                latest = self.checkpointer.latest()
                self.log.print(f"megazero: stopped by signal after iteration {self.iteration}; checkpoint saved"
                               + (f", {latest}" if latest else ""))
        finally:
            stop.restore()
        return records

    def _loop(self, records: list[dict[str, Any]], stop: StopSignal) -> bool:
        """Train to --train-iters or a signal (True); a diverged run raises ``AgreedStop`` on every rank."""
        t, every = self.cfg.training, self.cfg.logging.log_interval
        while self.iteration < t.train_iters:
            self.pstate.ledger.take_wait_seconds()
            self.optimizer_fields.start_step()
            timer = DeviceTimer(self.pstate.device).start()  # CUDA events on CUDA, perf_counter on CPU
            loss, result, lr = self.train_step()
            elapsed = timer.stop().seconds()
            if self.iteration == self.start[0]:  # this run's first step (graphs compile in it)
                for callback in self.on_first_step:
                    callback()
            self.iteration += 1
            nonfinite = self._count(loss, result)
            self.step_record.record(self.iteration, loss, result.grad_norm)
            last = self.iteration == t.train_iters
            signalled = self.checkpointer.saves and stop.agreed(self.pstate)  # decided before the record:
            if self.iteration % every == 0 or last or nonfinite or signalled:  # the iteration a run stops at
                record = self._record(loss, result, lr, elapsed)  # is always shown (and a NaN iteration)
                records.append(record)
                self._emit(record, format_iteration(record))
            else:
                self.pstate.ledger.take()
            self._check_skips(loss, result)
            if self.eval_interval and (self.iteration % self.eval_interval == 0 or last):
                records.append(self.evaluate())
            self.checkpointer.poll()  # --async-save: publish a background save every rank has written
            interval = self.cfg.checkpoint.save_interval
            if last or signalled or (interval and self.iteration % interval == 0):
                self.checkpointer.save(self.iteration, self.batches.consumed_samples)
            if signalled:
                return True
            self.progress.tick(self.iteration)
        return False
