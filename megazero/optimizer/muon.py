"""Muon's update on whole matrices, which parameters it takes, and how a fused weight splits into matrices.

Muon (Keller Jordan; ``torch.optim.Muon``) keeps one momentum per parameter and replaces each matrix's
update by the Newton-Schulz (NS) orthogonalisation of its momentum. Everything here is one process and
one whole matrix at a time; a distributed owner assembles a matrix from its TP and ZeRO pieces, calls
``newton_schulz`` on it, and returns the update to where the pieces live. The momentum and the weight
decay are elementwise (they run on any shard); only NS needs the whole matrix.

The parameter split (``takes_muon``): Muon takes the 2-D hidden matrices - attention qkv and proj, the
dense MLP and a shared expert's fc1/gate/fc2 - and every routed expert's matrix separately (experts are
stored [E, in, out], E matrices). AdamW takes the rest: the word and position embeddings, the output head
(``output.weight``, or the tied embedding), norm weights, biases (also the experts' [E, out] biases) and
the MoE router.

The fused-weight rule (``matrices_of``): a weight is orthogonalised as the matrices of the unfused model,
so the update does not depend on the fusion. megazero's qkv weight, laid out group by group ([q heads of
group 0, k0, v0, q heads of group 1, ...]), is three matrices, exactly HF's q_proj, k_proj and v_proj:
with GQA, W_q is every query head together ([heads x d, h]) and W_k, W_v every key/value group together
([groups x d, h]) - not one matrix per head or per group. The llama MLP stores gate and up (``fc1``)
apart already. An expert's [in, out] matrix is taken as its transpose, the [out, in] of HF's per-expert
nn.Linear, so its shape-dependent learning rate is the one ``torch.optim.Muon`` gives that linear.

The arithmetic and its order are torch's single-tensor Muon (torch/optim/_muon.py, torch 2.13):
momentum ``m.lerp_(g, 1 - mu)``; Nesterov ``g.lerp(m, mu)``; NS; ``w *= 1 - lr * wd`` (the unadjusted
lr); ``w -= adjusted_lr * NS``. torch runs NS in bf16; ``MuonHyper.ns_dtype`` says which dtype runs it
here (--muon-ns-dtype: fp32 by default; bf16 reproduces ``torch.optim.Muon`` bit for bit).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import torch
from torch import nn

from ..config import MUON_LR_ADJUSTMENTS, MUON_NS_COEFFICIENTS, ModelConfig, OptimizerConfig
from ..tensor_parallel.layers import spec_of

NS_COEFFICIENTS = MUON_NS_COEFFICIENTS  # the quintic's (a, b, c): Keller Jordan's, torch's defaults
NS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # --muon-ns-dtype's words
LR_ADJUSTMENTS = MUON_LR_ADJUSTMENTS
ADAMW_MODULES = frozenset({"embedding", "output", "router"})  # name parts whose matrices stay with AdamW


@dataclass(frozen=True)
class MuonHyper:
    """Muon's hyperparameters, by torch.optim.Muon's names and defaults (``adjust_lr`` is its adjust_lr_fn)."""

    lr: float
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    eps: float = 1e-7
    adjust_lr: str = "original"
    ns_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not (self.lr >= 0 and self.weight_decay >= 0 and 0 <= self.momentum < 1 and self.eps > 0):
            raise ValueError(f"Muon needs lr >= 0 ({self.lr}), weight decay >= 0 ({self.weight_decay}), "
                             f"0 <= momentum < 1 ({self.momentum}) and eps > 0 ({self.eps}).")
        if not 1 <= self.ns_steps < 100:
            raise ValueError(f"Muon's NS steps must be in [1, 100), got {self.ns_steps}.")
        if self.adjust_lr not in LR_ADJUSTMENTS:
            raise ValueError(f"Muon's lr adjustment must be one of {LR_ADJUSTMENTS}, got {self.adjust_lr!r}.")
        if len(self.ns_coefficients) != 3:
            raise ValueError(f"Muon's NS coefficients are three numbers (a, b, c), got {self.ns_coefficients}.")


def muon_hyper(cfg: OptimizerConfig, lr: float) -> MuonHyper:
    """The run's Muon hyperparameters (--muon-* flags, the decoupled --weight-decay) at the scheduled ``lr``."""
    return MuonHyper(lr=lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                     ns_steps=cfg.muon_ns_steps, ns_coefficients=cfg.muon_ns_coefficients,
                     adjust_lr=cfg.muon_lr_adjust, ns_dtype=NS_DTYPES[cfg.muon_ns_dtype])


class NSClock:
    """Seconds this process spent in ``newton_schulz`` since the last ``take``: the metrics' NS time per step
    (the trainer takes it at each step's start and in its record). On CUDA each call is bracketed by device
    synchronisations, so the seconds are the kernels', not their launches'; on the CPU the call is synchronous."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def take(self) -> float:
        """The seconds gathered since the last take; the clock restarts from 0."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


NS_CLOCK = NSClock()  # one per process: every rank times its own NS calls


def newton_schulz(G: torch.Tensor, steps: int = 5, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = 1e-7, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``orthogonalise`` timed by ``NS_CLOCK``; the same arguments and result."""
    if G.is_cuda:
        torch.cuda.synchronize(G.device)
    start = time.perf_counter()
    out = orthogonalise(G, steps, coefficients, eps, dtype)
    if G.is_cuda:
        torch.cuda.synchronize(G.device)
    NS_CLOCK.seconds += time.perf_counter() - start
    return out


def orthogonalise(G: torch.Tensor, steps: int = 5, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = 1e-7, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The quintic NS iteration on a 2-D matrix, as torch's ``_zeropower_via_newtonschulz`` runs it.

    X = G / ||G||_F (so the spectral norm is at most 1), then ``steps`` times X <- aX + (bA + cA^2)X
    with A = XX^T. A tall matrix is transposed first, so A is the smaller Gram matrix. The result's
    singular values land near 1 (roughly 0.5-1.5: the coefficients trade convergence for speed).
    Returns a new tensor in ``dtype``; ``G`` is left untouched.
    """
    if G.ndim != 2:
        raise ValueError(f"Newton-Schulz takes a 2-D matrix, got shape {tuple(G.shape)}.")
    a, b, c = coefficients
    tall = G.size(0) > G.size(1)
    X_mn = G.to(dtype=dtype, copy=True)  # m <= n after the transposition
    if tall:
        X_mn = X_mn.T
    X_mn.div_(X_mn.norm().clamp(min=eps))
    for _ in range(steps):
        A_mm = X_mn @ X_mn.T
        B_mm = torch.addmm(A_mm, A_mm, A_mm, beta=b, alpha=c)
        X_mn = torch.addmm(X_mn, B_mm, X_mn, beta=a)
    return X_mn.T if tall else X_mn


def adjusted_lr(lr: float, shape: Sequence[int], adjustment: str) -> float:
    """The lr a matrix of ``shape`` (out, in) takes: ``original`` lr * sqrt(max(1, out/in)) (Keller Jordan's),
    ``match_rms_adamw`` lr * 0.2 * sqrt(max(out, in)) (Moonlight's: the update's RMS matches AdamW's)."""
    out_features, in_features = shape[:2]
    if adjustment == "original":
        return lr * math.sqrt(max(1, out_features / in_features))
    if adjustment == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(out_features, in_features)))
    raise ValueError(f"Muon's lr adjustment must be one of {LR_ADJUSTMENTS}, got {adjustment!r}.")


@dataclass(frozen=True)
class Matrix:
    """One matrix Muon orthogonalises inside a stored weight.

    ``rows``: ranges along dim 0 of the stored 2-D weight (or of expert ``expert``'s [in, out] slice of a
    3-D expert weight), concatenated in order. An expert's matrix is the transpose of its rows: (out, in).
    """

    label: str
    rows: tuple[tuple[int, int], ...]
    expert: int | None = None


def qkv_matrices(cfg: ModelConfig) -> tuple[Matrix, Matrix, Matrix]:
    """W_q, W_k, W_v inside the fused qkv weight [g x (heads per group + 2) x d, h]: HF's q/k/v_proj."""
    d, per = cfg.head_dim, cfg.num_attention_heads // cfg.query_groups
    group = (per + 2) * d
    starts = [i * group for i in range(cfg.query_groups)]
    q = tuple((s, s + per * d) for s in starts)
    k = tuple((s + per * d, s + (per + 1) * d) for s in starts)
    v = tuple((s + (per + 1) * d, s + group) for s in starts)
    return Matrix("q", q), Matrix("k", k), Matrix("v", v)


def matrices_of(name: str, shape: Sequence[int], cfg: ModelConfig) -> tuple[Matrix, ...]:
    """The matrices of the unfused model inside Muon parameter ``name`` of full (TP-gathered) ``shape``."""
    if name.endswith("attention.qkv.weight"):
        return qkv_matrices(cfg)
    if len(shape) == 3:  # [E, in, out] routed experts
        return tuple(Matrix(f"expert {e}", ((0, shape[1]),), expert=e) for e in range(shape[0]))
    return (Matrix("whole", ((0, shape[0]),)),)


def matrix_shape(full_shape: Sequence[int], m: Matrix) -> tuple[int, int]:
    """The (out, in) shape ``take_matrix`` gives matrix ``m`` of a weight of ``full_shape``, without the weight."""
    rows = sum(hi - lo for lo, hi in m.rows)
    return (rows, full_shape[1]) if m.expert is None else (full_shape[2], rows)


def ns_cost(shape: Sequence[int]) -> int:
    """Newton-Schulz work on an (m, n) matrix, up to a constant: its GEMMs cost m * n * min(m, n)."""
    return shape[0] * shape[1] * min(shape[0], shape[1])


def _stored(weight: torch.Tensor, m: Matrix) -> torch.Tensor:
    return weight if m.expert is None else weight[m.expert]


def take_matrix(weight: torch.Tensor, m: Matrix) -> torch.Tensor:
    """Matrix ``m`` of ``weight`` (or of its gradient or momentum), as a new contiguous (out, in) tensor."""
    stored = _stored(weight, m)
    rows = torch.cat([stored[lo:hi] for lo, hi in m.rows])
    return rows if m.expert is None else rows.t().contiguous()


def add_to_matrix_(weight: torch.Tensor, m: Matrix, update: torch.Tensor, alpha: float = 1.0) -> None:
    """weight's matrix ``m`` += alpha * ``update`` ((out, in), as ``take_matrix`` returns it), in place."""
    stored, rows = _stored(weight, m), update if m.expert is None else update.t()
    offset = 0
    for lo, hi in m.rows:
        stored[lo:hi].add_(rows[offset:offset + hi - lo], alpha=alpha)
        offset += hi - lo


def split_matrices(weight: torch.Tensor, matrices: Sequence[Matrix]) -> list[torch.Tensor]:
    """The unfused model's tensors of one stored weight (copies): ``merge_matrices`` is the inverse."""
    return [take_matrix(weight, m) for m in matrices]


@torch.no_grad()
def merge_matrices(pieces: Sequence[torch.Tensor], matrices: Sequence[Matrix], out: torch.Tensor) -> torch.Tensor:
    """Write the unfused tensors ``pieces`` back into the stored layout ``out`` (every element is covered)."""
    for piece, m in zip(pieces, matrices):
        stored, rows = _stored(out, m), piece if m.expert is None else piece.t()
        offset = 0
        for lo, hi in m.rows:
            stored[lo:hi].copy_(rows[offset:offset + hi - lo])
            offset += hi - lo
    return out


def takes_muon(name: str, param: torch.Tensor) -> bool:
    """The split rule (module docstring): hidden matrices to Muon; embeddings, head, router, norms, biases not.

    A matrix is 2-D, or 3-D for a routed expert weight (``ParamSpec.expert``: [E, in, out], E matrices);
    an expert's 2-D [E, out] bias is E biases.
    """
    matrix_ndim = 3 if spec_of(param).expert else 2
    return param.ndim == matrix_ndim and not ADAMW_MODULES.intersection(name.split("."))


def split_parameters(named: Iterable[tuple[str, nn.Parameter]]
                     ) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(Muon's, AdamW's) named parameters, in the model's order."""
    pairs = list(named)
    return [(n, p) for n, p in pairs if takes_muon(n, p)], [(n, p) for n, p in pairs if not takes_muon(n, p)]


def momentum_direction_(grad: torch.Tensor, momentum: torch.Tensor, h: MuonHyper) -> torch.Tensor:
    """Update the momentum in place and return what NS orthogonalises; elementwise, so any shard can run it."""
    momentum.lerp_(grad, 1 - h.momentum)
    return grad.lerp(momentum, h.momentum) if h.nesterov else momentum


@torch.no_grad()
def muon_step_(weight: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor, matrices: Sequence[Matrix],
               h: MuonHyper) -> int:
    """One Muon step of a whole stored weight, NS on each of its ``matrices``; returns the NS calls made."""
    direction = momentum_direction_(grad, momentum, h)
    weight.mul_(1 - h.lr * h.weight_decay)
    for m in matrices:
        update = newton_schulz(take_matrix(direction, m), h.ns_steps, h.ns_coefficients, h.eps, h.ns_dtype)
        add_to_matrix_(weight, m, update, alpha=-adjusted_lr(h.lr, update.shape, h.adjust_lr))
    return len(matrices)


class SerialMuon:
    """Muon over one process's whole Muon parameters (``split_parameters``), reading ``.grad``: the single-process
    reference a distributed Muon is checked against. ``ns_calls`` counts NS calls over all steps."""

    def __init__(self, named: Iterable[tuple[str, nn.Parameter]], cfg: ModelConfig, hyper: MuonHyper) -> None:
        self.hyper = hyper
        self.params = [(p, matrices_of(n, p.shape, cfg)) for n, p in named]
        self.momentum = [torch.zeros_like(p, dtype=torch.float32) for p, _ in self.params]
        self.ns_calls = 0

    def step(self, lr: float | None = None) -> None:
        """One step at ``lr`` (the scheduled lr; None keeps the hyperparameters'). Parameters without a grad skip."""
        h = self.hyper if lr is None else replace(self.hyper, lr=lr)
        for (p, matrices), momentum in zip(self.params, self.momentum):
            if p.grad is not None:
                self.ns_calls += muon_step_(p.data, p.grad, momentum, matrices, h)
