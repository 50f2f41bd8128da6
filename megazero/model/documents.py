"""Packed documents: where each sample's documents start, computed once per micro-batch.

The GPT dataset packs documents, each ended by the tokenizer's end-of-document (EOD) token, into
fixed-length samples. Megatron-LM's three flags make a packed sample train as its documents
would alone:

    --reset-position-ids    positions restart at 0 after every EOD (learned table and RoPE)
    --reset-attention-mask  a token attends only to earlier tokens of its own document
    --eod-mask-loss         no loss where the input token is the EOD (its prediction of the next
                            document's first token, which it cannot see)

A document runs up to and including its EOD, so a document alone as [t1 .. tn, EOD] has exactly
the inputs, positions, attention and loss terms it has inside the packed sample.
``PackingRule.documents`` turns one micro-batch of token ids into a ``Documents`` that travels
with it through every stage and layer: the boundaries are never recomputed per layer.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..config import ConfigError, DataConfig, flag
from ..context_parallel.doc_blocks import Bounds, document_blocks, pairs, ring_runs


@dataclass(frozen=True)
class Documents:
    """One micro-batch's documents (inputs [b, S]).

    ``bounds``: per sample, the document starts and S (cu_seqlens), for the attention mask; None
    when attention is not reset. ``positions`` [b, s]: each token's position (restarting per
    document), None for 0, 1, ...; ``loss_mask`` [b, s] (1 = counted), None for every token;
    ``loss_scale`` multiplies the masked sum of token losses (1 / count: the micro-batch's mean;
    the schedule sets the global batch's). Under context parallelism ``local`` cuts positions and
    loss mask to a rank's tokens (s = S / cp); ``bounds`` stay global.
    """

    bounds: Bounds | None = None
    positions: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    loss_scale: float = 1.0
    mtp_scales: tuple[float, ...] = ()  # per MTP depth, as loss_scale (``model/mtp.py``); () = the micro-batch's

    def local(self, split, cp_rank: int) -> "Documents":
        """This CP rank's positions and loss mask (``split``: the ``CPSplit``)."""
        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else split.take(t, 1, cp_rank)
        return dataclasses.replace(self, positions=take(self.positions), loss_mask=take(self.loss_mask))

    def token_count(self) -> int:
        """Tokens that carry a loss."""
        assert self.loss_mask is not None
        return int(self.loss_mask.sum().item())


def document_bounds(inputs_bs: torch.Tensor, eod_id: int) -> Bounds:
    """Per sample: 0, the position after each EOD (but the last token's), and S."""
    seq = inputs_bs.shape[1]
    rows, cols = torch.nonzero(inputs_bs[:, :-1] == eod_id, as_tuple=True)
    starts: list[list[int]] = [[0] for _ in range(inputs_bs.shape[0])]
    for row, col in zip(rows.tolist(), cols.tolist()):
        starts[row].append(col + 1)
    return tuple(tuple(s + [seq]) for s in starts)


def attended_pairs(bounds: Bounds, ring: tuple[int, int] | None = None) -> int:
    """(query, key) pairs the block-diagonal causal mask lets attention compute: sum of L(L+1)/2 over
    the documents. ``ring`` = (ring rank, ring size): only the pairs whose query this ring rank holds
    (its two load-balanced chunks against every rank's keys: what its ring steps compute).
    """
    if ring is None:
        return sum((e - s) * (e - s + 1) // 2 for cuts in bounds for s, e in zip(cuts[:-1], cuts[1:]))
    rank, size = ring
    local_len = bounds[0][-1] // size
    every_key = [run for src in range(size) for run in ring_runs(src, size, local_len)]
    return pairs(document_blocks(ring_runs(rank, size, local_len), every_key, bounds))


def attended_share(step_bounds: list[Bounds], ring: tuple[int, int] | None = None) -> float:
    """The step's attended pairs over the pairs full causal attention computes on the same samples
    (one document per sample): the factor on the attention core's FLOPs (``model.flops``)."""
    causal = [tuple((0, cuts[-1]) for cuts in bounds) for bounds in step_bounds]
    return (sum(attended_pairs(b, ring) for b in step_bounds) / sum(attended_pairs(b, ring) for b in causal))


def document_positions(bounds: Bounds, device: torch.device | str) -> torch.Tensor:
    """Positions [b, S] that restart at 0 at every document start."""
    rows = []
    for cuts in bounds:
        lengths = torch.tensor([e - s for s, e in zip(cuts[:-1], cuts[1:])], device=device)
        starts = torch.tensor(cuts[:-1], device=device).repeat_interleave(lengths)
        rows.append(torch.arange(cuts[-1], device=device) - starts)
    return torch.stack(rows)


@dataclass(frozen=True)
class PackingRule:
    """The run's three document flags and the EOD id of the tokenizer the data was made with."""

    eod_id: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    def documents(self, inputs_bs: torch.Tensor) -> Documents:
        """The documents of one micro-batch's inputs [b, S] (token ids, labels excluded)."""
        bounds = document_bounds(inputs_bs, self.eod_id)
        positions = document_positions(bounds, inputs_bs.device) if self.reset_position_ids else None
        mask = (inputs_bs != self.eod_id).float() if self.eod_mask_loss else None
        scale = 1.0 / max(1, int(mask.sum().item())) if mask is not None else 1.0
        return Documents(bounds=bounds if self.reset_attention_mask else None, positions=positions,
                         loss_mask=mask, loss_scale=scale)


def packing_rule(data: DataConfig, eod_id: int | None) -> PackingRule | None:
    """The run's rule from its data flags (None without them); refuses the flags when the tokenizer the
    data was made with knows no EOD id. Every rank loads the tokenizer and calls this alike, so all stop.
    """
    given = [flag(name) for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
             if getattr(data, name)]
    if not given:
        return None
    if eod_id is None or eod_id < 0:
        tokenizer = data.tokenizer_model or "the default corpus's tokenizer"
        raise ConfigError(f"{given[0]} needs the end-of-document id that separates the packed documents, but "
                          f"{tokenizer} defines no EOS token; pass the --tokenizer-model the data was made with "
                          f"(tools/preprocess_data.py ends each document with its EOS) or drop {' '.join(given)}")
    return PackingRule(eod_id, data.reset_position_ids, data.reset_attention_mask, data.eod_mask_loss)
