"""The optimizer's per-parameter facts live in ``ParamSpec``: the weight-decay rule and the tied-embedding role."""
from __future__ import annotations

from torch import nn

from megazero.config import ModelConfig
from megazero.model.gpt import GPTModel, count_parameters
from megazero.model.transformer import TPContext
from megazero.data_parallel.layout import plan_buckets
from megazero.optimizer.grads import counts_for_norm
from megazero.parallel.state import ParallelState
from megazero.tensor_parallel.layers import spec_of
from tests.helpers.reference import param_groups

CFG = ModelConfig(arch="gpt2", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100)


def test_weight_decay_rule_matrices_only():
    model = GPTModel(CFG, TPContext())
    for name, p in model.named_parameters():
        assert spec_of(p).weight_decay == (p.ndim >= 2), name
    plain = nn.Linear(4, 4)  # a parameter without a spec gets the same rule
    assert spec_of(plain.weight).weight_decay and not spec_of(plain.bias).weight_decay
    decay, no_decay = param_groups(list(model.parameters()), 0.1)
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim < 2 for p in no_decay["params"])


def test_tied_roles_bucket_and_norm():
    last = GPTModel(CFG, TPContext(), layer_ids=range(1, 2), pre_process=False, post_process=True)
    copy = last.embedding.word.weight
    assert spec_of(copy).tied_role == "embedding_copy"
    assert not counts_for_norm(copy, ParallelState.serial())
    assert count_parameters(last) == sum(p.numel() for p in last.parameters()) - copy.numel()
    params = list(reversed(list(last.parameters())))
    buckets, _ = plan_buckets(params, bucket_size=10**9, num_shards=1, shard_rank=0)
    holding = [b.params for b in buckets if any(p is copy for p in b.params)]
    assert len(holding) == 1 and len(holding[0]) == 1  # alone in its bucket
