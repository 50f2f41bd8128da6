"""The trainer's side of the mixture of experts, once per step: aux-loss-free bias updates and balance records.

Each router counts the tokens it routed in the step's training forwards (a recompute is not counted
again) and keeps the values of its balance losses (``moe/router.py``). After the optimizer step:

- **Counts** are summed over every rank that routed tokens of this pipeline stage: over dp x cp
  (``dp_cp_group``), then over tp (under sequence parallelism each TP rank routes its own tokens). Every
  rank of the stage then holds the same global counts, so with ``--moe-router-enable-expert-bias`` every
  replica of a router applies the same bias update and the biases stay equal.
- **Loss values** are already the whole micro-batch's inside the router (reduced over tp x cp); their mean
  over the step's micro-batches (the router's) and over dp x cp is the global-batch mean, as the LM loss.
- On a logged step the stages' rows meet over the pipeline group (a sum: each layer lives on one stage).
  The headline loss values are the **mean over the MoE layers** of each layer's value (a perfectly
  balanced Switch loss reads 1.0 whatever the depth); the metrics file has every layer's.

Legend: L layers of the model, E experts, N loss values (``BalanceLosses.value_names``).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..config import ModelConfig
from ..moe.balance import BalanceLosses
from ..model.chunk import routers_of
from ..moe.router import Router
from ..parallel import collectives as C
from ..parallel.state import ParallelState


def imbalance(tokens_per_expert: torch.Tensor) -> float:
    """max / mean - 1 of one layer's token counts: 0 when perfectly balanced (0 too for a layer that routed none)."""
    mean = tokens_per_expert.double().mean()
    return float(tokens_per_expert.max() / mean - 1) if mean > 0 else 0.0


class NullMoEStep:
    """A dense model: nothing to update, nothing to record."""

    def after_step(self) -> None:
        """Nothing routed."""

    def fields(self) -> dict[str, Any]:
        return {}


class MoEStep:
    """Takes the routers' step counts and losses, updates the expert biases, and gives a logged step's fields."""

    def __init__(self, cfg: ModelConfig, pstate: ParallelState, routers: list[Router]) -> None:
        assert cfg.num_experts is not None
        self.cfg, self.pstate, self.routers, self.experts = cfg, pstate, routers, cfg.num_experts
        self.names = BalanceLosses.from_config(cfg).value_names
        self.rows = cfg.num_layers + cfg.mtp_depth  # MTP blocks (model/mtp.py) are layers L .. L + D - 1
        self.moe_layers = [layer for layer in range(self.rows) if cfg.is_moe_layer(layer)]
        assert len({r.layer_id for r in routers}) == len(routers), "one router per layer"
        self.rate = cfg.moe_router_bias_update_rate if cfg.moe_router_enable_expert_bias else None
        self.table: torch.Tensor | None = None  # [L, E + N] fp64, this step's; stage-reduced when ``reduced``
        self.reduced = False

    def after_step(self) -> None:
        """Take this step's counts and losses from every router (which resets them); with the expert bias, reduce
        the counts over the stage and update each router's bias from its layer's global counts."""
        self.table = self._local_table()
        self.reduced = False
        if self.rate is not None:
            self._reduce_stage()
            for router in self.routers:
                router.update_expert_bias(self.table[router.layer_id, :self.experts], self.rate)

    def _local_table(self) -> torch.Tensor:
        """[L, E + N] fp64: this rank's tokens per expert and loss values in its layers' rows, zeros elsewhere.

        fp64 holds counts exactly up to 2^53 and carries them in the same tensor as the losses.
        """
        experts = self.experts
        table = torch.zeros(self.rows, experts + len(self.names), dtype=torch.float64,
                            device=self.pstate.device)
        for router in self.routers:
            table[router.layer_id, :experts] = router.take_step_tokens_per_expert().to(table)
            losses = router.take_step_losses()
            for column, name in enumerate(self.names, start=experts):
                if name in losses:  # absent only when the router ran no training forward
                    table[router.layer_id, column] = losses[name].to(table)
        return table

    def _reduce_stage(self) -> None:
        """Counts summed over every rank of this stage (tp x cp x dp); losses averaged over dp x cp."""
        assert self.table is not None
        if not self.reduced:
            experts, state = self.experts, self.pstate
            C.all_reduce(self.table, state.dp_cp_group)
            self.table[:, experts:] /= state.dp_cp
            counts = self.table[:, :experts].contiguous()  # gloo takes contiguous tensors only
            C.all_reduce(counts, state.tp_group)
            self.table[:, :experts] = counts
            self.reduced = True

    def fields(self) -> dict[str, Any]:
        """A logged step's record fields (every rank calls it: it runs collectives).

        ``moe_<loss>``: mean over the MoE layers; ``moe_imbalance``: the worst layer's max/mean - 1, and
        ``moe_imbalance_layer`` which layer; ``moe_layers``: per layer, its global tokens per expert, imbalance
        and loss values.
        """
        self._reduce_stage()
        assert self.table is not None
        whole = self.table.clone()
        C.all_reduce(whole, self.pstate.pp_group)  # each row is non-zero on the one stage holding the layer
        experts = self.experts
        layers: dict[str, dict[str, Any]] = {}
        for layer in self.moe_layers:
            row = whole[layer]
            counts = row[:experts].round().to(torch.int64)
            layers[str(layer)] = {"tokens_per_expert": counts.tolist(), "imbalance": imbalance(counts),
                                  **{name: float(row[experts + i]) for i, name in enumerate(self.names)}}
        if not layers:  # a pattern with no MoE layer: nothing was routed
            return {}
        worst = max(layers, key=lambda layer: layers[layer]["imbalance"])
        means = {f"moe_{name}": sum(v[name] for v in layers.values()) / len(layers) for name in self.names}
        return {**means, "moe_imbalance": layers[worst]["imbalance"], "moe_imbalance_layer": int(worst),
                "moe_layers": layers}


def moe_step(cfg: ModelConfig, pstate: ParallelState, chunks: Sequence[nn.Module]) -> MoEStep | NullMoEStep:
    """The step's MoE bookkeeping for this model: a null object for a dense one (decided by the config, so a
    pipeline stage without MoE layers still joins the records' collectives)."""
    if cfg.num_experts is None:
        return NullMoEStep()
    return MoEStep(cfg, pstate, [router for chunk in chunks for router in routers_of(chunk)])
