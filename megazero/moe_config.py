"""The mixture-of-experts fields of the model config (``--num-experts`` and the ``--moe-*`` flags).

``MoEFields`` is a mixin ``ModelConfig`` inherits, so MoE settings load, print, checkpoint and compare
like every other model setting while their checks stay here. Flag names are Megatron-LM's. Without
``--num-experts`` the model is dense and every other MoE flag is refused (``WITH_EXPERTS``), never ignored.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config_fields import ConfigError, Needs, opt, require, when

WITH_EXPERTS = Needs("--num-experts E", ("num_experts",), lambda experts: experts is not None)
_WITH_CAPACITY = Needs("--moe-expert-capacity-factor F", ("moe_expert_capacity_factor",),
                       lambda factor: factor is not None)


@dataclass(frozen=True, kw_only=True)
class MoEFields:
    num_experts: int | None = opt(None, "Routed experts per MoE layer; None = a dense model (every --moe-* flag "
                                  "then refused).", at_least=1)
    moe_router_topk: int = opt(2, "Experts each token is routed to (k).", at_least=1, applies=WITH_EXPERTS)
    moe_ffn_hidden_size: int | None = opt(None, "Hidden width of each routed expert; None = the dense MLP width "
                                          "(--ffn-hidden-size).", at_least=1, applies=WITH_EXPERTS)
    moe_layer_freq: list[str] | None = opt(None, "Which layers are MoE (the others keep the dense MLP): N = every "
                                           "N-th layer from layer 0 (layer % N == 0), or a 0/1 pattern with one "
                                           "entry per layer, '[0,1,1,1]' or '0 1 1 1'; None = every layer.",
                                           applies=WITH_EXPERTS)
    moe_shared_expert_intermediate_size: int | None = opt(None, "Hidden width of a dense shared expert added to "
                                                          "the routed output; None = no shared expert.",
                                                          at_least=1, applies=WITH_EXPERTS)
    moe_router_score_function: str = opt("softmax", "Router scores: softmax or sigmoid (DeepSeek-V3).",
                                         choices=("softmax", "sigmoid"), applies=WITH_EXPERTS)
    moe_router_pre_softmax: bool = opt(False, "Softmax over all experts, then top-k, no renormalising; without it, "
                                       "top-k of the logits then softmax over the k (Mixtral, Qwen3).",
                                       applies=WITH_EXPERTS)
    moe_router_topk_scaling_factor: float | None = opt(None, "Multiply the routing weights by this; None = 1.",
                                                       above=0, applies=WITH_EXPERTS)
    moe_router_num_groups: int | None = opt(None, "Group-limited routing: experts form this many groups and each "
                                            "token picks among the --moe-router-group-topk best groups first.",
                                            at_least=1, applies=WITH_EXPERTS)
    moe_router_group_topk: int | None = opt(None, "Group-limited routing: groups each token keeps.", at_least=1,
                                            applies=WITH_EXPERTS)
    moe_router_load_balancing_type: str = opt("aux_loss", "Balancing loss: aux_loss (Switch/GShard, over the "
                                              "micro-batch), seq_aux_loss (per sequence, DeepSeek-V3) or none.",
                                              choices=("aux_loss", "seq_aux_loss", "none"), applies=WITH_EXPERTS)
    moe_aux_loss_coeff: float = opt(0.0, "Weight of the balancing loss; 0 = off.", at_least=0, applies=WITH_EXPERTS)
    moe_z_loss_coeff: float = opt(0.0, "Weight of the router z-loss (mean squared logsumexp); 0 = off.",
                                  at_least=0, applies=WITH_EXPERTS)
    moe_router_enable_expert_bias: bool = opt(False, "Aux-loss-free balancing: a per-expert bias added to the "
                                              "scores for the top-k choice only, updated once per step from the "
                                              "token counts (saved in checkpoints).", applies=WITH_EXPERTS)
    moe_router_bias_update_rate: float = opt(1e-3, "Aux-loss-free balancing: step of the per-expert bias update.",
                                             above=0, applies=when("moe_router_enable_expert_bias", True))
    moe_router_force_balance: bool = opt(False, "Debug/benchmark router: tokens spread round-robin over the "
                                         "experts, exactly balanced, whatever the scores.", applies=WITH_EXPERTS)
    moe_expert_capacity_factor: float | None = opt(None, "Tokens an expert takes, as a multiple of an even share "
                                                   "(k x tokens / E); the rest are dropped; None = dropless.",
                                                   above=0, applies=WITH_EXPERTS)
    moe_token_drop_policy: str = opt("probs", "With a capacity: drop the tokens with the lowest routing weight "
                                     "(probs) or the latest in the batch (position).", choices=("probs", "position"),
                                     applies=_WITH_CAPACITY)
    moe_pad_expert_input_to_capacity: bool = opt(False, "With a capacity: pad every expert's input to exactly its "
                                                 "capacity (static shapes).", applies=_WITH_CAPACITY)

    def _check_moe(self, num_layers: int) -> None:
        """The MoE settings must agree with each other and with the layer count (one line naming the flag)."""
        experts = self.num_experts
        if experts is None:
            return
        k = self.moe_router_topk
        require(k <= experts, f"--moe-router-topk ({k}) must not exceed --num-experts ({experts}); pick k <= E.")
        require(not (self.moe_router_pre_softmax and self.moe_router_score_function == "sigmoid"),
                "--moe-router-pre-softmax only applies with --moe-router-score-function softmax; drop one of them.")
        require(self.moe_aux_loss_coeff == 0 or self.moe_router_load_balancing_type != "none",
                f"--moe-aux-loss-coeff {self.moe_aux_loss_coeff} needs a balancing loss; pass "
                f"--moe-router-load-balancing-type aux_loss or seq_aux_loss, or --moe-aux-loss-coeff 0 (a preset or "
                f"a checkpoint may have set it).")
        self._check_groups(experts, k)
        self._check_force_balance()
        self.moe_layer_pattern(num_layers)  # raises ConfigError for a malformed or wrong-length pattern

    def _check_force_balance(self) -> None:
        """The round-robin router reads neither the expert bias nor the groups: either one with it does nothing."""
        if not self.moe_router_force_balance:
            return
        require(not self.moe_router_enable_expert_bias,
                "--moe-router-enable-expert-bias does nothing with --moe-router-force-balance (the round-robin "
                "router never reads the bias); drop one of them.")
        require(self.moe_router_num_groups is None,
                "--moe-router-num-groups/--moe-router-group-topk (group-limited routing) do nothing with "
                "--moe-router-force-balance (the round-robin router never reads the groups); drop one of them.")

    def refuse_idle_balancing(self, given: frozenset[str], pending: frozenset[str] = frozenset()) -> None:
        """A balancing loss named (``given``: typed or in a preset) without its weight applies no loss: refused.

        The type's default is aux_loss, so only a type the user gave is checked; a weight given too, even 0, is
        the user's word (a run's own config.yaml holds both), and one a --load checkpoint may still supply
        (``pending``) waits.
        """
        kind = self.moe_router_load_balancing_type
        if self.num_experts is None or "moe_router_load_balancing_type" not in given or kind == "none" \
                or self.moe_aux_loss_coeff > 0 or "moe_aux_loss_coeff" in given | pending:
            return
        raise ConfigError(f"--moe-router-load-balancing-type {kind} applies no loss with --moe-aux-loss-coeff "
                          f"{self.moe_aux_loss_coeff:g} (its weight); pass --moe-aux-loss-coeff C > 0 (e.g. 1e-2), "
                          f"or --moe-router-load-balancing-type none.")

    def check_trainable(self) -> None:
        """Refuse to train a router the loss cannot move; such a model still converts, evaluates and generates.

        Top-1 with the softmax over the k chosen (Mixtral; Qwen3-MoE with norm_topk_prob) gives every token's
        one weight the constant 1: the expert choice is a detached top-k, so the router gets no gradient.
        """
        if self.num_experts is None or self.moe_router_topk > 1 or self.moe_router_pre_softmax \
                or self.moe_router_score_function == "sigmoid":
            return
        raise ConfigError("--moe-router-topk 1 with a softmax over the k chosen (Mixtral's, or Qwen3-MoE's "
                          "norm_topk_prob) gives every token's one weight the constant 1, so the router gets no "
                          "gradient and cannot train; such a model converts, evaluates (--skip-train) and "
                          "generates (tools/generate.py), but to train pass --moe-router-pre-softmax, "
                          "--moe-router-score-function sigmoid or --moe-router-topk >= 2.")

    def _check_groups(self, experts: int, k: int) -> None:
        """Group-limited routing: both flags or neither, groups dividing E, enough experts in the kept groups."""
        groups, keep = self.moe_router_num_groups, self.moe_router_group_topk
        require((groups is None) == (keep is None),
                "--moe-router-num-groups and --moe-router-group-topk go together (group-limited routing); pass "
                "both or neither.")
        if groups is None or keep is None:
            return
        require(experts % groups == 0, f"--moe-router-num-groups ({groups}) must divide --num-experts ({experts}); "
                                       f"pick a divisor of E.")
        require(keep <= groups, f"--moe-router-group-topk ({keep}) must not exceed --moe-router-num-groups "
                                f"({groups}); keep at most every group.")
        require(k >= keep, f"--moe-router-topk ({k}) below --moe-router-group-topk ({keep}) scores every group 0 (a "
                           f"group's score is the sum of its best k // group_topk experts); keep at most k groups.")
        require(k <= keep * (experts // groups),
                f"--moe-router-topk ({k}) exceeds the {keep * (experts // groups)} experts of the "
                f"--moe-router-group-topk {keep} groups kept; raise --moe-router-group-topk or lower k.")

    def moe_layer_pattern(self, num_layers: int) -> tuple[bool, ...]:
        """Per layer (0-based), whether it is an MoE layer; all False for a dense model."""
        if self.num_experts is None:
            return (False,) * num_layers
        if self.moe_layer_freq is None:
            return (True,) * num_layers
        shown = " ".join(self.moe_layer_freq)
        expanded = _expand_pattern_expression(shown)
        entries = expanded if expanded is not None else \
            shown.replace(",", " ").strip().removeprefix("[").removesuffix("]").split()
        if len(self.moe_layer_freq) == 1 and entries == self.moe_layer_freq:  # one bare number: every N-th layer
            every = int(entries[0]) if entries[0].isdigit() else 0
            require(every >= 1, f"--moe-layer-freq {shown!r} must be an integer N >= 1 or a 0/1 pattern such as "
                                f"'[0,1,1,1]'; fix the value.")
            return tuple(layer % every == 0 for layer in range(num_layers))
        if any(entry not in ("0", "1") for entry in entries):
            raise ConfigError(f"--moe-layer-freq {shown!r} must be an integer N >= 1 or a list of 0 and 1 such as "
                              f"'[0,1,1,1]' or Megatron's '([0]*3+[1]*58)'; fix the value.")
        require(len(entries) == num_layers, f"--moe-layer-freq has {len(entries)} entries but --num-layers is "
                                            f"{num_layers}; give one 0/1 per layer.")
        return tuple(entry == "1" for entry in entries)

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether global layer ``layer_id`` (0-based) has routed experts: the one way code asks. Ids past the
        last layer are MTP blocks (``model/mtp.py``), which take the last layer's kind."""
        return self.moe_layer_pattern(self.num_layers)[min(layer_id, self.num_layers - 1)]

    @property
    def moe_ffn_size(self) -> int:
        """Hidden width of one routed expert: --moe-ffn-hidden-size, else the dense MLP width."""
        return self.moe_ffn_hidden_size or self.ffn_size

    if TYPE_CHECKING:  # ModelConfig's, read here (annotations only at type-check time: no fields of this mixin)
        num_layers: int

        @property
        def ffn_size(self) -> int: ...


_TERM = re.compile(r"\[\s*([01](?:\s*,\s*[01])*)\s*\](?:\s*\*\s*(\d+))?")


def _expand_pattern_expression(text: str) -> list[str] | None:
    """Megatron's Python-expression form, '([0]*3+[1]*58)': 0/1 lists times counts joined by '+', read without
    eval; None when ``text`` is not of that form with at least one '*' or '+' (a plain list is read as before)."""
    body = text.strip()
    if body.startswith("(") and body.endswith(")"):
        body = body[1:-1].strip()
    if "*" not in body and "+" not in body:
        return None
    entries: list[str] = []
    for term in body.split("+"):
        match = _TERM.fullmatch(term.strip())
        if match is None:
            return ["?"]  # not 0/1 lists times counts: refused by the caller's one line
        values = [v.strip() for v in match.group(1).split(",")]
        entries += values * int(match.group(2) or 1)
    return entries
