"""--compile with mixture-of-experts layers (issue 33, "Composition"): the MoE layer is a graph break
(``compile.eager_sites``: host-side split sizes, routing that changes shapes each step), the rest of each block
stays compiled; the same losses, gradients and token counts as eager, full recompute included (the recompute
in backward routes the same tokens and the router does not count them again); and through pretrain_gpt.py at
ep 2 against one eager process. ``aot_eager`` (dynamo's graphs and AOTAutograd's split without code
generation) keeps compile time small; inductor's own kernels are checked by tests/model/test_compile.py.
"""
from __future__ import annotations

import json

import torch
import torch._dynamo

from megazero.config import ModelConfig
from megazero.model.chunk import blocks_of, routers_of
from megazero.model.compile import apply_compile, eager_sites
from megazero.model.gpt import GPTModel
from megazero.model.recompute import apply_recompute
from megazero.model.transformer import TPContext
from megazero.tensor_parallel.layers import initialize_parameters
from megazero.tensor_parallel.random import DropoutRNG
from tests.helpers.compiled import assert_two_steps_match
from tests.helpers.launch import launch

MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)


def _model(recompute: str) -> GPTModel:
    cfg = ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      seq_length=16, vocab_size=128, moe_shared_expert_intermediate_size=32, **MOE)
    model = GPTModel(cfg, TPContext(rng=DropoutRNG(7, 0, "cpu")))
    initialize_parameters(model, 7, None)
    apply_recompute(blocks_of(model), recompute)
    return model


def test_compiled_moe_model_equals_eager_with_full_recompute():
    torch._dynamo.reset()
    eager, compiled = _model("none"), _model("full")
    assert apply_compile(compiled, backend="aot_eager") == 2
    assert all(eager_sites(b) == ["mlp"] and b.mlp_eager for b in blocks_of(compiled))
    assert "compiled, moe eager" in repr(compiled)
    assert_two_steps_match(eager, compiled)
    for want, got in zip(routers_of(eager), routers_of(compiled)):  # two forwards of 32 tokens x k 2
        counts = got.take_step_tokens_per_expert()
        assert torch.equal(counts, want.take_step_tokens_per_expert()) and counts.sum() == 2 * 32 * 2


SMALL = ["--arch", "llama", "--num-query-groups", "2", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "10", "--log-interval", "1", "--lr", "1e-3", "--num-experts", "4",
         "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]


def _records(tmp_path, name: str, ranks: int, flags: list[str]) -> list[tuple[float, float]]:
    """(loss, grad norm) per iteration of one pretrain_gpt.py run; every rank must exit 0."""
    metrics = tmp_path / f"{name}.jsonl"
    results = launch("pretrain_gpt.py", [*SMALL, *flags, "--metrics-file", str(metrics)], ranks)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"{name} rank {rank} failed:\n{r.stderr[-3000:]}"
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "event" not in r]
    assert [r["iteration"] for r in records] == list(range(1, 11)), name
    return [(r["loss"], r["grad_norm"]) for r in records]


def test_pretrain_gpt_ep2_compiled_matches_one_eager_process(tmp_path):
    eager = _records(tmp_path, "eager", 1, [])
    compiled = _records(tmp_path, "ep2.compile", 2, ["--ep", "2", "--compile", "--compile-backend", "aot_eager",
                                                      "--recompute", "full"])
    for what, i in (("loss", 0), ("grad norm", 1)):
        worst = max(abs(a[i] - b[i]) / abs(b[i]) for a, b in zip(compiled, eager))
        assert worst <= 1e-5, f"ep 2 --compile: worst relative {what} difference {worst:.2e}"
    assert eager[-1][0] < eager[0][0], "the loss should fall over 10 iterations"
