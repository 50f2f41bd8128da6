"""Tiny DeepSeek-V3 models made by transformers for the HF conversion tests (tests/checkpoint/test_hf_deepseek_v3*.py):
two shapes (q LoRA + YaRN + group-limited routing; DeepSeek-V2-Lite's, no q LoRA), their config dicts, and the
logits comparison against megazero's model."""
from __future__ import annotations

import torch
import transformers

from megazero.config import ModelConfig
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from tests.helpers.reference import full_logits

VOCAB, LOGIT_TOL = 300, 1e-5
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 1.0}
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=64,
            moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1, num_nextn_predict_layers=0,
            rms_norm_eps=1e-6)
CASES = {  # q LoRA, YaRN, 8 experts in 4 groups (2 kept, k 4: a group scores its best 2), 3 layers; V2-Lite's shape
    "v3": dict(q_lora_rank=24, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=4, n_group=4,
               topk_group=2, routed_scaling_factor=2.5, rope_parameters=YARN),
    "v2_lite": dict(q_lora_rank=None, num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                    topk_group=1, routed_scaling_factor=1.0, v_head_dim=16),
}

def hf_model(case: str, seed: int = 0, **changes) -> torch.nn.Module:
    """A random tiny DeepSeek-V3 whose norms are not ones, whose router is sharp and whose score-correction bias
    moves choices, so a wrong mapping shows in the logits."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**BASE, **CASES[case], **changes}, attn_implementation="eager"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape))
    return model.eval()


def ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(seed))


def logits_error(cfg: ModelConfig, state: dict, hf: torch.nn.Module, tokens: torch.Tensor) -> float:
    model = GPTModel(cfg, TPContext()).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return float((full_logits(model, tokens) - hf(tokens).logits).abs().max())


def hf_dict(case: str, **changes) -> dict:
    return {**transformers.DeepseekV3Config(**{**BASE, **CASES[case]}).to_dict(), **changes}


