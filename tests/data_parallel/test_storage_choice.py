"""The data-parallel buffers' parameter and gradient storage is chosen once, from the ZeRO stage, in one place.

``storage.storage_for`` is the only site of ``buffers.py``, ``layout.py`` and ``storage.py`` that tests the
ZeRO stage (one of its ``shards_*`` properties, ``ZeroStage`` itself, or a comparison with a ``stage``); every storage
method follows from the storage picked there. The numerics are the ones before the split (the step records of
five layouts compare bitwise; ``tools/compare_step_records.py``); here: what each stage's storage holds.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from megazero.data_parallel.buffers import ParamGradBuffer
from megazero.data_parallel.param_offload import HostParamShards
from megazero.data_parallel.storage import (FullGrads, OffloadedParams, ReplicatedParams, ShardedGrads,
                                            ShardedParams, storage_for)
from megazero.run_plan import ZeroStage

PACKAGE = Path(__file__).resolve().parents[2] / "megazero" / "data_parallel"
STORAGE_MODULES = ("buffers.py", "layout.py", "storage.py")
STAGE_QUESTIONS = {name for name, value in vars(ZeroStage).items() if isinstance(value, property)}  # shards_*


def _asks_stage(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and node.attr in STAGE_QUESTIONS:
        return True
    if isinstance(node, ast.Name) and node.id == "ZeroStage":
        return True
    if isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
        return any(isinstance(o, ast.Name) and o.id == "stage" or isinstance(o, ast.Attribute) and o.attr == "stage"
                   for o in operands)
    return False


def stage_sites(source: str) -> list[str]:
    """The functions (``Class.method``; ``<module>`` for top-level code) of ``source`` that test the ZeRO stage,
    one entry per site; imports of ``ZeroStage`` do not count."""
    sites: list[str] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, child.name if where == "<module>" else f"{where}.{child.name}")
                continue
            if _asks_stage(child) and where not in sites:
                sites.append(where)
            visit(child, where)

    visit(ast.parse(source), "<module>")
    return sites


def test_the_zero_stage_picks_the_storage_at_one_site():
    sites = {name: stage_sites((PACKAGE / name).read_text()) for name in STORAGE_MODULES}
    assert sites == {"buffers.py": [], "layout.py": [], "storage.py": ["storage_for"]}, (
        f"only storage.storage_for may test the ZeRO stage; the storage it picks answers the rest: {sites}")


def test_the_site_counter_sees_every_form():
    source = '''
from ..run_plan import ZeroStage
LIMIT = ZeroStage.GRADIENTS
def pick(stage: ZeroStage):
    return 1 if stage.shards_parameters else 2
class Buffer:
    def grad_shard(self, b):
        if self.stage.shards_gradients:
            return b
    def zero(self):
        return self.stage == 2
    def fine(self, b):
        return b.shard_lo
'''
    assert stage_sites(source) == ["<module>", "pick", "Buffer.grad_shard", "Buffer.zero"]


@pytest.mark.parametrize("stage, params_kind, grads_kind", [
    (ZeroStage.NONE, ReplicatedParams, FullGrads), (ZeroStage.OPTIMIZER_STATE, ReplicatedParams, FullGrads),
    (ZeroStage.GRADIENTS, ReplicatedParams, ShardedGrads), (ZeroStage.PARAMETERS, ShardedParams, ShardedGrads)])
def test_each_stage_stores_as_its_sharding_says(stage, params_kind, grads_kind):
    """Two buffers (shard rank 0 and 1 of 2) of one small model: the attributes the rest of the package reads
    exist exactly for the stage's storage, and the two shards together are the model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    expected = [p.detach().clone() for p in model.parameters()]
    shards: dict[int, list[torch.Tensor]] = {}
    for rank in range(2):
        copy = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
        copy.load_state_dict(model.state_dict())
        params = list(copy.parameters())
        buf = ParamGradBuffer(params, bucket_size=20, num_shards=2, shard_rank=rank, param_dtype=torch.float32,
                              grad_dtype=torch.float32, storage=storage_for(stage), device=torch.device("cpu"))
        assert (type(buf.param_storage), type(buf.grad_storage)) == (params_kind, grads_kind)
        assert (buf.param_data is None) == stage.shards_parameters
        assert (buf.param_shard_data is None) == (not stage.shards_parameters)
        assert (buf.grad_data is None) == stage.shards_gradients
        assert (buf.grad_shard_data is None) == (not stage.shards_gradients)
        assert buf.param_store is None and len(buf.buckets) > 1
        alive = [b.grad is not None for b in buf.buckets]  # ZeRO 2/3: bucket gradients only while in use
        assert not any(alive) if stage.shards_gradients else all(alive)
        for b in buf.buckets:
            buf.bucket_grad(b).fill_(rank + 1.0)
            assert buf.grad_shard(b).numel() == b.shard_numel
            buf.release(b)
            assert (b.grad is None) == stage.shards_gradients
            shard = buf.read_param_shard(b)
            assert buf.fetch_param_shard(b).result().data_ptr() == shard.data_ptr()
            shards.setdefault(b.index, []).append(shard.clone())
        buf.zero_grad()
        assert all(torch.count_nonzero(buf.grad_shard(b)) == 0 for b in buf.buckets)
    original = {id(p): want for p, want in zip(params, expected)}
    for b in buf.buckets:  # the two ranks' shards of a bucket are its parameters
        full = torch.cat(shards[b.index])
        for p in b.params:
            start = buf.offsets[p] - b.offset
            assert torch.equal(full[start: start + p.numel()], original[id(p)].reshape(-1))


def test_offloaded_parameters_live_in_the_store():
    """ZeRO 3 + --offload-params (host tier): no device shards; the shard is read from, fetched from and written
    to the store, and the full-size parameters hold no bytes until materialized."""
    model = nn.Linear(6, 4)
    expected = torch.cat([p.detach().reshape(-1).clone() for p in reversed(list(model.parameters()))])
    buf = ParamGradBuffer(list(model.parameters()), bucket_size=10**6, num_shards=1, shard_rank=0,
                          param_dtype=torch.float32, grad_dtype=torch.float32,
                          storage=storage_for(ZeroStage.PARAMETERS, HostParamShards), device=torch.device("cpu"))
    assert isinstance(buf.param_storage, OffloadedParams) and isinstance(buf.param_store, HostParamShards)
    assert buf.param_shard_data is None and buf.param_data is None and not buf.fetch_deferred
    (b,) = buf.buckets
    assert b.param.untyped_storage().nbytes() == 0
    assert torch.equal(buf.read_param_shard(b)[:expected.numel()], expected)
    buf.set_param_shard(b, torch.ones(3), lo=2)
    assert torch.equal(buf.fetch_param_shard(b).result()[2:5], torch.ones(3))
    assert buf.materialize_params(b).untyped_storage().nbytes() == b.numel * 4
    buf.free_params(b)
    with pytest.raises(AssertionError, match="offloaded shards"):
        buf.param_shard(b)
    buf.close()
