"""The router's load-balancing losses, and how their gradients reach the router weight.

Legend: T tokens on this rank, E experts, k experts per token, B sequences in the micro-batch, S tokens
per whole sequence. ``seq_group`` is the group of ranks that hold the other tokens of the same sequences
(tp x cp under sequence parallelism); ``None`` when this rank holds them all.

Losses (values are per micro-batch, unscaled by their coefficients):

- Switch/GShard ``aux_loss``: E * sum_e f_e P_e, f_e = c_e / (S k) the fraction of the S k assignments
  of the whole batch routed to e, P_e the mean over those S tokens of e's router probability.
- DeepSeek-V3 ``seq_aux_loss``: the same per sequence (f and P of each sample), averaged over the B samples.
- Router ``z_loss``: mean over tokens of logsumexp(logits)^2 (ST-MoE).

Under SP/CP each rank holds part of a sequence. The counts c and the token total are detached, so
their all-reduce over ``seq_group`` costs no gradient; P is a sum over tokens, so the loss is linear in
each rank's tokens' probabilities and this rank's *partial* loss (its own tokens' terms, with the global
c and S) has exactly this rank's share of the gradient. Summing the router's gradients over
``seq_group`` (the SP partial-gradient all-reduce; the dp x cp reduction) then gives the serial gradient.
The values logged are the whole losses, from the same one all-reduce (the probability sums ride along).

The losses are not returned to the model: ``AuxLossScaler`` attaches them to the routing weights, an
identity whose backward also feeds ``scale`` (coefficient x the micro-batch's loss scaling) as the
gradient of the loss (Megatron's MoEAuxLossAutoScaler idea).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..parallel import collectives as C
from ..parallel.collectives import Group


class AuxLossScaler(torch.autograd.Function):
    """forward: ``out`` unchanged / backward: ``out``'s gradient unchanged, and ``scale`` as d(total)/d(``loss``).

    So ``loss`` adds ``scale * d(loss)/d(.)`` to the gradients of whatever it was computed from, in the
    same backward pass as ``out``, without being part of the model's output.
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.loss_dtype, ctx.loss_device = scale, loss.dtype, loss.device
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_loss = torch.full((), ctx.scale, dtype=ctx.loss_dtype, device=ctx.loss_device)  # no host-to-device copy
        return grad_out, grad_loss, None


def attach_loss(out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``out``, carrying ``scale * loss``'s gradient in backward (see ``AuxLossScaler``)."""
    return AuxLossScaler.apply(out, loss, scale)


def count_slots(slots: torch.Tensor, size: int) -> torch.Tensor:
    """How often each of ``size`` slots occurs in ``slots`` (int64): ``bincount`` with a fixed output shape,
    which needs no device-to-host read of the largest id (a sync on GPU) and keeps shapes static."""
    return torch.zeros(size, dtype=torch.int64, device=slots.device).scatter_add_(0, slots, torch.ones_like(slots))


def balance_scores(logits_TE: torch.Tensor, score_function: str) -> torch.Tensor:
    """The per-expert probabilities P is made of: softmax over all E, or the sigmoids normalised to sum 1."""
    if score_function == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    scores = torch.sigmoid(logits_TE)
    return scores / scores.sum(dim=-1, keepdim=True)


def sequence_sums(values_TX: torch.Tensor, batch: int) -> torch.Tensor:
    """[B, X] sums over each sequence's tokens; token t of a flattened [s, b] batch belongs to sequence t % b."""
    return values_TX.reshape(-1, batch, values_TX.shape[-1]).sum(dim=0)


def switch_loss(prob_sums_BE: torch.Tensor, counts_BE: torch.Tensor, tokens_per_seq: torch.Tensor | float,
                topk: int) -> torch.Tensor:
    """Mean over the B rows of E * sum_e (c_be / (S k)) * (P_be / S): the Switch loss of each row's tokens.

    One row is the whole batch for ``aux_loss``, one sequence for ``seq_aux_loss``.
    """
    batch, experts = counts_BE.shape
    scale = experts / (topk * tokens_per_seq * tokens_per_seq * batch)
    return (prob_sums_BE * counts_BE.to(prob_sums_BE.dtype)).sum() * scale


@dataclass(frozen=True)
class BalanceLosses:
    """Which losses a router adds, with their coefficients; ``apply`` computes and attaches them."""

    load_balancing_type: str
    aux_loss_coeff: float
    z_loss_coeff: float
    score_function: str
    topk: int
    num_experts: int

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "BalanceLosses":
        """The losses ``cfg`` asks every router for."""
        assert cfg.num_experts is not None, "balance losses need --num-experts"
        return cls(cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff,
                   cfg.moe_router_score_function, cfg.moe_router_topk, cfg.num_experts)

    @property
    def value_names(self) -> tuple[str, ...]:
        """The keys of the values ``apply`` returns (what a run logs), in a fixed order."""
        kind = self.balance_kind
        return ((kind,) if kind is not None else ()) + (("z_loss",) if self.z_loss_coeff != 0.0 else ())

    @property
    def balance_kind(self) -> str | None:
        """``aux_loss`` / ``seq_aux_loss`` when that loss is on (a non-zero coefficient), else None."""
        on = self.load_balancing_type != "none" and self.aux_loss_coeff != 0.0
        return self.load_balancing_type if on else None

    @property
    def active(self) -> bool:
        return self.balance_kind is not None or self.z_loss_coeff != 0.0

    def apply(self, probs_TK: torch.Tensor, logits_TE: torch.Tensor, experts_TK: torch.Tensor, seq_group: Group,
              batch: int, scale: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``probs_TK`` with the active losses attached (``scale`` x coeff), and the whole losses' detached values.

        ``batch``: the sequences B in the T tokens (rows of a flattened [s, b, h] activation); only the
        sequence-wise loss needs it.
        """
        if not self.active:
            return probs_TK, {}
        rows = batch if self.balance_kind == "seq_aux_loss" else 1
        prob_sums = sequence_sums(balance_scores(logits_TE, self.score_function), rows)  # [rows, E], with grad
        lse_sq = torch.logsumexp(logits_TE, dim=-1).square()  # [T], with grad
        counts, whole_prob_sums, tokens, whole_lse_sq = self._reduce(experts_TK, prob_sums, lse_sq, seq_group, rows)
        loss = logits_TE.new_zeros(())
        values: dict[str, torch.Tensor] = {}
        kind = self.balance_kind
        if kind is not None:
            loss = loss + self.aux_loss_coeff * switch_loss(prob_sums, counts, tokens / rows, self.topk)
            values[kind] = switch_loss(whole_prob_sums, counts, tokens / rows, self.topk)
        if self.z_loss_coeff != 0.0:
            loss = loss + self.z_loss_coeff * lse_sq.sum() / tokens
            values["z_loss"] = whole_lse_sq / tokens
        return attach_loss(probs_TK, loss, scale), values

    def _reduce(self, experts_TK: torch.Tensor, prob_sums_RE: torch.Tensor, lse_sq_T: torch.Tensor, seq_group: Group,
                rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Whole-sequence counts [rows, E], probability sums [rows, E], token total and sum of lse^2: one all-reduce.

        Carried in fp64, so counts stay exact integers; only the counts and the total enter the
        gradient (as constants), the sums are for the logged values.
        """
        tokens, experts = experts_TK.shape[0], self.num_experts
        row_of_token = torch.arange(tokens, device=experts_TK.device) % rows
        slots = (row_of_token[:, None] * experts + experts_TK).flatten()
        counts = count_slots(slots, rows * experts).to(torch.float64)
        extra = torch.stack([counts.new_full((), tokens), lse_sq_T.detach().sum().to(torch.float64)])  # no sync
        stats = torch.cat([counts, prob_sums_RE.detach().flatten().to(torch.float64), extra])
        C.all_reduce(stats, seq_group)
        dtype = prob_sums_RE.dtype
        counts_RE = stats[:rows * experts].view(rows, experts)
        whole_sums = stats[rows * experts:2 * rows * experts].view(rows, experts).to(dtype)
        return counts_RE, whole_sums, stats[-2].to(dtype), stats[-1].to(dtype)
