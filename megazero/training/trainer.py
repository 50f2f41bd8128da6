"""The training loop: one global batch per step through the schedule and the optimizer.

Around the step it logs (console line, metrics file, wandb), evaluates on
held-out batches every ``--eval-interval``, saves every ``--save-interval``,
and on SIGTERM/SIGINT finishes the current step, saves and returns, so a
preempted job leaves a checkpoint at the iteration it reached.
"""
from __future__ import annotations

import math
import signal
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..config import Config
from ..optimizer.lr import LRSchedule
from ..parallel import collectives as C
from ..parallel.state import ParallelState
from .evaluate import evaluate, reduce_loss
from .flops import achieved_tflops, device_peak_tflops, flops_per_token
from .logging import MetricsLog, format_eval, format_iteration, peak_memory_bytes


class StopSignal:
    """Remembers SIGTERM/SIGINT instead of dying mid-step; all ranks then agree to stop."""

    def __init__(self) -> None:
        self.received = False
        self.previous = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()

    def agreed(self, device: torch.device) -> bool:
        """True on every rank when any rank was signalled (one tiny all-reduce)."""
        flag = torch.tensor([float(self.received)], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            C.all_reduce(flag, None, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)


class Trainer:
    def __init__(self, cfg: Config, pstate: ParallelState, chunks: list[nn.Module], optimizer: Any,
                 schedule: Callable, batches: Any, log: MetricsLog, *, start_iteration: int = 0,
                 eval_batches: Callable[[], Any] | None = None, save: Callable[[int], None] | None = None, wandb: Any = None) -> None:
        self.cfg, self.pstate, self.chunks = cfg, pstate, chunks
        self.optimizer, self.schedule, self.batches, self.log = optimizer, schedule, batches, log
        self.eval_batches, self.save, self.wandb = eval_batches, save, wandb
        self.lr = LRSchedule(cfg.optimizer, cfg.training.train_iters)
        self.iteration = start_iteration
        self.skipped = self.nan_iterations = 0
        t = cfg.training
        self.flops_per_token = flops_per_token(cfg.model, t.recompute, t.recompute_num_layers)
        self.peak_tflops = device_peak_tflops(pstate.device)
        C.LEDGER.enabled = True  # bytes sent per collective kind and group, taken per step
        C.LEDGER.timing = cfg.logging.log_timers

    def train_step(self) -> tuple[float, Any, float]:
        """Run one global batch; returns (mean loss over the global batch, optimizer result, lr)."""
        micro_batches = [mb.to(self.pstate.device) for mb in self.batches.next_step()]
        for chunk in self.chunks:
            chunk.train()
        self.optimizer.zero_grad()
        losses = self.schedule(self.chunks, micro_batches, self.pstate, self.optimizer.no_sync)
        lr = self.lr(self.iteration + 1)
        result = self.optimizer.step(lr)
        return reduce_loss(losses, self.pstate), result, lr

    def _record(self, loss: float, result: Any, lr: float, elapsed: float) -> dict[str, Any]:
        t = self.cfg.training
        tokens_per_step = t.global_batch_size * self.cfg.model.seq_length
        tflops = achieved_tflops(self.flops_per_token, tokens_per_step, elapsed, self.pstate.layout.world_size)
        record = {
            "iteration": self.iteration, "train_iters": t.train_iters,
            "consumed_samples": self.batches.consumed_samples, "loss": loss, "lr": lr,
            "grad_norm": result.grad_norm, "loss_scale": result.loss_scale,
            "skipped_iterations": self.skipped, "nan_iterations": self.nan_iterations,
            "step_time_ms": 1000 * elapsed, "tokens_per_sec": tokens_per_step / elapsed,
            "tflops_per_device": tflops, "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
            "peak_memory_bytes": peak_memory_bytes(self.pstate.device), "comm_bytes": C.LEDGER.take(),
        }
        if self.cfg.logging.log_timers:
            record["comm_wait_s"] = C.LEDGER.take_wait_seconds()
        timeline = getattr(self.schedule, "timeline", None)
        if timeline is not None:  # this rank's idle share of its schedule call
            record["bubble_fraction"] = timeline.last_bubble_fraction()
        return record

    def _emit(self, record: dict[str, Any], line: str) -> None:
        if self.pstate.is_logging_rank:
            self.log.record(record)
            self.log.print(line)
            if self.wandb is not None:
                self.wandb.log(record, step=record["iteration"])

    def _evaluate(self) -> dict[str, Any]:
        result = evaluate(self.chunks, self.eval_batches(), self.cfg.training.eval_iters, self.pstate)
        record = {"event": "eval", "iteration": self.iteration, **result}
        self._emit(record, format_eval(record))
        return record

    def train(self) -> list[dict[str, Any]]:
        t, every = self.cfg.training, self.cfg.logging.log_interval
        records: list[dict[str, Any]] = []
        stop = StopSignal()
        if self.save is not None:
            stop.install()
        try:
            while self.iteration < t.train_iters:
                C.LEDGER.take_wait_seconds()
                start = time.perf_counter()
                loss, result, lr = self.train_step()
                elapsed = time.perf_counter() - start
                self.iteration += 1
                self.skipped += int(result.skipped)
                self.nan_iterations += int(not math.isfinite(loss) or not math.isfinite(result.grad_norm))
                last = self.iteration == t.train_iters
                if self.iteration % every == 0 or last:
                    record = self._record(loss, result, lr, elapsed)
                    records.append(record)
                    self._emit(record, format_iteration(record))
                else:
                    C.LEDGER.take()
                if self.eval_batches is not None and t.eval_interval and (
                        self.iteration % t.eval_interval == 0 or last):
                    records.append(self._evaluate())
                signalled = self.save is not None and stop.agreed(self.pstate.device)
                interval = self.cfg.checkpoint.save_interval
                if self.save is not None and (last or signalled or (interval and self.iteration % interval == 0)):
                    self.save(self.iteration)
                if signalled:
                    self.log.print(f"megazero: stopped by signal after iteration {self.iteration}; checkpoint saved")
                    break
        finally:
            stop.restore()
        timeline = getattr(self.schedule, "timeline", None)
        if timeline is not None and self.cfg.logging.timeline:
            timeline.write(self.cfg.logging.timeline)
        return records
