"""--finetune, --no-load-optim, --no-load-rng and --skip-train (Megatron's meanings) through pretrain_gpt.py.

One run at tp 2 (2 ranks) trains 6 iterations, evaluating every 2 and saving at 4 and 6. From its checkpoints:
- ``--finetune`` at tp 1 trains bitwise like the same weights exported to HF and imported back (a checkpoint at
  iteration 0 without optimizer state or generators) in a fresh run: iteration 0, data from the start, fresh
  optimizer, generators from --seed;
- ``--no-load-optim`` continues at iteration 5 with the data where the run was, and its update is a fresh
  ``torch.optim.AdamW`` step from the loaded weights (computed here, in this process);
- ``--skip-train`` reports the very validation loss the run logged at the checkpoint's iteration.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from megazero.arguments import parse_config
from megazero.checkpoint import storage
from megazero.checkpoint.convert import read_full_state
from megazero.config import ConfigError
from megazero.data import build_data
from megazero.data.sampler import MicroBatchIterator
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from megazero.training.run import find_checkpoint
from tests.helpers.launch import launch
from tests.helpers.reference import param_groups
from tests.helpers.tool_module import load_tool

SMALL = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
         "--lr", "1e-3", "--lr-warmup-iters", "1", "--eval-iters", "2"]
ITERS, SAVED_AT = 6, 4


def run(tmp, name: str, nproc: int, flags: list[str]) -> tuple[list[dict], list[dict], list]:
    """pretrain_gpt.py on ``nproc`` ranks (each must exit 0): its iteration records, evaluation records, outputs."""
    metrics = os.path.join(tmp, f"{name}.jsonl")
    results = launch("pretrain_gpt.py", [*SMALL, *flags, "--metrics-file", metrics], nproc, default_corpus=True)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"{name} rank {rank} failed:\n{r.stderr[-3000:]}"
    records = [json.loads(line) for line in open(metrics)]
    return ([r for r in records if "event" not in r], [r for r in records if r.get("event") == "eval"], results)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("finetune"))
    ckpt = os.path.join(tmp, "ckpt")
    records, evals, _ = run(tmp, "trained", 2, ["--tp", "2", "--train-iters", str(ITERS), "--eval-interval", "2",
                                                  "--save", ckpt, "--save-interval", str(SAVED_AT),
                                                  "--hidden-dropout", "0.1"])  # the checkpoints hold its streams
    return tmp, ckpt, records, evals


def test_finetune_trains_like_the_same_weights_imported_from_hf(trained):
    tmp, ckpt, records, _ = trained
    convert = load_tool("convert_checkpoint")
    assert convert.main(["--input", ckpt, "--output", os.path.join(tmp, "hf"), "--to", "hf"]) == 0
    imported = os.path.join(tmp, "imported")
    assert convert.main(["--input", os.path.join(tmp, "hf"), "--output", imported, "--to", "megazero"]) == 0
    meta = storage.read_metadata(storage.resolve(imported))
    assert meta["iteration"] == 0 and meta["consumed_samples"] == 0 and not meta["optimizer"]["files"]
    flags = ["--train-iters", "3", "--hidden-dropout", "0.1"]  # the checkpoint's streams must not be restored
    from megazero.data import default_corpus  # an import records no data: name the corpus the run trained on

    corpus = default_corpus(log=lambda *_: None)
    from_hf, _, _ = run(tmp, "from_hf", 1, [*flags, "--load", imported, "--data-path", corpus.data_prefix,
                                            "--tokenizer-model", corpus.tokenizer_model])
    finetuned, _, out = run(tmp, "finetuned", 1, [*flags, "--load", ckpt, "--finetune"])  # saved at tp 2
    assert "megazero: --finetune: only the model weights come from" in out[0].stdout
    assert [r["iteration"] for r in finetuned] == [1, 2, 3]
    assert [r["consumed_samples"] for r in finetuned] == [r["consumed_samples"] for r in records[:3]]
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in finetuned] == [r[key] for r in from_hf], key  # bitwise
    assert finetuned[0]["loss"] != records[0]["loss"]  # the trained weights, not a new model


def _batch(cfg, consumed: int) -> list[torch.Tensor]:
    """The micro-batches of the global batch after ``consumed`` samples, from the data a run of ``cfg`` reads."""
    t = cfg.training
    data = build_data(data_path=None, tokenizer_model=None, split=cfg.data.split, seq_length=cfg.model.seq_length,
                      train_samples=t.train_iters * t.global_batch_size, eval_samples=0, seed=t.seed,
                      is_builder=True, log=lambda *_: None)
    micro = t.micro_batch_size
    return MicroBatchIterator(data.train, micro, t.global_batch_size // micro, 0, 1, consumed).next_step()


def _loss(model: GPTModel, micro_batches: list[torch.Tensor]) -> torch.Tensor:
    return sum(model(mb[:, :-1], mb[:, 1:]) for mb in micro_batches) / len(micro_batches)


def test_no_load_optim_keeps_the_position_and_steps_a_fresh_adamw(trained):
    """Iteration 5 is the checkpoint's weights on batch 5, and its update torch.optim.AdamW's first step from
    them, so iteration 6's loss is that model's on batch 6 (dropout off: the reference draws no masks)."""
    tmp, ckpt, records, _ = trained
    got, _, out = run(tmp, "no_load_optim", 1, ["--train-iters", str(ITERS), "--load", os.path.join(
        ckpt, f"iter_{SAVED_AT:07d}"), "--no-load-optim", "--no-load-rng", "--hidden-dropout", "0"])
    assert "megazero: --no-load-optim: the optimizer starts fresh at iteration 4" in out[0].stdout
    assert "megazero: --no-load-rng: seeding the default generator and the dropout streams from --seed 1234 " \
           "at iteration 4; the checkpoint's are not restored." in out[0].stdout
    straight = records[SAVED_AT:]
    for key in ("iteration", "consumed_samples", "lr"):
        assert [r[key] for r in got] == [r[key] for r in straight], key

    cfg, state = read_full_state(os.path.join(ckpt, f"iter_{SAVED_AT:07d}"), tp=1)
    cfg = cfg.updated(hidden_dropout=0.0)
    model = GPTModel(cfg.model, TPContext())
    model.load_state_dict(state)
    o = cfg.optimizer
    adamw = torch.optim.AdamW(param_groups(list(model.parameters()), o.weight_decay), lr=got[0]["lr"],
                              betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
    gbs = cfg.training.global_batch_size
    before = _loss(model, _batch(cfg, SAVED_AT * gbs))
    first = float(before.detach())
    assert abs(got[0]["loss"] - first) <= 1e-6 * abs(first)  # the data where the run was
    before.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
    adamw.step()
    with torch.no_grad():
        want = float(_loss(model, _batch(cfg, (SAVED_AT + 1) * gbs)))
    assert abs(got[1]["loss"] - want) <= 1e-6 * abs(want), (got[1]["loss"], want)


def test_skip_train_reports_the_logged_validation_loss(trained):
    """From the latest checkpoint (iteration 6 = --train-iters, which a resume calls "nothing to do"), in the
    saving layout: the evaluation record equals the run's own at iteration 6, bitwise; nothing trains or saves."""
    tmp, ckpt, _, evals = trained
    before = sorted(os.listdir(ckpt))
    records, got, out = run(tmp, "skip_train", 2, ["--tp", "2", "--train-iters", str(ITERS), "--load", ckpt,
                                                   "--skip-train"])
    logged = next(r for r in evals if r["iteration"] == ITERS)
    assert records == [] and got == [logged]  # iteration, val_loss and val_ppl: equal floats
    assert f"validation loss at iteration {ITERS} | lm loss value: {logged['val_loss']:.6E}" in out[0].stdout
    assert sorted(os.listdir(ckpt)) == before  # no checkpoint, and --save is refused with --skip-train


@pytest.mark.parametrize("switch", ["--finetune", "--no-load-optim", "--no-load-rng", "--skip-train"])
def test_load_switches_without_load_are_refused(switch):
    with pytest.raises(ConfigError) as err:
        parse_config([switch])
    assert str(err.value) == f"{switch} only applies with --load DIR (here no --load); drop it or pass --load DIR."


def test_refused_on_every_rank_before_anything_starts():
    results = launch("pretrain_gpt.py", ["--skip-train", "--train-iters", "1"], 2, timeout=120)
    for r in results:
        assert r.returncode == 2
        assert r.stderr.strip() == ("pretrain_gpt.py: error: --skip-train only applies with --load DIR (here no "
                                    "--load); drop it or pass --load DIR.")


def test_load_flags_that_cannot_work(tmp_path):
    empty = str(tmp_path / "job")
    cases = [
        (["--load", empty, "--save", empty, "--finetune"],
         f"--finetune with --load equal to --save ({empty}) would start again from iteration 0 at every restart, "
         f"from its own latest checkpoint; pass another --save folder."),
        (["--load", empty, "--save", empty, "--skip-train"],
         f"--skip-train only evaluates the --load checkpoint and saves nothing; drop --save {empty}."),
        (["--load", empty, "--skip-train", "--eval-iters", "0"],
         "--skip-train with --eval-iters 0 evaluates no batch; pass --eval-iters >= 1."),
    ]
    for flags, message in cases:
        cfg, _ = parse_config(flags)
        with pytest.raises(ConfigError) as err:
            find_checkpoint(cfg)
        assert str(err.value) == message
