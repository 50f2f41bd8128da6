"""CUDA + an offloaded optimizer (``optimizer/offload.py``): the grad shards' trip to the host and the updated
shards' trip back, on side streams (built by the engine; not on a CPU-only machine, where the step reads the
shards in place)."""
from __future__ import annotations

import torch


class HostTransfers:
    """CUDA + an offloaded optimizer: the grad shards' trip to the host and the updated shards' trip back,
    on side streams, so neither stalls the step (ZeRO-Offload's overlap).

    Down: when a bucket's reduction for the step's last micro-batch retires (``GradSyncEngine._retire``)
    its grad shard is copied, non_blocking, into a pinned fp32 host buffer on the ``down`` stream while
    backward goes on; the step waits for that bucket's event only when it reaches the bucket
    (``host_grad``). A bucket whose shard is summed again after its DP reduction (sequence-parallel or
    tied-embedding segments) is copied after that sum, in ``finish_grads``.
    Up: each updated master shard is copied to the device parameter shard on the ``up`` stream while the
    host runs AdamW on the next bucket; ``params_sent`` then makes the compute stream wait for the copies
    on the GPU (the host never blocks), so the next all-gather or forward reads updated parameters. The
    disk tier reuses its host buffers, so its masters go up through a ring of ``RING`` pinned buffers
    (``ring_numel``: the disk store's buffer width) whose slot is reused only after its copy's event.
    """

    RING = 2

    def __init__(self, buckets: list, persistent_master: bool, ring_numel: int = 0) -> None:
        self.slot = {id(b): i for i, (_, b) in enumerate(buckets)}
        self.late = {id(b) for _, b in buckets if any(s.tp_sync or s.emb_sync for s in b.segments)}
        numels = [b.shard_numel for _, b in buckets]
        self.grads = host_empty(sum(numels))
        self.views = list(self.grads.split(numels)) if numels else []
        self.down_events: dict[int, torch.cuda.Event] = {}
        self.down, self.up = torch.cuda.Stream(), torch.cuda.Stream()
        self.ring = [] if persistent_master else [host_empty(ring_numel) for _ in range(self.RING)]
        self.ring_events: list[torch.cuda.Event | None] = [None] * len(self.ring)
        self.sent_up = 0

    def reset(self) -> None:
        """A new step: no bucket's grads are on their way yet (a skipped step left its events unread)."""
        self.down_events.clear()

    def grad_ready(self, b, shard: torch.Tensor, late_ok: bool = False) -> None:
        """Start copying bucket ``b``'s reduced grad shard to the host (after the compute stream's work on it)."""
        i = self.slot[id(b)]
        if i in self.down_events or (id(b) in self.late and not late_ok):
            return
        self.down.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.down):
            src = shard if shard.dtype == torch.float32 else shard.float()  # bf16 main grads: cast on the device
            self.views[i].copy_(src, non_blocking=True)
            self.down_events[i] = torch.cuda.Event()
            self.down_events[i].record(self.down)

    def finish_grads(self, buckets: list, shard_of) -> None:
        """After the replicated-grad sums: copy every bucket not yet on its way, then fence the compute
        stream behind the copies (the step unscales and clips the device shards in place next)."""
        for buf, b in buckets:
            self.grad_ready(b, shard_of(buf, b), late_ok=True)
        torch.cuda.current_stream().wait_stream(self.down)

    def host_grad(self, i: int) -> torch.Tensor:
        """Bucket ``i``'s grad shard on the host [shard_numel] fp32, once its copy has landed."""
        self.down_events.pop(i).synchronize()
        return self.views[i]

    def send_param(self, buf, b, master: torch.Tensor, lo: int = 0) -> None:
        """Copy updated master ``master`` (host fp32; shard elements [lo, lo + n) of ``b``) into ``b``'s device
        parameter shard, asynchronously."""
        if buf.param_store is not None:  # --offload-params: the shard lives on the host too
            buf.set_param_shard(b, master, lo)
            return
        if self.sent_up == 0:
            self.up.wait_stream(torch.cuda.current_stream())  # nothing still reads this step's parameters
        src = master
        if self.ring:  # the disk tier's buffer is reused for the next bucket: stage through the ring
            k = self.sent_up % len(self.ring)
            if self.ring_events[k] is not None:
                self.ring_events[k].synchronize()
            src = self.ring[k][:master.numel()].copy_(master)
        self.sent_up += 1
        with torch.cuda.stream(self.up):
            dst = buf.param_shard(b)[lo:lo + master.numel()]
            dst.copy_(src.to(buf.device, non_blocking=True))  # cast on the device, as before
            if self.ring:
                self.ring_events[k] = torch.cuda.Event()
                self.ring_events[k].record(self.up)

    def params_sent(self) -> None:
        """The compute stream waits (on the GPU) for every copy up; the next gather or forward is behind it."""
        torch.cuda.current_stream().wait_stream(self.up)
        self.sent_up = 0

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [self.grads, *self.ring])


def host_empty(numel: int) -> torch.Tensor:
    """fp32 host memory, pinned when a GPU will copy to and from it."""
    t = torch.empty(numel, dtype=torch.float32)
    return t.pin_memory() if torch.cuda.is_available() else t


def disk_buffer_width(shard_numels: list[int], buffer_size: int) -> int:
    """Shard elements per host buffer of the disk tier (``--offload-buffer-size``, or less when every bucket's
    shard is smaller): the disk store's buffers and the ring its masters go up through."""
    return min(buffer_size, max(shard_numels, default=0))
