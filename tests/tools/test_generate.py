"""tools/generate.py on checkpoints that pretrain_gpt.py saved at tp 2 x pp 2 (4 ranks, 2 iterations).

Greedy ids must equal transformers' greedy ``generate`` on the same checkpoint exported with
tools/convert_checkpoint.py --to hf (for gpt2, and for llama with GQA and Llama-3 RoPE scaling).
The weights are drawn with a wide init (std 0.2) so the next-token margins are far above the
~1e-6 by which two fp32 implementations differ, and the 32 ids vary.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.launch import launch, run_python
from tests.helpers.tool_module import load_tool

transformers = pytest.importorskip("transformers")

PROMPT = "Return the number of"
ARCH_FLAGS = {
    "gpt2": ["--arch", "gpt2", "--num-attention-heads", "4"],
    "llama": ["--arch", "llama", "--num-attention-heads", "4", "--num-query-groups", "2", "--rope-scaling-type",
              "llama3", "--rope-scaling-factor", "4", "--rope-scaling-original-max-position-embeddings", "16"],
}
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--seq-length", "48", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3", "--init-method-std", "0.2",
         "--log-interval", "1", "--tp", "2", "--pp", "2"]


@pytest.fixture(scope="module", params=sorted(ARCH_FLAGS))
def saved(request, tmp_path_factory) -> tuple[str, str]:
    """(checkpoint saved at tp 2 x pp 2, its HF export)."""
    root = tmp_path_factory.mktemp(f"generate_{request.param}")
    ckpt, hf = str(root / "ckpt"), str(root / "hf")
    results = launch("pretrain_gpt.py", [*ARCH_FLAGS[request.param], *SMALL, "--save", ckpt], 4)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank}:\n{r.stderr[-3000:]}"
    assert load_tool("convert_checkpoint").main(["--input", ckpt, "--output", hf, "--to", "hf"]) == 0
    return ckpt, hf


def _generate(capsys, *args: str) -> list[dict]:
    """Run the tool in this process; the JSON lines of --print-ids, one per prompt."""
    capsys.readouterr()
    assert load_tool("generate").main([*args, "--print-ids"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_greedy_ids_equal_transformers_generate(saved, capsys):
    ckpt, hf = saved
    [record] = _generate(capsys, "--load", ckpt, "--prompt", PROMPT, "--max-new-tokens", "32")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    assert hf_tokenizer(PROMPT, add_special_tokens=False)["input_ids"] == record["prompt_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    prompt = torch.tensor([record["prompt_ids"]])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False,
                             pad_token_id=hf_tokenizer.pad_token_id)
    assert out[0, prompt.shape[1]:].tolist() == record["new_ids"]
    assert len(record["new_ids"]) == 32 and record["stop"] == "max_new_tokens"
    assert len(set(record["new_ids"])) > 4, record["new_ids"]  # a varied continuation, not one token repeated


def test_sampling_repeats_with_a_seed_and_top_k_1_is_greedy(saved, capsys):
    ckpt, _ = saved
    base = ["--load", ckpt, "--prompt", PROMPT, "--prompt", "", "--max-new-tokens", "12"]
    hot = [*base, "--temperature", "1.5", "--top-p", "0.95"]
    first, again = _generate(capsys, *hot, "--seed", "1"), _generate(capsys, *hot, "--seed", "1")
    assert len(first) == 2 and first == again
    assert _generate(capsys, *hot, "--seed", "2") != first
    greedy = _generate(capsys, *base)
    assert _generate(capsys, *base, "--temperature", "3", "--top-k", "1", "--seed", "5") == greedy
    assert greedy[1]["prompt_ids"] == [2]  # an empty prompt starts where a document starts: after end-of-document


def test_a_missing_load_folder_is_one_line(tmp_path):
    """Run as a user would: exit 2 with one line on stderr."""
    proc = run_python(["tools/generate.py", "--load", str(tmp_path / "nope"), "--prompt", "x"], timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.strip() == (f"generate.py: error: --load {str(tmp_path / 'nope')!r} does not exist or is not "
                                   "a folder; pass the --save folder of a training run")


def _one_line_failure(capsys, args: list[str]) -> str:
    """The tool in this process must exit 2 with one line on stderr, which is returned."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        load_tool("generate").main(args)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == "" and len(err.strip().splitlines()) == 1, (out, err)
    return err.strip()


@pytest.mark.parametrize("flags,words", [(["--top-p", "1.5"], "--top-p"), (["--temperature", "hot"], "--temperature"),
                                         (["--max-new-tokens", "0"], "--max-new-tokens")])
def test_bad_flags_are_one_line(tmp_path, capsys, flags, words):
    assert words in _one_line_failure(capsys, ["--load", str(tmp_path), "--prompt", "x", *flags])


@pytest.mark.parametrize("flags,shown", [(["--top-k", "5"], "--top-k 5"), (["--top-p", "0.9"], "--top-p 0.9"),
                                         (["--seed", "1"], "--seed 1"),
                                         (["--temperature", "0", "--top-k", "1"], "--top-k 1")])
def test_sampling_flags_without_a_temperature_are_refused(tmp_path, capsys, flags, shown):
    """Greedy decoding (--temperature 0, the default) reads no top-k, top-p or seed: each is refused, not ignored."""
    flag = shown.split()[0]
    assert _one_line_failure(capsys, ["--load", str(tmp_path), "--prompt", "x", *flags]) == (
        f"generate.py: error: {shown} only applies when sampling; pass --temperature T > 0 to sample, or drop {flag} "
        f"for greedy decoding (--temperature 0, the default)")


def test_a_sampling_flag_without_a_temperature_is_one_line_from_the_command_line(tmp_path):
    proc = run_python(["tools/generate.py", "--load", str(tmp_path), "--prompt", "x", "--top-k", "5"], timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.strip() == ("generate.py: error: --top-k 5 only applies when sampling; pass --temperature T > 0 "
                                   "to sample, or drop --top-k for greedy decoding (--temperature 0, the default)")


def test_the_recorded_tokenizer_or_one_line_asking_for_it(tmp_path, capsys):
    """A checkpoint records its run's tokenizer; one that records none (as one converted from HF, with
    another vocabulary than the default corpus's) asks for --tokenizer-model, which then serves."""
    from megazero.checkpoint.convert import write_checkpoint
    from megazero.config import Config, ModelConfig
    from megazero.data.tokenizer import load_tokenizer, train_sentencepiece
    from megazero.model.gpt import GPTModel
    from megazero.model.transformer import TPContext
    from megazero.tensor_parallel.layers import initialize_parameters

    tok = train_sentencepiece([f"w{i} token{i % 37} text{i % 11}" for i in range(800)], str(tmp_path / "tok"), 280)
    model_cfg = ModelConfig(arch="llama", num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16,
                            vocab_size=300)
    model = GPTModel(model_cfg, TPContext())
    initialize_parameters(model, 3, None)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    recorded = write_checkpoint(str(tmp_path / "recorded"), Config(model=model_cfg).updated(
        tokenizer_model=tok, data_path=[str(tmp_path / "data")]), state, tp=1, pp=1)
    bare = write_checkpoint(str(tmp_path / "bare"), Config(model=model_cfg), state, tp=1, pp=1)
    expected = load_tokenizer(tok).encode("w5 token5")
    assert _generate(capsys, "--load", recorded, "--prompt", "w5 token5", "--max-new-tokens", "3")[0][
        "prompt_ids"] == expected
    line = _one_line_failure(capsys, ["--load", bare, "--prompt", "w5"])
    assert "records no tokenizer" in line and "(300)" in line and "pass --tokenizer-model" in line
    assert _generate(capsys, "--load", bare, "--tokenizer-model", tok, "--prompt", "w5 token5",
                     "--max-new-tokens", "3")[0]["prompt_ids"] == expected


def test_too_long_a_prompt_is_one_line(saved, capsys):
    line = _one_line_failure(capsys, ["--load", saved[0], "--prompt", PROMPT, "--max-new-tokens", "46"])
    assert "--max-new-tokens 46" in line and "more than the model's 48" in line
