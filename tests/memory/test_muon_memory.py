"""The planner under ``--optimizer muon``: its state and NS workspace against what real steps hold, and the search.

- State: one dp 2 gloo world trains a tiny llama (GQA) with Muon for two real steps at ZeRO 0, 1 and 2, fp32 and
  bf16 (``step_meter``, as tests/memory/test_step_peak.py measures AdamW); the planned params, grads and optimizer
  bytes of every rank are within 2% of the measured ones (bucket padding), as there.
- NS workspace: every Newton-Schulz call of those steps runs under a dispatch mode that sums the storages alive
  after each op (``LiveBytes``); the most one call held on any rank equals the plan's ``ns_workspace_bytes``
  exactly, and no rank exceeds it, with NS in fp32 and, as torch.optim.Muon runs it, in bf16 (``--muon-ns-dtype``:
  half the bytes). The formula 2mn + 2m^2 is also checked alone on square, wide and tall matrices, in both dtypes.
- Search: with ``--optimizer muon`` the layout search lists exactly the layouts it lists for AdamW that
  ``Config.refuse_unbuilt_muon`` takes (offload variants included), and none that it refuses.
"""
from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import megazero.optimizer.muon_shards as muon_shards
from megazero.arguments import parse_config
from megazero.config import Config
from megazero.memory import PlanSpec, plan_memory
from megazero.memory.muon_plan import ns_workspace_elements
from megazero.memory.search import Hardware, search_layouts, trains
from megazero.optimizer.muon import newton_schulz
from megazero.run_plan import RunPlan
from tests.helpers.dist import spawn
from tests.helpers.step_meter import measure_steps

TOL = 0.02
KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes")
CASES = [(0, "fp32", "fp32"), (1, "fp32", "fp32"), (1, "bf16", "fp32"), (2, "bf16", "fp32"), (1, "bf16", "bf16")]


class LiveBytes(TorchDispatchMode):
    """The most bytes of distinct storages alive at once among the tensors the ops under it made."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref] = []
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made += [weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        alive = {}
        for ref in self.made:
            t = ref()
            if t is not None:
                alive[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        self.peak = max(self.peak, sum(alive.values()))
        return out


def muon_config(zero: int, precision: str, ns_dtype: str) -> Config:
    return Config.from_flat({
        "arch": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
        "ffn_hidden_size": 160, "seq_length": 16, "vocab_size": 1000, "zero": zero, "bf16": precision == "bf16",
        "micro_batch_size": 2, "global_batch_size": 8, "device": "cpu", "bucket_size": 3000, "seed": 5,
        "optimizer": "muon", "lr": 0.02, "muon_ns_dtype": ns_dtype})


def run_cases(pstate) -> list[dict[str, Any]]:
    """Each case's measured peak state and the most bytes one NS call held on this rank."""
    original, out = muon_shards.newton_schulz, []
    for case in CASES:
        held = [0]

        def metered(*args, **kwargs):
            with LiveBytes() as live:
                result = original(*args, **kwargs)
            held[0] = max(held[0], live.peak)
            return result

        muon_shards.newton_schulz = metered
        try:
            out.append({**measure_steps(pstate, muon_config(*case)), "ns_bytes": held[0]})
        finally:
            muon_shards.newton_schulz = original
    return out


def test_planner_matches_muon_steps_dp2():
    per_rank = spawn(run_cases, 2)
    bad = []
    for i, case in enumerate(CASES):
        cfg = muon_config(*case)
        stage = plan_memory(PlanSpec.from_plan(cfg, RunPlan.resolve(cfg, 2), device="cpu")).stages[0]
        records = [results[i] for results in per_rank]
        for rec in records:
            for key in KEYS:
                planned, measured = getattr(stage, key), rec[key]
                if abs(planned - measured) > TOL * measured:
                    bad.append(f"{case} rank {rec['rank']} {key}: planned {planned:.0f}, measured {measured}")
        ns = [rec["ns_bytes"] for rec in records]
        assert all(n > 0 for n in ns), (case, ns)  # every rank owns matrices, so the check reads them all
        if max(ns) != stage.ns_workspace_bytes:
            bad.append(f"{case} NS workspace: planned {stage.ns_workspace_bytes}, measured per rank {ns}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(48, 48), (32, 80), (80, 32)])
def test_ns_workspace_formula_is_what_newton_schulz_holds(shape, dtype):
    G = torch.randn(*shape)
    with LiveBytes() as live:
        newton_schulz(G, dtype=dtype)
    assert live.peak == dtype.itemsize * ns_workspace_elements(shape)


def _key(c) -> tuple:
    r = c.spec.run
    return (r.tp, r.cp, r.pp, r.dp, int(r.zero), r.micro_batch_size, c.spec.cfg.training.recompute,
            r.placement.optimizer_state, r.placement.parameters)


def test_search_proposes_only_what_muon_takes():
    cfg = Config.from_flat({"arch": "llama", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
                            "num_query_groups": 4, "seq_length": 512, "vocab_size": 8000, "bf16": True,
                            "global_batch_size": 8, "micro_batch_size": 1})
    hw = Hardware(gpus=4, gpu_memory_gib=0.25, gpus_per_node=4)
    adamw = search_layouts(cfg, hw, micro_batch_sizes=(1, 2), offload=True)
    muon = search_layouts(cfg.updated(optimizer="muon"), hw, micro_batch_sizes=(1, 2), offload=True)
    takes = {_key(c) for c in adamw if trains(c.spec.cfg.updated(optimizer="muon"))}
    assert all(trains(c.spec.cfg) for c in muon)
    assert {_key(c) for c in muon} == takes and takes
    refused = {_key(c) for c in adamw} - takes
    if not trains(cfg.updated(optimizer="muon", zero=3)):  # while Muon refuses ZeRO 3, the grid exercises it
        assert any(k[4] == 3 for k in refused), refused


@pytest.mark.parametrize("preset,pp", [("deepseek-tiny.yaml", 2), ("moonlight-16b-a3b.yaml", 3)])
def test_presets_with_a_moe_layer_list_plan_under_muon(preset, pp):
    """A preset's --moe-layer-freq is a list: the planner's per-model caches of Muon's matrices hash the model
    config (a plain `torchrun ... --config configs/deepseek-tiny.yaml --optimizer muon --pp 2` once failed there
    with "unhashable type: 'list'"). Every stage's Muon state is one moment less than AdamW's."""
    flags = ["--config", f"configs/{preset}", "--pp", str(pp), "--ep", "2", "--zero", "1", "--vocab-size", "8000",
             "--recompute", "full"]
    plans = {}
    for optimizer in ("adamw", "muon"):
        cfg, _ = parse_config([*flags, "--optimizer", optimizer])
        assert isinstance(cfg.model.moe_layer_freq, list)
        spec = PlanSpec.from_plan(cfg, RunPlan.resolve(cfg, 4 * pp), device="cpu")  # dp 4
        plans[optimizer] = plan_memory(spec).stages
    for adamw, muon in zip(plans["adamw"], plans["muon"]):
        assert muon.optimizer_bytes < adamw.optimizer_bytes, (adamw.optimizer_bytes, muon.optimizer_bytes)
