"""megazero's Muon math (``megazero/optimizer/muon.py``) against ``torch.optim.Muon``, in one process, fp32.

- NS is torch's own ``_zeropower_via_newtonschulz`` bit for bit: in bf16 (what torch runs) and in fp32
  (torch's function with its one bf16 cast made a copy, ``torch_ns_in_fp32``), on square, wide and tall matrices.
- 20 steps of ``SerialMuon`` + ``torch.optim.AdamW`` on a tiny llama (GQA) and gpt2 equal ``torch.optim.Muon`` +
  ``torch.optim.AdamW`` on an unfused copy (W_q, W_k, W_v as separate tensors, their gradients split the same
  way), to 1e-6 relative, with both lr adjustments and NS in either dtype.
- The parameter split and the fused-weight split, on llama (GQA), gpt2 and MoE models; the q/k/v and
  expert matrices are the tensors megazero's HF export writes.
- Muon is not SGD: its update differs from momentum SGD's on the same gradients.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch
from torch import nn
from torch.optim import _muon as torch_muon

from megazero.checkpoint.hf import to_hf
from megazero.config import ModelConfig
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from megazero.optimizer.muon import (NS_COEFFICIENTS, MuonHyper, SerialMuon, adjusted_lr, matrices_of,
                                     merge_matrices, muon_step_, newton_schulz, split_matrices, split_parameters)
from megazero.tensor_parallel.layers import initialize_parameters
from tests.helpers.compare import rel_err
from tests.helpers.reference import param_groups

LLAMA = ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                    seq_length=16, vocab_size=100, qk_layernorm=True)  # W_q 32 x 32, W_k and W_v 16 x 32, fc1 128 x 32
GPT2 = ModelConfig(arch="gpt2", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100)
MOE_LLAMA = ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                        seq_length=16, vocab_size=100, num_experts=4, moe_ffn_hidden_size=48)
MOE_GPT2 = ModelConfig(arch="gpt2", num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16,
                       vocab_size=100, num_experts=4, moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=32)
MUON_LR, ADAM_LR, DECAY, STEPS = 0.02, 1e-3, 0.1, 20


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Matrices this small run fastest on one thread (and do not fight the other tests of a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def torch_ns_in(dtype: torch.dtype) -> Iterator[None]:
    """Run torch's Muon with its NS in ``dtype``: bf16 is torch as shipped; fp32 makes its one cast
    (``grad.bfloat16()``) a copy, leaving every other operation of torch's code as it is."""
    if dtype == torch.bfloat16:
        yield
        return
    original = torch.Tensor.bfloat16
    torch.Tensor.bfloat16 = lambda self, *args, **kwargs: self.clone()  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.bfloat16 = original  # type: ignore[method-assign]


def build(cfg: ModelConfig) -> GPTModel:
    model = GPTModel(cfg, TPContext())
    initialize_parameters(model, 7, None)
    return model


@pytest.mark.parametrize("shape", [(48, 48), (32, 80), (80, 32)], ids=["square", "wide", "tall"])
def test_newton_schulz_is_torchs_bitwise(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0] + shape[1]))
    before = G.clone()
    for steps, coefficients in ((5, NS_COEFFICIENTS), (3, (2.0, -1.5, 0.5))):
        theirs_bf16 = torch_muon._zeropower_via_newtonschulz(G, coefficients, steps, 1e-7)
        assert torch.equal(newton_schulz(G, steps, coefficients, dtype=torch.bfloat16), theirs_bf16)
        with torch_ns_in(torch.float32):
            theirs = torch_muon._zeropower_via_newtonschulz(G, coefficients, steps, 1e-7)
        ours = newton_schulz(G, steps, coefficients)
        assert theirs.dtype == ours.dtype == torch.float32 and torch.equal(ours, theirs)
    assert torch.equal(G, before)  # the input is not normalised in place
    with pytest.raises(ValueError, match="2-D"):
        newton_schulz(G[None])


def test_lr_adjustments_are_torchs():
    for shape in ((64, 64), (32, 64), (192, 64), (64, 192)):
        for name in ("original", "match_rms_adamw"):
            assert adjusted_lr(0.02, shape, name) == torch_muon._adjust_lr(0.02, name, torch.Size(shape))
    with pytest.raises(ValueError, match="lr adjustment"):
        MuonHyper(lr=0.02, adjust_lr="spectral")
    with pytest.raises(ValueError, match="momentum"):
        MuonHyper(lr=0.02, momentum=1.0)


def reference_run(cfg: ModelConfig, hyper: MuonHyper) -> dict[str, float]:
    """STEPS steps of megazero's Muon and of torch's on an unfused copy, the same gradients each step (computed
    on the megazero model, split for torch); returns the relative error of every final weight."""
    model = build(cfg)
    muon_named, adam_named = split_parameters(model.named_parameters())
    ours = SerialMuon(muon_named, cfg, hyper)
    ours_adam = torch.optim.AdamW(param_groups([p for _, p in adam_named], DECAY), lr=ADAM_LR)
    layout = {name: matrices_of(name, p.shape, cfg) for name, p in muon_named}
    unfused = {name: [nn.Parameter(t) for t in split_matrices(p.detach(), layout[name])] for name, p in muon_named}
    copies = {name: nn.Parameter(p.detach().clone()) for name, p in adam_named}
    theirs = torch.optim.Muon([t for pieces in unfused.values() for t in pieces], lr=hyper.lr,
                              weight_decay=hyper.weight_decay, nesterov=hyper.nesterov, adjust_lr_fn=hyper.adjust_lr)
    theirs_adam = torch.optim.AdamW(param_groups(list(copies.values()), DECAY), lr=ADAM_LR)
    tokens = torch.Generator().manual_seed(3)
    start = {name: p.detach().clone() for name, p in muon_named}
    for _ in range(STEPS):
        ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length + 1), generator=tokens)
        model.zero_grad()
        model(ids[:, :-1], ids[:, 1:]).backward()
        for name, p in muon_named:
            for piece, grad in zip(unfused[name], split_matrices(p.grad, layout[name])):
                piece.grad = grad
        for name, p in adam_named:
            copies[name].grad = p.grad.clone()
        ours.step()
        ours_adam.step()
        with torch_ns_in(hyper.ns_dtype):
            theirs.step()
        theirs_adam.step()
    assert ours.ns_calls == STEPS * sum(len(m) for m in layout.values())  # one NS per unfused matrix per step
    errs = {name: rel_err(copies[name], p) for name, p in adam_named}
    for name, p in muon_named:
        assert rel_err(p, start[name]) > 1e-3, name  # the weights moved
        errs[name] = rel_err(p, merge_matrices([t.detach() for t in unfused[name]], layout[name], torch.empty_like(p)))
    return errs


REFERENCE_RUNS = [  # (model, lr adjustment, NS dtype, Nesterov): both adjustments in fp32 on each model, bf16 NS
    ("llama", "original", torch.float32, True),  # (torch as shipped) once per model, and Nesterov off once
    ("llama", "match_rms_adamw", torch.float32, True),
    ("gpt2", "original", torch.float32, True),
    ("gpt2", "match_rms_adamw", torch.float32, True),
    ("llama", "match_rms_adamw", torch.bfloat16, True),
    ("gpt2", "original", torch.bfloat16, True),
    ("llama", "original", torch.float32, False),
]


@pytest.mark.parametrize("arch, adjust, ns_dtype, nesterov", REFERENCE_RUNS,
                         ids=[f"{a}-{j}-{str(d)[6:]}{'' if n else '-plain'}" for a, j, d, n in REFERENCE_RUNS])
def test_twenty_steps_equal_torch_muon(arch, adjust, ns_dtype, nesterov):
    hyper = MuonHyper(lr=MUON_LR, weight_decay=DECAY, adjust_lr=adjust, ns_dtype=ns_dtype, nesterov=nesterov)
    errs = reference_run(LLAMA if arch == "llama" else GPT2, hyper)
    bad = {k: v for k, v in errs.items() if not v <= 1e-6}
    assert not bad, bad


def layer_names(cfg: ModelConfig, takes: list[str]) -> set[str]:
    return {n.partition(".")[2].partition(".")[2] for n in takes if n.startswith("layers.")}


def test_parameter_split_rule():
    """Hidden matrices (each expert's too) to Muon; embeddings, head, router, norms and biases to AdamW."""
    dense = ["attention.qkv.weight", "attention.proj.weight", "mlp.fc1.weight"]
    want = {
        "llama": (LLAMA, {*dense, "mlp.gate.weight", "mlp.fc2.weight"}, {"embedding.word.weight", "output.weight"}),
        "gpt2": (GPT2, {*dense, "mlp.fc2.weight"}, {"embedding.word.weight", "embedding.position.weight"}),
        "moe_gpt2": (MOE_GPT2, {*dense[:2], "mlp.experts.fc1_weight", "mlp.experts.fc2_weight",
                                "mlp.shared_expert.fc1.weight", "mlp.shared_expert.fc2.weight"},
                     {"embedding.word.weight", "embedding.position.weight", "layers.0.mlp.router.weight",
                      "layers.0.mlp.experts.fc1_bias", "layers.0.mlp.experts.fc2_bias"}),
        "moe_llama": (MOE_LLAMA, {*dense[:2], "mlp.experts.fc1_weight", "mlp.experts.gate_weight",
                                  "mlp.experts.fc2_weight"},
                      {"embedding.word.weight", "output.weight", "layers.0.mlp.router.weight",
                       "layers.1.mlp.router.weight"}),
    }
    for tag, (cfg, muon_layer_names, some_adamw) in want.items():
        model = build(cfg)
        muon, adamw = split_parameters(model.named_parameters())
        assert layer_names(cfg, [n for n, _ in muon]) == muon_layer_names, tag
        adamw_names = {n for n, _ in adamw}
        assert some_adamw <= adamw_names, (tag, some_adamw - adamw_names)
        assert all(p.ndim == 1 for n, p in adamw if n not in some_adamw), tag  # the rest: norms and biases
        assert len(muon) + len(adamw) == len(list(model.parameters())), tag


def test_fused_weights_split_as_hf_does():
    """W_q (all query heads), W_k, W_v (all key/value groups) and each expert's (out, in) matrix are the tensors
    megazero's HF export writes (q_proj, k_proj, v_proj; experts.E.w1/w3/w2); split and merge are inverses."""
    model = build(MOE_LLAMA)
    hf = to_hf(model.state_dict(), MOE_LLAMA)
    state = dict(model.named_parameters())
    q, k, v = split_matrices(state["layers.0.attention.qkv.weight"].detach(),
                             matrices_of("layers.0.attention.qkv.weight", (64, 32), MOE_LLAMA))
    d, groups = MOE_LLAMA.head_dim, MOE_LLAMA.query_groups
    assert (q.shape, k.shape, v.shape) == ((4 * d, 32), (groups * d, 32), (groups * d, 32))
    for ours, theirs in zip((q, k, v), ("q_proj", "k_proj", "v_proj")):
        assert torch.equal(ours, hf[f"model.layers.0.self_attn.{theirs}.weight"]), theirs
    for ours_name, theirs_name in (("fc1_weight", "w3"), ("gate_weight", "w1"), ("fc2_weight", "w2")):
        weight = state[f"layers.1.mlp.experts.{ours_name}"].detach()
        matrices = matrices_of(f"layers.1.mlp.experts.{ours_name}", weight.shape, MOE_LLAMA)
        assert len(matrices) == MOE_LLAMA.num_experts
        pieces = split_matrices(weight, matrices)
        for e, piece in enumerate(pieces):
            hf_name = next(n for n in hf if n.endswith(f"layers.1.block_sparse_moe.experts.{e}.{theirs_name}.weight"))
            assert torch.equal(piece, hf[hf_name]), (ours_name, e)
        assert torch.equal(merge_matrices(pieces, matrices, torch.full_like(weight, float("nan"))), weight)
    qkv = state["layers.0.attention.qkv.weight"].detach()
    layout = matrices_of("layers.0.attention.qkv.weight", qkv.shape, MOE_LLAMA)
    assert torch.equal(merge_matrices([q, k, v], layout, torch.full_like(qkv, float("nan"))), qkv)


def test_muon_is_not_sgd():
    """On a gradient whose singular values span 100x, momentum SGD's update keeps that spread; Muon's
    orthogonalised update has every singular value near 1 (within 2x of each other) and points elsewhere."""
    gen = torch.Generator().manual_seed(5)
    u, _ = torch.linalg.qr(torch.randn(48, 32, generator=gen))
    w, _ = torch.linalg.qr(torch.randn(32, 32, generator=gen))
    grad = u @ torch.diag(torch.logspace(0, -2, 32)) @ w.T
    weight = torch.randn(48, 32, generator=gen)
    ours, sgd_weight = weight.clone(), nn.Parameter(weight.clone())
    h = MuonHyper(lr=0.02, weight_decay=0.0)
    assert muon_step_(ours, grad, torch.zeros_like(grad), matrices_of("w", grad.shape, GPT2), h) == 1
    sgd_weight.grad = grad.clone()
    torch.optim.SGD([sgd_weight], lr=0.02, momentum=0.95, nesterov=True).step()
    muon_update, sgd_update = weight - ours, weight - sgd_weight.detach()
    muon_sv, sgd_sv = torch.linalg.svdvals(muon_update), torch.linalg.svdvals(sgd_update)
    assert sgd_sv.max() / sgd_sv.min() > 99 and muon_sv.max() / muon_sv.min() < 2, (sgd_sv, muon_sv)
    cosine = torch.nn.functional.cosine_similarity(muon_update.flatten(), sgd_update.flatten(), dim=0)
    assert cosine < 0.9, cosine
