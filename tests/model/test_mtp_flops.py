"""The FLOP count of multi-token prediction (``model/flops.py``) against torch's own counter.

``torch.utils.flop_counter.FlopCounterMode`` (torch's rules, not ours) counts the matrix multiplies of one real
training forward and backward of a tiny model with MTP depth 1 and 2: a dense llama and an MLA + MoE one. Its CPU
rules have no entry for the CPU attention kernel, so the comparison leaves out the attention core
(``layer_forward_flops``' second value, per block: main layers and MTP blocks); the MoE experts are 18 wide, so
their rows take the per-expert ``mm`` loop (the counter has no rule for ``torch._grouped_mm``). The rest must
agree exactly: FLOPs are integer counts, as in ``test_flops_documents.py``'s rel 1e-9. Full recompute's counted
backward holds the re-run forwards (early stop off: whole blocks), so it checks which blocks the formula says are
recomputed (the MTP blocks too, as ``apply_recompute(blocks_of(model))`` sets them).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from megazero.config import ModelConfig
from megazero.model.chunk import blocks_of
from megazero.model.flops import flops_per_token, layer_forward_flops
from megazero.model.gpt import GPTModel
from megazero.model.recompute import apply_recompute
from megazero.model.transformer import TPContext
from megazero.tensor_parallel.layers import initialize_parameters

BASE = dict(arch="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=16,
            vocab_size=128)
MLA_MOE = dict(arch="llama", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=128,
               multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4,
               v_head_dim=6, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=18,
               moe_shared_expert_intermediate_size=18, moe_layer_freq=[0, 1])
BATCH = 2


def counted(cfg: ModelConfig, recompute: str, recompute_num_layers: int | None = None) -> tuple[float, float]:
    """(forward, forward + backward) matmul FLOPs per token that FlopCounterMode counts in one training step."""
    model = GPTModel(cfg, TPContext())
    initialize_parameters(model, 3, None)
    apply_recompute(blocks_of(model), recompute, recompute_num_layers)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
    # the formula counts a checkpointed block's whole forward again (Megatron's convention); torch's early stop
    # would skip the block's last matmuls in the re-run, so it is off here
    with FlopCounterMode(display=False) as forward, set_checkpoint_early_stop(False):
        loss = model.train()(tokens[:, :-1], tokens[:, 1:])
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    per_token = BATCH * cfg.seq_length
    return forward.get_total_flops() / per_token, (forward.get_total_flops() + backward.get_total_flops()) / per_token


def cores(cfg: ModelConfig) -> list[float]:
    """The attention core of every block (main layers, then the MTP blocks): what the counter cannot see."""
    return [layer_forward_flops(cfg, None, i)[1] for i in range(cfg.num_layers + cfg.mtp_depth)]


@pytest.mark.parametrize("flat", [BASE, MLA_MOE], ids=["dense", "mla_moe"])
@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_flops_equal_torchs_counter(flat, depth):
    cfg = ModelConfig(**flat, mtp_num_layers=depth)
    if "num_experts" in flat:
        assert cfg.is_moe_layer(cfg.num_layers) and not cfg.is_moe_layer(0)  # MTP blocks: the last layer's kind
    core = sum(cores(cfg))
    forward, step = counted(cfg, "none")
    assert forward == pytest.approx(flops_per_token(cfg) / 3 - core, rel=1e-9)
    assert step == pytest.approx(flops_per_token(cfg) - 3 * core, rel=1e-9)
    assert flops_per_token(cfg) > flops_per_token(ModelConfig(**flat))  # the depths are counted at all
    # selective re-runs only cores, which the counter does not see: the same count, the formula + the cores
    assert counted(cfg, "selective")[1] == pytest.approx(step, rel=1e-9)
    assert flops_per_token(cfg, "selective") == pytest.approx(flops_per_token(cfg) + core, rel=1e-12)
    # full: every block re-runs its forward, the MTP blocks included (not eh_proj, not the heads)
    full = counted(cfg, "full")[1]
    assert full == pytest.approx(flops_per_token(cfg, "full") - 4 * core, rel=1e-9)


def test_full_recompute_of_the_first_n_blocks():
    """N = num_layers: the main layers re-run, the MTP blocks keep their activations (and are not re-run)."""
    cfg = ModelConfig(**BASE, mtp_num_layers=2)
    per_block = cores(cfg)
    step = counted(cfg, "full", cfg.num_layers)[1]
    assert step == pytest.approx(flops_per_token(cfg, "full", cfg.num_layers) - 3 * sum(per_block)
                                 - sum(per_block[:cfg.num_layers]), rel=1e-9)
    assert flops_per_token(cfg, "full", cfg.num_layers) < flops_per_token(cfg, "full")


@pytest.mark.parametrize("flat", [BASE, MLA_MOE], ids=["dense", "mla_moe"])
def test_depth_zero_is_bitwise_the_old_formula(flat):
    """Without MTP the figure is the formula before MTP was counted, written out here, bit for bit."""
    cfg = ModelConfig(**flat)
    layers = [layer_forward_flops(cfg, None, i) for i in range(cfg.num_layers)]
    forward = sum(layer for layer, _ in layers) + 2.0 * cfg.hidden_size * cfg.vocab_size
    assert flops_per_token(cfg) == 3.0 * forward
    assert flops_per_token(cfg, "full", 1) == 3.0 * forward + layers[0][0]
    assert flops_per_token(cfg, "selective") == 3.0 * forward + sum(core for _, core in layers)
    assert flops_per_token(ModelConfig(**flat, mtp_num_layers=0)) == flops_per_token(cfg)
