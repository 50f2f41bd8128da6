"""Dropout streams resume across a layout change that they do not depend on, and say so when they cannot.

A 2-rank cp 2 run with hidden dropout saves at iteration 2 of 4. Resumed in one process at cp 1,
it continues the uninterrupted run's losses: hidden-dropout masks are drawn for the whole sequence
and sliced, so no generator depends on cp (``checkpoint/rng_streams.py``). Before, any layout
change re-seeded every stream and iterations 3-4 drifted by ~7e-4 relative. Resumed at cp 1 with
the same two processes (so dp 2), the shared streams depend on dp: they start again from --seed and
rank 0 prints one line naming dp; the default generator resumes. The pure decision is checked for
every kind and axis in one process.
"""
from __future__ import annotations

import json

from safetensors.torch import load_file

from megazero.checkpoint import rng_streams as R
from megazero.parallel.layout import Layout
from tests.helpers.launch import launch, train_records

FLAGS = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
         "--lr", "1e-3", "--hidden-dropout", "0.3", "--train-iters", "4"]
RESEED = "from --seed"


def _losses(records: list[dict]) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in records if "loss" in r}


def _read(metrics) -> list[dict]:
    return [json.loads(line) for line in open(metrics).read().splitlines()]


def test_cp_change_resumes_streams_and_dp_change_says_why_not(tmp_path):
    ckpt = tmp_path / "ckpt"
    straight = _losses(train_records(tmp_path / "cp2.jsonl", [*FLAGS, "--cp", "2", "--save", str(ckpt),
                                                              "--save-interval", "2"], 2))
    saved = ckpt / "iter_0000002"
    cp_ranks = [load_file(str(saved / f"rng_rank{r:05d}.safetensors")) for r in (0, 1)]
    assert any(k.endswith(".shared") for k in cp_ranks[0])  # the streams were drawn from and saved
    assert cp_ranks[0].keys() == cp_ranks[1].keys()  # the fact the cp 1 resume reads rank 0 for:
    assert all(cp_ranks[0][k].equal(cp_ranks[1][k]) for k in cp_ranks[0])  # every CP rank holds the same state

    metrics = tmp_path / "cp1.jsonl"
    [one] = launch("pretrain_gpt.py", [*FLAGS, "--load", str(saved), "--metrics-file", str(metrics)], 1)
    assert one.returncode == 0 and RESEED not in one.stdout, one.stderr[-3000:]
    resumed = _losses(_read(metrics))
    assert sorted(resumed) == [3, 4]
    for it, loss in resumed.items():  # ring attention at cp 2 vs whole-sequence attention: fp32 rounding only
        assert abs(loss - straight[it]) <= 1e-6 * straight[it], (it, loss, straight[it])

    dp2 = launch("pretrain_gpt.py", [*FLAGS, "--load", str(saved)], 2)
    assert all(r.returncode == 0 for r in dp2), dp2[0].stderr[-3000:]
    lines = [line for line in dp2[0].stdout.splitlines() if RESEED in line]
    assert lines == ["megazero: dp 1 -> 2 changed: re-seeding the shared dropout streams from --seed (their "
                     "state depends on it); resuming the default generator from the checkpoint."], dp2[0].stdout
    assert RESEED not in dp2[1].stdout


def _axes(**changes) -> dict:
    layout = {"tp": 2, "cp": 2, "pp": 2, "dp": 2, "zero": 1, "virtual_stages": 1}
    sp = changes.pop("sequence_parallel", False)
    return R.rng_axes({**layout, **changes}, sp)


def test_each_kind_is_reseeded_exactly_when_an_axis_it_depends_on_changed():
    held = R.held_kinds(["cpu", "dropout/embedding.shared", "dropout/layer0.shared", "dropout/layer0.tp"])
    assert held == [R.DEFAULT, R.SHARED, R.PER_TP_RANK]
    expected = {"cp": [], "tp": [R.PER_TP_RANK], "dp": [R.SHARED, R.PER_TP_RANK],
                "virtual_stages": [R.SHARED, R.PER_TP_RANK], "pp": [R.DEFAULT, R.SHARED, R.PER_TP_RANK],
                "sequence_parallel": [R.SHARED, R.PER_TP_RANK]}
    for axis, kinds in expected.items():
        value = True if axis == "sequence_parallel" else 4
        changed = R.changed_axes(_axes(), _axes(**{axis: value}))
        assert list(changed) == [axis] and R.reseeded(held, changed) == kinds, axis
    assert R.reseeded(R.held_kinds(["cpu"]), R.changed_axes(_axes(), _axes(tp=4))) == []  # no per-TP streams held
    # --sequence-parallel at tp 1 changes nothing; an older checkpoint without "cp" was cp 1
    assert R.changed_axes(_axes(tp=1), _axes(tp=1, sequence_parallel=True)) == {}
    assert R.rng_axes({"tp": 1, "pp": 1, "dp": 1, "virtual_stages": 1}, False)["cp"] == 1


def test_source_rank_keeps_unchanged_coordinates_and_takes_the_first_along_changed_ones():
    saved = _axes()  # tp 2, cp 2, pp 2, dp 2
    now = Layout(tp=2, cp=1, dp=2, pp=2)
    before = Layout(tp=2, cp=2, dp=2, pp=2)
    for rank in range(now.world_size):
        c = now.coords(rank)
        assert R.source_rank(saved, now, rank) == before.rank(tp=c.tp, cp=0, dp=c.dp, pp=c.pp)
    same = Layout(tp=2, cp=2, dp=2, pp=2)
    assert [R.source_rank(saved, same, r) for r in range(16)] == list(range(16))
