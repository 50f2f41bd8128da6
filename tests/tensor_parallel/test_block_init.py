"""Block-seeded initialisation: any TP slice is the same full tensor, and a rank draws only its own.

``fill_normal_slice`` is checked in one process against the full (tp = 1) draw for
slices that are not block-aligned. One 4-rank gloo world then builds a gpt2 and a
llama through ``build_chunks`` (meta device, then storage, then init) at tp = 4 and
tp = 2 and compares every parameter bitwise with the slice of the tp = 1 build:
split rows and columns, replicated drawn and constant tensors, and vocabulary
padding that differs with tp (1100 rows pad to 1100 at tp 1 and 2, 1200 at tp 4).
A dispatch mode records every tensor the tp = 4 build allocates: none may be
larger than the rank's largest parameter (the old full draw was tp times that).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megazero.config import Config
from megazero.parallel.layout import Layout
from megazero.parallel.state import ParallelState
from megazero.pipeline.partition import build_chunks
from megazero.run_plan import RunPlan
from megazero.tensor_parallel.layers import INIT_BLOCK, fill_normal_slice, spec_of
from tests.helpers.dist import spawn

VOCAB = 1100
MODELS = {  # ffn 1120: 280 rows a rank at tp 4, so slices straddle 128-row blocks
    "gpt2": dict(arch="gpt2", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16,
                 ffn_hidden_size=1120, vocab_size=VOCAB, make_vocab_size_divisible_by=50),
    "llama": dict(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                  seq_length=16, ffn_hidden_size=1120, vocab_size=VOCAB, make_vocab_size_divisible_by=50),
}


def _slices(full_len: int, tp: int, dim: int, other: int, dtype=torch.float32) -> list[torch.Tensor]:
    out = []
    for rank in range(tp):
        n = full_len // tp
        shape = (n, other) if dim == 0 else (other, n)
        t = torch.empty(shape, dtype=dtype)
        fill_normal_slice(t, seed=5, name="w", std=0.5, dim=dim, start=rank * n)
        out.append(t)
    return out


@pytest.mark.parametrize("dim", [0, 1])
def test_any_slice_is_the_full_tensor(dim: int) -> None:
    """300 = 3 x 100 = 4 x 75 rows: slices straddle blocks; a shorter full tensor is a prefix; bf16 is the cast."""
    full = _slices(300, 1, dim, 7)[0]
    for tp in (2, 3, 4):
        assert torch.equal(torch.cat(_slices(300, tp, dim, 7), dim), full), f"tp={tp} dim={dim}"
    assert torch.equal(_slices(200, 1, dim, 7)[0], full.narrow(dim, 0, 200)), "depends on the full length"
    assert torch.equal(torch.cat(_slices(300, 4, dim, 7, torch.bfloat16), dim), full.to(torch.bfloat16))
    assert not torch.equal(full.narrow(dim, 0, INIT_BLOCK), full.narrow(dim, INIT_BLOCK, INIT_BLOCK))


class _Allocations(TorchDispatchMode):
    """The largest tensor (elements) any op made off the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.largest = max(self.largest, t.numel())
        return out


def _build(arch: str, pstate: ParallelState, seed: int = 3,
           bf16: bool = False) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """This rank's first chunk built as a run builds it, and its parameters by name."""
    cfg = Config.from_flat({**MODELS[arch], "seed": seed, "bf16": bf16, "tensor_model_parallel_size": pstate.tp})
    model = build_chunks(cfg, RunPlan.resolve(cfg, pstate.layout.world_size), pstate)[0]
    assert all(p.device.type == "cpu" for p in model.parameters()), "a parameter was left on the meta device"
    return {name: p.detach() for name, p in model.named_parameters()}, model


def _mismatches(arch: str, ref: dict, pstate: ParallelState) -> list[str]:
    """Parameters of this rank's build that differ from the slice of the tp = 1 build."""
    got, model = _build(arch, pstate)
    bad = []
    for name, p in model.named_parameters():
        full, dim = ref[name], spec_of(p).split_dim
        if dim is not None:
            rows = p.shape[dim] * pstate.tp
            if full.shape[dim] < rows:  # the padded vocabulary: rows past VOCAB are zero in both builds
                pad = list(full.shape)
                pad[dim] = rows - full.shape[dim]
                full = torch.cat([full, full.new_zeros(pad)], dim)
            full = full.narrow(dim, pstate.tp_rank * p.shape[dim], p.shape[dim])
        if not torch.equal(got[name], full):
            bad.append(f"{arch} tp={pstate.tp} {name}")
    return bad


def check_ranks(pstate: ParallelState) -> dict:
    """Every rank: tp = 4 (pstate) and tp = 2 (sub-groups) against tp = 1; allocations; seed determinism."""
    rank = pstate.rank
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    layout2 = Layout.from_world(2, 2, 1)
    tp2 = ParallelState(layout=layout2, rank=rank % 2, coords=layout2.coords(rank % 2), device=pstate.device,
                        tp_group=pairs[rank // 2])
    serial = ParallelState.serial()
    report: dict = {"bad": [], "largest_alloc": {}, "largest_param": {}}
    for arch in MODELS:
        ref, _ = _build(arch, serial)
        report["bad"] += _mismatches(arch, ref, pstate) + _mismatches(arch, ref, tp2)
        with _Allocations() as seen:
            params, _ = _build(arch, pstate)
        report["largest_alloc"][arch] = seen.largest
        report["largest_param"][arch] = max(p.numel() for p in params.values())
        again, _ = _build(arch, pstate)
        other, _ = _build(arch, pstate, seed=4)
        bf16, _ = _build(arch, pstate, bf16=True)
        report[f"{arch}.deterministic"] = all(torch.equal(params[n], again[n]) for n in params)
        report[f"{arch}.seed_matters"] = not torch.equal(params["layers.0.mlp.fc1.weight"],
                                                         other["layers.0.mlp.fc1.weight"])
        report[f"{arch}.bf16_is_cast"] = all(torch.equal(bf16[n], params[n].to(torch.bfloat16)) for n in params)
    return report


def test_tp_slices_of_the_built_model_equal_serial() -> None:
    for rank, report in enumerate(spawn(check_ranks, 4, tp=4)):
        assert not report["bad"], f"rank {rank}: slices differ from tp=1: {report['bad']}"
        for arch in MODELS:
            assert report[f"{arch}.deterministic"] and report[f"{arch}.seed_matters"], (rank, arch)
            assert report[f"{arch}.bf16_is_cast"], f"rank {rank} {arch}: bf16 build is not the fp32 draw cast"
            largest, own = report["largest_alloc"][arch], report["largest_param"][arch]
            assert largest <= own, (f"rank {rank} {arch}: the build allocated a {largest}-element tensor, more "
                                    f"than its largest parameter ({own}): a full tensor was drawn")
