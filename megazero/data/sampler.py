"""Which samples each data-parallel rank reads at each step.

Step t's global batch is dataset indices ``[consumed, consumed + G)``; DP
rank r takes the contiguous slice ``[r*G/dp, (r+1)*G/dp)`` of it, cut into
micro-batches. The global batch therefore does not depend on the DP size,
and the only state is ``consumed_samples``: a run resumed from a checkpoint
reads exactly what the uninterrupted run would have read.
"""

from __future__ import annotations

from typing import Iterator

import torch

from ..run_plan import RunPlan


def rank_indices(consumed: int, global_batch_size: int, dp_rank: int, dp_size: int) -> range:
    """Dataset indices DP rank ``dp_rank`` reads in the step starting at ``consumed``."""
    per_rank = global_batch_size // dp_size
    start = consumed + dp_rank * per_rank
    return range(start, start + per_rank)


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A micro-batch on ``device``: on CUDA through pinned host memory with a non-blocking copy.

    A copy from pageable memory is staged by the driver and blocks the host until it is done;
    from pinned memory it is one DMA the host does not wait for, so the next micro-batch is
    stacked while this one crosses the bus, and the copy is ordered before the kernels that read
    it on the same stream. PyTorch's pinned-memory allocator keeps the host buffer alive until
    the copy has run. On CPU the batch is returned as it is.
    """
    if device.type != "cuda":
        return batch
    return batch.pin_memory().to(device, non_blocking=True)


class MicroBatchIterator:
    """One DP rank's micro-batches, step by step, resumable by ``consumed_samples``.

    The batch arithmetic was validated when the run plan was resolved
    (``RunPlan.micro_batches``); the global batch is ``micro_batch_size x micro_batches x dp_size``.
    """

    def __init__(self, dataset: torch.utils.data.Dataset, micro_batch_size: int, micro_batches: int,
                 dp_rank: int, dp_size: int, consumed_samples: int = 0) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        self.dataset = dataset
        self.micro_batch_size, self.num_micro_batches = micro_batch_size, micro_batches
        self.global_batch_size = micro_batch_size * micro_batches * dp_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples

    @classmethod
    def from_plan(cls, dataset: torch.utils.data.Dataset, plan: RunPlan, dp_rank: int,
                  consumed_samples: int = 0) -> "MicroBatchIterator":
        """This DP rank's iterator for the run ``plan`` describes."""
        return cls(dataset, plan.micro_batch_size, plan.micro_batches, dp_rank, plan.dp, consumed_samples)

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
