"""Packed documents with --reset-position-ids, --reset-attention-mask and --eod-mask-loss train exactly as
each document would alone: same per-token loss, same gradients, and a document's logits do not depend on
any other document of its sample. Both families; llama with GQA and Llama-3 RoPE scaling."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megazero.config import ConfigError, DataConfig, ModelConfig
from megazero.model.documents import PackingRule, document_bounds, document_positions, packing_rule
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from megazero.tensor_parallel.layers import initialize_parameters

VOCAB, EOD, SEED = 96, 2, 5
DOC_LENGTHS = (7, 5, 9, 1, 4)  # each ends with EOD; a one-token document is its EOD alone; S = 26
ARCHS = {
    "gpt2": dict(arch="gpt2", num_layers=2, hidden_size=32, num_attention_heads=4),
    "llama": dict(arch="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  rope_scaling_type="llama3", rope_scaling_original_max_position_embeddings=8),
}
ALL_FLAGS = PackingRule(EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)


def packed_sample(seed: int = 0, lengths: tuple[int, ...] = DOC_LENGTHS) -> torch.Tensor:
    """[S + 1] tokens: documents ending in EOD, then one token (the last label)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.cat([torch.randint(3, VOCAB, (n - 1,), generator=g), torch.tensor([EOD])]) for n in lengths]
    return torch.cat(docs + [torch.randint(3, VOCAB, (1,), generator=g)])


def build(arch: str, dtype: torch.dtype) -> GPTModel:
    cfg = ModelConfig(vocab_size=VOCAB, seq_length=sum(DOC_LENGTHS), **ARCHS[arch])
    model = GPTModel(cfg, TPContext())
    initialize_parameters(model, SEED, None)
    return model.to(dtype)


def token_losses(logits_sbv: torch.Tensor, labels_s: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_sbv[:, 0, :VOCAB], labels_s, reduction="none")


def grads(model: GPTModel) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_sample_equals_its_documents_alone(arch, dtype, tol):
    model = build(arch, dtype)
    tokens = packed_sample()
    inputs, labels = tokens[:-1], tokens[1:]
    documents = ALL_FLAGS.documents(inputs[None])
    packed = token_losses(model(inputs[None], documents=documents), labels)
    keep = documents.loss_mask[0].bool()
    packed[keep].sum().backward()
    packed_grads = grads(model)

    alone, start = [], 0
    for n in DOC_LENGTHS:  # a document alone: its tokens up to the EOD predict the next, the EOD is the last label
        if n > 1:
            alone.append(token_losses(model(inputs[None, start:start + n - 1]), labels[start:start + n - 1]))
        start += n
    alone = torch.cat(alone)
    alone.sum().backward()
    alone_grads = grads(model)

    torch.testing.assert_close(packed[keep], alone, rtol=0, atol=tol)
    for name, g in packed_grads.items():
        torch.testing.assert_close(g, alone_grads[name], rtol=tol, atol=tol, msg=lambda m: f"d{name}: {m}")
    # the model's own loss (its cross entropy is fp32): the mean over the kept tokens (loss_scale = 1 / count)
    loss = model(inputs[None], labels[None], documents=documents)
    torch.testing.assert_close(loss, alone.mean().float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_changing_one_document_leaves_the_others_bitwise(arch):
    model = build(arch, torch.float32)
    before = packed_sample(seed=0)[:-1]
    after = before.clone()
    second = slice(DOC_LENGTHS[0], DOC_LENGTHS[0] + DOC_LENGTHS[1] - 1)  # the second document but its EOD
    after[second] = torch.randint(3, VOCAB, (DOC_LENGTHS[1] - 1,), generator=torch.Generator().manual_seed(9))
    others = torch.ones(before.numel(), dtype=torch.bool)
    others[second.start:second.stop + 1] = False
    with torch.no_grad():
        for rule, independent in ((ALL_FLAGS, True), (PackingRule(EOD, reset_position_ids=True), False)):
            logits = [model(t[None], documents=rule.documents(t[None]))[:, 0] for t in (before, after)]
            # only with the attention mask are the other documents untouched (positions alone do not isolate)
            assert torch.equal(logits[0][others], logits[1][others]) == independent, rule


def test_bounds_positions_and_mask_per_sample():
    batch = torch.tensor([[5, EOD, 6, 7, EOD, 8, 9, EOD],  # an EOD as the last input starts no document
                          [5, 6, 7, 8, 9, 10, 11, 12]])
    documents = ALL_FLAGS.documents(batch)
    assert documents.bounds == ((0, 2, 5, 8), (0, 8))
    assert documents.positions.tolist() == [[0, 1, 0, 1, 2, 0, 1, 2], list(range(8))]
    assert documents.loss_mask.tolist() == [[1, 0, 1, 1, 0, 1, 1, 0], [1] * 8]
    assert documents.loss_scale == 1 / 13
    assert document_bounds(batch[1:], EOD) == ((0, 8),)
    assert document_positions(((0, 3, 4),), "cpu").tolist() == [[0, 1, 2, 0]]
    only_positions = PackingRule(EOD, reset_position_ids=True).documents(batch)
    assert only_positions.bounds is None and only_positions.loss_mask is None


def test_flags_without_an_eod_id_are_refused_naming_the_flag():
    assert packing_rule(DataConfig(), -1) is None  # no flag: nothing to refuse
    assert packing_rule(DataConfig(eod_mask_loss=True), EOD) == PackingRule(EOD, eod_mask_loss=True)
    flags = DataConfig(tokenizer_model="t.model", reset_attention_mask=True, eod_mask_loss=True)
    for no_eod in (None, -1):  # an HF tokenizer without an EOS token; sentencepiece's "none" id
        with pytest.raises(ConfigError, match=r"^--reset-attention-mask needs the end-of-document id .* t\.model "
                                              r"defines no EOS token; pass the --tokenizer-model .* or drop "
                                              r"--reset-attention-mask --eod-mask-loss$"):
            packing_rule(flags, no_eod)
