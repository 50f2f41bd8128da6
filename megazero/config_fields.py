"""Config field metadata: CLI names, help, choices and the numeric range each setting must lie in.

``opt`` declares a field once (its flag, help text and bounds); ``check_bounds`` is the first
thing every config section's ``__post_init__`` runs, so a value out of range is refused where it
is parsed, with one line naming the flag, the range and the value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the flag and the fix."""


@dataclass(frozen=True)
class Bounds:
    """The range a numeric setting must lie in (None = unbounded on that side); NaN and inf never do."""

    low: float | None = None
    low_open: bool = False
    high: float | None = None
    high_open: bool = False

    def holds(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{self.low:g}, {self.high:g}{right}"


def opt(default: Any, help: str, *aliases: str, choices: tuple | None = None, at_least: float | None = None,
        above: float | None = None, below: float | None = None, at_most: float | None = None) -> Any:
    """A dataclass field with CLI metadata; the first flag is derived from the name.

    ``at_least``/``above`` and ``below``/``at_most`` bound a numeric value (None passes); every
    section checks its bounds first (``check_bounds``), so a flag is range-checked where it is parsed.
    """
    bounds = None
    if at_least is not None or above is not None:
        bounds = Bounds(low=above if above is not None else at_least, low_open=above is not None,
                        high=below if below is not None else at_most, high_open=below is not None)
    return field(default=default, metadata={"help": help, "aliases": aliases, "choices": choices, "bounds": bounds})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_bounds(section: Any) -> None:
    """Every bounded field of ``section`` in its range: one line naming the flag, the range and the value."""
    for f in fields(section):
        bounds, value = f.metadata.get("bounds"), getattr(section, f.name)
        if bounds is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        names = "/".join((flag(f.name), *f.metadata.get("aliases", ())))
        require(bounds.holds(value), f"{names} must be {bounds}, got {value}; pass a value in that range.")
