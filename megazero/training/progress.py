"""How far a run is: wall time since training began, an ETA, and the one summary at the end.

The ETA is the remaining iterations times the mean wall time of the last ``WINDOW`` iterations -
evaluations and saves included, since they recur - so it follows a run whose pace changes (a
slower node) without being thrown by one slow step. This run's first step is left out of that
mean once a later one exists: it carries the start-up cost (allocation, compiles, warm caches)
that no later step repeats, and made the first ETA ~2x too high.
"""
from __future__ import annotations

import os
import time
from collections import deque
from typing import Any, Callable

from ..config import Config
from ..pipeline.timeline import rank_path


def clock_time(seconds: float) -> str:
    """``1:02:03`` (hours unbounded), the way a log line reads a duration."""
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class Progress:
    """Marks the wall clock at the end of every iteration; ``fields`` gives a record's elapsed_s and eta_s."""

    WINDOW = 20

    def __init__(self, start_iteration: int, train_iters: int, clock: Callable[[], float] = time.perf_counter):
        self.train_iters, self.clock, self.start_iteration = train_iters, clock, start_iteration
        self.started = clock()
        self.marks: deque[tuple[int, float]] = deque([(start_iteration, self.started)], maxlen=self.WINDOW)

    def elapsed(self) -> float:
        return self.clock() - self.started

    def tick(self, iteration: int) -> None:
        """Iteration ``iteration`` is done (its evaluation and save included)."""
        self.marks.append((iteration, self.clock()))

    def _first_step_in_window(self, iteration: int) -> bool:
        """Whether the window still starts at this run's start and a later step than the first is in it."""
        return self.marks[0][0] == self.start_iteration and len(self.marks) > 1 and iteration > self.marks[1][0]

    def fields(self, iteration: int) -> dict[str, float]:
        """Seconds since training began, and the estimate of the seconds left, at ``iteration``'s step end."""
        now = self.clock()
        first_iteration, first_time = self.marks[1] if self._first_step_in_window(iteration) else self.marks[0]
        per_iteration = (now - first_time) / max(1, iteration - first_iteration)
        return {"elapsed_s": now - self.started, "eta_s": max(0, self.train_iters - iteration) * per_iteration}


def _losses(records: list[dict[str, Any]]) -> str:
    """The last training loss and the last validation loss (with its iteration) the run logged."""
    trained = [r for r in records if "event" not in r]
    evaluated = [r for r in records if r.get("event") == "eval"]
    text = f"final lm loss {trained[-1]['loss']:.6E}"
    if evaluated:
        text += f", validation loss {evaluated[-1]['val_loss']:.6E} (iteration {evaluated[-1]['iteration']})"
    return text


def _timelines(path: str, world_size: int) -> str:
    """The --timeline files every rank wrote: one, or the first and last of them."""
    first, last = rank_path(path, 0), rank_path(path, world_size - 1)
    return f"timeline {first}" + (f" .. {last}" if world_size > 1 else "") + " (Chrome trace: ui.perfetto.dev)"


def _outputs(cfg: Config, latest: str, world_size: int, wandb: str) -> str:
    """Where the run's files are, and the command that plots its metrics. ``wandb``: where its wandb run is
    written ('' for none)."""
    lg, where = cfg.logging, []
    if lg.metrics_file:
        plot = os.path.splitext(lg.metrics_file)[0] + ".png"
        where.append(f"metrics {lg.metrics_file} (plot: .venv/bin/python tools/plot_metrics.py {lg.metrics_file} "
                     f"--output {plot})")
    if cfg.checkpoint.save:
        where.append(f"checkpoints {cfg.checkpoint.save}" + (f" ({latest})" if latest else ""))
    if lg.tensorboard_dir:
        where.append(f"tensorboard {lg.tensorboard_dir} (.venv/bin/tensorboard --logdir {lg.tensorboard_dir})")
    if lg.timeline:
        where.append(_timelines(lg.timeline, world_size))
    if wandb:
        where.append(wandb)
    return "megazero: outputs: " + ("; ".join(where) if where else "none (no --metrics-file, --save, "
                                    "--tensorboard-dir, --timeline or --wandb-project)")


def summary(records: list[dict[str, Any]], cfg: Config, start: tuple[int, int], wall_s: float,
            latest: str = "", *, world_size: int = 1, wandb: str = "") -> list[str]:
    """The end-of-run lines: iterations, tokens, wall time, mean tokens/s, final losses, where the files are.

    ``start``: the (iteration, consumed samples) this run started from. Tokens are those this run trained
    (samples consumed since then x --seq-length); tokens/s is that over the whole wall time of the loop
    (evaluations and saves included). The last record is the iteration the run stopped at (the trainer
    records the last iteration and a signal's, whatever --log-interval).
    """
    trained = [r for r in records if "event" not in r]
    outputs = _outputs(cfg, latest, world_size, wandb)
    if not trained:
        return ["megazero: done: no iteration trained in this run", outputs]
    last = trained[-1]
    tokens = (last["consumed_samples"] - start[1]) * cfg.model.seq_length
    return [f"megazero: done: {last['iteration'] - start[0]} iterations (now at {last['iteration']}/"
            f"{last['train_iters']}), {tokens} tokens in "
            f"{clock_time(wall_s)} ({wall_s:.1f} s), {tokens / max(wall_s, 1e-9):.0f} tokens/s; {_losses(records)}",
            outputs]
