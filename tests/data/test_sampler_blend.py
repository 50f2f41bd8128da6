"""DP slicing, resume, and weighted blending."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from megazero.data.blend import BlendedDataset, blend_assignment, parse_data_path
from megazero.data.gpt_dataset import GPTDataset
from megazero.data.indexed import IndexedDataset, IndexedDatasetWriter
from megazero.data.sampler import MicroBatchIterator


class Ids(torch.utils.data.Dataset):
    """Item i is a tensor holding i (so batches show which samples they hold)."""

    def __init__(self, n: int, width: int = 3, tag: int = 0) -> None:
        self.n, self.width, self.tag = n, width, tag

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return torch.full((self.width,), self.tag * 1_000_000 + i, dtype=torch.int64)


@pytest.fixture(scope="module")
def gpt(tmp_path_factory: pytest.TempPathFactory) -> GPTDataset:
    folder = str(tmp_path_factory.mktemp("gpt"))
    rng = np.random.RandomState(0)
    with IndexedDatasetWriter(os.path.join(folder, "d"), vocab_size=1000) as w:
        for _ in range(200):
            w.add_document(rng.randint(0, 1000, size=rng.randint(1, 60)))
    return GPTDataset(IndexedDataset(os.path.join(folder, "d")), seq_length=8, num_samples=512, seed=11)


def run(ds: torch.utils.data.Dataset, dp: int, steps: int, gbs: int = 16, mbs: int = 2,
        consumed: int = 0) -> list[torch.Tensor]:
    """Per step, the global batch as the concatenation over DP ranks."""
    its = [MicroBatchIterator(ds, mbs, gbs // (mbs * dp), r, dp, consumed) for r in range(dp)]
    out = []
    for _ in range(steps):
        per_rank = [torch.cat(it.next_step()) for it in its]
        out.append(torch.cat(per_rank))
    return out


def test_dp_size_does_not_change_global_batch(gpt: GPTDataset) -> None:
    one = run(gpt, dp=1, steps=5)
    for dp, mbs in ((2, 2), (4, 2), (4, 4), (8, 1)):
        other = run(gpt, dp=dp, steps=5, mbs=mbs)
        assert all(torch.equal(a, b) for a, b in zip(one, other))
    it = MicroBatchIterator(gpt, 2, 2, 1, 4)
    micro = it.next_step()
    assert len(micro) == 2 and micro[0].shape == (2, 9) and micro[0].dtype == torch.int64
    assert it.consumed_samples == 16


def test_slices_are_contiguous_and_order_repeats() -> None:
    it = MicroBatchIterator(Ids(100), 2, 1, dp_rank=2, dp_size=4, consumed_samples=16)
    assert [m[:, 0].tolist() for m in it.next_step()] == [[20, 21]]
    assert [m[:, 0].tolist() for m in it.next_step()] == [[28, 29]]


def test_two_runs_same_order(gpt: GPTDataset) -> None:
    assert all(torch.equal(a, b) for a, b in zip(run(gpt, 2, 4), run(gpt, 2, 4)))


def test_resume_matches_uninterrupted(gpt: GPTDataset) -> None:
    full = run(gpt, dp=2, steps=6)
    first = MicroBatchIterator(gpt, 2, 4, 0, 2)
    for _ in range(3):
        first.next_step()
    state = first.state_dict()
    assert state == {"consumed_samples": 48}
    resumed_its = []
    for r in range(2):
        it = MicroBatchIterator(gpt, 2, 4, r, 2)
        it.load_state_dict(state)
        resumed_its.append(it)
    for step in range(3, 6):
        assert torch.equal(torch.cat([torch.cat(it.next_step()) for it in resumed_its]), full[step])


def test_exhaustion_and_validation() -> None:
    it = MicroBatchIterator(Ids(20), 4, 1, 0, 2)
    assert it.global_batch_size == 8 and len(list(it)) == 2 and not it.has_next()
    with pytest.raises(StopIteration):
        it.next_step()
    with pytest.raises(ValueError, match="dp_rank"):  # the batch arithmetic is RunPlan's (tests/test_run_plan.py)
        MicroBatchIterator(Ids(20), 2, 1, 4, 4)


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.25, 0.2, 0.05], [1.0], [0.999, 0.001]])
def test_blend_proportions(weights: list[float]) -> None:
    n = 10_000
    source, index = blend_assignment(weights, n, seed=0)
    counts = np.bincount(source, minlength=len(weights))
    assert np.all(np.abs(counts / n - np.asarray(weights)) < 0.01)
    # every prefix is also balanced (within a couple of samples per source)
    for m in (10, 100, 1234):
        prefix = np.bincount(source[:m], minlength=len(weights))
        assert np.all(np.abs(prefix - np.asarray(weights) * m) <= 2)
    for k in range(len(weights)):
        assert index[source == k].tolist() == list(range(counts[k]))


def test_blended_dataset() -> None:
    sources = [Ids(8000, tag=0), Ids(3000, tag=1)]
    blend = BlendedDataset(sources, [0.7, 0.3], 10_000, seed=1)
    again = BlendedDataset(sources, [0.7, 0.3], 10_000, seed=1)
    tags = np.array([int(blend[i][0]) // 1_000_000 for i in range(len(blend))])
    assert abs(tags.mean() - 0.3) < 0.01
    assert all(torch.equal(blend[i], again[i]) for i in range(0, 10_000, 97))
    with pytest.raises(ValueError, match="needs"):
        BlendedDataset([Ids(10), Ids(10)], [0.5, 0.5], 100, seed=0)


def test_parse_data_path() -> None:
    assert parse_data_path(["a/b"]) == [(1.0, "a/b")]
    assert parse_data_path(["3", "x", "1", "y"]) == [(0.75, "x"), (0.25, "y")]
    for bad, match in ((["1", "x", "2"], "pairs"), (["w", "x", "1", "y"], "not a number"),
                       (["0", "x", "1", "y"], "positive"), ([], "empty")):
        with pytest.raises(ValueError, match=match):
            parse_data_path(bad)
