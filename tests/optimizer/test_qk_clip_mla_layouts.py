"""QK-clip on multi-head latent attention across layouts: a spawned world of 2 ranks trains 3 Muon steps of a
2-layer MLA llama (q LoRA, q/k 8 + 4 RoPE, v 6) with some heads clipped every step (1, 2 and 3 of 8) at tp 2
(sequence parallel), cp 2 ring and cp 2 all-to-all, and matches one process: the heads clipped per step, every
step's reduced per-head max-logit table and so the per-head gamma = tau / max (the first step's, from the same
weights, bitwise where the layout computes the same products - see ``FIRST`` - later steps within 1e-5, as
Muon's parity leaves the weights), and the final weights (2e-5).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from megazero.optimizer.qk_clip import head_gamma
from megazero.parallel.state import ParallelState
from tests.helpers.compare import rel_err
from tests.helpers.dist import spawn
from tests.helpers.moe_runs import layout_of, serial_config
from tests.helpers.optimizer_harness import train
from tests.helpers.tiny_config import degrees, tiny_config

TAU = 0.025
MLA = dict(arch="llama", multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=6)


def clip_cfg(**flat: Any):
    return tiny_config(**MLA, optimizer="muon", lr=0.02, train_iters=3, micro_batch_size=2, global_batch_size=8,
                       qk_clip_threshold=TAU, **flat)


RUNS = {"tp2.sp": clip_cfg(**degrees(tp=2, sp=True)), "cp2.p2p": clip_cfg(**degrees(cp=2, comm="p2p")),
        "cp2.a2a": clip_cfg(**degrees(cp=2, comm="a2a"))}
# The first step's gamma per layer against one process (the same weights; 0.0: bitwise). The max is exact, so only
# the rounding of the q.k products can differ: a2a's head shards attend whole sequences with one process's
# shapes (bitwise); tp 2's layer 0 computes the same q and k (column-parallel up-projections, bitwise) but layer 1's
# input comes through the row-parallel output projection's sum, in another order (1 ulp, 1.4e-7); the ring's
# blocks are GEMMs of other shapes than the whole sequence's and round apart in the last bit (1.8e-7).
FIRST = {"tp2.sp": (0.0, 1e-6), "cp2.p2p": (1e-6, 1e-6), "cp2.a2a": (0.0, 0.0)}


def clipped_run(pstate: ParallelState, cfg) -> dict[str, Any]:
    """Per step (heads clipped, the reduced [layers, heads] max-logit table), and the final weights."""
    tables: list[torch.Tensor] = []

    def keep_tables(model, _) -> None:
        step = model.optimizer.step

        def step_and_keep(lr: float):
            result = step(lr)
            tables.append(model.optimizer.after_update.__self__.max_logits.clone())
            return result
        model.optimizer.step = step_and_keep

    result = train(pstate, cfg, hook=keep_tables)
    return {"counts": [r["qk_clip_count"] for r in result["records"]], "tables": tables, "params": result["params"]}


def layouts(pstate: ParallelState) -> dict[str, Any]:
    return {key: clipped_run(ParallelState.build(layout_of(cfg, pstate.layout.world_size), "cpu"), cfg)
            for key, cfg in RUNS.items()}


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return spawn(layouts, 2)


def test_mla_tp2_cp2_ring_and_a2a_clip_what_one_process_clips(world):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        serial = {key: clipped_run(ParallelState.serial(), serial_config(cfg)) for key, cfg in RUNS.items()}
    finally:
        torch.set_num_threads(threads)
    for key in RUNS:
        ref = serial[key]
        assert all(0 < count < 8 for count in ref["counts"]), ref["counts"]  # some heads, not all
        for rank, per_run in enumerate(world):
            run = per_run[key]
            assert run["counts"] == ref["counts"], (key, rank, run["counts"], ref["counts"])
            assert len(run["tables"]) == len(ref["tables"]) == 3
            for layer, tol in enumerate(FIRST[key]):
                gamma, want = head_gamma(run["tables"][0][layer], TAU), head_gamma(ref["tables"][0][layer], TAU)
                assert torch.equal(gamma, want) if tol == 0.0 else rel_err(gamma, want) <= tol, (key, layer)
            for got, want in zip(run["tables"][1:], ref["tables"][1:]):
                assert rel_err(got, want) < 1e-5, (key, rank)
            bad = {n: rel_err(p, ref["params"][n]) for n, p in run["params"].items()}
            assert all(e < 2e-5 for e in bad.values()), (key, rank, bad)
