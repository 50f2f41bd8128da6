"""The training loop: one global batch per step through the schedule and the optimizer."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

from ..config import Config
from ..optimizer.lr import LRSchedule
from ..parallel import collectives as C
from ..parallel.state import ParallelState
from .logging import MetricsLog, format_iteration, peak_memory_bytes


class Trainer:
    def __init__(self, cfg: Config, pstate: ParallelState, chunks: list[nn.Module], optimizer: Any,
                 schedule: Callable, batches: Any, log: MetricsLog) -> None:
        self.cfg, self.pstate, self.chunks = cfg, pstate, chunks
        self.optimizer, self.schedule, self.batches, self.log = optimizer, schedule, batches, log
        self.lr = LRSchedule(cfg.optimizer, cfg.training.train_iters)
        self.iteration = 0
        self.skipped = 0
        C.LEDGER.enabled = True  # bytes sent per collective kind and group, taken per step

    def train_step(self) -> tuple[float, Any, float]:
        """Run one global batch; returns (mean loss over the global batch, optimizer result, lr)."""
        micro_batches = [mb.to(self.pstate.device) for mb in self.batches.next_step()]
        for chunk in self.chunks:
            chunk.train()
        self.optimizer.zero_grad()
        losses = self.schedule(self.chunks, micro_batches, self.pstate, self.optimizer.no_sync)
        lr = self.lr(self.iteration + 1)
        result = self.optimizer.step(lr)
        return self._mean_loss(losses), result, lr

    def _mean_loss(self, losses: list[torch.Tensor]) -> float:
        """Average of the micro-batch losses over the DP group, broadcast from the last pipeline stage."""
        if not losses and self.pstate.pp_group is None:
            return float("nan")
        loss = torch.stack(losses).float().mean() if losses else torch.zeros((), device=self.pstate.device)
        if losses and self.pstate.dp_group is not None:
            C.all_reduce(loss, self.pstate.dp_group)
            loss /= self.pstate.dp_size
        if self.pstate.pp_group is not None:  # only the last stage computed it; every rank logs it
            C.broadcast(loss, self.pstate.stage_rank(self.pstate.pp_size - 1), self.pstate.pp_group)
        return float(loss)

    def train(self) -> list[dict[str, Any]]:
        t = self.cfg.training
        tokens_per_step = t.global_batch_size * self.cfg.model.seq_length
        records = []
        while self.iteration < t.train_iters:
            start = time.perf_counter()
            loss, result, lr = self.train_step()
            elapsed = time.perf_counter() - start
            comm_bytes = C.LEDGER.take()
            self.iteration += 1
            self.skipped += int(result.skipped)
            if self.iteration % self.cfg.logging.log_interval == 0 or self.iteration == t.train_iters:
                record = {
                    "iteration": self.iteration, "train_iters": t.train_iters,
                    "consumed_samples": self.batches.consumed_samples, "loss": loss, "lr": lr,
                    "grad_norm": result.grad_norm, "loss_scale": result.loss_scale,
                    "skipped_iterations": self.skipped, "step_time_ms": 1000 * elapsed,
                    "tokens_per_sec": tokens_per_step / elapsed,
                    "peak_memory_bytes": peak_memory_bytes(self.pstate.device), "comm_bytes": comm_bytes,
                }
                if getattr(self.schedule, "timeline", None) is not None:  # --timeline: this rank's idle share
                    record["bubble_fraction"] = self.schedule.timeline.last_bubble_fraction()
                records.append(record)
                if self.pstate.is_logging_rank:
                    self.log.record(record)
                    self.log.print(format_iteration(record))
        if getattr(self.schedule, "timeline", None) is not None and self.cfg.logging.timeline:
            self.schedule.timeline.write(self.cfg.logging.timeline)
        return records
