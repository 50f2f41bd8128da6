"""ParallelState: the one object that owns the process groups of a run.

Code receives it (or the single group it needs) as an argument; nothing
reads parallel state from module globals, so two worlds in one test session
cannot leak into each other. A group of size 1 is stored as ``None``: every
communication op treats ``None`` as "nothing to do", which lets the same
code run in one process without ``torch.distributed`` at all. The world is a
named group too (``world_group``); no collective falls back to it implicitly.
Each state counts its own collectives in its ``ledger``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .collectives import CommLedger, Group, all_gather_object
from .layout import Coords, Layout


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass
class ParallelState:
    layout: Layout
    rank: int
    coords: Coords
    device: torch.device
    tp_group: Group = None
    dp_group: Group = None
    pp_group: Group = None
    model_parallel_group: Group = None
    embedding_group: Group = None
    world_group: Group = None  # every rank (stop signal, checkpoint votes, start-up records)
    ledger: CommLedger = field(default_factory=CommLedger)  # bytes and blocked time of these groups

    # -- construction --------------------------------------------------------------------
    @classmethod
    def serial(cls, device: str | torch.device = "cpu") -> "ParallelState":
        """One process, no torch.distributed: the reference every parity test compares to."""
        return cls(layout=Layout(1, 1, 1), rank=0, coords=Coords(0, 0, 0), device=torch.device(device))

    @classmethod
    def build(cls, layout: Layout, device: str | torch.device,
              timeout: timedelta | None = None) -> "ParallelState":
        """Create every group of the grid. All ranks call ``new_group`` for all groups, in one order.

        ``timeout`` bounds every collective on these groups (new groups do not inherit the world's).
        """
        assert dist.is_initialized(), "init_distributed() first"
        assert dist.get_world_size() == layout.world_size, (dist.get_world_size(), layout)
        rank = dist.get_rank()
        mine: dict[str, Group] = {}
        for name, groups in (("tp", layout.tp_groups()), ("dp", layout.dp_groups()),
                             ("pp", layout.pp_groups()), ("mp", layout.model_parallel_groups()),
                             ("emb", layout.embedding_groups())):
            mine[name] = None
            for ranks in groups:
                if len(ranks) == 1:
                    continue  # trivial axis: never a collective, never a group
                handle = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    mine[name] = handle
        mine["world"] = dist.group.WORLD if layout.world_size > 1 else None
        ledger = CommLedger()
        for name, handle in mine.items():
            ledger.name_group(handle, name)
        return cls(layout=layout, rank=rank, coords=layout.coords(rank), device=torch.device(device),
                   tp_group=mine["tp"], dp_group=mine["dp"], pp_group=mine["pp"],
                   model_parallel_group=mine["mp"], embedding_group=mine["emb"], world_group=mine["world"],
                   ledger=ledger)

    # -- where this rank sits ---------------------------------------------------------------
    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    # -- the degrees: one spelling, as in Layout, RunPlan and the config (``tp``, ``dp``, ``pp``) --------
    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the given pipeline stage in this rank's pipeline."""
        return self.layout.rank(self.tp_rank, self.dp_rank, pp_rank)

    @property
    def is_logging_rank(self) -> bool:
        """The rank that knows the loss and prints: last stage, first TP and DP rank."""
        return self.is_last_stage and self.tp_rank == 0 and self.dp_rank == 0


def default_device(choice: str = "auto") -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout: timedelta | None = None) -> None:
    """Join the world torchrun described in the environment (a world of 1 without torchrun).

    ``timeout`` (``--distributed-timeout-minutes``) is how long a collective waits for a dead or stuck
    peer before raising, so one lost rank ends the job instead of hanging it (gloo and NCCL alike).
    """
    if dist.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None, timeout=timeout)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def ranks_per_node_from_env() -> int:
    """torchrun's LOCAL_WORLD_SIZE (ranks on this node); without torchrun, every rank shares one node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size_from_env()))


def gather_nodes(pstate: ParallelState) -> list[int]:
    """Each rank's node as torchrun numbered it (GROUP_RANK), in rank order: the truth behind the arithmetic.

    One small all-gather over the world at start-up; without torchrun, rank // ranks per node.
    """
    mine = int(os.environ.get("GROUP_RANK", pstate.rank // ranks_per_node_from_env()))
    return [int(node) for node in all_gather_object(mine, pstate.world_group)]
