"""Model settings a checkpoint records that a run loading it may still change.

Each of these shapes only the training objective (the balancing and z-losses, the aux-loss-free bias
step) or how tokens reach their experts (a capacity, a debug router), never the saved weights: a run
takes the checkpoint's value unless the flag is given (a converted checkpoint, saved with coefficient
0, can then be trained with a balancing loss), and says so in one line. The routing function itself
(--moe-router-topk, the score function, ...) stays model-defining: the trained weights assume it.
"""
from __future__ import annotations

from typing import Any

from ..config import Config, flag

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
