"""pretrain_gpt.py end to end: the same losses at any TP x DP layout, and clean failures on bad input."""
from __future__ import annotations

import json
import math

import pytest

from tests.helpers.launch import launch, train_records
from tests.helpers.refusals import refusal_line

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "10", "--log-interval", "1",
         "--lr", "1e-3", "--lr-warmup-iters", "2"]
ARCH_FLAGS = {"gpt2": ["--arch", "gpt2"], "llama": ["--arch", "llama", "--num-query-groups", "2"]}


# The entry path's smoke launch: one real interpreter (``python pretrain_gpt.py``, nothing preloaded) that trains;
# every other launch here forks its ranks, as each is still its own process with its own world.
SMOKE = dict(fresh=True)


def _check_records(records: list[dict]) -> list[float]:
    assert [r["iteration"] for r in records] == list(range(1, 11))
    for r in records:
        assert {"loss", "lr", "grad_norm", "tokens_per_sec"} <= r.keys()
    return [r["loss"] for r in records]


def _losses(tmp_path, name: str, nproc: int, extra: list[str]) -> list[float]:
    return _check_records(train_records(tmp_path / f"{name}.jsonl", [*SMALL, *extra], nproc))


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> dict:
    """The smoke launch (``SMOKE``), once for two tests: one fresh rank trains gpt2 at ``SMALL`` (the serial run of
    ``test_losses_match_across_layouts[gpt2]``), evaluates and saves at its last iteration (evaluation and saving
    leave the training's losses as they are), with the interpreter's import log (PYTHONPROFILEIMPORTTIME) on
    stderr for ``test_a_run_without_compile_never_imports_dynamo``."""
    tmp = tmp_path_factory.mktemp("smoke")
    flags = [*SMALL, *ARCH_FLAGS["gpt2"], "--eval-interval", "10", "--eval-iters", "1", "--save", str(tmp / "ckpt"),
             "--save-interval", "10", "--metrics-file", str(tmp / "tp1.jsonl")]
    (rank,) = launch("pretrain_gpt.py", flags, 1, env={"PYTHONPROFILEIMPORTTIME": "1"}, **SMOKE)
    records = [json.loads(line) for line in open(tmp / "tp1.jsonl").read().splitlines()] if rank.returncode == 0 else []
    return {"rank": rank, "records": records, "ckpt": tmp / "ckpt"}


def _smoke_rank(smoke_run: dict):
    rank = smoke_run["rank"]
    assert rank.returncode == 0, rank.stderr[-3000:]
    return rank


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_losses_match_across_layouts(tmp_path, arch, request):
    if arch == "gpt2":  # one fresh rank: the smoke launch
        smoke = request.getfixturevalue("smoke_run")
        _smoke_rank(smoke)
        serial = _check_records([r for r in smoke["records"] if "event" not in r])
    else:
        serial = _losses(tmp_path, "tp1", 1, ARCH_FLAGS[arch])
    for name, nproc, flags in (("tp2", 2, ["--tp", "2"]), ("tp2dp2", 4, ["--tp", "2"])):
        losses = _losses(tmp_path, name, nproc, [*ARCH_FLAGS[arch], *flags])
        for it, (a, b) in enumerate(zip(losses, serial), start=1):
            assert abs(a - b) <= 1e-5 * abs(b), f"{arch} {name} iteration {it}: {a} vs serial {b}"
    assert serial[-1] < serial[0], "loss should fall over 10 iterations"


def test_a_run_without_compile_never_imports_dynamo(smoke_run):
    """``torch._dynamo`` is ~1.5 of a rank's ~4 CPU-seconds of imports: only --compile may pull it in (a
    ``torch.compiler.disable`` at import time did, in every rank of every run). The interpreter's import log
    (PYTHONPROFILEIMPORTTIME) of a fresh rank that trains, evaluates and saves (``smoke_run``) names every module
    it loaded."""
    rank = _smoke_rank(smoke_run)
    assert [r["iteration"] for r in smoke_run["records"] if r.get("event") == "eval"] == [10]
    assert (smoke_run["ckpt"] / "iter_0000010").is_dir()  # it evaluated and saved
    imported = [line.rsplit("|", 1)[-1].strip() for line in rank.stderr.splitlines() if line.startswith("import time:")]
    assert "megazero.training.run" in imported and "torch.nn" in imported  # the log is there
    assert not [m for m in imported if m.startswith("torch._dynamo")], "a plain run imported torch._dynamo"


BAD_INPUT = [
    # (ranks, flags, words the single error line must contain)
    (2, ["--tp", "2", "--num-attention-heads", "3", "--hidden-size", "48"], ["--num-attention-heads", "--tp"]),
    (2, ["--tp", "2", "--num-attention-heads", "4", "--hidden-size", "64", "--ffn-hidden-size", "99"],
     ["--ffn-hidden-size", "--tp"]),
    (2, ["--tp", "2", "--hidden-size", "63", "--num-attention-heads", "3", "--ffn-hidden-size", "128"],
     ["--hidden-size", "--tp"]),
    (2, ["--tp", "2", "--arch", "llama", "--num-attention-heads", "6", "--hidden-size", "48",
         "--num-query-groups", "3"], ["--num-query-groups", "--tp"]),
    (3, ["--tp", "2"], ["world size 3", "--tp"]),
    (1, ["--tp", "2"], ["world size 1", "--tp"]),
    (2, ["--arch", "gpt3"], ["--arch", "gpt2"]),
    (2, ["--config", "no/such/preset.yaml"], ["--config", "no/such/preset.yaml"]),
    (2, ["--global-batch-size", "6"], ["--global-batch-size", "--micro-batch-size"]),
    (2, ["--load", "no/such/checkpoint"], ["--load", "no/such/checkpoint"]),
    (2, ["--pp", "2", "--num-layers", "3"], ["--num-layers", "--pp"]),
]


def _refusal_line(nproc: int, flags: list[str]) -> str:
    return refusal_line([*SMALL, *flags], nproc)


@pytest.mark.parametrize("nproc,flags,words", BAD_INPUT, ids=[" ".join(b[1]) for b in BAD_INPUT])
def test_bad_input_is_refused_in_one_line_before_any_group(nproc, flags, words):
    line = _refusal_line(nproc, flags)
    assert "\n" not in line.strip(), line
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"


# The contract itself, through real ranks: exit 2, one line, no traceback, on every rank (a check that fails on
# the model's shape, one on the world size, one in argparse).
LAUNCHED = [BAD_INPUT[0], BAD_INPUT[4], BAD_INPUT[6]]


@pytest.mark.parametrize("nproc,flags,words", LAUNCHED, ids=[" ".join(b[1]) for b in LAUNCHED])
def test_bad_input_fails_fast_with_one_line(nproc, flags, words):
    # the timeout is a hang guard: start-up alone can take a minute on a loaded machine
    results = launch("pretrain_gpt.py", [*SMALL, *flags], nproc, timeout=300)
    for rank, r in enumerate(results):
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2, f"rank {rank}: exit {r.returncode}\n{r.stderr}"
        assert "Traceback" not in r.stderr, r.stderr
        assert len(lines) == 1, f"rank {rank}: expected one error line, got:\n{r.stderr}"
        for word in words:
            assert word in lines[0], f"{word!r} not in {lines[0]!r}"


def test_trains_from_preprocessed_data_with_tp_pp_dp(tmp_path):
    """The user's path: train a tokenizer and preprocess JSONL with the tools, then tp=2 x pp=2 x dp=2."""
    from megazero.data.corpus import corpus_documents
    from tests.helpers.launch import run_python

    docs = corpus_documents(max_bytes=300_000)
    with open(tmp_path / "docs.jsonl", "w") as fh:
        for doc in docs:
            fh.write(json.dumps({"text": doc}) + "\n")
    tools = [["tools/train_tokenizer.py", "--input", str(tmp_path / "docs.jsonl"), "--model-prefix",
              str(tmp_path / "tok"), "--vocab-size", "1000"],
             ["tools/preprocess_data.py", "--input", str(tmp_path / "docs.jsonl"), "--output-prefix",
              str(tmp_path / "corpus"), "--tokenizer-model", str(tmp_path / "tok.model"), "--workers", "2"]]
    for tool in tools:
        out = run_python(tool)
        assert out.returncode == 0, out.stderr[-2000:]
    flags = [*SMALL, "--num-layers", "4", "--tp", "2", "--pp", "2", "--data-path", str(tmp_path / "corpus"),
             "--tokenizer-model", str(tmp_path / "tok.model"), "--train-iters", "6",
             "--metrics-file", str(tmp_path / "m.jsonl")]
    for rank, r in enumerate(launch("pretrain_gpt.py", flags, 8)):  # forked ranks (SMOKE above is the fresh one)
        assert r.returncode == 0, f"rank {rank}:\n{r.stderr[-2000:]}"
    losses = [json.loads(line)["loss"] for line in open(tmp_path / "m.jsonl") if '"loss"' in line]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert abs(losses[0] - math.log(1000)) < 1.0  # starts near uniform over the tokenizer's vocabulary
