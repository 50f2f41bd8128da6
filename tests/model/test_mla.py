"""Multi-head latent attention (``megazero/model/mla.py``, docs/architecture.md#mla-multi-head-latent-attention)
against transformers and across TP.

- Layer parity, fp32, one process: megazero's ``MLA`` equals transformers' ``DeepseekV3Attention`` (eager, its
  explicit softmax) with the same weights, output and every gradient (each weight's and the input's) within
  1e-6: with q LoRA and YaRN (mscale != mscale_all_dim, so both the cos/sin scale and the softmax correction
  act), without q LoRA (DeepSeek-V2-Lite's shape) and a value head wider than the query/key head, and with
  packed documents against HF given the block-diagonal mask and restarting positions, on DeepSeek's interleaved
  RoPE layout with the RoPE rows permuted (what a conversion does). YaRN's frequencies equal HF's bitwise at
  DeepSeek-V3's own rope settings.
- Parameter and FLOP counts: ``memory.params`` (the planner's formula) equals the built model's numel, and
  its per-parameter list the registration order; the FLOP count is the matmul shapes' (written out here).
- A tiny llama with --multi-latent-attention trains: finite, decreasing loss; a spawned 2-rank world at tp 2
  (with and without sequence parallelism) gives one process's loss and grad norm within 1e-5 relative over 5
  iterations (the replicated latent weights counted once in the norm).
- Bad combinations are refused, one line naming the flag.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from megazero.checkpoint.hf import to_hf
from megazero.config import Config, ConfigError, ModelConfig
from megazero.memory.params import block_param_numels, num_parameters
from megazero.model.chunk import blocks_of
from megazero.model.documents import Documents
from megazero.model.flops import layer_forward_flops
from megazero.model.gpt import GPTModel
from megazero.model.mla import MLA
from megazero.model.recompute import apply_recompute
from megazero.model.rope import rotary_inv_freq
from megazero.model.transformer import TPContext
from megazero.parallel.state import ParallelState
from megazero.tensor_parallel.layers import initialize_parameters
from tests.helpers.compare import full_grads, rel_err
from tests.helpers.dist import spawn
from tests.helpers.moe_runs import layout_of, serial_records
from tests.helpers.optimizer_harness import train
from tests.helpers.reference import sync_replicated_grads
from tests.helpers.refusals import refusal_line
from tests.helpers.tiny_config import degrees, tiny_config

HIDDEN, HEADS, SEQ, BATCH = 64, 4, 24, 2

CASES = {  # name: (q_lora_rank, qk nope, rope, v, yarn (factor, original, mscale, mscale_all_dim) or None)
    "q_lora.yarn": (24, 8, 4, 8, (4.0, 8, 0.8, 1.0)),
    "v2_lite.wide_v": (None, 8, 4, 16, None),
}


def hf_config(q_lora: int | None, dq: int, dr: int, dv: int, yarn: tuple | None, interleave: bool) -> DeepseekV3Config:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn is not None:
        factor, original, mscale, all_dim = yarn
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor,
                "original_max_position_embeddings": original, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": mscale,
                "mscale_all_dim": all_dim}
    return DeepseekV3Config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                            q_lora_rank=q_lora, kv_lora_rank=16, qk_nope_head_dim=dq, qk_rope_head_dim=dr,
                            v_head_dim=dv, max_position_embeddings=int(yarn[0] * yarn[1]) if yarn else 4 * SEQ,
                            rms_norm_eps=1e-6, rope_parameters=rope,
                            rope_interleave=interleave, attention_bias=False, attn_implementation="eager")


def our_config(q_lora: int | None, dq: int, dr: int, dv: int, yarn: tuple | None, **flat: Any) -> ModelConfig:
    scaling: dict[str, Any] = {}
    if yarn is not None:
        factor, original, mscale, all_dim = yarn
        scaling = dict(rope_scaling_type="yarn", rope_scaling_factor=factor,
                       rope_scaling_original_max_position_embeddings=original, rope_scaling_mscale=mscale,
                       rope_scaling_mscale_all_dim=all_dim)
    return ModelConfig(arch="llama", num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
                       vocab_size=128, norm_epsilon=1e-6, multi_latent_attention=True, q_lora_rank=q_lora,
                       kv_lora_rank=16, qk_head_dim=dq, qk_pos_emb_head_dim=dr, v_head_dim=dv, **scaling, **flat)


def rope_rows(heads: int, dq: int, dr: int, interleave: bool) -> torch.Tensor:
    """Row order taking HF's per-head [nope, rope] rows to ours: DeepSeek's interleaved RoPE pairs (x0, x1), ...
    are rotate-half's (x0, x2, .., x1, x3, ..) once the rope rows are permuted evens first."""
    rope = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)]) if interleave else torch.arange(dr)
    head = torch.cat([torch.arange(dq), dq + rope])
    return torch.cat([h * (dq + dr) + head for h in range(heads)])


def hf_to_ours(hf: DeepseekV3Attention, dq: int, dr: int, interleave: bool) -> dict[str, tuple[str, torch.Tensor]]:
    """Our parameter name -> (HF's name, the row order taking HF's tensor to ours)."""
    rkv = hf.config.kv_lora_rank
    q_rows = rope_rows(HEADS, dq, dr, interleave)
    kv_rows = torch.cat([torch.arange(rkv), rkv + rope_rows(1, 0, dr, interleave)])
    everything = {n: torch.arange(p.shape[0]) for n, p in hf.named_parameters()}
    names = {"kv_down.weight": ("kv_a_proj_with_mqa.weight", kv_rows),
             "kv_norm.weight": ("kv_a_layernorm.weight", None), "kv_up.weight": ("kv_b_proj.weight", None),
             "proj.weight": ("o_proj.weight", None)}
    if hf.config.q_lora_rank is None:
        names["q_proj.weight"] = ("q_proj.weight", q_rows)
    else:
        names.update({"q_down.weight": ("q_a_proj.weight", None), "q_norm.weight": ("q_a_layernorm.weight", None),
                      "q_up.weight": ("q_b_proj.weight", q_rows)})
    return {ours: (theirs, everything[theirs] if rows is None else rows) for ours, (theirs, rows) in names.items()}


def block_mask(bounds: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """HF's additive mask [b, 1, s, s]: causal within each document."""
    keep = torch.zeros(len(bounds), SEQ, SEQ, dtype=torch.bool)
    for b, cuts in enumerate(bounds):
        for start, end in zip(cuts[:-1], cuts[1:]):
            keep[b, start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min).unsqueeze(1)


def restarting_positions(bounds: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(end - start) for start, end in zip(cuts[:-1], cuts[1:])])
                        for cuts in bounds])


def compare_with_hf(case: tuple, interleave: bool = False, bounds: tuple | None = None) -> dict[str, float]:
    """Relative differences (``rel_max``) of the output and every gradient, ours against HF's on the same weights
    and input."""
    q_lora, dq, dr, dv, yarn = case
    torch.manual_seed(0)
    hf_cfg = hf_config(q_lora, dq, dr, dv, yarn, interleave)
    hf = DeepseekV3Attention(hf_cfg, layer_idx=0)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2) if p.ndim == 2 else p.uniform_(0.5, 1.5)
    ours = MLA(our_config(q_lora, dq, dr, dv, yarn), TPContext())
    mapping = hf_to_ours(hf, dq, dr, interleave)
    hf_params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            theirs, rows = mapping[name]
            p.copy_(hf_params[theirs][rows])
    x = torch.randn(BATCH, SEQ, HIDDEN)
    probe = torch.randn(BATCH, SEQ, HIDDEN)
    positions = torch.arange(SEQ).expand(BATCH, SEQ) if bounds is None else restarting_positions(bounds)
    mask = block_mask(bounds or ((0, SEQ),) * BATCH)
    x_hf, x_ours = x.clone().requires_grad_(), x.transpose(0, 1).clone().requires_grad_()
    cos_sin = DeepseekV3RotaryEmbedding(hf_cfg)(x_hf, positions)
    out_hf = hf(x_hf, cos_sin, mask)[0]
    docs = None if bounds is None else Documents(bounds=bounds, positions=positions)
    out_ours = ours(x_ours, documents=docs).transpose(0, 1)
    (out_hf * probe).sum().backward()
    (out_ours * probe).sum().backward()
    diffs = {"output": rel_max(out_ours, out_hf), "input grad": rel_max(x_ours.grad.transpose(0, 1), x_hf.grad)}
    for name, p in ours.named_parameters():
        theirs, rows = mapping[name]
        assert p.grad is not None and p.grad.abs().max() > 0, name
        diffs[name + " grad"] = rel_max(p.grad, hf_params[theirs].grad[rows])
    return diffs


def rel_max(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """The largest difference relative to the reference's largest magnitude (fp32 sums of ~10^3 terms)."""
    assert theirs.abs().max() > 0
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


@pytest.mark.parametrize("name", CASES)
def test_mla_equals_transformers_deepseek_v3_attention(name):
    diffs = compare_with_hf(CASES[name])
    assert max(diffs.values()) <= 1e-6, diffs


def test_documents_and_interleaved_rope_equal_transformers_with_a_block_mask():
    bounds = ((0, 7, 16, SEQ), (0, 11, SEQ))
    diffs = compare_with_hf((None, 8, 4, 8, (40.0, 8, 1.0, 1.0)), interleave=True, bounds=bounds)
    assert max(diffs.values()) <= 1e-6, diffs


def test_yarn_frequencies_are_transformers_at_deepseek_v3_settings():
    """DeepSeek-V3's config.json: rope_theta 10000, factor 40, original 4096, beta 32 / 1, mscale 1 / 1."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    hf_cfg = DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters=yarn)
    theirs = DeepseekV3RotaryEmbedding(hf_cfg)
    cfg = ModelConfig(arch="llama", multi_latent_attention=True, rope_scaling_type="yarn", rope_scaling_factor=40.0,
                      rope_scaling_original_max_position_embeddings=4096, rope_scaling_mscale_all_dim=1.0)
    assert torch.equal(rotary_inv_freq(cfg, "cpu", 64), theirs.inv_freq)
    assert theirs.attention_scaling == 1.0
    mla = MLA(cfg, TPContext())
    assert mla.query_scale == pytest.approx((0.1 * math.log(40.0) + 1.0) ** 2, rel=1e-15)


def tiny_mla(**flat: Any) -> Config:
    mla = dict(arch="llama", multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
               qk_pos_emb_head_dim=4, v_head_dim=6, train_iters=5, micro_batch_size=4)
    return tiny_config(**{**mla, **flat})


@pytest.mark.parametrize("q_lora", [16, None])
def test_parameter_counts_are_the_built_models(q_lora):
    cfg = tiny_mla(q_lora_rank=q_lora).model
    model = GPTModel(cfg, TPContext())
    assert sum(p.numel() for p in model.parameters()) == num_parameters(cfg)
    for block in blocks_of(model):
        assert [p.numel() for p in block.parameters()] == block_param_numels(cfg, 1)
    layer, core = layer_forward_flops(cfg)
    h, n, s = cfg.hidden_size, cfg.num_attention_heads, cfg.seq_length
    q = (h * q_lora + q_lora * n * 12) if q_lora else h * n * 12
    attention = 2 * (q + h * (8 + 4) + 8 * n * (8 + 6) + n * 6 * h)
    assert core == 2 * s * n * (12 + 6) and layer == attention + core + 2 * 3 * h * cfg.ffn_size


REFUSED = {  # the flags added to a valid MLA run -> what the one line must name
    ("--arch", "gpt2"): "--multi-latent-attention needs --arch llama",
    ("--num-query-groups", "2"): "--num-query-groups does not apply with --multi-latent-attention",
    ("--kv-channels", "8"): "--kv-channels does not apply with --multi-latent-attention",
    ("--qk-layernorm",): "--qk-layernorm does not apply with --multi-latent-attention",
    ("--qk-pos-emb-head-dim", "3"): "--qk-pos-emb-head-dim (3) must be even",
    ("--num-attention-heads", "3", "--tp", "2"): "--num-attention-heads (3) must be divisible by "
                                                 "--tensor-model-parallel-size (2)",
    ("--rope-scaling-beta-fast", "16"): "--rope-scaling-beta-fast 16.0 only applies with --rope-scaling-type yarn",
    ("--rope-scaling-type", "yarn", "--rope-scaling-mscale", "0.7"): "--rope-scaling-mscale 0.7 needs a nonzero",
}
BASE_ARGV = ["--arch", "llama", "--multi-latent-attention", "--num-layers", "2", "--hidden-size", "32",
             "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "128", "--device", "cpu",
             "--train-iters", "1", "--micro-batch-size", "1", "--global-batch-size", "6"]


@pytest.mark.parametrize("extra", REFUSED)
def test_bad_combinations_are_refused_in_one_line(extra):
    line = refusal_line(BASE_ARGV + list(extra), 6)
    assert REFUSED[extra] in line and "\n" not in line.strip(), line


def test_mla_flags_without_it_and_yarn_without_mla_are_refused():
    plain = [a for a in BASE_ARGV if a != "--multi-latent-attention"]
    assert "--kv-lora-rank 16 only applies with --multi-latent-attention" in refusal_line(
        plain + ["--kv-lora-rank", "16"], 1)
    assert "--rope-scaling-type yarn is built for --multi-latent-attention only" in refusal_line(
        plain + ["--rope-scaling-type", "yarn"], 1)
    with pytest.raises(ConfigError, match="--rope-scaling-low-freq-factor"):
        tiny_mla(rope_scaling_type="yarn", rope_scaling_low_freq_factor=2.0)


@pytest.mark.parametrize("q_lora", [16, None])
def test_a_tiny_llama_with_mla_learns_a_batch(q_lora):
    """With and without q LoRA (and packed documents): ten AdamW steps on one batch, the loss finite and falling."""
    cfg = tiny_mla(q_lora_rank=q_lora).model
    torch.manual_seed(0)
    model = GPTModel(cfg, TPContext())
    initialize_parameters(model, 7, None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 1000, (4, cfg.seq_length + 1))
    docs = Documents(bounds=((0, 5, 16),) * 4, positions=restarting_positions(((0, 5, 16),) * 4))
    losses = []
    for _ in range(10):
        optimizer.zero_grad()
        loss = model(tokens[:, :-1], tokens[:, 1:], documents=docs)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.7 * losses[0], losses


def test_recompute_selective_and_full_give_the_same_gradients():
    cfg = tiny_mla().model
    tokens = torch.randint(0, 1000, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(1))
    results = []
    for mode in ("none", "selective", "full"):
        model = GPTModel(cfg, TPContext())
        initialize_parameters(model, 7, None)
        apply_recompute(blocks_of(model), mode)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        results.append((loss.item(), [p.grad for p in model.parameters()]))
    assert blocks_of(model)[0].recompute == "full"
    for loss, grads in results[1:]:
        assert loss == results[0][0] and all(torch.equal(g, r) for g, r in zip(grads, results[0][1]))


def test_the_fused_head_gives_the_same_loss_and_gradients():
    """--cross-entropy-chunk-size on an MLA model with one MTP depth: the head and its loss fused chunk by chunk
    (the LM's and the depth's), the loss and every gradient as the plain head's within 1e-6."""
    cfg = dataclasses.replace(tiny_mla().model, mtp_num_layers=1)
    tokens = torch.randint(0, 1000, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(3))
    results = []
    for chunk in (0, 5):
        model = GPTModel(cfg, TPContext(), ce_chunk_size=chunk)
        initialize_parameters(model, 7, None)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, want), (fused, got) = results
    assert rel_err(fused, plain) < 1e-6 and any(n.startswith("mtp.") for n in want)
    for name, g in got.items():
        assert rel_err(g, want[name]) < 1e-6, name


def test_an_export_transformers_cannot_compute_is_refused():
    """HF conversion (DeepseekV3ForCausalLM) is tested in tests/checkpoint/test_hf_deepseek_v3.py; at the default
    --norm-epsilon 1e-5 (the latent norms' too, with no --mla-latent-norm-epsilon) transformers' latent norms (eps
    1e-6) would compute something else: refused."""
    cfg = tiny_mla().model
    with pytest.raises(ValueError, match=r"--mla-latent-norm-epsilon 1e-05 \(transformers normalises the MLA"):
        to_hf({}, cfg)


RUNS = [("tp2", tiny_mla(**degrees(tp=2))), ("tp2.sp", tiny_mla(**degrees(tp=2, sp=True)))]


def loss_and_grads(cfg: ModelConfig, group: Any, sequence_parallel: bool,
                   pstate: ParallelState) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward of the tiny MLA model on packed documents; every gradient at full size, the
    SP-partial ones summed over TP as the engine sums them."""
    model = GPTModel(cfg, TPContext(group=group, sequence_parallel=sequence_parallel))
    initialize_parameters(model, 7, group)
    tokens = torch.randint(0, 1000, (2, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
    bounds = ((0, 6, 16), (0, 16))
    loss = model(tokens[:, :-1], tokens[:, 1:], documents=Documents(bounds, restarting_positions(bounds)))
    loss.backward()
    if group is not None:
        sync_replicated_grads(model.parameters(), pstate)
    return loss.detach(), full_grads(model, group)


def run_layouts(pstate: ParallelState, runs: list[tuple[str, Config]]) -> dict[str, Any]:
    """Per run: the records of 5 training iterations; then each parameter's gradient error at tp 2 (with and
    without SP, with and without q LoRA) against this process's tp 1 gradients."""
    out: dict[str, Any] = {}
    for key, cfg in runs:
        state = ParallelState.build(layout_of(cfg, pstate.layout.world_size), "cpu")
        out[key] = [(r["loss"], r["grad_norm"]) for r in train(state, cfg)["records"]]
    tp2 = ParallelState.build(layout_of(runs[0][1], pstate.layout.world_size), "cpu")
    for q_lora in (16, None):
        cfg = tiny_mla(q_lora_rank=q_lora).model
        ref_loss, ref_grads = loss_and_grads(cfg, None, False, tp2)
        for sp in (False, True):
            loss, grads = loss_and_grads(cfg, tp2.tp_group, sp, tp2)
            out[f"grads.q_lora={q_lora}.sp={sp}"] = {"loss": rel_err(loss, ref_loss), **{
                name: rel_err(g[:1000], ref_grads[name][:1000]) for name, g in grads.items()}}
    return out


def test_tp2_with_and_without_sp_trains_what_one_process_trains():
    serial = dict(zip([k for k, _ in RUNS], serial_records([cfg for _, cfg in RUNS])))
    assert all(len(r) == 5 and all(math.isfinite(v) for step in r for v in step) for r in serial.values()), serial
    world = spawn(run_layouts, 2, RUNS)
    bad = {}
    for rank, per_run in enumerate(world):
        for key, records in per_run.items():
            if key.startswith("grads."):  # every parameter's gradient, the replicated latent ones included
                latent = ("kv_down", "kv_norm") + (("q_down", "q_norm") if "q_lora=16" in key else ())
                assert all(any(f"{w}." in name for name in records) for w in latent), (key, list(records))
                bad.update({f"rank{rank}.{key}.{name}": err for name, err in records.items() if not err <= 1e-5})
                continue
            for it, (got, want) in enumerate(zip(records, serial[key])):
                for what, g, w in zip(("loss", "grad_norm"), got, want):
                    if not abs(g - w) <= 1e-5 * abs(w):
                        bad[f"rank{rank}.{key}.{what}[{it}]"] = (g, w)
    assert not bad, bad
