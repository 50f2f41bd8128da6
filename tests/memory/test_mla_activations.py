"""The planner's MLA activation terms (``megazero/memory/mla_activations.py``) against the bytes autograd saves.

One training forward of a real 2-layer MLA model per case under ``SavedTensorMeter``, as
``test_activations.py`` measures the plain blocks: with and without q LoRA, a value head narrower than the
query/key head (v padded) and wider (q, k padded, v a view of kv_up's output), fp32 and bf16, each recompute
mode, dropout off (SDPA's flash kernel) and on (CPU's math kernel), at tp 1, tp 2 with and without SP, and cp 2
(ring and all-to-all): the plan equals the measured bytes, to the byte. Before these terms the planner used the
plain block's figures at head_dim = h / n for an MLA block: -2.0% of the whole model's bytes for a 1-layer fp32
q-LoRA model (h 64, s 32), and for DeepSeek-V3's shape (tp 8, SP, bf16) 44 MiB per layer against MLA's 124 MiB.
"""
from __future__ import annotations

import itertools

from megazero.config import ModelConfig
from megazero.memory import layer_terms
from megazero.memory.activations import ActivationSpec
from megazero.parallel.state import ParallelState
from tests.helpers.dist import spawn
from tests.helpers.saved_vs_planned import measured_and_planned

MLA = dict(arch="llama", num_layers=2, hidden_size=48, num_attention_heads=4, seq_length=16,
           multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4)
MODES = ("none", "selective", "full")
V_WIDTHS = (6, 16)  # below dq + dr = 12 (v padded) and above it (q and k padded, v unpadded)


def measure(pstate, cases) -> dict[str, tuple[int, int]]:
    """(measured, planned) bytes of one training forward per case (a dict of flat settings) on this rank."""
    return {" ".join(f"{k}={v}" for k, v in case.items()): measured_and_planned(pstate, {**MLA, **case})
            for case in cases}


def tp1_cases() -> list[dict]:
    return [dict(q_lora_rank=q, v_head_dim=dv, bf16=bf16, recompute=mode, hidden_dropout=p, attention_dropout=p)
            for q, dv, bf16, mode, p in itertools.product((24, None), V_WIDTHS, (False, True), MODES, (0.0, 0.1))]


def tp2_cases() -> list[dict]:
    return [dict(q_lora_rank=q, v_head_dim=dv, bf16=bf16, sequence_parallel=sp, recompute=mode, attention_dropout=p)
            for q, dv, bf16, sp, mode, p in itertools.product((24, None), V_WIDTHS, (False, True), (False, True),
                                                               MODES, (0.0, 0.1))
            if q is not None or dv == 6]


def cp2_cases() -> list[dict]:
    return [dict(context_parallel_size=2, cp_comm_type=comm, q_lora_rank=24, v_head_dim=dv, bf16=bf16,
                 recompute=mode) for comm, dv, bf16, mode in itertools.product(("p2p", "a2a"), V_WIDTHS,
                                                                                (False, True), MODES)]


def _check(results: dict[str, tuple[int, int]]) -> None:
    bad = {k: f"measured {m}, planned {p} ({100 * (p - m) / m:+.2f}%)" for k, (m, p) in results.items() if m != p}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in bad.items())


def test_mla_activation_bytes_tp1():
    _check(measure(ParallelState.serial(), tp1_cases()))


def test_mla_activation_bytes_tp2_and_cp2():
    for result in spawn(measure, 2, tp2_cases(), tp=2):
        _check(result)
    for result in spawn(measure, 2, cp2_cases(), cp=2):
        _check(result)


def test_deepseek_v3_attention_terms_by_hand():
    """DeepSeek-V3's shape at s 4096, b 1, bf16, tp 8 with SP: the terms written out from the docstring's
    table, so a change to one of them shows here by name."""
    cfg = ModelConfig(arch="llama", num_layers=1, hidden_size=7168, num_attention_heads=128, seq_length=4096,
                      vocab_size=129280, multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512,
                      qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128)
    terms = layer_terms(cfg, ActivationSpec(seq_length=4096, micro_batch_size=1, tp=8, sequence_parallel=True))
    s, r, heads = 4096, 8, 128 // 8
    assert {k: terms[k] for k in ("q_norm", "q_up_input", "kv_norm", "kv_up_input", "rope_tables", "core_qk",
                                  "core_v", "lse", "core_out", "proj_input")} == {
        "q_norm": s * (2 * 1536 + 1) * 4 // r, "q_up_input": s * 1536 * 2 // r, "kv_norm": s * (2 * 512 + 1) * 4 // r,
        "kv_up_input": s * 512 * 2 // r, "rope_tables": 2 * s * 64 * 4, "core_qk": 2 * heads * s * 192 * 2,
        "core_v": heads * s * 192 * 2, "lse": heads * s * 4, "core_out": heads * s * 192 * 2,
        "proj_input": s * heads * 128 * 2}
    assert "qkv_out" not in terms and "rope" not in terms  # the plain block's terms are gone
