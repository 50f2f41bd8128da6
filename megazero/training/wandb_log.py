"""Weights & Biases logging from one rank (rank 0 of the last pipeline stage), offline-safe.

Mode ``offline`` is the default unless an API key is configured, so a run on
a machine with no network still records its history under ``wandb/``.
"""
from __future__ import annotations

import netrc
import os
from typing import Any


def has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def resolve_mode(mode: str | None) -> str:
    if mode:
        return mode
    return "online" if has_api_key() else "offline"


class NullWandb:
    """The wandb run of a rank that logs none (no --wandb-project, --wandb-mode disabled, or not the logging
    rank): every call does nothing, so the trainer logs the same way with or without wandb."""

    def log(self, record: dict[str, Any], step: int) -> None:
        """Nothing is logged."""

    def finish(self) -> None:
        """Nothing to close."""

    def describe(self) -> str:
        return "megazero: wandb: disabled (--wandb-mode disabled); nothing is logged to it"

    def where(self) -> str:
        """Nothing is written ('': the end-of-run outputs line leaves wandb out)."""
        return ""


class WandbRun:
    """A live wandb run: logs a record's numbers at its iteration."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, record: dict[str, Any], step: int) -> None:
        self.run.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)

    def finish(self) -> None:
        """Finish the run and wait for wandb's service to write it: pretrain_gpt.py leaves with ``os._exit``,
        which skips the atexit hook where wandb would otherwise wait, and a run left to that race kept only
        its file's header (seen under load, 2026-12-04)."""
        import wandb

        self.run.finish()
        wandb.teardown()

    def describe(self) -> str:
        """Where the run is written and, offline, how to upload it."""
        folder = self._folder()
        if self.run.settings.mode == "offline":
            return f"megazero: wandb: offline run in {folder}; upload it with: .venv/bin/wandb sync {folder}"
        return f"megazero: wandb: run {self.run.url}, local files in {folder}"

    def where(self) -> str:
        """The wandb part of the end-of-run outputs line."""
        folder = self._folder()
        if self.run.settings.mode == "offline":
            return f"wandb offline run {folder} (upload: .venv/bin/wandb sync {folder})"
        return f"wandb run {self.run.url} (local files {folder})"

    def _folder(self) -> str:
        return os.path.dirname(self.run.dir)  # run.dir is the run's files/ folder


def open_wandb(*, enabled: bool, project: str, name: str | None, mode: str | None, config: dict[str, Any],
               directory: str | None = None) -> WandbRun | NullWandb:
    """A wandb run on the rank that logs (``enabled``) unless --wandb-mode is disabled; else a ``NullWandb``."""
    mode = resolve_mode(mode)
    if not enabled or mode == "disabled":
        return NullWandb()
    import wandb  # imported lazily: start-up cost only for runs that log

    return WandbRun(wandb.init(project=project, name=name, mode=mode, config=config, dir=directory,
                               settings=wandb.Settings(silent=True, console="off")))
