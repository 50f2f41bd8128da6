"""--tensorboard-dir writes the metrics file's numbers; tools/plot_metrics.py draws runs' metrics files.

Two short single-process runs (started together) serve every check: run "a" writes TensorBoard event
files and evaluates; run "b" is shorter and never evaluates, so the plot overlays runs of different
lengths and fields.
"""
from __future__ import annotations

import io
import json
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from megazero.training.metrics import MetricsLog
from tests.helpers.launch import launch
from tests.helpers.tool_module import load_tool

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

SMALL = ["--config", "configs/tiny.yaml", "--num-layers", "2", "--hidden-size", "64", "--seq-length", "32",
         "--log-interval", "1"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    jobs = {"a": [*SMALL, "--train-iters", "4", "--eval-interval", "2", "--tensorboard-dir", str(root / "a" / "tb")],
            "b": [*SMALL, "--train-iters", "3", "--lr", "5e-4"]}
    with ThreadPoolExecutor(2) as pool:
        results = pool.map(lambda name: launch("pretrain_gpt.py",
                                               [*jobs[name], "--metrics-file", str(root / name / "metrics.jsonl")],
                                               1)[0], jobs)
        for name, result in zip(jobs, results):
            assert result.returncode == 0, f"run {name} failed:\n{result.stderr[-3000:]}"
    return root


def _logged(path) -> list[dict]:
    """The metrics file's iteration and evaluation records (start-up memory records have no iteration)."""
    return [r for r in map(json.loads, open(path).read().splitlines()) if "iteration" in r]


def _scalars(tb_dir) -> dict[str, dict[int, float]]:
    acc = event_accumulator.EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_every_number_of_the_metrics_file(runs):
    records = _logged(runs / "a" / "metrics.jsonl")
    expected: dict[str, dict[int, float]] = {}
    for r in records:
        for key, value in r.items():
            if key != "iteration" and isinstance(value, (int, float)):  # booleans as 0/1; null is no number
                expected.setdefault(key, {})[r["iteration"]] = float(np.float32(value))  # TensorBoard keeps float32
    grouped = _scalars(runs / "a" / "tb")  # tags are <group>/<field> (test_run_starts.py checks the groups)
    scalars = {tag.split("/", 1)[1]: values for tag, values in grouped.items()}
    assert {"loss", "lr", "grad_norm", "tokens_per_sec", "peak_memory_bytes", "val_loss", "val_ppl"} <= set(expected)
    assert scalars == expected and len(grouped) == len(scalars)
    assert sorted(scalars["loss"]) == [1, 2, 3, 4] and sorted(scalars["val_loss"]) == [2, 4]


def test_nested_and_non_finite_fields_reach_tensorboard(tmp_path):
    """A nested field is tagged group/outer/inner, a NaN loss stays NaN, None and step-less records write nothing."""
    log = MetricsLog(str(tmp_path / "m.jsonl"), True, io.StringIO(), tensorboard_dir=str(tmp_path / "tb"))
    log.record({"event": "memory", "rank": 0, "params_bytes": 10})
    log.record({"iteration": 7, "loss": float("nan"), "mfu": None, "skipped": True,
                "comm_bytes": {"tp": {"all_reduce": 4096}}, "comm_wait_s": {"tp": 0.5}})
    log.close()
    scalars = _scalars(tmp_path / "tb")
    assert set(scalars) == {"train/loss", "train/skipped", "comm/comm_bytes/tp/all_reduce", "comm/comm_wait_s/tp"}
    assert math.isnan(scalars["train/loss"][7]) and scalars["train/skipped"] == {7: 1.0}
    assert scalars["comm/comm_bytes/tp/all_reduce"] == {7: 4096.0}


def test_plot_overlays_two_runs(runs, tmp_path, capsys):
    tool = load_tool("plot_metrics")
    out = tmp_path / "plots" / "ab.png"
    paths = [str(runs / name / "metrics.jsonl") for name in ("a", "b")]
    assert tool.main([*paths, "--output", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000
    assert "wrote" in capsys.readouterr().out

    fig = tool.plot_runs([tool.load_run(p, name) for p, name in zip(paths, "ab")])
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    lines = {title: len(ax.get_lines()) for title, ax in panels.items()}
    assert lines == {"training loss": 2, "validation loss": 1, "learning rate": 2, "grad norm": 2, "throughput": 2}
    loss_a, loss_b = panels["training loss"].get_lines()
    a = [r for r in _logged(paths[0]) if "event" not in r]
    assert list(loss_a.get_xdata()) == [1, 2, 3, 4] and list(loss_b.get_xdata()) == [1, 2, 3]
    assert list(loss_a.get_ydata()) == [r["loss"] for r in a]
    legend = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert legend == ["a", "b"]

    by_tokens = tool.plot_runs([tool.load_run(paths[0], "a")], x="tokens")
    tokens_per_step = 16 * 32  # tiny.yaml's global batch x --seq-length 32
    loss_line = next(ax for ax in by_tokens.axes if ax.get_title() == "training loss").get_lines()[0]
    assert list(loss_line.get_xdata()) == [i * tokens_per_step for i in (1, 2, 3, 4)]


def test_plot_survives_gaps_missing_fields_and_resumes(tmp_path):
    """A null loss is a gap, a field never logged leaves the panel empty, a re-logged iteration counts once."""
    tool = load_tool("plot_metrics")
    path = tmp_path / "resumed" / "metrics.jsonl"
    path.parent.mkdir()
    rows = [{"event": "memory", "rank": 0}, {"iteration": 1, "loss": 9.0, "lr": 1e-4},
            {"iteration": 2, "loss": None, "loss_nonfinite": "nan", "lr": 2e-4},
            {"iteration": 2, "loss": 8.5, "lr": 2e-4}, {"iteration": 3, "loss": None, "lr": 3e-4}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    fig = tool.plot_runs([tool.load_run(str(path), "resumed")])
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    (loss,) = panels["training loss"].get_lines()
    assert list(loss.get_xdata()) == [1, 2, 3]
    assert list(loss.get_ydata())[:2] == [9.0, 8.5] and math.isnan(loss.get_ydata()[2])
    assert panels["grad norm"].get_lines() == [] and panels["validation loss"].get_lines() == []
    assert "no run logged grad_norm" in [t.get_text() for t in panels["grad norm"].texts]


@pytest.mark.parametrize("content, words", [(None, "no such file"), ("", "is empty"),
                                            ("{not json\n", "line 1 is not JSON")])
def test_plot_refuses_a_bad_file_in_one_line(tmp_path, capsys, content, words):
    tool = load_tool("plot_metrics")
    path = tmp_path / "metrics.jsonl"
    if content is not None:
        path.write_text(content)
    assert tool.main([str(path), "--output", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and words in err, err
    assert not (tmp_path / "p.png").exists()


def test_tensorboard_dir_is_probed_at_start_up(tmp_path):
    from megazero.config import Config
    from megazero.training.preflight import check_output_paths

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="--tensorboard-dir") as err:
        check_output_paths(Config.from_flat({"tensorboard_dir": str(blocker / "tb")}))
    assert "Not a directory" in str(err.value) and "\n" not in str(err.value)
