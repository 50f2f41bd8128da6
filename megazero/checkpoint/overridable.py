"""Model settings a checkpoint records that a run loading it may still change.

Each of these shapes only the training objective (the balancing and z-losses, the aux-loss-free bias
step) or how tokens reach their experts (a capacity, a debug router), never the saved weights: a run
takes the checkpoint's value unless the flag is given (a converted checkpoint, saved with coefficient
0, can then be trained with a balancing loss), and says so in one line. The routing function itself
(--moe-router-topk, the score function, ...) stays model-defining: the trained weights assume it.

The document-masking switches are data settings and never come from a checkpoint; a resume that sets them
unlike the saving run (typically by omitting them) is told so in one line.
"""
from __future__ import annotations

from typing import Any

from ..config import Config, flag
from ..config_fields import switch_flag

OVERRIDABLE_KEYS = ("moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                    "moe_router_bias_update_rate", "moe_router_force_balance", "moe_expert_capacity_factor",
                    "moe_token_drop_policy", "moe_pad_expert_input_to_capacity")


def overrides_line(meta: dict[str, Any], cfg: Config) -> str | None:
    """The line naming each given setting of ``OVERRIDABLE_KEYS`` that differs from the checkpoint's
    (``cfg`` is the merged config); None when the run keeps every recorded value."""
    saved, run = meta["config"], cfg.to_flat()
    changed = [f"{flag(key)} {run[key]} (the checkpoint's {saved[key]})" for key in OVERRIDABLE_KEYS
               if key in cfg.explicit and key in saved and saved[key] != run[key]]
    if not changed:
        return None
    return f"megazero: training settings given over the checkpoint's: {', '.join(changed)}; the weights are the same"


DOCUMENT_KEYS = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")


def document_change_line(meta: dict[str, Any], cfg: Config) -> str | None:
    """The line naming each document-masking switch this run sets unlike the run that saved the checkpoint;
    None when they agree. They are data settings, never taken from a checkpoint (unlike the model's), so a
    resume that omits them would otherwise train another objective without a word."""
    saved, run = meta["config"], cfg.to_flat()
    changed = [f"{switch_flag(key, run[key])} (the checkpoint's run: {switch_flag(key, saved[key])})"
               for key in DOCUMENT_KEYS if key in saved and saved[key] != run[key]]
    if not changed:
        return None
    return (f"megazero: document masking differs from the run that saved the checkpoint: {', '.join(changed)}; "
            f"pass the same switches to keep its objective")


def preset_yield_line(given: Config, merged: Config) -> str | None:
    """The line naming each model setting that only the --config preset gave and the checkpoint replaced
    (``merge_config``; ``given`` is the config before it); None when the preset agreed with the checkpoint.
    A typed flag is never replaced: one that contradicts the checkpoint is refused."""
    before, after = given.to_flat(), merged.to_flat()
    replaced = sorted(given.from_preset - merged.from_preset, key=list(before).index)
    changed = [f"{flag(key)} {after[key]} (the preset's {before[key]})" for key in replaced
               if before[key] != after[key]]
    if not changed:
        return None
    return (f"megazero: the checkpoint's model replaces what the --config preset set: {', '.join(changed)}; a flag "
            f"typed on the command line instead must agree with the checkpoint")
