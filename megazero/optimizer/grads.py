"""Gradient bookkeeping shared by every optimizer: which replicas to sum, and what the global norm counts.

Two kinds of parameters get gradients that are partial sums on some ranks:
- sequence-parallel replicated parameters (norms, row-parallel biases): each TP rank
  saw only its chunk of the sequence, so their grads are all-reduced over TP;
- the tied word embedding on the first and last pipeline stages: each copy saw half of
  its uses, so the two grads are summed over the embedding group.

The global norm counts every parameter of the full model exactly once: TP-split
parameters on every TP rank, replicated ones on TP rank 0 only, the embedding
copy on the last stage not at all; the step (``zero.py``) then sums over the
model-parallel group (tp x pp), and the gradient-sync engine over dp x cp when sharded
(``GradSyncEngine.sum_over_shards``): the two sums together cover the world.

Mixture-of-experts expert weights differ across ep, etp and pp ranks (ep folds over tp x cp x dp)
and are sharded (ZeRO 1-3) or replicated (ZeRO 0) over the expert-data-parallel group: etp-split
ones count on every etp rank, unsplit ones on etp rank 0, and when replicated over edp on edp rank
0 only. With an expert grid that is not the dense one (ep > 1 or etp != tp) the engine sums over
dp x cp at ZeRO 0 too (``GradSyncEngine.sums_norm_over_dp``), so there a dense copy, replicated over
dp x cp, counts on dp x cp rank 0 only (the others add exact zeros: the dense sum is the one without
experts). With the same grid (ep 1, etp = tp) the edp group is dp x cp: experts count as dense copies.
"""
from __future__ import annotations

import torch

from ..parallel.state import ParallelState
from ..tensor_parallel.layers import spec_of


def counts_for_norm(p: torch.Tensor, pstate: ParallelState, sharded: bool = False,
                    summed_over_dp: bool = False) -> bool:
    """Whether this rank's copy of ``p`` contributes to the global grad norm.

    ``sharded``: ZeRO 1-3, each rank of the reduction group holds a different shard of ``p``'s bucket;
    ``summed_over_dp``: the engine sums the squares over dp x cp (``GradSyncEngine.sums_norm_over_dp``).
    """
    spec = spec_of(p)
    if spec.tied_role == "embedding_copy":
        return False
    tp_rank, replica = (pstate.etp_rank, pstate.edp_rank) if spec.expert else (pstate.tp_rank, pstate.dp_cp_rank)
    one_replica = sharded or not summed_over_dp or replica == 0
    return (spec.split_dim is not None or tp_rank == 0) and one_replica


# Elements upcast to fp64 at a time. CPU: 512 KiB of fp64 stays in cache, so the fp64 sum costs what
# an fp32 dot does (measured: same time as torch.dot over 20M fp32 values; vector_norm(dtype=float64)
# was 11x slower, as it casts the whole input first). CUDA: 32 MiB chunks keep kernel launches few
# (a 100M-element shard is 25 chunks) with a bounded temporary (chosen, not measured on a GPU).
NORM_CHUNK = {"cpu": 1 << 16, "cuda": 1 << 22}


def sum_squares_fp64(grad: torch.Tensor, runs: list[tuple[int, int]], acc: torch.Tensor) -> None:
    """Add sum(grad[lo:hi]**2) over ``runs`` into the fp64 scalar ``acc``, upcasting chunk by chunk.

    An fp32 sum over millions of squares drifts by ~1e-5 relative and differs between layouts; fp64
    makes every layout agree with the serial float64 norm to ~1e-15, with no grad-sized temporary.
    """
    chunk = NORM_CHUNK.get(grad.device.type, NORM_CHUNK["cuda"])
    for lo, hi in runs:
        for start in range(lo, hi, chunk):
            x = grad[start: min(start + chunk, hi)].double()
            acc += torch.dot(x, x)


def nonfinite_probe(grad: torch.Tensor, runs: list[tuple[int, int]], acc: torch.Tensor) -> None:
    """Make ``acc`` NaN when grads outside the norm (replicas another rank counts) are not finite.

    A NaN in a replica that this rank does not count would otherwise escape the agreed norm.
    """
    for lo, hi in runs:
        bad = (~torch.isfinite(grad[lo:hi])).any()
        acc += torch.where(bad, torch.full_like(acc, float("nan")), torch.zeros_like(acc))


def clip_coefficient(norm: float, max_norm: float) -> float:
    """Scale factor for clipping, as torch.nn.utils.clip_grad_norm_ computes it."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
