"""The full model at tp = 2 and 4 (with and without sequence parallelism) equals tp = 1.

Both architectures; llama with grouped-query attention, with and without --qk-layernorm. The vocabulary is
chosen so its padding differs between TP sizes, which must not change the math.
"""
from __future__ import annotations

import pytest
import torch

from megazero.config import ModelConfig
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from megazero.tensor_parallel.layers import initialize_parameters
from tests.helpers.compare import full_grads, rel_err
from tests.helpers.dist import spawn
from tests.helpers.reference import sync_replicated_grads

VOCAB, SEED = 1100, 11
ARCHS = {
    "gpt2": dict(arch="gpt2", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16),
    "llama": dict(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                  seq_length=16),
    # q/k head norms: one weight shared by the heads of every TP rank, its grad a partial sum over TP
    "llama_qk": dict(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                     seq_length=16, qk_layernorm=True),
}


def loss_and_grads(pstate, arch: str, sequence_parallel: bool, tp_group):
    cfg = ModelConfig(vocab_size=VOCAB, **ARCHS[arch])
    model = GPTModel(cfg, TPContext(group=tp_group, sequence_parallel=sequence_parallel))
    initialize_parameters(model, SEED, tp_group)
    tokens = torch.randint(0, VOCAB, (3, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    if tp_group is not None:
        sync_replicated_grads(model.parameters(), pstate)
    return loss.detach(), full_grads(model, tp_group)


def check_model(pstate) -> dict[str, float]:
    errs = {}
    for arch in ARCHS:
        ref_loss, ref_grads = loss_and_grads(pstate, arch, False, None)
        for sp in (False, True):
            loss, grads = loss_and_grads(pstate, arch, sp, pstate.tp_group)
            errs[f"{arch}.sp={sp}.loss"] = rel_err(loss, ref_loss)
            assert grads.keys() == ref_grads.keys()
            for name, g in grads.items():
                expected = ref_grads[name]
                if g.shape != expected.shape:  # padded vocabulary rows differ in count; real rows must match
                    g, expected = g[:VOCAB], expected[:VOCAB]
                errs[f"{arch}.sp={sp}.d{name}"] = rel_err(g, expected)
    return errs


@pytest.mark.parametrize("tp", [2, 4])
def test_model_matches_serial(tp):
    for rank, errs in enumerate(spawn(check_model, tp, tp=tp)):
        bad = {k: v for k, v in errs.items() if not v <= 1e-5}
        assert not bad, f"tp={tp} rank {rank}: {bad}"
