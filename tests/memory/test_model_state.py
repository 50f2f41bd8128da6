"""Model-state figures: the ZeRO paper's Table 1, closed-form parameter counts, and measured records.

The paper (Rajbhandari et al. 2020, Table 1) uses mixed-precision Adam with
K = 12 and 2-byte gradients, i.e. ``--bf16 --main-grads-dtype bf16``, and GB =
1e9 bytes. Its columns: baseline (zero 0), P_os (zero 1), P_os+g (zero 2),
P_os+g+p (stage 3, arithmetic only here). A figure matches when it equals the
prediction rounded (or, as the paper sometimes prints, truncated) to the
digits printed.
"""
from __future__ import annotations

import math

import pytest

from megazero.config import Config, ModelConfig
from megazero.memory import PlanSpec, model_state_bytes, num_parameters, plan_memory
from megazero.run_plan import RunPlan
from megazero.model.gpt import GPTModel, count_parameters
from megazero.model.transformer import TPContext
from tests.helpers.dist import spawn
from tests.helpers.model_shapes import MODELS
from tests.helpers.step_meter import measure_steps

# DP -> (baseline, P_os, P_os+g, P_os+g+p) in GB, per model size.
ZERO_TABLE_1 = {
    7.5e9: {1: (120, 120, 120, 120), 4: (120, 52.5, 41.3, 30), 16: (120, 35.6, 21.6, 7.5),
            64: (120, 31.4, 16.6, 1.88), 256: (120, 30.4, 15.4, 0.47), 1024: (120, 30.1, 15.1, 0.12)},
    128e9: {1: (2048, 2048, 2048, 2048), 4: (2048, 896, 704, 512), 16: (2048, 608, 368, 128),
            64: (2048, 536, 284, 32), 256: (2048, 518, 263, 8), 1024: (2048, 513, 257, 2)},
    1e12: {1: (16000, 16000, 16000, 16000), 4: (16000, 7000, 5500, 4000), 16: (16000, 4750, 2875, 1000),
           64: (16000, 4187.5, 2218.75, 250), 256: (16000, 4046.9, 2054.7, 62.5),
           1024: (16000, 4011.7, 2013.7, 15.6)},
}


def _matches(predicted: float, printed: float) -> bool:
    text = repr(float(printed))
    decimals = 0 if printed == int(printed) else len(text.split(".")[1])
    scale = 10 ** decimals
    target = round(printed * scale)
    return math.floor(predicted * scale + 0.5) == target or math.floor(predicted * scale) == target


@pytest.mark.parametrize("psi", sorted(ZERO_TABLE_1))
def test_zero_paper_table_1(psi):
    bad = []
    for dp, row in ZERO_TABLE_1[psi].items():
        for stage, printed in enumerate(row):
            gb = model_state_bytes(psi, dp, stage, "bf16", "bf16").total / 1e9
            if not _matches(gb, printed):
                bad.append(f"{psi:.3g} params, DP {dp}, stage {stage}: predicted {gb:.4f} GB, paper {printed}")
    assert not bad, "\n".join(bad)


def test_headline_7_5b_at_dp_64():
    per_stage = [model_state_bytes(7.5e9, 64, z, "bf16", "bf16").total / 1e9 for z in (0, 1, 2)]
    assert [round(x, 1) for x in per_stage] == [120.0, 31.4, 16.6], per_stage


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_num_parameters_closed_form(name, tp):
    """Equals the built model's count; tp changes only the vocabulary padding (a stand-in rank builds it)."""
    cfg = ModelConfig(**MODELS[name])
    built = count_parameters(GPTModel(cfg, TPContext()), 1) if tp == 1 else None
    if tp == 1:
        assert num_parameters(cfg, 1) == built
    padded = cfg.padded_vocab_size(tp)
    pad_rows = padded - cfg.padded_vocab_size(1)
    copies = 1 if cfg.tied_embeddings else 2
    assert num_parameters(cfg, tp) == num_parameters(cfg, 1) + copies * pad_rows * cfg.hidden_size


def test_llama_7b_parameter_count():
    cfg = ModelConfig(arch="llama", num_layers=32, hidden_size=4096, num_attention_heads=32,
                      ffn_hidden_size=11008, seq_length=4096, vocab_size=32000, make_vocab_size_divisible_by=128)
    assert num_parameters(cfg) == 6_738_415_616  # Llama-2-7B's published count


# -- predicted vs the optimizer's measured memory records ------------------------------------------------
LAYOUTS = [  # (world, tp, pp, zero, precision, main grads, model)
    (1, 1, 1, 0, "fp32", "fp32", "gpt2"),
    (2, 1, 1, 1, "fp32", "fp32", "llama_gqa"),
    (2, 1, 1, 2, "bf16", "fp32", "gpt2"),
    (2, 2, 1, 1, "bf16", "bf16", "llama_gqa"),
    (2, 1, 2, 0, "fp32", "fp32", "gpt2"),
    (4, 1, 2, 2, "bf16", "fp32", "gpt2_untied"),
    (4, 2, 2, 1, "fp32", "fp32", "llama_tied"),
    (4, 2, 1, 2, "bf16", "bf16", "gpt2"),
]


def _config(tp: int, pp: int, zero: int, precision: str, grads: str, model: str) -> Config:
    flat = {**MODELS[model], "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "zero": zero,
            "bf16": precision == "bf16", "main_grads_dtype": grads, "micro_batch_size": 2,
            "global_batch_size": 8, "device": "cpu", "num_layers": 4, "bucket_size": 3000}
    return Config.from_flat(flat)


def measured_records(pstate, layout: tuple) -> dict:
    """This rank's peak model state over two real steps (``step_meter``) and the model's parameter count."""
    from megazero.optimizer.accounting import counted_parameters
    from megazero.training.parallelize import build_model_chunks

    cfg = _config(*layout[1:])
    chunks = build_model_chunks(cfg, RunPlan.resolve(cfg, pstate.layout.world_size), pstate)
    count = counted_parameters(chunks, pstate)
    return {**measure_steps(pstate, cfg), "num_parameters": count}


def test_model_state_matches_measured_records():
    """Within 2% per component of the peak measured during real steps on every rank, across eight
    layouts (pp = 2 with 1F1B, tp = 2, ZeRO 0/1/2, bf16 main grads among them; m = 8 / (2 dp))."""
    bad = []
    for layout in LAYOUTS:
        world, tp, pp = layout[:3]
        cfg = _config(*layout[1:])
        run_plan = RunPlan.resolve(cfg, world)
        plan = plan_memory(PlanSpec.from_plan(cfg, run_plan, device="cpu"))
        assert plan.spec.schedule == "1f1b"
        for rec in spawn(measured_records, world, layout, tp=tp, pp=pp):
            stage = plan.stages[rec["pp_rank"]]
            assert rec["num_parameters"] == plan.num_parameters, (layout, rec["num_parameters"])
            for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
                predicted, measured = getattr(stage, key), rec[key]
                err = abs(predicted - measured) / measured
                if err > 0.02:
                    bad.append(f"{layout} rank {rec['rank']} {key}: predicted {predicted:.0f}, "
                               f"measured {measured} ({100 * err:.2f}%)")
    assert not bad, "\n".join(bad)
