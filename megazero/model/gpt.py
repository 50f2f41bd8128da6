"""The decoder-only language model, or the slice of it one pipeline stage holds.

A stage owns a range of global layer indices; blocks are stored under those
indices (``layers.5.mlp.fc1.weight``), so a parameter's name, and therefore
its seeded initial value, does not depend on the pipeline split. The first
stage embeds tokens; the last stage holds the final norm, the output head
and the loss. With tied embeddings (gpt2), or multi-token prediction (its
modules embed the shifted tokens, ``mtp.py``), a last stage that is not also the
first keeps its own copy of the word embedding under the same name, kept
equal to the first stage's by summing their gradients over the embedding group.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..tensor_parallel.comm import scatter_to_sequence_parallel_region
from ..tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ..tensor_parallel.fused_cross_entropy import fused_linear_cross_entropy
from ..tensor_parallel.layers import (ColumnParallelLinear, VocabParallelEmbedding, column_parallel_linear,
                                      set_spec, spec_of)
from ..tensor_parallel.random import EMBEDDING
from .documents import Documents
from .kv_cache import KVCache
from .mtp import MTPStack
from .transformer import TPContext, TransformerBlock, hidden_dropout, make_norm


class Embedding(nn.Module):
    """Token (vocab-parallel) plus, for gpt2, learned position embeddings -> [s, b, h]."""

    def __init__(self, cfg: ModelConfig, ctx: TPContext, padded_vocab: int, with_positions: bool) -> None:
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        self.word = VocabParallelEmbedding(padded_vocab, cfg.hidden_size, tp_group=ctx.group,
                                           valid_rows=cfg.vocab_size, init_std=cfg.init_method_std)
        self.position = None
        if with_positions:
            # given a weight, the module skips its own normal_ init (ours follows from the spec; on the meta
            # device torch's normal_ would import dynamo, ~1.7 s of CPU in every rank that builds a model)
            self.position = nn.Embedding(cfg.position_table_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.position_table_size, cfg.hidden_size))
            set_spec(self.position.weight, init_std=cfg.init_method_std)

    def forward(self, ids_bs: torch.Tensor, cache: KVCache | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        """``cache`` (decoding only): the tokens follow the cached ones, so their positions start after them.
        ``documents`` with positions (this rank's cut): each sample's positions restart at every document."""
        x = self.word(ids_bs)
        if self.position is not None and documents is not None and documents.positions is not None:
            x = x + self.position.weight[documents.positions].transpose(0, 1)  # [b, s, h] -> [s, b, h]
        elif self.position is not None and cache is not None:
            x = x + self.position.weight[cache.positions(ids_bs.shape[1], ids_bs.device)].unsqueeze(1)
        elif self.position is not None and self.ctx.cp.active:  # this rank's tokens sit at scattered positions
            x = x + self.position.weight[self.ctx.positions(ids_bs.shape[1], ids_bs.device)].unsqueeze(1)
        elif self.position is not None:
            x = x + self.position.weight[: ids_bs.shape[1]].unsqueeze(1)
        if self.ctx.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.ctx.group)
        if self.training and self.cfg.hidden_dropout > 0:
            x = hidden_dropout(x, self.cfg.hidden_dropout, self.ctx, EMBEDDING)  # its own streams
        return x


class GPTModel(nn.Module):
    """Layers ``layer_ids`` of the model; ``pre_process``/``post_process`` mark the first/last stage.

    ``padded_vocab``: rows of the embedding and head over all TP ranks (the run plan's
    ``padded_vocab_size``); None pads ``cfg``'s vocabulary for this TP degree (a model built alone).
    ``ce_chunk_size``: > 0 computes the head and loss fused, that many tokens at a time, so the
    fp32 logits are never held whole (--cross-entropy-chunk-size); 0 = the head, then the loss.
    """

    def __init__(self, cfg: ModelConfig, ctx: TPContext, *, padded_vocab: int | None = None,
                 layer_ids: range | None = None, pre_process: bool = True, post_process: bool = True,
                 ce_chunk_size: int = 0) -> None:
        super().__init__()
        assert cfg.vocab_size is not None, "set cfg.vocab_size from the tokenizer first"
        self.cfg, self.ctx, self.ce_chunk_size = cfg, ctx, ce_chunk_size
        self.pre_process, self.post_process = pre_process, post_process
        self.padded_vocab = cfg.padded_vocab_size(ctx.tp) if padded_vocab is None else padded_vocab
        layer_ids = range(cfg.num_layers) if layer_ids is None else layer_ids
        self.layer_ids = layer_ids
        tied = cfg.tied_embeddings
        self.embedding = None
        if pre_process or (post_process and (tied or cfg.mtp_depth > 0)):  # MTP embeds shifted tokens
            self.embedding = Embedding(cfg, ctx, self.padded_vocab, with_positions=pre_process and cfg.arch == "gpt2")
            if not pre_process:
                spec_of(self.embedding.word.weight).tied_role = "embedding_copy"  # counted once, on the first stage
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, ctx, layer_id=i) for i in layer_ids})
        if post_process:
            self.final_norm = make_norm(cfg, ctx)
            if not tied:
                self.output = ColumnParallelLinear(cfg.hidden_size, self.padded_vocab, tp_group=ctx.group,
                                                   bias=False, init_std=cfg.init_method_std)
                spec_of(self.output.weight).valid_rows = cfg.vocab_size
        self.mtp = MTPStack(cfg, ctx) if post_process and cfg.mtp_depth > 0 else None

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embedding.word.weight if self.cfg.tied_embeddings else self.output.weight

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        """inputs: token ids [b, s] on the first stage, else hidden states [s/cp, b, h].

        Returns hidden states on non-last stages, the mean token loss when ``labels`` [b, s]
        are given on the last stage, and vocab-sharded logits [s/cp, b, V/tp] otherwise. Token ids
        and labels are whole samples; under context parallelism each rank keeps its own tokens here
        (the loss is then the mean over this rank's tokens: equal counts, so the mean over the CP
        group is the sample mean).

        ``documents`` (``model.documents``, the micro-batch's packed documents, whole samples): positions
        restart and attention stays in each document where they say so; with a loss mask the loss is
        ``loss_scale`` times the sum of the unmasked token losses.
        """
        cp, whole_labels, whole_documents = self.ctx.cp, labels, documents
        if cp.active and self.pre_process:
            inputs = cp.split.take(inputs, 1, cp.rank)
        if cp.active and labels is not None:
            labels = cp.split.take(labels, 1, cp.rank)
        if cp.active and documents is not None:
            documents = documents.local(cp.split, cp.rank)
        x = self.embedding(inputs, documents=documents) if self.pre_process else inputs
        for layer in self.layers.values():
            x = layer(x) if documents is None else layer(x, documents=documents)
        if not self.post_process:
            return x
        h = x
        x = self.final_norm(x)
        if labels is None:
            return self.logits_local(x)
        loss = self._loss(x, labels, documents)
        if self.mtp is not None and torch.is_grad_enabled():  # training: the MTP losses ride on the LM loss
            loss = self.mtp(self, h, loss, whole_labels, whole_documents)
        return loss

    def _loss(self, x: torch.Tensor, labels: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        """The mean token loss, or with a loss mask ``loss_scale`` x the sum of the token losses it keeps; fused
        with the head, chunk by chunk, under --cross-entropy-chunk-size."""
        mask_sb = None if documents is None or documents.loss_mask is None else documents.loss_mask.t()
        scale = 1.0 if documents is None else documents.loss_scale
        if self.ce_chunk_size > 0:
            loss = fused_linear_cross_entropy(x, self.output_weight, labels.t(), self.ctx.group,
                                              vocab_size=self.cfg.vocab_size, chunk_size=self.ce_chunk_size,
                                              sequence_parallel=self.ctx.sequence_parallel, token_weights=mask_sb)
            return loss if mask_sb is None else loss * scale
        losses_sb = vocab_parallel_cross_entropy(self.logits_local(x), labels.t(), self.ctx.group, self.cfg.vocab_size)
        if mask_sb is None:
            return losses_sb.mean()
        return (losses_sb * mask_sb.to(losses_sb.dtype)).sum() * scale

    def token_loss_sum(self, x: torch.Tensor, labels_sb: torch.Tensor, weights_sb: torch.Tensor) -> torch.Tensor:
        """Sum of ``weights_sb`` x the token losses of ``x``'s head logits (fused under --cross-entropy-chunk-size)."""
        if self.ce_chunk_size > 0:
            return fused_linear_cross_entropy(x, self.output_weight, labels_sb, self.ctx.group,
                                              vocab_size=self.cfg.vocab_size, chunk_size=self.ce_chunk_size,
                                              sequence_parallel=self.ctx.sequence_parallel, token_weights=weights_sb)
        losses_sb = vocab_parallel_cross_entropy(self.logits_local(x), labels_sb, self.ctx.group, self.cfg.vocab_size)
        return (losses_sb * weights_sb.to(losses_sb.dtype)).sum()

    @torch.no_grad()
    def decode(self, ids_bs: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits [b, s, vocab] of ``ids_bs`` [b, s], the tokens that follow those in ``cache``, which then
        holds theirs too. For generation: a whole model (tp 1, pp 1, cp 1) in eval mode, with no recompute
        or compile wrap; padded vocabulary rows are left out."""
        assert self.pre_process and self.post_process and self.ctx.tp == 1 and not self.ctx.cp.active
        x = self.embedding(ids_bs, cache=cache)
        for layer in self.layers.values():
            x = layer(x, cache=cache)
        cache.advance(ids_bs.shape[1])
        logits_sbv = self.logits_local(self.final_norm(x))
        return logits_sbv[..., :self.cfg.vocab_size].transpose(0, 1)

    def logits_local(self, x: torch.Tensor) -> torch.Tensor:
        """Vocab-sharded logits; the input-gradient all-reduce overlaps the head's weight-gradient GEMM."""
        return column_parallel_linear(x, self.output_weight, None, self.ctx.group, self.ctx.sequence_parallel)


def count_parameters(model: nn.Module, tp: int = 1, ep: int = 1, etp: int | None = None) -> int:
    """Parameters of the full model represented by this module: TP slices scaled back up, and expert
    weights (E/ep experts, each split over etp ranks, which defaults to tp) scaled to all experts whole."""
    total = 0
    for p in model.parameters():
        spec = spec_of(p)
        if spec.tied_role == "embedding_copy":
            continue
        split = (tp if etp is None or not spec.expert else etp) if spec.split_dim is not None else 1
        total += p.numel() * split * (ep if spec.expert else 1)
    return total
