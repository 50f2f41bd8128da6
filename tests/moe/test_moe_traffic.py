"""The expert-parallel traffic, counted at the collectives, equals the formula every training step (issue 33).

The issue's figure, 4 x T x k x H x bytes per MoE layer per rank (dispatch and combine, forward and
backward; T tokens of one micro-batch on the rank, k choices, H hidden), is the *full* volume of the four
exchanges, the rank's own block included. The ledger (``ParallelState.ledger``, axis ``ep``) counts what
*leaves* the rank: the rows a rank routes to its own experts never enter the all-to-all. So per MoE layer,
micro-batch and rank, with ``sent`` the rank's assignments bound for other ranks' experts and ``received``
the other ranks' assignments bound for its experts:

    ledger = 2 x (sent + received) x H x bytes + (E - E/ep) x 8      (the int64 count exchange, own block kept)

(dispatch forward and combine backward carry ``sent`` rows, combine forward and dispatch backward
``received`` ones). The two views reconcile exactly over the ep group: sum(sent) = sum(received), so the
ranks' ledgers plus 4 x (own-block rows) x H x bytes add up to ep x 4 x T x k x H x bytes. Under the
force-balance router every rank sends exactly the share (ep - 1)/ep off-rank and the ledger is
(ep - 1)/ep x 4 x T x k x H x bytes (+ counts) on every rank; with a capacity factor cf and padding every
expert takes exactly ceil(cf x T x k / E) rows from each rank: (ep - 1)/ep x 4 x cf x k x T x H x bytes,
whatever the router chose. Without padding a capacity keeps min(count, capacity) per expert.

Two spawned ranks (ep 2 over dp 2) train a 2-layer model 3 steps per case through the trainer; each step's
``comm_bytes["all_to_all/ep"]`` is compared with the formula, fed by every rank's routed counts of each
micro-batch and layer (a forward hook on the routers). No recompute: a recomputed forward would exchange
its counts again. The dropless run also counts the tensors alive at each micro-batch's start: from the second
step on they must not grow (an in-flight exchange once kept its rows alive through its autograd nodes).
"""
from __future__ import annotations

import gc
import math

import torch

from megazero.model.chunk import routers_of
from tests.helpers.dist import spawn
from tests.helpers.moe_runs import make_cfg
from tests.helpers.optimizer_harness import train

EP, STEPS = 2, 3
CASES = {
    "dropless": dict(),
    "force-balance": dict(model=dict(moe_router_force_balance=True)),
    "force-balance-bf16": dict(model=dict(moe_router_force_balance=True), training=dict(bf16=True)),
    "capacity-padded": dict(model=dict(moe_expert_capacity_factor=0.75, moe_pad_expert_input_to_capacity=True)),
    "capacity-dropping": dict(model=dict(moe_expert_capacity_factor=0.5)),
}
CONFIGS = {key: make_cfg(ep=EP, iters=STEPS, **kw) for key, kw in CASES.items()}


def _train_counting(pstate, configs) -> dict[str, dict]:
    """Per case: the ledger's ep bytes of each step and the routed counts of each training forward."""
    out = {}
    for key, cfg in configs.items():
        forwards: list[tuple[int, list[int]]] = []
        live: list[int] = []  # tensors alive at each micro-batch's start

        def record(router, _args, routing, forwards=forwards):
            if router.training:
                forwards.append((router.layer_id, routing.tokens_per_expert.tolist()))

        def census(_module, _args, live=live):
            gc.collect()
            live.append(sum(1 for o in gc.get_objects() if torch.is_tensor(o)))

        def hook(model, _pstate):
            model.chunks[0].register_forward_pre_hook(census)
            for chunk in model.chunks:
                for router in routers_of(chunk):
                    router.register_forward_hook(record)

        result = train(pstate, cfg, hook=hook)
        out[key] = {"ep_bytes": [r["comm_bytes"].get("all_to_all/ep", 0) for r in result["records"]],
                    "forwards": forwards, "live": live}
    return out


def _shape(cfg) -> dict[str, int]:
    m, t = cfg.model, cfg.training
    micro_batches = t.global_batch_size // (t.micro_batch_size * EP)  # ep 2 over dp 2: one expert grid, edp 1
    return dict(T=t.micro_batch_size * m.seq_length, k=m.moe_router_topk, H=m.hidden_size, E=m.num_experts,
                bytes=2 if t.bf16 else 4, per_step=micro_batches * m.num_layers)


def _kept(counts: list[int], cfg, s: dict[str, int]) -> list[int]:
    """Rows that travel per expert: all (dropless), at most the capacity, or exactly it (padded)."""
    cf = cfg.model.moe_expert_capacity_factor
    if cf is None:
        return counts
    cap = math.ceil(cf * s["T"] * s["k"] / s["E"])
    return [cap] * len(counts) if cfg.model.moe_pad_expert_input_to_capacity else [min(c, cap) for c in counts]


def _step_terms(per_rank_forwards: list[list], cfg, s: dict[str, int]) -> list[dict[str, int]]:
    """This step's (sent, received, own) rows per rank, summed over its forwards, and the count bytes."""
    local = s["E"] // EP
    terms = [dict(sent=0, received=0, own=0, counts=0) for _ in range(EP)]
    for same_forward in zip(*per_rank_forwards):  # rank r's i-th forward exchanged with every rank's i-th
        assert len({layer for layer, _ in same_forward}) == 1, same_forward
        kept = [_kept(counts, cfg, s) for _, counts in same_forward]
        for r in range(EP):
            mine = range(r * local, (r + 1) * local)
            terms[r]["own"] += sum(kept[r][e] for e in mine)
            terms[r]["sent"] += sum(kept[r]) - sum(kept[r][e] for e in mine)
            terms[r]["received"] += sum(kept[p][e] for p in range(EP) if p != r for e in mine)
            terms[r]["counts"] += (s["E"] - local) * 8
    return terms


def _check_case(key: str, results: list[dict]) -> list[str]:
    cfg = CONFIGS[key]
    s = _shape(cfg)
    row = s["H"] * s["bytes"]
    bad = []
    for step in range(STEPS):
        window = slice(step * s["per_step"], (step + 1) * s["per_step"])
        forwards = [res[key]["forwards"][window] for res in results]
        assert all(len(f) == s["per_step"] for f in forwards), (key, step, [len(f) for f in forwards])
        terms = _step_terms(forwards, cfg, s)
        counted = [res[key]["ep_bytes"][step] for res in results]
        for r, (got, t) in enumerate(zip(counted, terms)):
            want = 2 * (t["sent"] + t["received"]) * row + t["counts"]
            if got != want:
                bad.append(f"{key} step {step + 1} rank {r}: ledger {got} bytes, formula {want}")
        full = sum(counted) - sum(t["counts"] for t in terms) + 4 * row * sum(t["own"] for t in terms)
        if cfg.model.moe_expert_capacity_factor is None and full != EP * s["per_step"] * 4 * s["T"] * s["k"] * row:
            bad.append(f"{key} step {step + 1}: ranks' ledgers + own blocks {full} != ep x 4 T k H bytes")
        if cfg.model.moe_router_force_balance or cfg.model.moe_pad_expert_input_to_capacity:
            cf = cfg.model.moe_expert_capacity_factor or 1.0
            closed = s["per_step"] * (4 * cf * s["k"] * s["T"] * row * (EP - 1) // EP + (s["E"] - s["E"] // EP) * 8)
            if counted != [closed] * EP:
                bad.append(f"{key} step {step + 1}: ledgers {counted}, (ep-1)/ep x 4 cf k T H bytes {closed}")
        if cfg.model.moe_router_force_balance and any(t["sent"] * EP != s["per_step"] * s["T"] * s["k"] * (EP - 1)
                                                      for t in terms):
            bad.append(f"{key} step {step + 1}: off-rank share not (ep-1)/ep: {terms}")
    return bad


def test_ep_traffic_equals_the_formula_every_step():
    results = spawn(_train_counting, EP, CONFIGS, ep=EP)
    dropped = [c for res in results for _, counts in res["capacity-dropping"]["forwards"] for c in counts]
    assert max(dropped) > math.ceil(0.5 * 64 * 2 / 4), "the capacity case must drop tokens to test anything"
    for res in results:  # the exchange keeps nothing from one step to the next (its autograd nodes once did)
        live = res["dropless"]["live"]
        assert live[len(live) // STEPS] == live[-(len(live) // STEPS)], live
    bad = [line for key in CONFIGS for line in _check_case(key, results)]
    assert not bad, "ep traffic differs from the formula:\n" + "\n".join(bad)
