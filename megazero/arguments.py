"""Command line + YAML -> ``Config``. Precedence: defaults < ``--config FILE.yaml`` < flags.

The parser is generated from the config dataclasses' field metadata, so a
new field is a new flag with no second list to keep in sync.
"""
from __future__ import annotations

import argparse
import os
import typing
from dataclasses import MISSING, fields
from typing import Any, Sequence

import yaml

from .config import SECTIONS, Config, ConfigError, ModelConfig, flag
from .config_fields import field_kind
from .moe_config import MoEFields


def _add_field(group: argparse._ArgumentGroup, f: Any, annotation: Any) -> None:
    kind, is_list, _ = field_kind(annotation)
    names = [flag(f.name), *f.metadata.get("aliases", ())]
    default = f.default if f.default is not MISSING else None
    helptext = f"{f.metadata['help']} (default: {default})".replace("%", "%%")  # argparse formats help with %
    if kind is bool:
        group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=helptext)
        return
    group.add_argument(*names, dest=f.name, type=kind, nargs=_nargs(annotation, is_list),
                       choices=f.metadata.get("choices"), default=argparse.SUPPRESS, help=helptext)


def _nargs(annotation: Any, is_list: bool) -> int | str | None:
    """How many values a flag takes: a ``tuple[float, float, float]`` field exactly three (argparse refuses
    another count in one line), a list one or more, a scalar one."""
    items = typing.get_args(annotation)
    if typing.get_origin(annotation) is tuple and Ellipsis not in items:
        return len(items)
    return "+" if is_list else None


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line naming the flag (argparse's own text says what is allowed)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}; see --help.\n")


def build_parser(prog: str = "pretrain_gpt.py", extra: Sequence[tuple[str, dict]] = (),
                 description: str = "Pretrain a GPT-style model with TP x CP x PP x DP.") -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog, description=description, allow_abbrev=False)
    parser.add_argument("--config", help="YAML preset; its keys are the flag names with underscores.")
    for name, kwargs in extra:
        parser.add_argument(name, **kwargs)
    moe_fields = {f.name for f in fields(MoEFields)}  # ModelConfig inherits them first: listed apart, after it
    for section, klass in SECTIONS.items():
        group = parser.add_argument_group(section)
        hints = typing.get_type_hints(klass)
        for f in fields(klass):
            if f.name not in moe_fields:
                _add_field(group, f, hints[f.name])
        if klass is ModelConfig:
            moe = parser.add_argument_group("mixture of experts (model)")
            for f in (f for f in fields(klass) if f.name in moe_fields):
                _add_field(moe, f, hints[f.name])
    return parser


def load_yaml(path: str) -> dict[str, Any]:
    """Flat mapping of settings from a preset; nested section mappings are flattened."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config file {path!r} does not exist; pass the path of a YAML preset "
                          f"such as configs/tiny.yaml.")
    with open(path) as fh:
        try:
            raw = yaml.safe_load(fh) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"--config file {path!r} is not valid YAML ({err.__class__.__name__}); "
                              f"fix its syntax.") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config file {path!r} must hold a mapping of setting: value.")
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def parse_config(argv: Sequence[str] | None = None, prog: str = "pretrain_gpt.py",
                 extra: Sequence[tuple[str, dict]] = ()) -> tuple[Config, argparse.Namespace]:
    """Parse flags (and the YAML they name) into a validated ``Config`` plus the extra options."""
    parser = build_parser(prog, extra)
    ns = parser.parse_args(argv)
    settings = load_yaml(ns.config) if ns.config else {}
    preset = frozenset(key.replace("-", "_") for key in settings)
    extra_names = {e[1].get("dest") or e[0].lstrip("-").replace("-", "_") for e in extra}
    typed = {key for key in vars(ns) if key != "config" and key not in extra_names}
    for key in typed:
        settings[key] = getattr(ns, key)
    explicit = frozenset(key.replace("-", "_") for key in settings)
    # --load: a typed model flag must agree with the checkpoint; a preset's alone yields to it (merge_config)
    return Config.from_flat(settings, explicit=explicit, model_pending=bool(settings.get("load")),
                            from_preset=preset - typed), ns
