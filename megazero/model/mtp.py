"""Multi-token prediction (DeepSeek-V3 MTP): D modules after the last layer, each predicting one token further.

Module k (1..D, stored as ``mtp.{k-1}``) turns the previous hidden state h^{k-1} (h^0: the main model's last
hidden state, before its final norm) and the embedding of the token k places on into

    h^k_i = block_k(eh_proj_k([enorm_k(Emb(t_{i+k})); hnorm_k(h^{k-1}_i)]))

(embedding first, as Megatron-core and the DeepSeek-V3 checkpoints order it), and final_norm_k(h^k) through the
shared output head predicts t_{i+k+1}. The block is an ordinary ``TransformerBlock`` with the global layer id
``num_layers + k - 1`` (its own dropout streams), so recompute, --compile and ZeRO 3 find it as any block.

Everything comes from the labels (labels[i] = t_{i+1}): the embedded token at depth k is labels[i+k-1], the
target labels[i+k]. Both are shifted on whole samples before the context-parallel cut, so a token shifted in
across a CP chunk boundary is the serial one. Position i has a target at depth k when i + k < S, when (under
--reset-attention-mask) position i + k lies in i's document, and when the LM loss counts position i + k
(--eod-mask-loss): its target is the LM target of i + k, seen from i.

Normalisation, as the LM loss under a loss mask (``pipeline/runner.py``): depth k's loss on a rank is the sum
of its counted token losses x dp·cp·m / N_k, N_k the tokens depth k counts in the whole global batch; the
schedule's 1/m and the engine's dp x cp mean turn that into the global per-token mean, whatever the counts on
each rank. Without a count from the schedule (``Documents.mtp_scales``) N_k is the micro-batch's own
(b (S - k) without documents, the same for every micro-batch and rank: then exact too). A rank with no counted
token adds a finite zero.

Backward: the total, ``mtp_loss_scaling_factor`` / D x the sum over depths, rides on the LM loss
(``ExtraLoss``): the value returned is the LM loss, and the total receives the LM loss's own gradient. So the
schedule's 1/m and the fp16 loss scale reach it exactly as they reach the LM loss, the target
``model/aux_loss.py`` sets for the routers' losses; no scale has to be set per step.
"""
from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ..config import ModelConfig
from ..tensor_parallel.comm import scatter_to_sequence_parallel_region
from ..tensor_parallel.layers import set_spec
from .documents import Documents
from .transformer import TPContext, TransformerBlock


class ExtraLoss(torch.autograd.Function):
    """forward: ``loss`` unchanged / backward: ``loss``'s gradient to it and to ``extra`` alike."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        ctx.extra_dtype = extra.dtype
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.to(ctx.extra_dtype)


def rms_norm(cfg: ModelConfig, ctx: TPContext) -> nn.RMSNorm:
    """A replicated RMSNorm (SP-partial gradients under sequence parallelism), weight 1."""
    norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_epsilon)
    set_spec(norm.weight, sequence_parallel=ctx.sequence_parallel, init_value=1.0)
    return norm


class Projection(nn.Module):
    """eh_proj: [2h] -> [h], no bias, replicated over TP (h^2 x 2 weights; its input is replicated too, or
    sequence-parallel with SP-partial gradients)."""

    def __init__(self, cfg: ModelConfig, ctx: TPContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.hidden_size, 2 * cfg.hidden_size))
        set_spec(self.weight, sequence_parallel=ctx.sequence_parallel, init_std=cfg.init_method_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


class MTPModule(nn.Module):
    """Depth ``index + 1``: enorm, hnorm, eh_proj, one block, its own final norm (the head is the model's)."""

    def __init__(self, cfg: ModelConfig, ctx: TPContext, index: int) -> None:
        super().__init__()
        self.enorm, self.hnorm = rms_norm(cfg, ctx), rms_norm(cfg, ctx)
        self.eh_proj = Projection(cfg, ctx)
        self.block = TransformerBlock(cfg, ctx, layer_id=cfg.num_layers + index)
        self.final_norm = rms_norm(cfg, ctx)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        """h^k [s, b, h] from h^{k-1} and the shifted tokens' embeddings (both this rank's, SP-cut under SP)."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        return self.block(x) if documents is None else self.block(x, documents=documents)


def document_ids(bounds: tuple, seq: int, device: torch.device) -> torch.Tensor:
    """[b, S]: which document of its sample each position belongs to."""
    pos = torch.arange(seq, device=device)
    return torch.stack([torch.bucketize(pos, torch.tensor(cuts[1:-1], device=device, dtype=torch.long), right=True)
                        for cuts in bounds])


def depth_mask(batch: int, seq: int, depth: int, documents: Documents | None,
               device: torch.device) -> torch.Tensor:
    """[b, S] float, whole samples: 1 where position i has a target at ``depth`` (see the module docstring)."""
    pos = torch.arange(seq, device=device)
    mask = (pos + depth < seq).expand(batch, seq)
    if documents is not None and documents.bounds is not None:
        ids = document_ids(documents.bounds, seq, device)
        mask = mask & (ids == torch.roll(ids, -depth, dims=1))
    if documents is not None and documents.loss_mask is not None:
        mask = mask & (torch.roll(documents.loss_mask, -depth, dims=1) > 0)
    return mask.float()


def mtp_token_counts(documents: Documents, batch: int, seq: int, depth: int, device: torch.device) -> list[float]:
    """Tokens each of the ``depth`` depths counts in one micro-batch (what the schedule sums over the step)."""
    return [float(depth_mask(batch, seq, k, documents, device).sum()) for k in range(1, depth + 1)]


class MTPStack(nn.ModuleList):
    """The D modules (``mtp.0`` .. ``mtp.{D-1}``); ``values`` collects each training forward's per-depth losses
    (detached, normalised as the LM loss: ``training/mtp_step.py`` averages them into the logged values)."""

    def __init__(self, cfg: ModelConfig, ctx: TPContext) -> None:
        super().__init__([MTPModule(cfg, ctx, k) for k in range(cfg.mtp_depth)])
        self.cfg, self.ctx = cfg, ctx
        self.values: list[torch.Tensor] = []

    def take_values(self) -> list[torch.Tensor]:
        values, self.values = self.values, []
        return values

    def depth_losses(self, model: Any, h: torch.Tensor, labels_bs: torch.Tensor,
                     documents: Documents | None) -> list[torch.Tensor]:
        """Each depth's loss (sum of counted token losses x its scale) on this rank; ``model``: the ``GPTModel``
        whose embedding and head they share; ``labels_bs`` and ``documents`` whole samples, ``h`` this rank's h^0."""
        cp, (batch, seq) = self.ctx.cp, labels_bs.shape
        local_docs = documents.local(cp.split, cp.rank) if cp.active and documents is not None else documents
        losses = []
        for k, module in enumerate(cast("list[MTPModule]", list(self)), start=1):
            mask = depth_mask(batch, seq, k, documents, labels_bs.device)
            emb_ids, targets = torch.roll(labels_bs, 1 - k, dims=1), torch.roll(labels_bs, -k, dims=1)
            if cp.active:
                mask, emb_ids, targets = (cp.split.take(t, 1, cp.rank) for t in (mask, emb_ids, targets))
            emb = model.embedding.word(emb_ids)
            if self.ctx.sequence_parallel:
                emb = scatter_to_sequence_parallel_region(emb, self.ctx.group)  # type: ignore[arg-type]
            h = module(h, emb, local_docs)
            token_sum = model.token_loss_sum(module.final_norm(h), targets.t(), mask.t())
            losses.append(token_sum * self._scale(k, batch, seq, documents, mask))
        return losses

    def _scale(self, k: int, batch: int, seq: int, documents: Documents | None, mask: torch.Tensor) -> float:
        """dp·cp·m / N_k from the schedule's count, else cp / (this micro-batch's count)."""
        if documents is not None and documents.mtp_scales:
            return documents.mtp_scales[k - 1]
        cp = self.ctx.cp.split.cp
        if documents is None or (documents.bounds is None and documents.loss_mask is None):
            return cp / (batch * (seq - k))
        return cp / max(1.0, float(depth_mask(batch, seq, k, documents, mask.device).sum()))

    def forward(self, model: nn.Module, h: torch.Tensor, lm_loss: torch.Tensor, labels_bs: torch.Tensor,
                documents: Documents | None) -> torch.Tensor:
        """The LM loss, carrying factor / D x the depths' losses in backward; records the depths' values."""
        losses = torch.stack(self.depth_losses(model, h, labels_bs, documents))
        self.values.append(losses.detach().float())
        total = losses.sum() * (self.cfg.mtp_loss_scaling_factor / len(self))
        return ExtraLoss.apply(lm_loss, total)


def mtp_depth_of(chunks: list[nn.Module]) -> int:
    """D of the model these chunks are cut from (every stage's chunks know it), 0 without MTP."""
    cfg = getattr(chunks[0], "cfg", None) if chunks else None
    return getattr(cfg, "mtp_depth", 0)
