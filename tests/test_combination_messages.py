"""Refusals a user met combining features from a preset and the command line (a CLI shake-out, 2026-11-27).

Each line must name the flag to pass, in the spelling the command line takes: ``--no-compile`` (the
message once said "pass no --compile"), and ``--moe-aux-loss-coeff 0`` where the coefficient came from
configs/moe-tiny.yaml rather than from the command (the message once said "drop the coefficient", which
a user who never typed it cannot do).
"""
from __future__ import annotations

import pytest

from megazero.arguments import parse_config
from megazero.config import ConfigError
from megazero.run_plan import RunPlan


def _refusal(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        RunPlan.resolve(parse_config(argv)[0], 1)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("switch", ["--reset-position-ids", "--reset-attention-mask"])
def test_document_masks_with_compile_name_the_flag_to_pass(switch):
    message = _refusal(["--config", "configs/tiny.yaml", switch, "--compile"])
    assert message == (f"{switch} only applies with --no-compile (here --compile); drop it or pass --no-compile.")


def test_a_preset_aux_loss_coefficient_without_a_balancing_loss_names_the_flag_that_zeroes_it():
    message = _refusal(["--config", "configs/moe-tiny.yaml", "--moe-router-load-balancing-type", "none",
                        "--moe-router-enable-expert-bias"])
    assert message.startswith("--moe-aux-loss-coeff 0.01 needs a balancing loss"), message
    assert "--moe-aux-loss-coeff 0 " in message, message
    # the flag it names is accepted: the same command with it passes
    parse_config(["--config", "configs/moe-tiny.yaml", "--moe-router-load-balancing-type", "none",
                  "--moe-router-enable-expert-bias", "--moe-aux-loss-coeff", "0"])
