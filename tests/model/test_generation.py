"""Decoding with the key/value cache gives what recomputing the whole sequence gives; sampling behaves.

The reference recomputes the full sequence with the training forward at every step. A cached step
runs 1-token matmuls (on CPU a GEMV path, not bitwise equal to the same row of a larger GEMM), so
fp32 logits are compared to 1e-5 relative and absolute (the parity tests' tolerance), ids exactly.
"""
from __future__ import annotations

import pytest
import torch

from megazero.config import ModelConfig
from megazero.model.generation import Sampling, generate, next_token
from megazero.model.gpt import GPTModel
from megazero.model.kv_cache import KVCache
from megazero.model.transformer import TPContext
from megazero.tensor_parallel.layers import initialize_parameters

MODELS = {
    "gpt2": ModelConfig(arch="gpt2", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=48,
                        vocab_size=300, init_method_std=0.2),
    # GQA (2 query heads per kv head) and Llama-3 RoPE scaling whose cut-offs fall inside the sequence
    "llama": ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                         seq_length=48, vocab_size=300, init_method_std=0.2, rope_scaling_type="llama3",
                         rope_scaling_factor=4.0, rope_scaling_original_max_position_embeddings=16),
    # --qk-layernorm (keys are normalised before they are cached) with a head dimension of 16, not 64 / 8
    "llama_qk": ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                            seq_length=48, vocab_size=300, init_method_std=0.2, qk_layernorm=True, kv_channels=16),
}


def _model(arch: str) -> GPTModel:
    model = GPTModel(MODELS[arch], TPContext())
    initialize_parameters(model, 7, None)
    return model.eval()


def _full_logits(model: GPTModel, ids_bs: torch.Tensor) -> torch.Tensor:
    """Training forward over the whole sequence: logits [b, s, vocab]."""
    with torch.no_grad():
        return model(ids_bs)[..., :model.cfg.vocab_size].transpose(0, 1)


@pytest.mark.parametrize("arch", MODELS)
def test_cached_logits_match_the_full_forward(arch):
    """A prefill of 9 tokens, single-token steps, then a 5-token chunk: every position's logits."""
    model = _model(arch)
    ids_bs = torch.randint(0, 300, (2, 30), generator=torch.Generator().manual_seed(0))
    cache = KVCache.for_model(model.cfg, 2, 30, dtype=torch.float32)
    pieces = [model.decode(ids_bs[:, :9], cache)]
    pieces += [model.decode(ids_bs[:, i:i + 1], cache) for i in range(9, 25)]
    pieces.append(model.decode(ids_bs[:, 25:], cache))
    cached, full = torch.cat(pieces, dim=1), _full_logits(model, ids_bs)
    assert cache.length == 30
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)
    assert full.std() > 0.5  # logits spread well beyond the tolerance: the comparison can fail


@pytest.mark.parametrize("arch", MODELS)
def test_greedy_generation_matches_recomputing_every_step(arch):
    model, prompt = _model(arch), [5, 17, 42, 99, 3]
    got = generate(model, prompt, 32, eos_id=-1, sampling=Sampling())
    ids = list(prompt)
    for _ in range(32):
        ids.append(int(_full_logits(model, torch.tensor([ids]))[0, -1].argmax()))
    assert got == ids[len(prompt):]
    assert len(set(got)) > 4  # not one token repeated: the ids say something about the model


def test_generation_stops_at_end_of_document():
    model, prompt = _model("gpt2"), [5, 17, 42]
    free = generate(model, prompt, 20, eos_id=-1, sampling=Sampling())
    stopped = generate(model, prompt, 20, eos_id=free[3], sampling=Sampling())
    assert stopped == free[:free.index(free[3]) + 1]


def test_cache_refuses_more_tokens_than_it_holds():
    model = _model("llama")
    cache = KVCache.for_model(model.cfg, 1, 4, dtype=torch.float32)
    model.decode(torch.tensor([[1, 2, 3]]), cache)
    with pytest.raises(ValueError, match="holds 4 positions; 3 are used and 2 more"):
        model.decode(torch.tensor([[4, 5]]), cache)


def _draws(logits_bv: torch.Tensor, sampling: Sampling, seed: int, n: int = 200) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [int(next_token(logits_bv, sampling, generator)[0]) for _ in range(n)]


LOGITS = torch.log(torch.tensor([[0.05, 0.4, 0.02, 0.3, 0.13, 0.1]]))  # sorted: 1, 3, 4, 5, 0, 2


def test_seeded_sampling_repeats_and_top_k_1_is_greedy():
    sampling = Sampling(temperature=1.0)
    assert _draws(LOGITS, sampling, 3) == _draws(LOGITS, sampling, 3)
    assert _draws(LOGITS, sampling, 3) != _draws(LOGITS, sampling, 4)
    assert set(_draws(LOGITS, sampling, 3)) == set(range(6))  # plain sampling reaches every token
    assert set(_draws(LOGITS, Sampling(temperature=5.0, top_k=1), 3)) == {1}
    model, prompt = _model("llama"), [5, 17, 42]
    greedy = generate(model, prompt, 12, eos_id=-1, sampling=Sampling())
    top1 = generate(model, prompt, 12, eos_id=-1, sampling=Sampling(temperature=2.0, top_k=1),
                    generator=torch.Generator().manual_seed(0))
    assert top1 == greedy


def test_top_k_and_top_p_keep_only_their_tokens():
    assert set(_draws(LOGITS, Sampling(temperature=1.0, top_k=3), 0)) == {1, 3, 4}
    # nucleus 0.75: 0.4 + 0.3 = 0.7 < 0.75, so the third token (4) completes it
    assert set(_draws(LOGITS, Sampling(temperature=1.0, top_p=0.75), 0)) == {1, 3, 4}
    assert set(_draws(LOGITS, Sampling(temperature=1.0, top_p=0.65), 0)) == {1, 3}
    assert set(_draws(LOGITS, Sampling(temperature=1.0, top_k=2, top_p=0.9), 0)) == {1, 3}


@pytest.mark.parametrize("fields,flag", [(dict(temperature=-1.0), "--temperature"), (dict(top_k=-2), "--top-k"),
                                         (dict(top_p=0.0), "--top-p"), (dict(top_p=1.5), "--top-p")])
def test_bad_sampling_settings_name_the_flag(fields, flag):
    with pytest.raises(ValueError, match=flag):
        Sampling(**fields)
