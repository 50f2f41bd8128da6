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
import socket
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .collectives import CommLedger, Group, all_gather_object
from .expert_layout import ExpertCoords
from .layout import Coords, Layout


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


class Degrees:
    """The parallel degrees of what holds a ``layout`` (``ParallelState``, ``RunPlan``): one spelling, as in
    ``Layout`` and the config (``tp``, ``dp``, ``pp``, ``cp``, ``ep``, ``etp``), written once."""

    layout: Layout

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
    def cp(self) -> int:
        return self.layout.cp

    @property
    def dp_cp(self) -> int:
        return self.layout.dp * self.layout.cp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def etp(self) -> int:
        return self.layout.expert_tp

    @property
    def edp(self) -> int:
        return self.layout.expert.edp

    @property
    def world_size(self) -> int:
        return self.layout.world_size


@dataclass
class ParallelState(Degrees):
    layout: Layout
    rank: int
    coords: Coords
    device: torch.device
    tp_group: Group = None
    dp_group: Group = None
    cp_group: Group = None
    dp_cp_group: Group = None  # the ranks with the same weights: gradient averaging and ZeRO shards
    cp_a2a_group: Group = None  # CP all-to-all group (--cp-comm-type a2a / a2a+p2p)
    cp_ring_group: Group = None  # CP ring (p2p / a2a+p2p)
    pp_group: Group = None
    model_parallel_group: Group = None
    embedding_group: Group = None
    tp_cp_group: Group = None  # the ranks that share one sequence (tp x cp): routing token counts reduce here
    ep_group: Group = None  # expert grid (expert_layout.py): the experts spread over it, tokens dispatched in it
    etp_group: Group = None  # one expert's weights split over it (the tp group when --etp = --tp)
    edp_group: Group = None  # same expert shard: expert gradients average here (dp_cp's group when they agree)
    world_group: Group = None  # every rank (stop signal, checkpoint votes, start-up records)
    ledger: CommLedger = field(default_factory=CommLedger)  # bytes and blocked time of these groups

    # -- construction --------------------------------------------------------------------
    @classmethod
    def serial(cls, device: str | torch.device = "cpu") -> "ParallelState":
        """One process, no torch.distributed: the reference every parity test compares to."""
        return cls(layout=Layout(1, 1, 1), rank=0, coords=Coords(0, 0, 0), device=torch.device(device))

    @classmethod
    def build(cls, layout: Layout, device: str | torch.device,
              timeout: timedelta | None = None, cp_a2a: int = 1) -> "ParallelState":
        """Create every group of the grid. All ranks call ``new_group`` for all groups, in one order.

        ``timeout`` bounds every collective on these groups (new groups do not inherit the world's).
        ``cp_a2a``: ranks per CP all-to-all group (1: ring only; ``layout.cp``: all-to-all only).
        """
        assert dist.is_initialized(), "init_distributed() first"
        assert dist.get_world_size() == layout.world_size, (dist.get_world_size(), layout)
        rank = dist.get_rank()
        mine: dict[str, Group] = {}
        a2a_groups, rings = layout.cp_subgroups(cp_a2a)
        for name, groups in (("tp", layout.tp_groups()), ("dp", layout.dp_groups()),
                             ("pp", layout.pp_groups()), ("mp", layout.model_parallel_groups()),
                             ("emb", layout.embedding_groups()), ("cp", layout.cp_groups()),
                             ("dp_cp", layout.dp_cp_groups() if layout.cp > 1 else []),
                             ("cp_a2a", a2a_groups if 1 < cp_a2a < layout.cp else []),
                             ("cp_ring", rings if 1 < cp_a2a < layout.cp else []),
                             *_expert_group_lists(layout)):
            mine[name] = None
            for ranks in groups:
                if len(ranks) == 1:
                    continue  # trivial axis: never a collective, never a group
                handle = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    mine[name] = handle
        mine["world"] = dist.group.WORLD if layout.world_size > 1 else None
        if layout.cp == 1:
            mine["dp_cp"] = mine["dp"]
        if not 1 < cp_a2a < layout.cp:  # a pure form: the one CP group does both jobs (or neither)
            mine["cp_a2a"], mine["cp_ring"] = (mine["cp"], None) if cp_a2a > 1 else (None, mine["cp"])
        _reuse_dense_groups(layout, mine)
        ledger = CommLedger()
        named: list[Group] = []
        for name, handle in mine.items():  # a group doing two jobs keeps its first name (dp_cp at cp 1 is "dp")
            if not any(handle is other for other in named):
                ledger.name_group(handle, name)
                named.append(handle)
        return cls(layout=layout, rank=rank, coords=layout.coords(rank), device=torch.device(device),
                   tp_group=mine["tp"], dp_group=mine["dp"], pp_group=mine["pp"], cp_group=mine["cp"],
                   dp_cp_group=mine["dp_cp"], cp_a2a_group=mine["cp_a2a"], cp_ring_group=mine["cp_ring"],
                   model_parallel_group=mine["mp"], embedding_group=mine["emb"], world_group=mine["world"],
                   tp_cp_group=mine["tp_cp"], ep_group=mine["ep"], etp_group=mine["etp"], edp_group=mine["edp"],
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

    @property
    def cp_rank(self) -> int:
        return self.coords.cp

    @property
    def dp_cp_rank(self) -> int:
        """This rank's index in the dp x cp group (its ZeRO shard)."""
        return self.coords.cp + self.cp * self.coords.dp

    # -- the expert grid (etp x ep x edp x pp over the same ranks; its degrees: ``Degrees``) ----------
    @property
    def expert_coords(self) -> ExpertCoords:
        return self.layout.expert.coords(self.rank)

    @property
    def ep_rank(self) -> int:
        return self.expert_coords.ep

    @property
    def etp_rank(self) -> int:
        return self.expert_coords.etp

    @property
    def edp_rank(self) -> int:
        """This rank's index in its expert-data-parallel group (its ZeRO shard of expert state)."""
        return self.expert_coords.edp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the given pipeline stage in this rank's pipeline."""
        return self.layout.rank(self.tp_rank, self.dp_rank, pp_rank, self.cp_rank)

    @property
    def is_logging_rank(self) -> bool:
        """The rank that knows the loss and prints: last stage, first TP, CP and DP rank."""
        return self.is_last_stage and self.tp_rank == 0 and self.dp_rank == 0 and self.cp_rank == 0


def _expert_group_lists(layout: Layout) -> list[tuple[str, list[list[int]]]]:
    """The groups only MoE needs, each created only where no dense group already holds the same ranks."""
    grid = layout.expert
    return [("tp_cp", layout.tp_cp_groups() if layout.tp > 1 and layout.cp > 1 else []),
            ("ep", grid.ep_groups()),  # always its own group: the ledger's ep axis (all-to-all bytes)
            ("etp", grid.etp_groups() if grid.etp_groups() != layout.tp_groups() else []),
            ("edp", grid.edp_groups() if grid.edp_groups() != layout.dp_cp_groups() else [])]


def _reuse_dense_groups(layout: Layout, mine: dict[str, Group]) -> None:
    """Point the expert names at the dense groups with the same ranks (a dense run creates no extra group)."""
    if not (layout.tp > 1 and layout.cp > 1):
        mine["tp_cp"] = mine["tp"] if layout.cp == 1 else mine["cp"]
    grid = layout.expert
    if grid.etp_groups() == layout.tp_groups():
        mine["etp"] = mine["tp"]
    if grid.edp_groups() == layout.dp_cp_groups():
        mine["edp"] = mine["dp_cp"]


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
        os.environ["MASTER_PORT"] = str(free_port())
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    device_id = device if device.type == "cuda" else None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # a store this attempt's rank 0 hosts (env://)
        dist.init_process_group(backend=backend, device_id=device_id, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend=backend, store=attempt_store(rank, world, timeout or timedelta(minutes=10)),
                            rank=rank, world_size=world, device_id=device_id, timeout=timeout)


_ATTEMPT_KEY = "megazero/attempt_store"  # in the agent's store: "host:port:token" of this attempt's store
_CONNECT_TRY = timedelta(seconds=5)  # how long one try waits on an address before re-reading the key


def attempt_store(rank: int, world: int, timeout: timedelta) -> dist.TCPStore:
    """A store that only this restart attempt's workers use, found through the store torchrun's agent keeps.

    Under torchrun the agent's store outlives its workers (static rendezvous always; c10d unless
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), so a restart that joins it reads the dead attempt's keys (gloo's
    and NCCL's peer addresses under the same names) and connects to dead peers or hangs (pytorch#135712).
    TORCHELASTIC_RESTART_COUNT cannot name the attempt: each node's agent counts for itself. So rank 0 hosts
    a fresh store and publishes its address with a random token; the others re-read the key until its address
    answers with its token. A stale entry names a dead rank 0, whose address refuses the connection.
    """
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    key = f"{_ATTEMPT_KEY}/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    if rank == 0:  # c10d may place rank 0 on another node than the agent's store: publish its own address
        store = dist.TCPStore(os.environ["MASTER_ADDR"], 0, world, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        token = uuid.uuid4().hex
        store.set("token", token)
        host = _own_address(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        agent.set(key, f"{host}:{store.port}:{token}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        host, port, token = agent.get(key).decode().rsplit(":", 2)  # waits up to `timeout` for a first entry
        try:  # a plain connect first: TCPStore's own failed connects print C++ stack traces
            socket.create_connection((host, int(port)), timeout=_CONNECT_TRY.total_seconds()).close()
            store = dist.TCPStore(host, int(port), world, is_master=False, timeout=_CONNECT_TRY)
            if store.get("token").decode() == token:
                store.set_timeout(timeout)
                return store
        except (OSError, RuntimeError):  # refused: a dead rank 0's entry; DistError is a RuntimeError
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank}: no live store at {host}:{port} (torchrun agent key {key}) "
                               f"within {timeout}; is rank 0 running?")
        time.sleep(0.2)


def _own_address(master_addr: str, master_port: int) -> str:
    """This host's address on the route to the agent's store: the one the other nodes reach it by."""
    with socket.create_connection((master_addr, master_port), timeout=_CONNECT_TRY.total_seconds()) as conn:
        return conn.getsockname()[0]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now: the OS picks it (bind to 0), so parallel worlds do not collide."""
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
