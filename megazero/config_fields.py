"""Config field metadata: CLI names, help, choices, numeric range and when a setting applies.

``opt`` declares a field once (its flag, help text, choices, bounds and the run it applies to);
``check_fields`` is the first thing every config section's ``__post_init__`` runs, so a value of
the wrong type, outside its choices or out of range is refused where it is parsed (from a flag, a
YAML preset or a Python caller), with one line naming the flag. ``check_applicable`` refuses a
setting that was given but cannot apply to the run (``Config.from_flat`` runs it over all sections).
"""
from __future__ import annotations

import functools
import math
import numbers
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Callable, NoReturn


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


@dataclass(frozen=True)
class Needs:
    """When a setting applies: ``test`` over the values of the settings ``on`` (flat field names) holds.

    ``phrase`` completes "only applies with ..." and "pass ..." (e.g. "--zero 3").
    """

    phrase: str
    on: tuple[str, ...]
    test: Callable[..., bool]


def when(name: str, *values: Any) -> Needs:
    """Applies only while setting ``name`` has one of ``values`` (True for a switch such as --compile)."""
    shown = flag(name) if values == (True,) else f"{flag(name)} {either(values)}"
    return Needs(shown, (name,), lambda value: value in values)


def opt(default: Any, help: str, *aliases: str, choices: tuple | None = None, at_least: float | None = None,
        above: float | None = None, below: float | None = None, at_most: float | None = None,
        applies: Needs | None = None) -> Any:
    """A dataclass field with CLI metadata; the first flag is derived from the name.

    ``at_least``/``above`` and ``below``/``at_most`` bound a numeric value (None passes); ``choices``
    lists the values allowed; ``applies`` says which runs the setting means something in (a setting
    given for any other run is refused rather than silently ignored).
    """
    bounds = None
    if at_least is not None or above is not None:
        bounds = Bounds(low=above if above is not None else at_least, low_open=above is not None,
                        high=below if below is not None else at_most, high_open=below is not None)
    return field(default=default, metadata={"help": help, "aliases": aliases, "choices": choices, "bounds": bounds,
                                            "applies": applies})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def switch_flag(name: str, on: bool) -> str:
    """A switch as it is typed: '--async-save', '--no-reshard-after-forward'."""
    return flag(name if on else "no_" + name)


def either(values: tuple) -> str:
    """'a, b or c' (a lone value as itself)."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def flag_names(f: Any) -> str:
    """The field's flag and its aliases, as a message names them ("--tensor-model-parallel-size/--tp")."""
    return "/".join((flag(f.name), *f.metadata.get("aliases", ())))


def field_kind(annotation: Any) -> tuple[type, bool, bool]:
    """(element type, is_list, optional) of an annotation such as ``int | None`` or ``list[str] | None``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kind, is_list, _ = field_kind(args[0])
        return kind, is_list, True
    if typing.get_origin(annotation) in (list, tuple):  # tuple[float, float, float]: a fixed count of numbers
        return typing.get_args(annotation)[0], True, False
    return annotation, False, False


@functools.cache
def _kinds(klass: type) -> dict[str, tuple[type, bool, bool]]:
    hints = typing.get_type_hints(klass)
    return {f.name: field_kind(hints[f.name]) for f in fields(klass)}


def check_fields(section: Any) -> None:
    """Every field of ``section`` as its declared type, within its choices and bounds (in that order)."""
    for f in fields(section):
        kind, is_list, optional = _kinds(type(section))[f.name]
        value = getattr(section, f.name)
        if value is not None or not optional:
            value = _typed(value, kind, is_list, flag_names(f))
            object.__setattr__(section, f.name, value)  # frozen sections: the one place a value is normalised
        choices, bounds = f.metadata.get("choices"), f.metadata.get("bounds")
        if choices is not None and value is not None and value not in choices:
            raise ConfigError(f"{flag_names(f)} must be {either(choices)}, got {value!r}; pass one of those.")
        if bounds is not None and isinstance(value, (int, float)):
            require(bounds.holds(value),
                    f"{flag_names(f)} must be {bounds}, got {value}; pass a value in that range.")


_KIND_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _typed(value: Any, kind: type, is_list: bool, names: str) -> Any:
    """``value`` as ``kind`` (or a list of it) where that is unambiguous; ConfigError otherwise."""
    if is_list and kind is not str:
        return _numbers(value, kind, names)
    if is_list:
        items = value.split() if isinstance(value, str) else value  # YAML 'W1 P1 W2 P2', as the flag takes it
        items = [items] if isinstance(items, numbers.Real) and not isinstance(items, bool) else items  # YAML `2`
        if isinstance(items, (list, tuple)) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                                    for v in items):
            return [str(v) for v in items]  # a blend weight written as a YAML number stays the text it was
        return _refuse(value, "a list of strings (or one string)", names)
    converted = _scalar(value, kind)
    return _refuse(value, _KIND_WORDS[kind], names) if converted is None else converted


def _numbers(value: Any, kind: type, names: str) -> tuple:
    """A list of numbers (YAML ``[3.4, -4.7, 2.0]`` or ``'3.4 -4.7 2.0'``, as the flag takes it) as a tuple of
    ``kind``: a tuple, so that it is hashable and equals a tuple default."""
    items = value.split() if isinstance(value, str) else value
    numbers_ = [_scalar(v, kind) for v in items] if isinstance(items, (list, tuple)) else [None]
    if any(n is None for n in numbers_):
        _refuse(value, f"a list of {_KIND_WORDS[kind].split()[-1]}s", names)
    return tuple(numbers_)


def _scalar(value: Any, kind: type) -> Any:
    """``value`` as ``kind``, or None when it is not one: a bool is never a number and a number never a bool,
    a numeric string (YAML 1.1 reads ``3e-4`` as one) is its number, an integral float is an int."""
    if kind is bool or kind is str:
        return value if isinstance(value, kind) else None
    if isinstance(value, str):
        value = _number(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's numbers are Real too
        return None
    if kind is float:
        return float(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    return int(value) if float(value).is_integer() else None


def _number(text: str) -> int | float | None:
    """The number a string spells (an int when it is written as one), or None."""
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return None


def _refuse(value: Any, expected: str, names: str) -> NoReturn:
    raise ConfigError(f"{names} must be {expected}, got {value!r} ({type(value).__name__}); write it as "
                      f"{expected} in the YAML preset or on the command line.")


def check_applicable(sections: list[Any], given: frozenset[str], pending: frozenset[str] = frozenset()) -> None:
    """Refuse the first setting in ``given`` (or off its default) that its ``applies`` says this run ignores.

    A setting whose ``applies`` reads a ``pending`` one (not known yet: a --load checkpoint supplies it) waits.
    """
    values = {f.name: getattr(s, f.name) for s in sections for f in fields(s)}
    shortest = {f.name: min((flag(f.name), *f.metadata.get("aliases", ())), key=len) for s in sections
                for f in fields(s)}  # "--cp 1" reads better than "--context-parallel-size 1"
    for section in sections:
        for f in fields(section):
            needs, value = f.metadata.get("applies"), values[f.name]
            if needs is None or (f.name not in given and value == f.default) or pending & set(needs.on):
                continue
            if not needs.test(*(values[name] for name in needs.on)):
                shown = f"{flag(f.name)} {_spelled(value)}"
                if isinstance(value, bool):  # a switch as it was typed: --async-save, --no-reshard-after-forward
                    shown = switch_flag(f.name, value)
                here = ", ".join(_setting(shortest[name], values[name]) for name in needs.on)
                raise ConfigError(f"{shown} only applies with {needs.phrase} (here {here}); drop it or pass "
                                  f"{needs.phrase}.")


def _setting(names: str, value: Any) -> str:
    """How a setting reads in a message: '--zero 1', '--compile', 'no --save'."""
    if value is None or value is False:
        return f"no {names}"
    return names if value is True else f"{names} {_spelled(value)}"


def _spelled(value: Any) -> str:
    """A value as it is typed after its flag: a tuple of numbers as '3.4445 -4.775 2.0315'."""
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)
