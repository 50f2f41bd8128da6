"""Synthetic token batches shaped like the data pipeline's, for parity tests that need no corpus."""
from __future__ import annotations

import torch

from megazero.config import Config
from megazero.model.documents import PackingRule

EOD = 2  # the end-of-document id of the packed batches
PACKED_RULE = PackingRule(EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)


class SyntheticBatches:
    """Seeded random token batches; each DP rank takes a contiguous slice of the global batch."""

    def __init__(self, cfg: Config, dp_rank: int, dp_size: int) -> None:
        self.cfg, self.dp_rank, self.dp_size = cfg, dp_rank, dp_size
        self.step, self.consumed_samples = 0, 0

    def next_step(self) -> list[torch.Tensor]:
        t, seq, vocab = self.cfg.training, self.cfg.model.seq_length, self.cfg.model.vocab_size
        gen = torch.Generator().manual_seed(1000 + self.step)
        tokens = torch.randint(0, vocab, (t.global_batch_size, seq + 1), generator=gen)
        self.step += 1
        self.consumed_samples += t.global_batch_size
        mine = tokens.view(self.dp_size, -1, seq + 1)[self.dp_rank]
        return list(mine.split(t.micro_batch_size))


class PackedBatches(SyntheticBatches):
    """The synthetic batches with an EOD wherever the drawn id is a multiple of 7 (about one token in seven)."""

    def next_step(self) -> list[torch.Tensor]:
        return [torch.where(mb % 7 == 0, EOD, mb) for mb in super().next_step()]
