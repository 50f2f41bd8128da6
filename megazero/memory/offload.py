"""Offload in the planner: what leaves the device, where it goes, and an assumed cost per step.

Bytes per rank, following the stores of ``optimizer/offload.py`` (n = this rank's shard
elements over every bucket, each bucket padded as ``data_parallel/buffers.py`` pads it:
the dp-th of the padded bucket under ZeRO 1/2/3, the whole bucket under ZeRO 0):

    --offload-optimizer cpu   the fp32 master and both Adam moments, 12 n bytes, live in host
                              memory; the device keeps no optimizer state. Also 12 (not 8) in
                              fp32 runs: the host keeps its own master, the parameter shard stays
                              where the parameters live.
    --offload-optimizer disk  the same 12 n bytes in one file per rank; the host keeps K buffers
                              (K = --offload-buffers; 1 when the state is a single piece), each
                              of 12 x min(B, largest bucket shard) bytes (B = --offload-buffer-size
                              elements: a larger shard streams through in pieces).
    --offload-params cpu      ZeRO 3: the compute-precision parameter shards, w n bytes, live in
                              host memory; the device keeps only the units gathered at the moment.
    --offload-params disk     ZeRO 3: the shards, w n bytes, live in a file per rank; a gather
                              reads a unit's shards into staging tensors that live only while
                              the unit is gathered (not counted: transient, one unit's shard).
                              A prefetch only starts the read: the unit is gathered when it is
                              needed, so ZeRO 3's replay runs with prefetch 0 (``plan.py``).
    (--offload-params needs --offload-optimizer cpu or disk, as the trainer requires.)
    tests/memory/test_offload_plan.py checks every tier against the optimizer's own records.

Cost per optimizer step (``offload_seconds``): ASSUMPTIONS, not measurements - every
transfer at a documented bandwidth, charged in full without overlap (real runs overlap
the copies with backward and with the next forward, so this is an upper bound):

    optimizer cpu    gradient shard device -> host (g n) and, unless the parameters live on
                     the host, updated parameters host -> device (w n), over PCIe; the AdamW
                     update on the host at ``cpu_adam_rate`` elements per second
    optimizer disk   the above, plus the 12 n bytes read and written once per step at the
                     NVMe read and write bandwidths
    params cpu       every all-gather fetches the shard host -> device: m micro-batches x
                     (2 with reshard-after-forward: forward and backward, else 1) x w n bytes
    params disk      the above, plus each fetch read from disk and the updated shard written
                     back once per step

Defaults (``OffloadHardware``): PCIe Gen4 x16 at 25 GB/s per direction per GPU; one NVMe
drive per GPU at 3 GB/s read and 3 GB/s write; CPU AdamW at 1e9 elements/s per rank (it
moves about 30 bytes per element - reads master, moments, gradient; writes master, moments,
parameter - so this is a ~30 GB/s share of a host's memory bandwidth). Measured on one core of
the 2-core test machine (``bench/RESULTS_cpu_adam.md``): the fused kernel the step runs, 1.44 G
elements/s, DeepSpeed's CPUAdam 1.42, torch's op-by-op AdamW 0.17-0.24; 1e9 leaves room for
cores shared by several ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import Placement

STATE_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq per shard element, in every offload store


@dataclass(frozen=True)
class OffloadHardware:
    """Bandwidths the offload cost is charged at (assumptions; see the module docstring)."""

    host_device_bandwidth: float = 25e9  # bytes/s per direction, PCIe Gen4 x16
    disk_read_bandwidth: float = 3e9  # bytes/s, one NVMe drive per GPU
    disk_write_bandwidth: float = 3e9
    cpu_adam_rate: float = 1e9  # AdamW elements per second per rank on the host


@dataclass(frozen=True)
class OffloadBytes:
    """Bytes moved off the device for one rank (all 0 without offload)."""

    optimizer_host: float = 0.0
    optimizer_disk: float = 0.0
    params_host: float = 0.0
    params_disk: float = 0.0
    params_device: float = 0.0  # ZeRO 3's parameter shards the device no longer holds


def offload_bytes(shards: list[int], w: int, optimizer: Placement, params: Placement,
                  buffers: int, buffer_size: int = 2_000_000) -> OffloadBytes:
    """Where this rank's state goes. ``shards``: shard elements of every bucket of every chunk;
    ``w``: bytes per parameter element; ``optimizer``, ``params``: where the optimizer state and
    the parameter shards live; ``buffers``, ``buffer_size``: the disk tier's host buffers.
    The device's optimizer state (8 or 12 bytes per element in memory) drops to 0 with either tier."""
    n = sum(shards)
    out = {}
    if optimizer is Placement.HOST:
        out.update(optimizer_host=STATE_BYTES * n)
    elif optimizer is Placement.DISK:
        width = min(buffer_size, max(shards, default=0))
        pool = buffers if len(shards) > 1 or sum(shards) > buffer_size else 1
        out.update(optimizer_host=pool * STATE_BYTES * width, optimizer_disk=STATE_BYTES * n)
    if params is Placement.HOST:
        out.update(params_host=w * n, params_device=w * n)
    elif params is Placement.DISK:
        out.update(params_disk=w * n, params_device=w * n)
    return OffloadBytes(**out)


def offload_seconds(n: int, w: int, g: int, micro_batches: int, reshard_after_forward: bool,
                    optimizer: Placement, params: Placement, hw: OffloadHardware = OffloadHardware()) -> float:
    """Assumed seconds a step spends on offload for a rank of ``n`` shard elements (module docstring)."""
    t = 0.0
    if optimizer.offloaded:
        copied = g + (w if not params.offloaded else 0)  # grads down; params back up unless they live there
        t += copied * n / hw.host_device_bandwidth + n / hw.cpu_adam_rate
    if optimizer is Placement.DISK:
        t += STATE_BYTES * n * (1 / hw.disk_read_bandwidth + 1 / hw.disk_write_bandwidth)
    if params.offloaded:
        fetches = micro_batches * (2 if reshard_after_forward else 1)
        t += fetches * w * n / hw.host_device_bandwidth
        if params is Placement.DISK:
            t += fetches * w * n / hw.disk_read_bandwidth + w * n / hw.disk_write_bandwidth
    return t


def describe(hw: OffloadHardware = OffloadHardware()) -> str:
    """The assumptions in one line, for the tables that print an offload cost."""
    return (f"assumed: host<->device {hw.host_device_bandwidth / 1e9:g} GB/s, "
            f"disk read {hw.disk_read_bandwidth / 1e9:g} / write {hw.disk_write_bandwidth / 1e9:g} GB/s, "
            f"CPU AdamW {hw.cpu_adam_rate / 1e9:g} G elements/s; no overlap")
