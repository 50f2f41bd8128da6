"""The planner knows mixture-of-experts: parameter counts, expert state per rank against real steps, the output.

Counts: ``num_parameters`` equals the built model's count, and the planner's dense and expert element lists
equal the built chunk's parameters in registration order (the buffers cut their buckets from them), for
gpt2 and llama, with a shared expert and a layer pattern. Expert state: the planner's expert parameter,
gradient and optimizer bytes per rank within 5% of the peaks measured over two real steps
(``tests/helpers/moe_memory.py``: they match exactly) at ep 2 with ZeRO 2 (pp 2, bf16 with fp32 main
grads) and ZeRO 3 (tp 2 with SP), and etp 2 at ZeRO 1. Activations: one MoE layer's planned terms against
the tensors autograd saves (saved-tensor hooks). The output: the plan's lines say what its MoE figures
assume, and the layout search varies ep and etp.
"""
from __future__ import annotations

import json

import pytest
import torch

from megazero.arguments import parse_config
from megazero.config import Config, ModelConfig
from megazero.memory import Hardware, PlanSpec, num_parameters, plan_memory, search_layouts
from megazero.memory.experts import expert_numels
from megazero.memory.moe_plan import moe_layer_terms
from megazero.memory.params import chunk_param_numels
from megazero.model.gpt import GPTModel, count_parameters
from megazero.model.transformer import TPContext
from megazero.moe.context import ExpertContext
from megazero.moe.layer import MoELayer
from megazero.run_plan import RunPlan
from megazero.tensor_parallel.layers import initialize_parameters, spec_of
from tests.helpers.dist import spawn
from tests.helpers.moe_memory import measured_expert_state
from tests.helpers.saved_tensors import SavedTensorMeter
from tests.helpers.tool_module import load_tool

MOE = {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 128, "seq_length": 16,
       "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("shared", [None, 24])
def test_counts_and_registration_order_match_the_built_model(arch, shared):
    cfg = ModelConfig(arch=arch, moe_layer_freq=["[0,1,1,0]"], moe_shared_expert_intermediate_size=shared, **MOE)
    model = GPTModel(cfg, TPContext())
    assert num_parameters(cfg) == count_parameters(model)
    dense = [p.numel() for p in model.parameters() if not spec_of(p).expert]
    experts = [p.numel() for p in model.parameters() if spec_of(p).expert]
    assert dense == chunk_param_numels(cfg, 1, cfg.num_layers, True, True)
    assert experts == expert_numels(cfg, 1, 1) * 2  # layers 1 and 2


LAYOUTS = [  # (world, tp, pp, ep, etp, zero, precision, arch)
    (4, 1, 2, 2, None, 2, "bf16", "gpt2"),  # pp 2: a dense layer on the first stage; edp 1
    (4, 2, 1, 2, 1, 3, "fp32", "llama"),  # tp 2 (SP), etp 1: edp 2
    (4, 2, 1, 1, 2, 1, "fp32", "gpt2"),  # etp 2, ep 1: edp 2
]


def _config(tp: int, pp: int, ep: int, etp: int | None, zero: int, precision: str, arch: str) -> Config:
    flat = {**MOE, "arch": arch, "moe_layer_freq": ["[0,1,1,1]"], "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp, "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp,
            "sequence_parallel": tp > 1, "zero": zero, "bf16": precision == "bf16", "micro_batch_size": 2,
            "global_batch_size": 8, "device": "cpu", "bucket_size": 3000}
    return Config.from_flat(flat)


def _measure(pstate, layout: tuple) -> dict:
    return measured_expert_state(pstate, _config(*layout[1:]))


def test_expert_state_matches_measured_steps():
    bad, seen = [], []
    for layout in LAYOUTS:
        world, tp, pp, ep, etp = layout[:5]
        cfg = _config(*layout[1:])
        plan = plan_memory(PlanSpec.from_plan(cfg, RunPlan.resolve(cfg, world), device="cpu"))
        for rec in spawn(_measure, world, layout, tp=tp, pp=pp, ep=ep, etp=etp):
            if rec["num_parameters"] != num_parameters(cfg.model, tp):  # the metrics file's count: every expert
                bad.append(f"{layout} rank {rec['rank']}: counted {rec['num_parameters']} parameters, "
                           f"the model has {num_parameters(cfg.model, tp)}")
            moe = plan.stages[rec["pp_rank"]].experts
            for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
                predicted, measured = getattr(moe, key), rec[key]
                seen.append(f"{layout} rank {rec['rank']} {key}: predicted {predicted:.0f}, measured {measured}")
                if abs(predicted - measured) > 0.05 * measured:
                    bad.append(seen[-1])
    print("\n".join(seen))
    assert not bad, "\n".join(bad)


BASE = ["--config", "configs/moe-tiny.yaml", "--vocab-size", "8000", "--recompute", "none", "--dp", "4"]


def test_the_plan_says_what_its_moe_figures_assume():
    """The table's lines name the expert grid and each assumption (dropless: balanced; capacity: exact), and
    ep divides the expert weights per rank while their state shards over edp from ZeRO 1 (JSON, bytes)."""
    tool = load_tool("plan_memory")
    code, text = tool.report(BASE + ["--ep", "4"])
    assert code == 0 and "dp=4 ep=4 etp=1 edp=1 (world 4)" in text and "(2 experts per rank)" in text, text
    assert "dropless: ASSUMES balanced tokens, each rank's experts compute k x T = 1,024 rows" in text, text
    code, text = tool.report(BASE + ["--ep", "2", "--moe-expert-capacity-factor", "1.5"])
    assert "capacity factor 1.5: an exact bound" in text and "1,536 rows" in text, text  # 8 x ceil(1.5 x 1024 / 8)
    code, text = tool.report(BASE + ["--ep", "2", "--zero-stages", "1", "3"])  # one row per stage: the lines too
    assert code == 0 and "edp=2 (expert state sharded over edp from ZeRO 1)" in text and "ASSUMES" in text, text
    plans = {(ep, zero): json.loads(tool.report(BASE + ["--ep", str(ep), "--zero", str(zero), "--json"])[1])[
        "layouts"][0] for ep in (1, 2) for zero in (0, 1)}
    cfg, _ = parse_config(BASE[:4])
    per_layer = sum(expert_numels(cfg.model, 1, 1))
    for (ep, zero), plan in plans.items():
        assert (plan["layout"]["ep"], plan["layout"]["edp"], plan["layout"]["zero"]) == (ep, 4 // ep, zero)
        assert plan["experts"]["params_on_rank"] == cfg.model.num_layers * per_layer // ep
    opt = {key: plan["experts"]["optimizer_bytes"] for key, plan in plans.items()}
    assert opt[(1, 0)] == 2 * opt[(2, 0)] and opt[(1, 1)] == opt[(2, 1)] == opt[(1, 0)] / 4


def test_the_search_varies_ep_and_etp():
    """Every (ep, etp) the grid folds into is searched; a layout's expert weights per rank are E / ep experts,
    and its step time carries the all-to-all (zero at ep 1)."""
    code, text = load_tool("plan_memory").report(BASE[:4] + ["--gpus", "4", "--gpu-memory", "80", "--top", "400"])
    assert code == 0 and " ep etp zero " in text.splitlines()[1]
    cfg, _ = parse_config(BASE[:4])
    cands = search_layouts(cfg, Hardware(gpus=4, gpu_memory_gib=80))
    grids = {(c.spec.run.tp, c.spec.run.ep, c.spec.run.etp) for c in cands}  # (tp, ep, etp); tp divides 2 kv groups
    assert grids == {(1, 1, 1), (1, 2, 1), (1, 4, 1), (2, 1, 1), (2, 2, 1), (2, 4, 1), (2, 1, 2), (2, 2, 2)}
    per_layer = sum(expert_numels(cfg.model, 1, 1))
    for c in cands:
        moe = max(st.experts.params_on_rank for st in c.plan.stages)
        assert moe * c.spec.run.pp * c.spec.run.ep * c.spec.run.etp == cfg.model.num_layers * per_layer


@pytest.mark.parametrize("arch,dtype,shared", [("llama", torch.float32, None), ("llama", torch.bfloat16, 32),
                                               ("gpt2", torch.bfloat16, None), ("gpt2", torch.float32, 32)])
def test_moe_layer_saved_bytes_match_what_autograd_keeps(arch, dtype, shared):
    """One MoE layer's planned terms (``moe_plan.moe_layer_terms``, less the dense MLP they replace) plus the
    layer's input, which the block's terms charge, within 3% of the tensors autograd saves (serial, dropless,
    every expert's rows as many as balanced routing gives on average)."""
    flat = {**MOE, "arch": arch, "num_layers": 1, "seq_length": 64, "moe_ffn_hidden_size": 96, "hidden_size": 64,
            "num_experts": 8, "moe_shared_expert_intermediate_size": shared, "micro_batch_size": 4,
            "global_batch_size": 4, "bf16": dtype == torch.bfloat16, "device": "cpu", "recompute": "none"}
    cfg = Config.from_flat(flat)
    spec = PlanSpec.from_plan(cfg, RunPlan.resolve(cfg, 1), device="cpu")
    terms = moe_layer_terms(cfg, spec.run, spec.activation_spec())
    planned = sum(terms.values()) - terms["dense_mlp"] + 64 * 4 * 64 * dtype.itemsize
    layer = MoELayer(cfg.model, ExpertContext(), 0, dtype=dtype)
    initialize_parameters(layer, 1, None)
    x = torch.randn(64, 4, 64, dtype=dtype, requires_grad=True)
    normed = x * 1  # stands in for the norm's output, the layer's input
    with SavedTensorMeter(list(layer.parameters()) + [x]) as meter:
        layer(normed)
    assert abs(planned - meter.bytes) <= 0.03 * meter.bytes, (planned, meter.bytes, terms)
