"""Packages only some features need (pyproject.toml's extras) and the one line a run without them gets.

``make setup`` installs every extra (the test extra asks for ``all``); a bare ``pip install -e .`` trains,
converts and generates without them. A feature that needs one checks for it before it starts - a run before
its process groups, a tool before it reads anything - so a missing package is one line naming the flag or tool
and the install command, not a traceback after training.
"""
from __future__ import annotations

import importlib.util

EXTRA_OF = {"wandb": "wandb", "datasets": "data", "tensorboard": "tensorboard", "matplotlib": "plot"}


def require(package: str, needed_by: str) -> None:
    """Raise ValueError when ``package`` (a key of ``EXTRA_OF``) is not installed; ``needed_by`` names the flag or
    tool that needs it."""
    if importlib.util.find_spec(package) is None:  # also None when sys.modules holds None (an import blocked)
        raise ValueError(f"{needed_by} needs the {package} package, which is not installed; install it with "
                         f".venv/bin/pip install -e '.[{EXTRA_OF[package]}]' (make setup installs every extra).")
