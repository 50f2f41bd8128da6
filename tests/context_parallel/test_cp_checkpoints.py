"""Checkpoints do not depend on --cp, through pretrain_gpt.py on the built-in corpus.

A 4-rank cp2 x pp2 run at ZeRO 1 (optimizer state sharded over dp x cp) saves at iteration 3 with
evaluation on. Loading that checkpoint at the same layout resumes bitwise (loss and grad norm of
iterations 4-6); loading it at cp 4 x pp 1 with ZeRO 3, and in one process, continues with the
same losses to 1e-5 (same weights, same data order: the data does not depend on cp). Bad --cp
input fails on every rank with one line.
"""
from __future__ import annotations

from tests.helpers.launch import launch, train_records

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6", "--log-interval", "1",
         "--lr", "1e-3", "--lr-warmup-iters", "2", "--eval-interval", "3", "--eval-iters", "1"]


def _by_iteration(records: list[dict]) -> dict[int, dict]:
    return {r["iteration"]: r for r in records if "loss" in r}


def test_checkpoint_moves_between_cp_layouts(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _by_iteration(train_records(tmp_path / "a.jsonl", [*SMALL, "--cp", "2", "--pp", "2", "--zero", "1",
                                                                 "--save", str(ckpt), "--save-interval", "3"], 4))
    assert sorted(first) == [1, 2, 3, 4, 5, 6] and first[6]["loss"] < first[1]["loss"]
    load = ["--load", str(ckpt / "iter_0000003")]
    same = _by_iteration(train_records(tmp_path / "b.jsonl", [*SMALL, "--cp", "2", "--pp", "2", "--zero", "1",
                                                                *load], 4))
    for it in (4, 5, 6):  # exact resume at the saved layout
        assert (same[it]["loss"], same[it]["grad_norm"]) == (first[it]["loss"], first[it]["grad_norm"]), it
    for name, nproc, flags in (("cp4", 4, ["--cp", "4", "--zero", "3"]), ("serial", 1, [])):
        other = _by_iteration(train_records(tmp_path / f"{name}.jsonl", [*SMALL, *flags, *load], nproc))
        for it in (4, 5, 6):
            assert abs(other[it]["loss"] - first[it]["loss"]) <= 1e-5 * first[it]["loss"], (name, it)


def test_bad_cp_input_fails_on_every_rank_with_one_line():
    for nproc, flags, words in ((2, ["--cp", "2", "--seq-length", "30"], ["--seq-length", "--cp 2"]),
                                (2, ["--cp", "2", "--cp-comm-type", "a2a", "--num-attention-heads", "3",
                                     "--hidden-size", "48"], ["--cp-comm-type a2a", "heads"]),
                                (3, ["--cp", "2"], ["world size 3", "--cp"])):
        results = launch("pretrain_gpt.py", [*SMALL, *flags], nproc, timeout=300)
        for rank, r in enumerate(results):
            lines = [line for line in r.stderr.splitlines() if line.strip()]
            assert r.returncode == 2 and "Traceback" not in r.stderr, f"rank {rank}: {r.stderr}"
            assert len(lines) == 1 and all(w in lines[0] for w in words), (rank, lines)
