"""Multi-token prediction in one process (issue 43): the losses against a reference written here, documents, size.

The reference takes the model's own h^0 (the last layer's output, before the final norm) and, per depth k,
runs the module on the first S - k positions only (causal: the later ones cannot reach them), embedding
``tokens[:, k:k+n]`` and scoring ``tokens[:, k+1:k+1+n]`` with ``F.cross_entropy`` - truncation and slices,
where the model rolls and masks whole samples.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megazero.config import Config, ConfigError, ModelConfig
from megazero.model.documents import PackingRule
from megazero.model.gpt import GPTModel, count_parameters
from megazero.model.transformer import TPContext
from megazero.tensor_parallel.layers import initialize_parameters

VOCAB, EOD, SEQ, DEPTH, FACTOR = 96, 2, 24, 3, 0.3
SHAPE = dict(arch="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB)
PACKED = PackingRule(EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)


def build(depth: int = DEPTH, seq: int = SEQ, **flat) -> GPTModel:
    cfg = ModelConfig(**SHAPE, seq_length=seq, mtp_num_layers=depth, mtp_loss_scaling_factor=FACTOR, **flat)
    model = GPTModel(cfg, TPContext())
    initialize_parameters(model, 5, None)
    with torch.no_grad():  # norms away from 1, so a norm swapped for another would show
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return model.double()


def main_hidden(model: GPTModel, inputs: torch.Tensor, documents=None) -> torch.Tensor:
    x = model.embedding(inputs, documents=documents)
    for layer in model.layers.values():
        x = layer(x, documents=documents)
    return x


def reference_token_losses(model: GPTModel, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Per depth k: F.cross_entropy of the S - k positions that have a target ([b, S - k]; one document per
    sample), stopping at the first depth with none."""
    seq = tokens.shape[1] - 1
    h = main_hidden(model, tokens[:, :seq])
    head, emb = model.output_weight, model.embedding.word.weight
    losses = []
    for k, module in enumerate(model.mtp, start=1):
        n = seq - k
        if n <= 0:
            break
        e = F.embedding(tokens[:, k:k + n], emb).transpose(0, 1)
        x = torch.cat([module.enorm(e), module.hnorm(h[:n])], dim=-1) @ module.eh_proj.weight.t()
        h = module.block(x)
        logits = (module.final_norm(h) @ head.t())[..., :VOCAB]  # padded rows are not tokens
        targets = tokens[:, k + 1:k + 1 + n].t()
        losses.append(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(n, -1).t())
    return losses


def grads(model: GPTModel) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq=["0", "1"])


@pytest.mark.parametrize("flat", [{}, MOE], ids=["dense", "moe"])
def test_mtp_losses_and_gradients_equal_the_reference(flat):
    """Each depth's logged loss within 1e-6 of the reference's; every gradient of the returned loss equals that of
    LM + factor / D x the reference depths' sum; the returned value is the LM loss alone. With an MoE last layer
    the MTP blocks are MoE blocks too (their routers' layer ids follow the main layers')."""
    model = build(**flat)
    if flat:
        assert [r.layer_id for m in model.mtp for r in [m.block.mlp.router]] == [2, 3, 4]
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    logits = model.logits_local(model.final_norm(main_hidden(model, tokens[:, :-1])))[..., :VOCAB]
    lm = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].t().flatten())
    assert abs(loss.item() - lm.item()) <= 1e-6 * lm.item()  # the head's cross entropy is fp32
    loss.backward()
    got = grads(model)
    values = model.mtp.take_values()[0].double()
    ref = torch.stack([losses.mean() for losses in reference_token_losses(model, tokens)])
    assert len(ref) == DEPTH and torch.allclose(values, ref.detach(), rtol=1e-6, atol=0), (values, ref)
    (lm + FACTOR / DEPTH * ref.sum()).backward()
    want = grads(model)
    assert got.keys() == want.keys() and any(k.startswith(f"mtp.{DEPTH - 1}.") for k in got)
    for name, g in got.items():
        assert want[name].abs().max() > 0, name
        err = float((g - want[name]).abs().max() / want[name].abs().max())
        assert err <= 1e-6, (name, err)  # the model's cross entropy and its gradient are fp32


def test_the_fused_head_gives_the_same_losses_and_gradients():
    """--cross-entropy-chunk-size: each depth's head and loss fused chunk by chunk, on packed documents."""
    lengths = (7, 2, 9, 1, 5)
    plain = build(seq=sum(lengths))
    fused = GPTModel(plain.cfg, TPContext(), ce_chunk_size=5).double()
    fused.load_state_dict(plain.state_dict())
    tokens = packed_tokens(lengths, 3)
    out = {}
    for name, model in (("plain", plain), ("fused", fused)):
        model(tokens[:, :-1], tokens[:, 1:], documents=PACKED.documents(tokens[:, :-1])).backward()
        out[name] = (model.mtp.take_values()[0], grads(model))
    assert torch.allclose(out["fused"][0], out["plain"][0], rtol=1e-6, atol=0)
    for name, g in out["plain"][1].items():
        assert float((out["fused"][1][name] - g).abs().max()) <= 1e-6 * float(g.abs().max()), name


def packed_tokens(lengths: tuple[int, ...], seed: int) -> torch.Tensor:
    """[1, S + 1]: documents ending in EOD (ids >= 3 inside), then one more token."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.cat([torch.randint(3, VOCAB, (n - 1,), generator=g), torch.tensor([EOD])]) for n in lengths]
    return torch.cat(docs + [torch.randint(3, VOCAB, (1,), generator=g)])[None]


def alone_sums(model: GPTModel, tokens: torch.Tensor, lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per depth: the summed token losses and counts of every document run alone by the reference, without the
    target after the document's EOD input (--eod-mask-loss): positions i < n - 1 - k of n tokens."""
    sums, counts, start = torch.zeros(DEPTH, dtype=torch.float64), torch.zeros(DEPTH, dtype=torch.float64), 0
    for n in lengths:
        for k, losses in enumerate(reference_token_losses(model, tokens[:, start:start + n + 1]), start=1):
            kept = losses[0, :max(0, n - 1 - k)]
            sums[k - 1] += kept.sum()
            counts[k - 1] += kept.numel()
        start += n
    return sums, counts


def test_with_documents_no_shift_crosses_a_document():
    """Each depth's packed loss x its count = the sum over the documents run alone; without the document masks
    the same tokens give other losses (so the comparison can fail)."""
    lengths = (7, 2, 9, 1, 5)  # documents no longer than a depth have no target at it
    model = build(seq=sum(lengths))
    tokens = packed_tokens(lengths, 3)
    with torch.no_grad():
        sums, counts = alone_sums(model, tokens, lengths)
    model(tokens[:, :-1], tokens[:, 1:], documents=PACKED.documents(tokens[:, :-1]))
    packed = model.mtp.take_values()[0].double()
    assert torch.allclose(packed * counts, sums, rtol=1e-6, atol=0), (packed * counts, sums)
    model(tokens[:, :-1], tokens[:, 1:], documents=PackingRule(EOD, eod_mask_loss=True).documents(tokens[:, :-1]))
    assert not torch.allclose(model.mtp.take_values()[0].double(), packed, rtol=1e-3)


def test_an_empty_depth_is_a_finite_zero_with_zero_gradients():
    """Documents of at most three tokens: depths 2 and 3 have no target anywhere, and add exactly nothing."""
    model = build(seq=6)
    tokens = packed_tokens((3, 1, 2), 4)
    model(tokens[:, :-1], tokens[:, 1:], documents=PACKED.documents(tokens[:, :-1])).backward()
    values = model.mtp.take_values()[0]
    assert torch.isfinite(values).all() and values[0] > 0 and values[1:].eq(0).all()
    assert all(p.grad is None or p.grad.eq(0).all() for n, p in model.named_parameters() if n.startswith("mtp.2."))


def test_parameter_count_of_the_modules():
    """Each module adds enorm, hnorm, final norm (h each), eh_proj (2h x h) and one dense llama block."""
    with_mtp, without = build(), build(depth=0)
    h, heads, groups, d, ffn = 32, 4, 2, 8, with_mtp.cfg.ffn_size
    block = 2 * h + h * (heads + 2 * groups) * d + heads * d * h + 3 * h * ffn
    assert count_parameters(with_mtp) - count_parameters(without) == DEPTH * (3 * h + 2 * h * h + block)
    assert sorted(n for n, _ in with_mtp.named_parameters() if n.startswith("mtp.0.") and "block" not in n) == [
        "mtp.0.eh_proj.weight", "mtp.0.enorm.weight", "mtp.0.final_norm.weight", "mtp.0.hnorm.weight"]


@pytest.mark.parametrize("flat,words", [
    (dict(arch="llama", mtp_num_layers=16, seq_length=16), "--mtp-num-layers 16 shifts"),
    (dict(arch="gpt2", mtp_num_layers=1), "--mtp-num-layers 1 needs --arch llama"),
    (dict(arch="llama", mtp_num_layers=1, optimizer="muon", qk_clip_threshold=100.0),
     "--qk-clip-threshold is built for the main"),
    (dict(arch="llama", mtp_loss_scaling_factor=0.2), "--mtp-loss-scaling-factor"),
])
def test_refusals_name_the_flag(flat, words):
    with pytest.raises(ConfigError, match=words):
        Config.from_flat(flat, explicit=frozenset(flat))
