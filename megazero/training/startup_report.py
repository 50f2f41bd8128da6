"""What a run says before it trains: its resolved configuration, its data, and where its state goes.

The configuration is the one the run uses (a checkpoint's model settings, the tokenizer's vocabulary
and ``--recompute auto``'s choice filled in), printed one section a line and written as
``config.yaml`` beside the checkpoints and the metrics file, where ``--config`` loads it back into
the same ``Config``. Settings that cannot apply to this run (``--initial-loss-scale`` without
``--fp16``) are left out of the file, since ``--config`` refuses them.
"""
from __future__ import annotations

import os
import time
from dataclasses import fields
from typing import Any, Callable

import yaml

from ..checkpoint.save import folder_bytes, format_bytes
from ..config import SECTIONS, Config, Placement
from ..data import DataBundle
from ..parallel.state import ParallelState
from ..run_plan import RunPlan

CONFIG_FILE = "config.yaml"
HEADER = "# megazero: the resolved configuration of a run; load it with pretrain_gpt.py --config <this file>\n"


def _applies(f: Any, values: dict[str, Any]) -> bool:
    needs = f.metadata.get("applies")
    return needs is None or bool(needs.test(*(values[name] for name in needs.on)))


def config_sections(cfg: Config) -> dict[str, dict[str, Any]]:
    """Every setting that applies to this run, by section, as YAML presets spell them."""
    values = cfg.to_flat()
    return {section: {f.name: values[f.name] for f in fields(klass) if _applies(f, values)}
            for section, klass in SECTIONS.items()}


def config_lines(cfg: Config) -> list[str]:
    """One line per section: ``megazero: config model: arch=gpt2 num_layers=4 ...``."""
    return [f"megazero: config {section}: " + " ".join(f"{k}={v}" for k, v in settings.items())
            for section, settings in config_sections(cfg).items()]


def write_config(cfg: Config, folder: str) -> str | None:
    """``folder/config.yaml``, replaced atomically; None (nothing written) when a file of that name that
    megazero did not write is there, since it is the user's."""
    path = os.path.join(folder, CONFIG_FILE)
    if os.path.exists(path):
        with open(path) as fh:
            if fh.readline() != HEADER:
                return None
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(HEADER)
        yaml.safe_dump(config_sections(cfg), fh, sort_keys=False)
    os.replace(tmp, path)
    return path


def _config_folders(cfg: Config, pstate: ParallelState) -> list[str]:
    """Where this rank writes config.yaml: --save (rank 0, its owner) and the metrics file's folder (the rank
    that writes the metrics file), unless that is the --save folder."""
    save, folders = cfg.checkpoint.save, []
    if save and pstate.rank == 0:
        folders.append(save)
    metrics = os.path.dirname(cfg.logging.metrics_file or "") or "."
    if cfg.logging.metrics_file and pstate.is_logging_rank and not (
            save and os.path.realpath(metrics) == os.path.realpath(save)):
        folders.append(metrics)
    return folders


def data_lines(cfg: Config, data: DataBundle) -> list[str]:
    """Per dataset: its documents and tokens, its blend weight, and what this run reads of its training and
    validation splits (training never reads the test split)."""
    by_prefix: dict[str, list] = {}
    for share in data.shares:
        if share.split != "test":
            by_prefix.setdefault(share.prefix, []).append(share)
    lines = []
    for prefix, shares in by_prefix.items():
        first = shares[0]
        name = f"the default corpus {prefix}" if cfg.data.data_path is None else prefix
        splits = "; ".join(f"{s.split} {s.documents} documents, {s.tokens} tokens -> {s.samples} samples, "
                           f"{s.epochs} epoch{'s' if s.epochs > 1 else ''}" for s in shares)
        lines.append(f"megazero: data {name}: weight {first.weight:.3f}, {first.dataset_documents} documents, "
                     f"{first.dataset_tokens} tokens; {splits}")
    return lines


def offload_line(plan: RunPlan, world_size: int) -> str | None:
    """Where offloaded training state lives, or None when it all stays on the device."""
    placement = plan.placement
    kinds = [("optimizer state (fp32 master weights, Adam moments)", placement.optimizer_state),
             ("parameter shards", placement.parameters)]
    parts = []
    for what, where in kinds:
        if where is Placement.HOST:
            parts.append(f"{what} in host memory (pinned on CUDA)")
        elif where is Placement.DISK:
            last = f"rank{world_size - 1}" if world_size > 1 else ""
            folders = os.path.join(str(placement.offload_path), "rank0") + (f" .. {last}" if last else "")
            parts.append(f"{what} in per-rank files under {folders} (removed when the run ends)")
    return "megazero: offload: " + "; ".join(parts) if parts else None


def report_start(cfg: Config, plan: RunPlan, pstate: ParallelState, data: DataBundle,
                 say: Callable[[str], None]) -> None:
    """The start-up lines (rank 0) and config.yaml (see ``_config_folders``)."""
    for line in [*config_lines(cfg), *data_lines(cfg, data), offload_line(plan, pstate.layout.world_size)]:
        if line:
            say(line)
    for folder in _config_folders(cfg, pstate):
        written = write_config(cfg, folder)
        print(f"megazero: wrote {written}" if written else
              f"megazero: {os.path.join(folder, CONFIG_FILE)} is not megazero's; the resolved configuration was "
              f"not written there", flush=True)


def report_model(model: Any, say: Callable[[str], None]) -> None:
    """Rank 0's training model as ``print(model)`` shows it: the engine's settings, then each chunk with what the
    wrap applied to every block (recompute, compile, ZeRO 3 unit; ``training/parallelize.py``)."""
    say(f"megazero: the training model of rank 0: {model!r}")


class LoadTimer:
    """``with`` it around each part of reading a checkpoint (the weights, later the optimizer state and
    generators); ``line`` reports the folder, its size on disk and the seconds, in one line."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began = 0.0

    def __enter__(self) -> "LoadTimer":
        self._began = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds += time.perf_counter() - self._began

    def line(self, folder: str) -> str:
        return (f"megazero: loaded checkpoint {folder} ({format_bytes(folder_bytes(folder))} on disk) in "
                f"{self.seconds:.2f} s")
