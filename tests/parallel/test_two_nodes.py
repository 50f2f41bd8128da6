"""Two real "nodes" on one machine: torchrun agents in two network namespaces joined by a veth pair.

Each namespace runs one ``torchrun --nnodes 2 --nproc_per_node 2`` agent; they meet through a c10d
rendezvous on the first namespace's address, and gloo talks over the veth only
(GLOO_SOCKET_IFNAME). Two layouts, each against one process's losses:

- tp 2 inside each node x dp 2 across the nodes, ZeRO 1 (every gradient reduce-scatter and
  weight all-gather crosses the link);
- tp 2 inside each node x pp 2 across the nodes (activations and gradients between stages cross it).

Rank 0's start-up line is checked too: it is built from the node number torchrun gave each rank
(GROUP_RANK, gathered), so it also shows that c10d numbers ranks node by node.
Needs root and ``ip netns``; skips with the reason otherwise.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.helpers.launch import ROOT, launch

ITERS = 6
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS), "--log-interval", "1",
         "--lr", "1e-3", "--lr-warmup-iters", "2"]
RTOL = 1e-5  # fp32, as tests/test_pretrain.py: the same math, summed in a different order


@dataclass(frozen=True)
class Nodes:
    """Two namespaces (node 0 holds the rendezvous) and the veth end and address inside each."""

    namespaces: tuple[str, str]
    interfaces: tuple[str, str]
    addresses: tuple[str, str]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def nodes():
    """The namespaces and their link, named from the pid (two suites never collide); always removed."""
    if os.geteuid() != 0:
        pytest.skip("two-node test needs root to create network namespaces (ip netns add)")
    if shutil.which("ip") is None:
        pytest.skip("two-node test needs the `ip` command (iproute2) to create network namespaces")
    pid = os.getpid()
    tag = f"mz{pid}"
    subnet = f"10.{(pid >> 8) & 0xFF}.{pid & 0xFF}"
    made = Nodes((f"{tag}a", f"{tag}b"), (f"{tag}x", f"{tag}y"), (f"{subnet}.1", f"{subnet}.2"))
    created: list[str] = []
    try:
        for ns in made.namespaces:
            result = _ip("netns", "add", ns)
            if result.returncode != 0:
                pytest.skip(f"cannot create a network namespace here (ip netns add: {result.stderr.strip()})")
            created.append(ns)
        steps = [("link", "add", made.interfaces[0], "type", "veth", "peer", "name", made.interfaces[1])]
        for ns, dev, addr in zip(made.namespaces, made.interfaces, made.addresses):
            steps += [("link", "set", dev, "netns", ns), ("-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
                      ("-n", ns, "link", "set", dev, "up"), ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            result = _ip(*step)
            if result.returncode != 0:
                pytest.skip(f"cannot link the namespaces (ip {' '.join(step)}: {result.stderr.strip()})")
        yield made
    finally:
        for ns in created:  # deleting a namespace deletes its end of the veth, and so the pair
            _ip("netns", "del", ns)


def _two_node_run(nodes: Nodes, name: str, port: int, flags: list[str], metrics: str) -> list[str]:
    """One torchrun agent per namespace (2 ranks each); returns each agent's output."""
    agents = []
    for node, (ns, dev) in enumerate(zip(nodes.namespaces, nodes.interfaces)):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                  "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, GLOO_SOCKET_IFNAME=dev)
        # c10d numbers the nodes itself (--node_rank is ignored), by sorted --local-addr here; is_host:
        # torchrun's own guess compares the endpoint with the machine's host name, not with the veth's address
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc_per_node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{nodes.addresses[0]}:{port}",
               "--rdzv-id", f"{nodes.namespaces[0]}-{name}", "--rdzv-conf", f"is_host={int(node == 0)}",
               "--local-addr", nodes.addresses[node], "--max-restarts", "0",
               os.path.join(ROOT, "pretrain_gpt.py"), *SMALL, *flags, "--metrics-file", metrics]
        agents.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, start_new_session=True))
    outputs = []
    try:
        for node, agent in enumerate(agents):
            out, _ = agent.communicate(timeout=300)
            outputs.append(out)
            assert agent.returncode == 0, f"{name}: node {node} agent exited {agent.returncode}:\n{out[-4000:]}"
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)  # the agent and its ranks (their own session)
                agent.wait()
    return outputs


def _losses(path) -> list[float]:
    records = [json.loads(line) for line in open(path).read().splitlines()]
    records = [r for r in records if "event" not in r]
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1)), records
    return [r["loss"] for r in records]


LAYOUTS = [
    # (name, flags, rank 0's line about the nodes)
    ("tp2-inside-dp2-across-zero1", ["--tp", "2", "--zero", "1"],
     "megazero: nodes: 2 nodes x 2 ranks (node n: ranks 2n..2n+1); tp groups inside one node; "
     "dp groups across 2 nodes; pp groups inside one node; pp stage 0 on nodes 0-1"),
    ("tp2-inside-pp2-across", ["--tp", "2", "--pp", "2"],
     "megazero: nodes: 2 nodes x 2 ranks (node n: ranks 2n..2n+1); tp groups inside one node; "
     "dp groups inside one node; pp groups across 2 nodes; pp stage 0 on node 0, 1 on node 1"),
]


def test_two_nodes_train_as_one_process(nodes, tmp_path):
    serial_metrics = tmp_path / "serial.jsonl"
    for rank, r in enumerate(launch("pretrain_gpt.py", [*SMALL, "--metrics-file", str(serial_metrics)], 1,
                                           default_corpus=True)):
        assert r.returncode == 0, f"serial rank {rank}:\n{r.stderr[-3000:]}"
    serial = _losses(serial_metrics)
    for index, (name, flags, nodes_line) in enumerate(LAYOUTS):
        metrics = tmp_path / f"{name}.jsonl"
        outputs = _two_node_run(nodes, name, 29400 + index, flags, str(metrics))
        lines = [line for out in outputs for line in out.splitlines() if line.startswith("megazero: nodes:")]
        assert lines == [nodes_line], f"{name}: start-up lines about nodes: {lines}"
        for it, (a, b) in enumerate(zip(_losses(metrics), serial), start=1):
            assert abs(a - b) <= RTOL * abs(b), f"{name} iteration {it}: {a} vs serial {b}"


def test_tp_group_across_nodes_is_refused_on_every_rank():
    """LOCAL_WORLD_SIZE 1 (one rank per node, as torchrun would set it) and --tp 2: one line, exit 2, no hang."""
    results = launch("pretrain_gpt.py", [*SMALL, "--tp", "2"], 2, timeout=300, env={"LOCAL_WORLD_SIZE": "1"},
                     fresh=True)
    for rank, r in enumerate(results):
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1, f"rank {rank}: exit {r.returncode}\n{r.stderr}"
        for words in ("--tp 2", "1 ranks per node", "--allow-tp-across-nodes"):
            assert words in lines[0], f"{words!r} not in {lines[0]!r}"
