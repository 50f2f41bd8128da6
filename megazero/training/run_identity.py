"""Which run a metrics file's records belong to: a run id, and the record that marks where each run starts.

Every start appends ``{"event": "run_start", "run_id": ..., "config": {...}, ...}`` to --metrics-file before
its other records, so two runs written into one file can be told apart (``tools/plot_metrics.py`` draws each
on its own). A resume (--load, not --finetune) continues the run id its checkpoint's metadata records, so a
preempted and resumed run stays one run; a fresh start, a --finetune, or a checkpoint that records no id
(saved before ids existed, or converted from HF) starts a new one. Checkpoints record the id they were saved
under (``CheckpointContext.run_id``).
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from ..checkpoint import storage
from ..config import Config
from ..parallel import collectives as C
from ..parallel.state import ParallelState
from ..run_plan import RunPlan
from .startup_report import config_sections


def new_run_id() -> str:
    """``20261201-221500-3f9a2c``: the UTC start time (ids sort as the runs started) and 6 random hex digits
    (two starts in the same second differ)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


@dataclass(frozen=True)
class RunIdentity:
    """This run's id, and the checkpoint whose run it continues (None: a new run)."""

    run_id: str
    continues: str | None = None

    @classmethod
    def agreed(cls, cfg: Config, loaded: str | None, pstate: ParallelState) -> "RunIdentity":
        """The same identity on every rank: rank 0's, broadcast (rank 0 saves the checkpoints; the metrics file
        may be another rank's). ``loaded``: the checkpoint folder this run starts from, if any."""
        recorded = None
        if loaded and not cfg.checkpoint.finetune:  # --finetune starts again at iteration 0: a new run
            recorded = storage.read_metadata(loaded).get("run_id")
        mine = cls(recorded, loaded) if isinstance(recorded, str) and recorded else cls(new_run_id())
        return C.broadcast_object(mine, 0, pstate.world_group)

    def start_record(self, cfg: Config, plan: RunPlan, start_iteration: int) -> dict[str, Any]:
        """The metrics file's first record of this start. It has no ``iteration`` key: it belongs to no step."""
        return {"event": "run_start", "run_id": self.run_id, "continues": self.continues,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "start_iteration": start_iteration,
                "world_size": plan.world_size, "layout": plan.layout_record(), "config": config_sections(cfg)}

    def line(self) -> str:
        if self.continues:
            return f"megazero: run {self.run_id}, continued from {self.continues}"
        return f"megazero: run {self.run_id} (a new run; a --load of its checkpoints continues it)"
