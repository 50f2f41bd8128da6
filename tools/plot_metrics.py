"""Plot one or more metrics files (``--metrics-file``) into one PNG, runs overlaid.

    .venv/bin/python tools/plot_metrics.py runs/tiny/metrics.jsonl --output runs/tiny/metrics.png
    .venv/bin/python tools/plot_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl --x tokens --output ab.png

Panels: training loss, validation loss, learning rate, grad norm and throughput (tokens/s), and the
MoE balance (the worst layer's imbalance) when a run logged it, against the iteration or the tokens
trained on (iteration x global batch x sequence length). A run is labelled by its file's folder
unless --labels names it. A non-finite value (null in the file) is a gap in its line; a field a run
never logged leaves that run out of its panel.

A file that several runs appended to (a fresh run into an earlier run's --metrics-file) holds one
"run_start" record per start: each run is its own curve, the file's latest run only unless
--all-runs (each labelled with its run id). A resume (--load) continues its checkpoint's run id, so
it stays one curve; an iteration it logs again is drawn once, as logged last.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Any, NamedTuple

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megazero.optional import require  # noqa: E402

try:
    import matplotlib
    from matplotlib.figure import Figure  # a bare Figure draws with Agg: no pyplot state, no display needed
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter
except ImportError:  # the plot extra is not installed: main() says how to install it
    matplotlib = None

PANELS = (  # (title, which records, field, y label, y scale)
    ("training loss", "train", "loss", "lm loss", "linear"),
    ("validation loss", "eval", "val_loss", "lm loss", "linear"),
    ("learning rate", "train", "lr", "learning rate", "linear"),
    ("grad norm", "train", "grad_norm", "global grad norm", "log"),  # early spikes dwarf the rest otherwise
    ("throughput", "train", "tokens_per_sec", "tokens/s", "linear"),
)
MOE_PANEL = ("MoE balance", "train", "moe_imbalance", "max/mean - 1 tokens per expert, worst layer", "linear")


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


def split_runs(records: list[dict[str, Any]]) -> tuple[dict[str | None, list[dict[str, Any]]], str | None]:
    """The records of each run (by run id, in the order the runs first started) and the id of the run that
    started last. A "run_start" record begins a run, or continues one with the same id (a resume); records
    before the first (a file written before run ids) form a run of their own, id None."""
    runs: dict[str | None, list[dict[str, Any]]] = {}
    current = None
    for record in records:
        if record.get("event") == "run_start":
            current = record.get("run_id")
            runs.setdefault(current, [])
        else:
            runs.setdefault(current, []).append(record)
    return runs, current


def _run(records: list[dict[str, Any]], label: str) -> Run:
    with_step = [r for r in records if isinstance(r.get("iteration"), int)]
    train = _by_iteration([r for r in with_step if "event" not in r])
    evals = _by_iteration([r for r in with_step if r.get("event") == "eval"])
    return Run(label, train, evals, _tokens_per_step(train))


def load_runs(path: str, label: str, all_runs: bool = False) -> tuple[list[Run], int]:
    """The file's latest run (every run with ``all_runs``, each labelled ``<label> <run id>``), and how many
    runs that logged an iteration were left out."""
    records = read_records(path)
    if not records:
        raise PlotError(f"{path} is empty; plot the --metrics-file of a run that logged an iteration.")
    by_id, latest = split_runs(records)
    runs = {run_id: _run(rs, label if len(by_id) == 1 else f"{label} {run_id or '(no run id)'}")
            for run_id, rs in by_id.items()}
    logged = {run_id: run for run_id, run in runs.items() if run.train or run.evals}
    if not logged:
        raise PlotError(f"{path} has no iteration records; plot the --metrics-file of a run that logged one.")
    if all_runs:
        return list(logged.values()), 0
    if latest not in logged:
        raise PlotError(f"{path}: its latest run ({latest}) logged no iteration yet; pass --all-runs to draw "
                        f"the {len(logged)} earlier run(s).")
    return [runs[latest]._replace(label=label)], len(logged) - 1


def load_run(path: str, label: str) -> Run:
    """The file's latest run."""
    return load_runs(path, label)[0][0]


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
    """The figure: one panel per PANELS entry (in that order), then the MoE balance panel when a run logged
    ``moe_imbalance``, then the legend."""
    if x == "tokens":
        for run in runs:
            if run.tokens_per_step is None:
                raise PlotError(f"run {run.label!r} logged no tokens_per_sec and step_time_ms to count tokens by; "
                                "use --x iteration.")
    cycle = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = [cycle[i % len(cycle)] for i in range(len(runs))]
    moe = any(math.isfinite(number(r.get(MOE_PANEL[2]))) for run in runs for r in run.train)
    panels = (*PANELS, MOE_PANEL) if moe else PANELS
    rows = len(panels) // 2 + 1  # two panels a row, and the legend
    fig = Figure(figsize=(11, 10 * rows / 3), layout="constrained")
    axes = list(fig.subplots(rows, 2).flat)
    for ax, panel in zip(axes, panels):
        _draw_panel(ax, panel, runs, colors, x)
    legend_ax = axes[len(panels)]
    legend_ax.axis("off")
    for spare in axes[len(panels) + 1:]:
        fig.delaxes(spare)
    legend_ax.legend([Line2D([], [], color=c) for c in colors], [r.label for r in runs], loc="center", title="runs")
    return fig


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="plot_metrics.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", metavar="METRICS.jsonl", help="metrics files (--metrics-file)")
    parser.add_argument("--output", required=True, help="the PNG to write (its folder is created)")
    parser.add_argument("--x", choices=("iteration", "tokens"), default="iteration", help="the horizontal axis")
    parser.add_argument("--labels", nargs="+", help="one legend label per metrics file (default: its folder name)")
    parser.add_argument("--all-runs", action="store_true",
                        help="draw every run a file holds (each run_start record begins one), each labelled with "
                             "its run id; default: each file's latest run")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        require("matplotlib", "tools/plot_metrics.py")
    except ValueError as err:
        print(f"plot_metrics.py: error: {err}", file=sys.stderr)
        return 2
    labels = args.labels or [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in args.metrics]
    try:
        if len(labels) != len(args.metrics):
            raise PlotError(f"--labels gives {len(labels)} labels for {len(args.metrics)} metrics files; "
                            "give one per file.")
        loaded = [load_runs(p, label, args.all_runs) for p, label in zip(args.metrics, labels)]
        runs, hidden = [run for file_runs, _ in loaded for run in file_runs], sum(left for _, left in loaded)
        fig = plot_runs(runs, args.x)
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
    print(f"wrote {args.output} ({len(runs)} run(s) against {args.x})"
          + (f"; {hidden} earlier run(s) in the same file(s) left out (--all-runs draws them)" if hidden else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
