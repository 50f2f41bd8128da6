"""Plot one or more metrics files (``--metrics-file``) into one PNG, runs overlaid.

    .venv/bin/python tools/plot_metrics.py runs/tiny/metrics.jsonl --output runs/tiny/metrics.png
    .venv/bin/python tools/plot_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl --x tokens --output ab.png

Panels: training loss, validation loss, learning rate, grad norm and throughput (tokens/s), against
the iteration or the tokens trained on (iteration x global batch x sequence length). A run is
labelled by its file's folder unless --labels names it. A non-finite value (null in the file) is a
gap in its line; a field a run never logged leaves that run out of its panel; an iteration logged
twice (a resumed run appends to the same file) is drawn once, as logged last.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Any, NamedTuple

import matplotlib
from matplotlib.figure import Figure  # a bare Figure draws with Agg: no pyplot state, no display needed
from matplotlib.lines import Line2D
from matplotlib.ticker import EngFormatter

PANELS = (  # (title, which records, field, y label, y scale)
    ("training loss", "train", "loss", "lm loss", "linear"),
    ("validation loss", "eval", "val_loss", "lm loss", "linear"),
    ("learning rate", "train", "lr", "learning rate", "linear"),
    ("grad norm", "train", "grad_norm", "global grad norm", "log"),  # early spikes dwarf the rest otherwise
    ("throughput", "train", "tokens_per_sec", "tokens/s", "linear"),
)


class PlotError(ValueError):
    """A metrics file that cannot be plotted; the message names the file and what to do."""


class Run(NamedTuple):
    label: str
    train: list[dict[str, Any]]  # iteration records, one per iteration, in order
    evals: list[dict[str, Any]]  # "event": "eval" records, likewise
    tokens_per_step: int | None  # global batch x sequence length; None when the file cannot tell


def read_records(path: str) -> list[dict[str, Any]]:
    """Every JSON object in ``path``, one per line; blank lines skipped."""
    if not os.path.isfile(path):
        raise PlotError(f"{path}: no such file; pass the --metrics-file of a pretrain_gpt.py run.")
    records = []
    with open(path) as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise PlotError(f"{path} line {number} is not JSON ({err.msg}); is it a --metrics-file?") from None
            if isinstance(record, dict):
                records.append(record)
    return records


def _by_iteration(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per iteration, the last one logged (a resumed run re-logs the steps after its checkpoint)."""
    return sorted({r["iteration"]: r for r in records}.values(), key=lambda r: r["iteration"])


def number(value: Any) -> float:
    """``value`` as a float, NaN for null, a missing field or anything not a number (a gap in the line)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _tokens_per_step(train: list[dict[str, Any]]) -> int | None:
    """Global batch x sequence length: each record's throughput times its step time gives it back."""
    sizes = [number(r.get("tokens_per_sec")) * number(r.get("step_time_ms")) / 1000 for r in train]
    sizes = [s for s in sizes if math.isfinite(s)]
    return round(statistics.median(sizes)) if sizes else None


def load_run(path: str, label: str) -> Run:
    records = read_records(path)
    if not records:
        raise PlotError(f"{path} is empty; plot the --metrics-file of a run that logged an iteration.")
    with_step = [r for r in records if isinstance(r.get("iteration"), int)]
    train = _by_iteration([r for r in with_step if "event" not in r])
    evals = _by_iteration([r for r in with_step if r.get("event") == "eval"])
    if not train and not evals:
        raise PlotError(f"{path} has no iteration records; plot the --metrics-file of a run that logged one.")
    return Run(label, train, evals, _tokens_per_step(train))


def _draw_panel(ax: Any, panel: tuple[str, ...], runs: list[Run], colors: list[str], x: str) -> None:
    title, which, field, ylabel, yscale = panel
    ax.set(title=title, xlabel=x, ylabel=ylabel)
    ax.xaxis.set_major_formatter(EngFormatter())  # 200k tokens, not 200000 crowding its neighbours
    ax.grid(alpha=0.3)
    for run, color in zip(runs, colors):
        records = run.train if which == "train" else run.evals
        ys = [number(r.get(field)) for r in records]
        if not any(math.isfinite(y) for y in ys):
            continue  # this run never logged the field (no evaluation, say)
        scale = run.tokens_per_step if x == "tokens" else 1
        ax.plot([r["iteration"] * scale for r in records], ys, color=color, label=run.label,
                marker="o" if which == "eval" else None, markersize=3, linewidth=1.2)
    if ax.lines:
        ax.set_yscale(yscale)
    else:
        ax.text(0.5, 0.5, f"no run logged {field}", ha="center", va="center", transform=ax.transAxes)


def plot_runs(runs: list[Run], x: str = "iteration") -> Figure:
    """The figure: one panel per PANELS entry (in that order, first five axes), the legend in the sixth."""
    if x == "tokens":
        for run in runs:
            if run.tokens_per_step is None:
                raise PlotError(f"run {run.label!r} logged no tokens_per_sec and step_time_ms to count tokens by; "
                                "use --x iteration.")
    cycle = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = [cycle[i % len(cycle)] for i in range(len(runs))]
    fig = Figure(figsize=(11, 10), layout="constrained")
    axes = fig.subplots(3, 2).flat
    for ax, panel in zip(axes, PANELS):
        _draw_panel(ax, panel, runs, colors, x)
    legend_ax = axes[len(PANELS)]
    legend_ax.axis("off")
    legend_ax.legend([Line2D([], [], color=c) for c in colors], [r.label for r in runs], loc="center", title="runs")
    return fig


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="plot_metrics.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", metavar="METRICS.jsonl", help="metrics files (--metrics-file)")
    parser.add_argument("--output", required=True, help="the PNG to write (its folder is created)")
    parser.add_argument("--x", choices=("iteration", "tokens"), default="iteration", help="the horizontal axis")
    parser.add_argument("--labels", nargs="+", help="one legend label per metrics file (default: its folder name)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    labels = args.labels or [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in args.metrics]
    try:
        if len(labels) != len(args.metrics):
            raise PlotError(f"--labels gives {len(labels)} labels for {len(args.metrics)} metrics files; "
                            "give one per file.")
        fig = plot_runs([load_run(p, label) for p, label in zip(args.metrics, labels)], args.x)
    except PlotError as err:
        print(f"plot_metrics.py: error: {err}", file=sys.stderr)
        return 2
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        fig.savefig(args.output, dpi=80)
    except OSError as err:
        print(f"plot_metrics.py: error: --output {args.output}: {err.strerror or err}; choose a writable path.",
              file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({len(labels)} run(s) against {args.x})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
