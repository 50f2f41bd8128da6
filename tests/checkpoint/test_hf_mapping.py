"""megazero <-> HF transformers: same logits through HF's forward, exact round trips, generate()."""
from __future__ import annotations

import pytest
import torch

from megazero.checkpoint.hf import from_hf, hf_config, to_hf
from megazero.config import ModelConfig
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from megazero.tensor_parallel.layers import initialize_parameters
from tests.helpers.hf_configs import CONFIGS
from tests.helpers.reference import full_logits

transformers = pytest.importorskip("transformers")


def _model(cfg: ModelConfig) -> GPTModel:
    model = GPTModel(cfg, TPContext())
    initialize_parameters(model, 5, None)
    with torch.no_grad():  # perturb norms and biases so a swapped or dropped one would show
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return model.eval()


def _hf_model(cfg: ModelConfig, state: dict) -> torch.nn.Module:
    klass = transformers.GPT2LMHeadModel if cfg.arch == "gpt2" else transformers.LlamaForCausalLM
    hf = klass(hf_config(cfg))
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k or "attn.bias" in k or "masked_bias" in k for k in missing), missing
    return hf.eval()


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_hf_logits_match_and_round_trip(arch):
    cfg = CONFIGS[arch]
    model = _model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    ours = full_logits(model, ids)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    hf = _hf_model(cfg, to_hf(state, cfg))
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max() <= 1e-4 * ours.abs().max()
    back = from_hf(to_hf(state, cfg), cfg, model.padded_vocab)
    assert back.keys() == state.keys()
    for k in state:
        assert torch.equal(back[k], state[k]), k
    out = hf.generate(ids[:1, :4], max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 9)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_hf_config_round_trips(arch):
    """megazero -> HF config -> megazero gives the same model settings (rope scaling and tying included)."""
    from megazero.checkpoint.hf import model_config_from_hf

    cfg = CONFIGS[arch]
    back = model_config_from_hf(hf_config(cfg).to_dict())
    keys = ("arch", "num_layers", "hidden_size", "num_attention_heads", "query_groups", "ffn_size", "vocab_size",
            "norm_epsilon", "rotary_base", "tied_embeddings", "position_table_size", "rope_scaling_type",
            "rope_scaling_factor", "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
            "rope_scaling_original_max_position_embeddings")
    assert {k: getattr(back, k) for k in keys} == {k: getattr(cfg, k) for k in keys}


def test_gpt2_grouped_query_attention_is_refused():
    cfg = ModelConfig(arch="gpt2", num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      vocab_size=300)
    with pytest.raises(ValueError, match="--num-query-groups 2"):
        hf_config(cfg)
