"""The planner's view of the optimizer's buckets, against the optimizer's own bucketing of a built model."""
from __future__ import annotations

import pytest

from megazero.config import ModelConfig
from megazero.memory import bucket_numels, grad_bytes
from megazero.memory.grads import unit_buckets
from megazero.memory.params import chunk_param_numels, chunk_param_units
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from megazero.data_parallel.layout import plan_buckets
from megazero.data_parallel.engine import MAX_INFLIGHT_BUCKETS
from megazero.data_parallel.zero3 import plan_units
from megazero.tensor_parallel.layers import spec_of
from tests.helpers.model_shapes import MODELS


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("pre,post", [(True, True), (True, False), (False, True), (False, False)])
def test_param_numels_in_registration_order(name, pre, post):
    cfg = ModelConfig(**MODELS[name])
    model = GPTModel(cfg, TPContext(), layer_ids=range(1), pre_process=pre, post_process=post)
    assert chunk_param_numels(cfg, 1, 1, pre, post) == [p.numel() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("bucket_size,shards,tied", [(3000, 1, False), (3000, 2, True), (500, 4, False),
                                                      (10**9, 2, False), (1, 3, True)])
def test_bucket_numels_match_plan_buckets(name, bucket_size, shards, tied):
    cfg = ModelConfig(**MODELS[name])
    model = GPTModel(cfg, TPContext())
    params = list(model.parameters())
    spec_of(params[0]).tied_role = "embedding" if tied else None  # as partition.py marks it with pp > 1
    buckets, _ = plan_buckets(list(reversed(params)), bucket_size, shards, 0)
    numels = chunk_param_numels(cfg, 1, cfg.num_layers, True, True)
    assert bucket_numels(numels, bucket_size, shards, tied) == [b.numel for b in buckets]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("layers_per_unit,pre,post", [(1, True, True), (2, True, False), (1, False, True),
                                                      (3, False, False)])
def test_unit_buckets_match_zero3_buckets(name, layers_per_unit, pre, post):
    """ZeRO 3 closes a bucket at every unit boundary: units as ``plan_units`` forms them, buckets as
    ``plan_buckets`` cuts them (bucket size 3000 and 500 elements, dp 2)."""
    cfg = ModelConfig(**{**MODELS[name], "num_layers": 3})
    model = GPTModel(cfg, TPContext(), layer_ids=range(3), pre_process=pre, post_process=post)
    params = list(model.parameters())
    blocks = [u for u in plan_units(model, layers_per_unit) if not u.root]  # the planner labels the root 0
    unit_of = {p: 0 for u in plan_units(model, layers_per_unit) if u.root for p in u.params}
    unit_of.update({p: i + 1 for i, u in enumerate(blocks) for p in u.params})
    assert chunk_param_units(cfg, 3, pre, post, layers_per_unit) == [unit_of[p] for p in params]
    for size in (3000, 500):
        buckets, _ = plan_buckets(list(reversed(params)), size, 2, 0, unit_of)
        numels = chunk_param_numels(cfg, 1, 3, pre, post)
        units = chunk_param_units(cfg, 3, pre, post, layers_per_unit)
        assert unit_buckets(numels, units, size, 2, False) == [(unit_of[b.params[0]], b.numel) for b in buckets]


def test_zero2_gradient_bytes_depend_on_micro_batches():
    """The issue's case: fp32, dp 2, m 2 holds a full buffer plus the shard, 6 bytes per parameter."""
    p = 1_000_000
    assert grad_bytes(p, [], 2, 2, 2, 4).peak == 6 * p
    assert grad_bytes(p, [], 2, 1, 2, 4).peak == 4 * p  # ZeRO 1: the full buffer only
    buckets = [100, 200, 300, 400, 50]
    k = MAX_INFLIGHT_BUCKETS + 1  # in flight + the one filling, consecutive in backward order
    window = max(sum(buckets[i: i + k]) for i in range(len(buckets) - k + 1))
    assert grad_bytes(p, [buckets], 2, 2, 1, 4).peak == 2 * p + 4 * window
