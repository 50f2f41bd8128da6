"""MTP's normalisation is layout-invariant, checked against hand-derived values (issue 43), not only by parity.

One spawned 2-rank gloo world, seq 8, one MTP depth, packed documents (``PACKED_RULE``: an EOD ends a document,
an EOD input carries no loss). Depth 1 has a target at position i when i + 1 < S and neither input i nor input
i + 1 is an EOD (``targets``, counted here independently of megazero).

- dp 2, 2 micro-batches a rank: rank 0 keeps 1 target (1 + 0), rank 1 keeps 3 (1 + 2), Megatron #7452's case.
  After the real schedule and the gradient-sync engine's DP mean, every MTP weight's gradient is the global
  per-token one, sum of the 4 targets' gradients / 4, and the logged ``mtp_1_loss`` the global per-token mean;
  the targets' losses and gradients come from one process running each micro-batch at scale 1. A per-rank
  mean (rank 0's sum / 1 and rank 1's / 3, averaged) is what #7452 reported: with token values 6 on one rank
  and 10 in all on the other, 14/3 where the per-token mean is 16/4 = 4; on this data too the two differ.
- cp 2 (ring), one sample whose CP rank 1 tokens (positions 2 .. 5) are all EOD, so that rank's shifted mask is
  empty: its MTP loss is finite and exactly 0, and backpropagating that rank's loss alone (rank 0's output
  given a zero gradient; plain chunks, so before any reduction) leaves every MTP gradient exactly zero on both
  ranks, while rank 0's alone gives every MTP weight a non-zero one there; both together give each rank's
  gradients of rank 0's loss alone, bitwise.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from megazero.config import Config
from megazero.parallel.layout import Layout
from megazero.parallel.state import ParallelState
from megazero.pipeline.runner import step_documents
from megazero.pipeline.schedules import build_schedule
from megazero.run_plan import RunPlan
from megazero.training.mtp_step import mtp_step
from megazero.training.parallelize import build_model_chunks
from tests.helpers.batches import EOD, PACKED_RULE
from tests.helpers.compare import rel_err
from tests.helpers.dist import spawn
from tests.helpers.optimizer_harness import build
from tests.helpers.tiny_config import degrees, family, tiny_config

SEQ, VOCAB, TOL = 8, 64, 1e-6


def mtp_cfg(**flat: Any) -> Config:
    """A one-layer llama with one MTP module (weight 0.5), 8 tokens, 4 samples a step of 1-sample micro-batches."""
    return tiny_config(**family("llama"), **{**dict(num_layers=1, mtp_num_layers=1, mtp_loss_scaling_factor=0.5,
                                                    seq_length=SEQ, vocab_size=VOCAB, micro_batch_size=1,
                                                    global_batch_size=4, train_iters=1), **flat})


DP_CFG, CP_CFG = mtp_cfg(), mtp_cfg(global_batch_size=1, **degrees(cp=2))


def sample(kept: int, seed: int) -> torch.Tensor:
    """[1, S + 1] tokens: ``kept`` + 1 non-EOD inputs first (so ``kept`` depth-1 targets), EOD inputs after."""
    tokens = torch.randint(EOD + 1, VOCAB, (1, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    tokens[:, kept + 1 if kept else 0:SEQ] = EOD
    return tokens


# per dp rank, its 2 micro-batches: rank 0 keeps 1 + 0 targets, rank 1 keeps 1 + 2
DP_BATCHES = [[sample(1, 10), sample(0, 11)], [sample(1, 12), sample(2, 13)]]
CP_SAMPLE = torch.cat([sample(1, 20)[:, :2], torch.full((1, 4), EOD), sample(1, 21)[:, :3]], dim=1)


def targets(tokens: torch.Tensor, positions: torch.Tensor | None = None) -> int:
    """Depth-1 targets of ``tokens``' inputs (at ``positions`` only, when given), from the rule above."""
    x = tokens[0, :SEQ]
    kept = [i for i in range(SEQ - 1) if x[i] != EOD and x[i + 1] != EOD]
    return len(kept if positions is None else [i for i in kept if i in positions.tolist()])


def mtp_grads(chunk: torch.nn.Module, main: bool = False) -> dict[str, torch.Tensor]:
    """The MTP module's gradients (``main``: the engine's reduced main grads)."""
    return {n: (p.main_grad if main else p.grad).detach().clone() for n, p in chunk.named_parameters()
            if n.startswith("mtp.")}


def dp_run(pstate: ParallelState) -> dict[str, Any]:
    """One schedule step at dp 2 through the engine (ZeRO 0): the DP-mean MTP gradients and logged MTP loss."""
    model = build(pstate, DP_CFG)
    try:
        initial = {n: p.detach().clone() for n, p in model.chunks[0].named_parameters() if n.startswith("mtp.")}
        schedule = build_schedule(RunPlan.resolve(DP_CFG, pstate.layout.world_size), packing=PACKED_RULE)
        model.optimizer.zero_grad()
        schedule(model.chunks, DP_BATCHES[pstate.dp_rank], pstate, model.optimizer.no_sync)
        model.engine.finish()
        record = mtp_step(DP_CFG.model, pstate, model.chunks)
        record.after_step()
        return {"initial": initial, "grads": mtp_grads(model.chunks[0], main=True), "loss": record.fields()}
    finally:
        model.close()


def cp_backward(chunk: torch.nn.Module, pstate: ParallelState, weight: float) -> dict[str, Any]:
    """Forward of ``CP_SAMPLE`` with the schedule's scales, backward with ``weight`` as this rank's loss gradient."""
    documents = step_documents(PACKED_RULE, [CP_SAMPLE], pstate, mtp_depth=1)[0]
    chunk.zero_grad(set_to_none=True)
    loss = chunk(CP_SAMPLE[:, :-1], CP_SAMPLE[:, 1:], documents=documents)
    torch.autograd.backward(loss, grad_tensors=torch.tensor(weight))
    return {"loss": float(loss), "mtp": chunk.mtp.take_values()[0].tolist(), "grads": mtp_grads(chunk)}


def cp_run(pstate: ParallelState) -> dict[str, Any]:
    """At cp 2, plain chunks (no reduction): backward of rank 1's loss alone, rank 0's alone, and both."""
    chunk = build_model_chunks(CP_CFG, RunPlan.resolve(CP_CFG, pstate.layout.world_size), pstate)[0]
    rank = pstate.cp_rank
    return {"positions": chunk.ctx.cp.split.positions(SEQ, rank),
            "rank1_only": cp_backward(chunk, pstate, float(rank == 1)),
            "rank0_only": cp_backward(chunk, pstate, float(rank == 0)), "both": cp_backward(chunk, pstate, 1.0)}


def world(pstate: ParallelState) -> dict[str, Any]:
    cp_state = ParallelState.build(Layout.from_world(2, 1, 1, 2), "cpu")  # collective: both ranks build it
    return {"dp": dp_run(pstate), "cp": cp_run(cp_state)}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return spawn(world, 2)


def token_sums(chunk: torch.nn.Module, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """One micro-batch in one process at MTP scale 1 (LM loss scale 0): the sum of its depth-1 token losses and
    the MTP weights' gradient of factor / D x that sum."""
    documents = dataclasses.replace(PACKED_RULE.documents(tokens[:, :-1]), loss_scale=0.0, mtp_scales=(1.0,))
    chunk.zero_grad(set_to_none=True)
    chunk(tokens[:, :-1], tokens[:, 1:], documents=documents).backward()
    return float(chunk.mtp.take_values()[0][0]), mtp_grads(chunk)


def test_uneven_dp_counts_give_the_global_per_token_gradient(ranks):
    counts = [sum(targets(mb) for mb in mbs) for mbs in DP_BATCHES]
    assert counts == [1, 3]  # #7452's case
    chunk = build_model_chunks(DP_CFG, RunPlan.resolve(DP_CFG, 1), ParallelState.serial())[0]
    sums = [[token_sums(chunk, mb) for mb in mbs] for mbs in DP_BATCHES]
    names = list(sums[0][0][1])
    assert {f"mtp.0.{part}.weight" for part in ("eh_proj", "enorm", "hnorm", "final_norm")} <= set(names)
    assert any(n.startswith("mtp.0.block.attention.") for n in names), names
    rank_sum = [{n: sum(g[n] for _, g in per_rank) for n in names} for per_rank in sums]
    per_token = {n: (rank_sum[0][n] + rank_sum[1][n]) / sum(counts) for n in names}
    per_rank_mean = {n: (rank_sum[0][n] / counts[0] + rank_sum[1][n] / counts[1]) / 2 for n in names}
    loss_sums = [sum(value for value, _ in per_rank) for per_rank in sums]
    want_loss = sum(loss_sums) / sum(counts)
    wrong_loss = (loss_sums[0] / counts[0] + loss_sums[1] / counts[1]) / 2
    assert abs(want_loss - wrong_loss) > 100 * TOL * want_loss  # the two normalisations differ on this data
    serial_weights = {n: p.detach() for n, p in chunk.named_parameters()}
    for rank, got in enumerate(ranks):
        run = got["dp"]
        assert all(torch.equal(w, serial_weights[n]) for n, w in run["initial"].items()), rank  # the same model
        assert abs(run["loss"]["mtp_1_loss"] - want_loss) <= TOL * want_loss, (rank, run["loss"], want_loss)
        for n in names:
            assert rel_err(run["grads"][n], per_token[n]) <= TOL, (rank, n)
        assert max(rel_err(run["grads"][n], per_rank_mean[n]) for n in names) > 100 * TOL, rank


def test_cp_rank_with_an_empty_shifted_mask_adds_a_finite_zero(ranks):
    cp = [got["cp"] for got in ranks]
    assert [targets(CP_SAMPLE, r["positions"]) for r in cp] == [targets(CP_SAMPLE), 0]  # rank 1: none at all
    assert targets(CP_SAMPLE) == 2
    for r in cp:
        assert all(torch.isfinite(torch.tensor(r[k]["loss"])) for k in ("rank1_only", "rank0_only", "both"))
    assert cp[1]["both"]["mtp"] == [0.0] and cp[0]["both"]["mtp"][0] > 0  # rank 1's MTP loss: a finite 0
    assert all(torch.count_nonzero(g) > 0 for g in cp[0]["rank0_only"]["grads"].values())  # rank 0's is not
    for rank, r in enumerate(cp):
        alone = r["rank1_only"]["grads"]
        assert alone and all(torch.count_nonzero(g) == 0 for g in alone.values()), rank  # exactly no contribution
        for n, g in r["both"]["grads"].items():
            assert torch.equal(g, r["rank0_only"]["grads"][n]), (rank, n)
