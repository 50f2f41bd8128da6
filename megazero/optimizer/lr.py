"""Learning-rate schedule: linear warm-up, then constant / linear / cosine / WSD decay to min_lr."""
from __future__ import annotations

import math

from ..config import OptimizerConfig


class LRSchedule:
    def __init__(self, cfg: OptimizerConfig, train_iters: int) -> None:
        self.cfg = cfg
        self.decay_iters = cfg.lr_decay_iters or train_iters
        self.warmup_iters = cfg.warmup_iters(self.decay_iters)

    def __call__(self, iteration: int) -> float:
        """LR for (1-based) ``iteration``."""
        cfg, step = self.cfg, iteration
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return cfg.lr * step / self.warmup_iters
        if cfg.lr_decay_style == "constant":
            return cfg.lr
        if step >= self.decay_iters:
            return cfg.min_lr
        span = max(1, self.decay_iters - self.warmup_iters)
        progress = (step - self.warmup_iters) / span
        if cfg.lr_decay_style == "linear":
            factor = 1.0 - progress
        elif cfg.lr_decay_style == "cosine":
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:  # wsd: stable at lr, then a linear cool-down over the last fraction
            decay_start = 1.0 - cfg.lr_wsd_decay_fraction
            factor = 1.0 if progress < decay_start else (1.0 - progress) / max(cfg.lr_wsd_decay_fraction, 1e-12)
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor
