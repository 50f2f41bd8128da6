"""Which samples each data-parallel rank reads at each step.

Step t's global batch is dataset indices ``[consumed, consumed + G)``; DP
rank r takes the contiguous slice ``[r*G/dp, (r+1)*G/dp)`` of it, cut into
micro-batches. The global batch therefore does not depend on the DP size,
and the only state is ``consumed_samples``: a run resumed from a checkpoint
reads exactly what the uninterrupted run would have read.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def check_batch_sizes(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Validate the batch arithmetic; returns micro-batches per step per rank."""
    if micro_batch_size < 1 or global_batch_size < 1:
        raise ValueError(
            f"--global-batch-size ({global_batch_size}) and --micro-batch-size ({micro_batch_size}) must be >= 1"
        )
    if dp_size < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {dp_size}")
    if global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(
            f"--global-batch-size ({global_batch_size}) must be divisible by --micro-batch-size "
            f"({micro_batch_size}) x data-parallel size ({dp_size}); change one of them"
        )
    return global_batch_size // (micro_batch_size * dp_size)


def rank_indices(consumed: int, global_batch_size: int, dp_rank: int, dp_size: int) -> range:
    """Dataset indices DP rank ``dp_rank`` reads in the step starting at ``consumed``."""
    per_rank = global_batch_size // dp_size
    start = consumed + dp_rank * per_rank
    return range(start, start + per_rank)


class MicroBatchIterator:
    """One DP rank's micro-batches, step by step, resumable by ``consumed_samples``."""

    def __init__(self, dataset: torch.utils.data.Dataset, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, consumed_samples: int = 0) -> None:
        self.num_micro_batches = check_batch_sizes(global_batch_size, micro_batch_size, dp_size)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples

    def has_next(self) -> bool:
        return self.consumed_samples + self.global_batch_size <= len(self.dataset)

    def next_step(self) -> list[torch.Tensor]:
        """This rank's micro-batches (each ``[micro, seq+1]`` int64) for the next step.

        Raises StopIteration when the dataset has no full global batch left.
        """
        if not self.has_next():
            raise StopIteration(
                f"dataset of {len(self.dataset)} samples exhausted at consumed_samples={self.consumed_samples}"
            )
        indices = rank_indices(self.consumed_samples, self.global_batch_size, self.dp_rank, self.dp_size)
        mbs = self.micro_batch_size
        batches = [
            torch.stack([self.dataset[i] for i in indices[m * mbs:(m + 1) * mbs]])
            for m in range(self.num_micro_batches)
        ]
        self.consumed_samples += self.global_batch_size
        return batches

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        while self.has_next():
            yield self.next_step()

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed_samples = int(state["consumed_samples"])
