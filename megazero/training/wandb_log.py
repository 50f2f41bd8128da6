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


class WandbLogger:
    """Thin wrapper: no-op unless enabled on this rank and mode is not 'disabled'."""

    def __init__(self, *, enabled: bool, project: str, name: str | None, mode: str | None,
                 config: dict[str, Any], directory: str | None = None) -> None:
        self.run = None
        mode = resolve_mode(mode)
        if not enabled or mode == "disabled":
            return
        import wandb  # imported lazily: start-up cost only for runs that log

        self.run = wandb.init(project=project, name=name, mode=mode, config=config, dir=directory,
                              settings=wandb.Settings(silent=True, console="off"))

    def log(self, record: dict[str, Any], step: int) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
