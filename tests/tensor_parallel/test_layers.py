"""TP layers and vocab-parallel cross entropy match serial torch (fp32, tp = 2 and 4).

Forward outputs, input gradients and gathered weight gradients are compared
with the same layer at TP=1 built from the same seed. The tolerance 1e-5 is
relative to the largest entry; the only difference from serial is the order
of floating-point sums in the all-reduces.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megazero.tensor_parallel.comm import _all_reduce, _split
from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megazero.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                             initialize_parameters)
from tests.helpers.compare import full_grads, gather_full, rel_err
from tests.helpers.dist import spawn

S, B, IN, OUT, SEED = 8, 3, 16, 24, 7


def _pair(make, group):
    """The same layer at TP=1 and on this TP group, initialised from one seed."""
    serial, parallel = nn.ModuleDict({"layer": make(None)}), nn.ModuleDict({"layer": make(group)})
    initialize_parameters(serial, SEED, None)
    initialize_parameters(parallel, SEED, group)
    return serial["layer"], parallel["layer"]


def _errors(serial, parallel, group, out_s, out_p, x_s, x_p, in_split, out_split) -> dict[str, float]:
    """Compare forward, input grad and weight grads; *_split say how the parallel tensors are sharded."""
    errs = {"out": rel_err(out_p, _split(out_s, out_split, group) if out_split is not None else out_s),
            "dx": rel_err(x_p.grad, _split(x_s.grad, in_split, group) if in_split is not None else x_s.grad)}
    grads_s = dict(serial.named_parameters())
    for name, g in full_grads(parallel, group).items():
        errs[f"d{name}"] = rel_err(g, grads_s[name].grad)
    return errs


def _run_linear(layer_s, layer_p, group, x_full, in_split, out_split):
    x_s = x_full.clone().requires_grad_()
    x_p = (_split(x_full, in_split, group) if in_split is not None else x_full.clone()).requires_grad_()
    out_s, out_p = layer_s(x_s), layer_p(x_p)
    grad_out = torch.randn(out_s.shape, generator=torch.Generator().manual_seed(3))
    out_s.backward(grad_out)
    out_p.backward(_split(grad_out, out_split, group) if out_split is not None else grad_out)
    return _errors(layer_s, layer_p, group, out_s, out_p, x_s, x_p, in_split, out_split)


def _sp_param_grads_reduced(layer, group):
    for p in layer.parameters():
        if getattr(p, "spec", None) is not None and p.spec.sequence_parallel and p.grad is not None:
            p.grad = _all_reduce(p.grad, group)


def check_layers(pstate) -> dict[str, float]:
    g = pstate.tp_group
    x = torch.randn(S, B, IN, generator=torch.Generator().manual_seed(1))
    h = torch.randn(S, B, OUT, generator=torch.Generator().manual_seed(2))
    errs = {}
    for gather in (False, True):
        s, p = _pair(lambda grp: ColumnParallelLinear(IN, OUT, tp_group=grp, gather_output=gather), g)
        for k, v in _run_linear(s, p, g, x, None, None if gather else -1).items():
            errs[f"column(gather={gather}).{k}"] = v
    s, p = _pair(lambda grp: RowParallelLinear(OUT, IN, tp_group=grp), g)
    errs.update({f"row.{k}": v for k, v in _run_linear(s, p, g, h, -1, None).items()})
    # Sequence parallel: column gathers the sequence in, row reduce-scatters it out.
    s, p = _pair(lambda grp: ColumnParallelLinear(IN, OUT, tp_group=grp, sequence_parallel=grp is not None), g)
    errs.update({f"column_sp.{k}": v for k, v in _run_linear(s, p, g, x, 0, -1).items()})
    s, p = _pair(lambda grp: RowParallelLinear(OUT, IN, tp_group=grp, sequence_parallel=grp is not None), g)
    x_s, x_p = h.clone().requires_grad_(), _split(h, -1, g).requires_grad_()
    out_s, out_p = s(x_s), p(x_p)
    grad_out = torch.randn(out_s.shape, generator=torch.Generator().manual_seed(4))
    out_s.backward(grad_out)
    out_p.backward(_split(grad_out, 0, g))
    _sp_param_grads_reduced(p, g)
    errs.update({f"row_sp.{k}": v for k, v in _errors(s, p, g, out_s, out_p, x_s, x_p, -1, 0).items()})
    errs.update(_check_embedding_and_loss(pstate))
    return errs


def _check_embedding_and_loss(pstate) -> dict[str, float]:
    g, vocab, padded = pstate.tp_group, 500, 512 * pstate.tp
    s, p = _pair(lambda grp: VocabParallelEmbedding(padded, IN, tp_group=grp, valid_rows=vocab), g)
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(5))
    out_s, out_p = s(ids), p(ids)
    grad_out = torch.randn(out_s.shape, generator=torch.Generator().manual_seed(6))
    out_s.backward(grad_out)
    out_p.backward(grad_out)
    errs = {"embedding.out": rel_err(out_p, out_s),
            "embedding.dweight": rel_err(gather_full(p.weight.grad, 0, g), s.weight.grad)}
    # Cross entropy over padded, vocab-sharded logits vs torch's on the real vocabulary.
    logits = torch.randn(S, B, padded, generator=torch.Generator().manual_seed(8)) * 3
    target = torch.randint(0, vocab, (S, B), generator=torch.Generator().manual_seed(9))
    ref_in = logits[..., :vocab].clone().requires_grad_()
    ref = F.cross_entropy(ref_in.reshape(-1, vocab), target.reshape(-1), reduction="none").view(S, B)
    local = _split(logits, -1, g).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, g, vocab_size=vocab)
    weights = torch.rand(S, B, generator=torch.Generator().manual_seed(10))
    (ref * weights).sum().backward()
    (loss * weights).sum().backward()
    grad_full = gather_full(local.grad, -1, g)
    errs["cross_entropy.loss"] = rel_err(loss, ref)
    errs["cross_entropy.dlogits"] = rel_err(grad_full[..., :vocab], ref_in.grad)
    errs["cross_entropy.padding_grad_is_zero"] = float(grad_full[..., vocab:].abs().max())
    return errs


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_layers_match_serial(tp):
    results = spawn(check_layers, tp, tp=tp)
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if not v <= 1e-5}
        assert not bad, f"tp={tp} rank {rank}: {bad}"
        assert len(errs) > 20
