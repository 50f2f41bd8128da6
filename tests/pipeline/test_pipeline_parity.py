"""Pipeline-parallel training equals the serial run: losses per iteration and final weights.

One spawn per world: pp = 2 (2 ranks), pp = 4 (4 ranks), and tp=2 x pp=2 plus pp=2 x dp=2
(4 ranks, the second layout built inside the same world). Each trains every schedule and
both architectures for 5 iterations through the real Trainer; the parent compares each
rank's logged losses (broadcast from the last stage) and the weights it holds with the
same run in one process. The tied embedding's copy on the last stage is compared too, so
a missing embedding-group sum shows up. Runs also cover m == p (interleaved all warm-up),
m < p (1F1B warm-up clipped) and the --num-layers-per-virtual-pipeline-stage flag.
"""
from __future__ import annotations

import glob
import json


from megazero.pipeline.timeline import bubble_of_step
from tests.helpers.dist import spawn
from tests.helpers.pipeline_harness import ITERS, Run, make_cfg, parity_errors, run_many, serial_reference

TOL = 1e-5
SCHEDULES = ("gpipe", "1f1b", "interleaved")


def schedule_runs(pp: int, layers: int, gbs: int) -> list[Run]:
    return [Run(f"{arch}.{s}", make_cfg(arch, pp=pp, schedule=s, vp=2 if s == "interleaved" else None,
                                        layers=layers, gbs=gbs))
            for arch in ("gpt2", "llama") for s in SCHEDULES]


def check_parity(results: list[dict[str, dict]], runs: list[Run]) -> None:
    bad = []
    for run in runs:
        ref = serial_reference(run.cfg)
        for rank, per_rank in enumerate(results):
            errs = parity_errors(per_rank[run.key], ref)
            worst = {k: v for k, v in errs.items() if not v <= TOL}
            if worst:
                bad.append(f"{run.key} rank {rank}: {dict(sorted(worst.items(), key=lambda kv: -kv[1])[:4])}")
    assert not bad, "pipeline run differs from serial:\n" + "\n".join(bad)


def test_pp2_all_schedules_match_serial():
    runs = schedule_runs(pp=2, layers=4, gbs=8) + [  # m = 4
        Run("gpt2.interleaved.m=pp", make_cfg("gpt2", pp=2, vp=2, gbs=4))]  # m == p: all warm-up
    results = spawn(run_many, 2, runs, pp=2)
    check_parity(results, runs)


def test_pp4_all_schedules_match_serial_and_count_in_flight(tmp_path):
    trace = str(tmp_path / "trace.json")
    runs = schedule_runs(pp=4, layers=8, gbs=16) + [  # m = 8
        Run("gpt2.1f1b.m<pp", make_cfg("gpt2", pp=4, layers=4, gbs=4)),  # m = 2 < p
        Run("llama.interleaved.per-vstage.m=pp", make_cfg("llama", pp=4, per_vstage=1, layers=8, gbs=8)),
        Run("llama.1f1b.timeline", make_cfg("llama", pp=4, layers=4, gbs=16, timeline=trace))]
    results = spawn(run_many, 4, runs, pp=4)
    check_parity(results, runs)
    # The schedules' own counts of micro-batches whose activations are alive (stage r = rank r here).
    for rank, per_rank in enumerate(results):
        assert per_rank["gpt2.gpipe"]["max_in_flight"] == 8, (rank, per_rank["gpt2.gpipe"]["max_in_flight"])
        assert per_rank["gpt2.1f1b"]["max_in_flight"] == 4 - rank, (rank, per_rank["gpt2.1f1b"]["max_in_flight"])
        assert per_rank["gpt2.1f1b.m<pp"]["max_in_flight"] == min(2, 4 - rank)
    assert results[0]["llama.1f1b"]["max_in_flight"] <= 4 < results[0]["llama.gpipe"]["max_in_flight"]
    check_timeline(trace, [r["llama.1f1b.timeline"] for r in results], m=8)


def check_timeline(trace: str, results: list[dict], m: int) -> None:
    """--timeline wrote one Chrome trace per rank with every F and B, and a bubble was measured."""
    files = sorted(glob.glob(trace.replace(".json", ".rank*.json")))
    assert len(files) == 4, files
    per_step: dict[int, list[list[tuple[float, float]]]] = {}
    for path in files:
        events = [e for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"]
        assert len(events) == 2 * m * ITERS, (path, len(events))
        assert {e["name"] for e in events} == {f"{k}{i}" for k in "FB" for i in range(m)}
        spans: dict[int, list[tuple[float, float]]] = {}
        for e in events:
            spans.setdefault(e["args"]["step"], []).append((e["ts"], e["ts"] + e["dur"]))
        for step, s in spans.items():
            per_step.setdefault(step, []).append(s)
    ratio, fraction = bubble_of_step(per_step[ITERS - 1])
    assert ratio > 0 and 0 < fraction < 1, (ratio, fraction)
    for r in results:
        assert all(0 <= b < 1 for b in r["bubble"]), r["bubble"]


def test_tp2_pp2_and_pp2_dp2_match_serial():
    runs = [
        Run("tp2pp2.gpt2.sp.1f1b", make_cfg("gpt2", tp=2, pp=2, sp=True)),
        Run("tp2pp2.llama.interleaved", make_cfg("llama", tp=2, pp=2, vp=2)),
        Run("tp2pp2.gpt2.sp.interleaved", make_cfg("gpt2", tp=2, pp=2, sp=True, vp=2)),
        Run("pp2dp2.gpt2.1f1b", make_cfg("gpt2", pp=2, gbs=16), layout=(1, 2, 2)),
        Run("pp2dp2.llama.gpipe", make_cfg("llama", pp=2, schedule="gpipe", gbs=16), layout=(1, 2, 2)),
        Run("pp2dp2.gpt2.interleaved", make_cfg("gpt2", pp=2, vp=2, gbs=16), layout=(1, 2, 2)),
    ]
    results = spawn(run_many, 4, runs, tp=2, pp=2)
    check_parity(results, runs)
