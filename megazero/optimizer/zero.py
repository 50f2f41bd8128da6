"""The distributed AdamW (ZeRO 0/1/2/3): the gradient-sync engine (``data_parallel/engine.py``) composed with
the step; with ``--optimizer muon`` the update itself is ``muon_shards.ShardedMuon``'s (Muon + AdamW), in two
sweeps of the store (in memory, on the host or on disk), whose second moment holds the AdamW-trained elements only.

The engine owns the buckets and every data-parallel collective; this module is
the step that runs on the reduced shards once the engine has finished:

    step()      wait for the engine's reductions and replicated-grad sums; unscale +
                overflow check (fp16); global norm (summed in fp64); skip on overflow
                or a non-finite norm; clip; AdamW on the fp32 master shard where the
                store keeps it (``offload.py``: device, host or disk, bucket by bucket);
                cast back into the parameter buffer; the engine all-gathers the updated shards.

It also implements ``ShardedOptimizerState`` (``protocol.py``), the interface
checkpoints save and load through.
"""
from __future__ import annotations

import math
from contextlib import AbstractContextManager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..config import ModelConfig, OptimizerConfig, Placement
from ..parallel import collectives as C
from ..parallel.state import ParallelState
from ..run_plan import StatePlacement
from ..data_parallel.buffers import ParamGradBuffer
from ..data_parallel.layout import Bucket, merged_runs
from ..data_parallel.engine import GradSyncEngine
from ..data_parallel.host_transfers import HostTransfers
from ..data_parallel.rank_file import OffloadError
from .adam import AdamHyper, StepResult, adamw_shard_step, decay_runs
from .grads import clip_coefficient, counts_for_norm, nonfinite_probe, sum_squares_fp64
from .muon_shards import ShardedMuon
from .offload import ShardOnDemand, build_store
from .pieces import kept_in, runs_in
from .scaler import DynamicLossScaler


Views = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # a piece of the store: master, exp_avg, exp_avg_sq


class DistributedOptimizer:
    """AdamW (``cfg``) on the shards of ``sync``, the gradient-sync engine it steps (its ZeRO stage, buckets and
    placement are the engine's settings); the trainer's optimizer interface.

    ``scaler`` (fp16): the dynamic loss scale whose hook ``training/parallelize.py`` put on the chunks.
    ``muon`` (``--optimizer muon``): the chunks' model config and each parameter's name in its chunk, which the
    split and fused-weight rules read; the step is then ``muon_shards.ShardedMuon``'s.
    """

    def __init__(self, sync: GradSyncEngine, cfg: OptimizerConfig, scaler: DynamicLossScaler | None = None,
                 muon: tuple[ModelConfig, dict[nn.Parameter, str]] | None = None) -> None:
        pstate, placement = sync.pstate, sync.settings.placement
        self.cfg, self.pstate, self.zero, self.scaler, self.sync = cfg, pstate, sync.stage, scaler, sync
        self.buffers: list[ParamGradBuffer] = self.sync.buffers
        self.decay_runs = [[decay_runs(b.segments) for b in buf.buckets] for buf in self.buffers]
        self.bucket_list = [(buf, b) for buf in self.buffers for b in buf.buckets]  # the store's bucket order
        self.muon: ShardedMuon | None = None
        cuts, kept = [r for runs in self.decay_runs for r in runs], None
        try:
            if cfg.optimizer == "muon":  # one moment for Muon's elements: the store keeps exp_avg_sq for AdamW's
                assert muon is not None, "--optimizer muon needs the model config and parameter names"
                self.muon = ShardedMuon(self.bucket_list, [sync.groups[buf.expert] for buf, _ in self.bucket_list],
                                        muon[1], muon[0], cfg, pstate)
                kept = [self.muon.kept(i) for i in range(len(self.bucket_list))]
                cuts = [(sorted([(s.lo, s.hi) for s in b.segments]), []) for _, b in self.bucket_list]  # segments
            self.store = _agreed_store([[_initial_shard(buf, b) for b in buf.buckets] for buf in self.buffers],
                                       placement, pstate, cuts, kept)
        except BaseException:  # no optimizer to close yet: the engine made above closes now
            self.sync.close()
            raise
        self.norm_runs = [[_norm_runs(b, sync, counted=True) for b in buf.buckets] for buf in self.buffers]
        self.probe_runs = [[_norm_runs(b, sync, counted=False) for b in buf.buckets] for buf in self.buffers]
        self.step_count = 0
        self.after_update: Callable[[], None] | None = None  # --qk-clip-threshold: ``qk_clip.QKClip.clip``

    @property
    def transfers(self) -> HostTransfers | None:
        """CUDA + offloaded state: the engine's grads-down / params-up copies on side streams."""
        return self.sync.transfers

    # -- the trainer's interface ------------------------------------------------------------
    def zero_grad(self) -> None:
        self.sync.zero_grad()

    def no_sync(self) -> AbstractContextManager[None]:
        """Backwards inside only accumulate: buckets launch no communication."""
        return self.sync.no_sync()

    def wait_param_gather(self) -> None:
        """Block until every updated parameter has arrived (before reading weights outside forward)."""
        self.sync.wait_param_gather()

    @torch.no_grad()
    def host_copies(self, keep: bool) -> dict[nn.Parameter, torch.Tensor]:
        """CPU copies of every parameter of this rank's chunks when ``keep`` (else {}; a collective over DP
        under ZeRO 3, so every DP rank calls it). ZeRO 3 gathers one unit at a time for the copy."""
        self.sync.wait_param_gather()
        units = self.sync.units
        batches = [[p for buf in self.buffers for p in buf.params]] if units is None else units.one_unit_at_a_time()
        copies: dict[nn.Parameter, torch.Tensor] = {}
        for params in batches:
            if keep:
                copies.update({p: p.detach().to("cpu", copy=True) for p in params})
        return copies

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        """Reduce, unscale, norm, clip and apply AdamW (or Muon + AdamW); or skip, agreed on every rank.

        A step is skipped (weights, fp32 master weights, moments and step count untouched) when fp16
        grads overflow (the scale halves) or, in any precision, when the global norm is not finite:
        ``min(1, c / nan)`` is 1 and ``c / inf`` is 0, so clipping cannot save such a step.
        """
        self.sync.wait_param_gather()
        self.sync.finish()
        grads = [[g.float() for g in gs] for gs in self.sync.grad_shards()]  # fp32 [shard]
        scale = unscaled_by = None
        if self.scaler is not None:
            at_floor = self.scaler.scale <= self.scaler.min_scale  # halving cannot help any more
            unscaled_by = self.scaler.scale  # update() may change it; the host grads are unscaled by this one
            found_inf = self._unscale_and_check(grads, unscaled_by)
            self.scaler.update(found_inf)
            scale = self.scaler.scale
            if found_inf:
                return StepResult(grad_norm=float("nan"), skipped=True, loss_scale=scale, nonfinite=at_floor)
        norm = self._global_norm(grads)
        if not math.isfinite(norm):
            return StepResult(grad_norm=norm, skipped=True, loss_scale=scale, nonfinite=True)
        coef = clip_coefficient(norm, self.cfg.clip_grad)
        self.step_count += 1
        hyper = AdamHyper(lr=lr, weight_decay=self.cfg.weight_decay, beta1=self.cfg.adam_beta1,
                          beta2=self.cfg.adam_beta2, eps=self.cfg.adam_eps)
        flat_grads = [g for gs in grads for g in gs]
        if self.muon is not None:
            self._muon_step(self.muon, flat_grads, coef, lr, unscaled_by)
        else:
            self._adamw_step(flat_grads, coef, hyper, unscaled_by)
        if self.after_update is not None:  # QK-clip scales the updated master weights before the gather
            self.after_update()
        for buf in self.buffers:
            buf.flush_param_shards()
        if self.transfers is not None:
            self.transfers.params_sent()
        self.sync.gather_params()
        return StepResult(grad_norm=norm, loss_scale=scale)

    def _adamw_step(self, flat_grads: list[torch.Tensor], coef: float, hyper: AdamHyper,
                    unscaled_by: float | None) -> None:
        """Clip and AdamW every bucket's shard where its state lives, and store the updated parameters."""
        flat_runs = [r for runs in self.decay_runs for r in runs]
        for i, lo, (master, exp_avg, exp_avg_sq), g in self._swept_grads(flat_grads, coef, unscaled_by):
            hi = lo + master.numel()
            runs = flat_runs[i] if hi - lo == self.bucket_list[i][1].shard_numel else runs_in(flat_runs[i], lo, hi)
            adamw_shard_step(master, g.to(master.device), exp_avg, exp_avg_sq, runs, hyper, self.step_count)
            self._store_param(i, lo, master)

    def _swept_grads(self, flat_grads: list[torch.Tensor], coef: float,
                     unscaled_by: float | None) -> Iterator[tuple[int, int, Views, torch.Tensor]]:
        """The store's sweep (the state where it lives, bucket by bucket; disk: maybe in pieces), each piece with
        its clipped fp32 grad (from the device, or as copied to the host during backward)."""
        grad = None
        for i, lo, views in self.store.sweep():
            if lo == 0:
                grad = flat_grads[i] if self.transfers is None else self._host_grad(i, unscaled_by)
            assert grad is not None, "a sweep starts each bucket at offset 0"
            g = grad[lo:lo + views[0].numel()]
            if coef < 1.0:
                g.mul_(coef)
            yield i, lo, views, g

    def _store_param(self, i: int, lo: int, master: torch.Tensor) -> None:
        """Bucket ``i``'s updated master piece at ``lo`` back to its parameters (sent from the host when offloaded)."""
        buf, b = self.bucket_list[i]
        if self.transfers is not None:
            self.transfers.send_param(buf, b, master, lo)
        elif self.store.separate_master:
            buf.set_param_shard(b, master, lo)

    def _muon_step(self, muon: ShardedMuon, flat_grads: list[torch.Tensor], coef: float, lr: float,
                   unscaled_by: float | None) -> None:
        """Muon and AdamW (``muon_shards.ShardedMuon``) where the state lives, then store the parameters: a first
        sweep runs AdamW, the momentum and NS; the NS outputs are shared; a second sweep decays the Muon weights and
        adds their updates (the device and host stores' sweeps are views in place; the disk tier reads twice)."""
        muon.begin(lr)
        for i, lo, views, g in self._swept_grads(flat_grads, coef, unscaled_by):
            muon.first(i, lo, views, g.to(views[0].device), self.step_count)
        muon.share()
        for i, lo, (master, _, _) in self.store.sweep():
            muon.second(i, lo, master)
            self._store_param(i, lo, master)
        muon.end()

    def _host_grad(self, i: int, scale: float | None) -> torch.Tensor:
        """Bucket ``i``'s grad shard as copied to the host during backward, unscaled here as the device
        shard was (same fp32 multiply, so the same numbers)."""
        g = self.transfers.host_grad(i)
        if scale is not None:
            g.mul_(1.0 / scale)
        return g

    def _global_norm(self, grads: list[list[torch.Tensor]]) -> float:
        """The global grad norm, summed in fp64 over model-parallel ranks (and DP shards when sharded).

        NaN/inf on any rank makes the result non-finite on every rank (the sums carry it), so all
        ranks take the same skip decision without another collective.
        """
        local_sq = torch.zeros((), dtype=torch.float64, device=self.pstate.device)
        for norm_runs, probe_runs, gs in zip(self.norm_runs, self.probe_runs, grads):
            for runs, probe, g in zip(norm_runs, probe_runs, gs):
                sum_squares_fp64(g, runs, local_sq)
                nonfinite_probe(g, probe, local_sq)
        if self.pstate.model_parallel_group is not None:
            C.all_reduce(local_sq, self.pstate.model_parallel_group)
        self.sync.sum_over_shards(local_sq)
        return float(local_sq.sqrt())

    def _unscale_and_check(self, grads: list[list[torch.Tensor]], scale: float) -> bool:
        """Divide grads by the loss scale; True when any rank saw inf/nan (all ranks agree)."""
        bad = torch.zeros((), dtype=torch.float32, device=self.pstate.device)
        for gs in grads:
            for g in gs:
                g.mul_(1.0 / scale)
                bad = torch.maximum(bad, (~torch.isfinite(g)).any().float())
        if self.pstate.model_parallel_group is not None:
            C.all_reduce(bad, self.pstate.model_parallel_group, op=dist.ReduceOp.MAX)
        self.sync.agree_over_dp(bad, op=dist.ReduceOp.MAX)
        return bool(bad > 0)

    # -- checkpoint interface (ShardedOptimizerState) ------------------------------------------
    @property
    def shards_state_over_dp(self) -> bool:
        """ZeRO 1/2/3: each DP rank owns different state; ZeRO 0: every DP rank holds all of it."""
        return self.zero.shards_optimizer_state

    def state_segments(self) -> Iterator[tuple[nn.Parameter, int, dict[str, torch.Tensor]]]:
        """Per piece of a parameter this rank updates: (param, flat offset into the TP-local param,
        views of its fp32 master weights and moments). Checkpoints save and load through these."""
        for i, _, (master, exp_avg, exp_avg_sq) in self.store.sweep(whole=True):  # disk: one bucket at a time
            kept = None if self.muon is None else self.muon.kept(i)
            for seg in self.bucket_list[i][1].segments:
                piece = slice(seg.lo, seg.hi)
                yield seg.param, seg.param_lo, {"master": master[piece], "exp_avg": exp_avg[piece],
                                                "exp_avg_sq": _second_moment(exp_avg_sq, kept, seg)}

    @property
    def state_views_transient(self) -> bool:
        """True when ``state_segments``' views are reused for the next bucket (disk offload): copy to keep."""
        return self.store.placement == Placement.DISK

    def close(self) -> None:
        """Release the offload stores (the disk tier removes this rank's files): the optimizer-state store this
        optimizer made, and the engine's parameter-shard stores through the engine."""
        self.store.close()
        self.sync.close()

    def state_scalars(self) -> dict[str, Any]:
        return {"step": self.step_count, "scaler": None if self.scaler is None else self.scaler.state_dict()}

    def load_state_scalars(self, scalars: dict[str, Any]) -> None:
        self.step_count = int(scalars.get("step", 0))
        if self.scaler is not None and scalars.get("scaler"):
            self.scaler.load_state_dict(scalars["scaler"])

    @torch.no_grad()
    def sync_params_from_master(self) -> None:
        """After loading master shards: cast them into the parameters and gather the full buckets."""
        if self.store.separate_master:
            for i, lo, (master, _, _) in self.store.sweep():
                buf, b = self.bucket_list[i]
                buf.set_param_shard(b, master, lo)
            for buf in self.buffers:
                buf.flush_param_shards()
        self.sync.gather_params()
        self.sync.wait_param_gather()


def _second_moment(exp_avg_sq: torch.Tensor, kept: list[tuple[int, int]] | None, seg) -> torch.Tensor:
    """A segment's exp_avg_sq: its slice of the shard's, or (Muon) of the compact one for an AdamW segment, and
    zeros for a Muon one (not stored: checkpoints keep the format, a zero second moment, and a load drops it)."""
    if kept is None:
        return exp_avg_sq[seg.lo:seg.hi]
    if (seg.lo, seg.hi) not in kept:
        return exp_avg_sq.new_zeros(seg.hi - seg.lo)
    at = kept_in(kept, 0, seg.lo)
    return exp_avg_sq[at:at + seg.hi - seg.lo]


def _initial_shard(buf: ParamGradBuffer, b: Bucket):
    """What the store's masters start from: the shard in place, or read from its offload store one bucket at a
    time as the optimizer store copies it (``ShardOnDemand``)."""
    if buf.param_store is None:
        return buf.read_param_shard(b)
    return ShardOnDemand(b.shard_numel, lambda: buf.read_param_shard(b))


def _agreed_store(shards: list[list[torch.Tensor]], placement: StatePlacement, pstate: ParallelState,
                  runs: list | None = None, kept: list | None = None):
    """The optimizer-state store; a rank that cannot build it (an unusable --offload-path) makes every
    rank raise the same error here, before a collective of the step could hang on it."""
    store, problem = None, None
    try:
        store = build_store(shards, placement, pstate.rank, runs, kept)
    except OffloadError as err:
        problem = f"rank {pstate.rank}: {err}"
    if placement.optimizer_state == Placement.DEVICE:
        return store
    problems = [p for p in C.all_gather_object(problem, pstate.world_group) if p]
    if problems:
        if store is not None:
            store.close()
        raise OffloadError(problems[0])
    return store


def _norm_runs(b: Bucket, sync: GradSyncEngine, counted: bool) -> list[tuple[int, int]]:
    """Shard ranges [lo, hi) whose grads enter the global norm (or, ``counted=False``, do not)."""
    sharded, summed = sync.stage.shards_optimizer_state, sync.sums_norm_over_dp
    return merged_runs(b.segments, lambda seg: counts_for_norm(seg.param, sync.pstate, sharded, summed) == counted)

