"""A valid top-1 HF MoE model (one expert per token, weight 1 after renormalising) converts, evaluates and generates.

Mixtral and Qwen3-MoE with ``num_experts_per_tok=1`` (Qwen3's ``norm_topk_prob`` true) once met a config check
whose fix changed the model. Now: tools/convert_checkpoint.py imports each, its logits are transformers' own
(fp32, within 1e-5), ``pretrain_gpt.py --load ... --skip-train`` reports transformers' loss on the very validation
batches it evaluates, tools/generate.py's greedy ids equal transformers' greedy ``generate``, and training the
model is still refused in one line saying why (the router gets no gradient). The references are transformers'.
"""
from __future__ import annotations

import json
import subprocess

import pytest
import torch
import torch.nn.functional as F

from megazero.checkpoint.convert import read_full_state
from megazero.data import build_data
from megazero.data.sampler import MicroBatchIterator
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from tests.helpers.launch import launch, metrics_records, run_python
from tests.helpers.reference import full_logits

transformers = pytest.importorskip("transformers")

VOCAB = 8000  # the default corpus's tokenizer: evaluation and generation use it
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, num_experts_per_tok=1, initializer_range=0.2)
FAMILIES = {
    "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig,
                dict(num_local_experts=4, intermediate_size=32)),
    "qwen3_moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig,
                  dict(num_experts=4, moe_intermediate_size=32, intermediate_size=48, head_dim=32,
                       norm_topk_prob=True)),
}
SEQ, MICRO, GLOBAL, EVAL_ITERS = 32, 2, 4, 2
PROMPT, NEW_TOKENS = "Return the number of", 16


def _tool(name: str, *args: str) -> subprocess.CompletedProcess:
    return run_python([f"tools/{name}.py", *args])


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def converted(request, tmp_path_factory) -> tuple[torch.nn.Module, str, str]:
    """(the transformers model, its save_pretrained folder, its import by tools/convert_checkpoint.py)."""
    model_cls, config_cls, extra = FAMILIES[request.param]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**COMMON, **extra))
    with torch.no_grad():  # a sharp router: each token's one expert is chosen by a wide margin
        for name, p in hf.named_parameters():
            if name.endswith("gate.weight") and p.shape[0] == 4:
                p.normal_(0, 0.5)
    root = tmp_path_factory.mktemp(f"top1_{request.param}")
    hf_dir, mz_dir = str(root / "hf"), str(root / "mz")
    hf.eval().save_pretrained(hf_dir)
    done = _tool("convert_checkpoint", "--input", hf_dir, "--output", mz_dir, "--to", "megazero")
    assert done.returncode == 0, done.stderr  # before: "--moe-router-topk 1 with a softmax over the k chosen ..."
    return hf, hf_dir, mz_dir


def test_the_import_computes_transformers_logits(converted):
    hf, _, mz = converted
    cfg, state = read_full_state(mz, tp=1)
    assert (cfg.model.moe_router_topk, cfg.model.moe_router_pre_softmax) == (1, False)
    model = GPTModel(cfg.model, TPContext()).eval()
    model.load_state_dict(state)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert float((full_logits(model, ids) - hf(ids).logits).abs().max()) <= 1e-5


def _validation_batches(seed: int = 1234) -> list[torch.Tensor]:
    """The micro-batches ``--skip-train`` evaluates on one rank: --eval-iters global batches of the validation split."""
    data = build_data(data_path=None, tokenizer_model=None, split="969,30,1", seq_length=SEQ,
                      train_samples=GLOBAL, eval_samples=EVAL_ITERS * GLOBAL, seed=seed, is_builder=True,
                      log=lambda *_: None)
    batches = MicroBatchIterator(data.valid, MICRO, GLOBAL // MICRO, 0, 1, 0)
    return [mb for _ in range(EVAL_ITERS) for mb in batches.next_step()]


def test_skip_train_reports_transformers_loss_and_training_is_refused_saying_why(converted, tmp_path):
    hf, _, mz = converted
    flags = ["--load", mz, "--seq-length", str(SEQ), "--micro-batch-size", str(MICRO), "--global-batch-size",
             str(GLOBAL), "--train-iters", "1", "--eval-iters", str(EVAL_ITERS)]
    [record] = [r for r in metrics_records(tmp_path / "eval.jsonl", [*flags, "--skip-train"], 1)
                if r.get("event") == "eval"]
    with torch.no_grad():
        losses = [F.cross_entropy(hf(mb[:, :-1]).logits.flatten(0, 1), mb[:, 1:].flatten()) for mb in
                  _validation_batches()]
    assert record["val_loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-5, abs=1e-5)
    [refused] = launch("pretrain_gpt.py", flags, 1, timeout=300)
    assert refused.returncode == 2, refused.stderr[-3000:]
    line = refused.stderr.strip()
    assert "\n" not in line and line.startswith("pretrain_gpt.py: error: --moe-router-topk 1 with a softmax over "
                                                "the k chosen"), line
    assert "the constant 1, so the router gets no gradient and cannot train" in line, line


def test_greedy_generation_equals_transformers_generate(converted):
    hf, _, mz = converted
    done = _tool("generate", "--load", mz, "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--print-ids")
    assert done.returncode == 0, done.stderr
    [record] = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    prompt = torch.tensor([record["prompt_ids"]])
    with torch.no_grad():
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    new_ids = record["new_ids"]  # (generate.py stops at end-of-document; transformers here does not)
    assert out[0, prompt.shape[1]:].tolist()[:len(new_ids)] == new_ids
    assert len(new_ids) == NEW_TOKENS or record["stop"] == "eod"
    assert len(set(new_ids)) > 3, new_ids  # a varied continuation, not one token repeated
