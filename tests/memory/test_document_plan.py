"""The planner under --reset-attention-mask: per-document attention bytes and the attended pairs' work.

Measured: bytes autograd saves in one forward of packed samples (``SavedTensorMeter``), documents of
L tokens (an EOD every L tokens, L = S, 16, 12: 12 does not divide S), against the plan of documents
of L (``--plan-document-length``): serial gpt2 and llama, flash (no dropout) and the math kernel
(attention dropout: its per-document L x L scores), recompute none and selective; and in one cp 2
world the ring and the all-to-all (their cores keep the same bytes under the mask). Within 1%
(measured: to 16 bytes); the plan without the mask misses the math kernel's by more than 10%.

Formula: the math kernel's scores term is 3 b n sum_d L_d^2 e / t per layer, the flash kernel's bytes are
causal attention's; the step-time model's compute scales the attention core by the attended share, here
counted from the block-diagonal causal mask itself (whole sequence, and the busiest rank of the ring).
The planner's output says the documents it assumed; the flag alone is refused in one line.
"""
from __future__ import annotations

import json
import itertools

import pytest
import torch

from megazero.config import Config, ConfigError
from megazero.context_parallel.split import CPSplit
from megazero.memory import Hardware, PlanSpec, chunk_activation_bytes, format_plan, plan_memory, step_time
from megazero.memory.documents import ring_hop_shares
from megazero.memory.search import cp_seconds
from megazero.model.chunk import blocks_of
from megazero.model.documents import PackingRule
from megazero.model.flops import flops_per_token
from megazero.model.recompute import apply_recompute
from megazero.parallel.state import ParallelState
from megazero.run_plan import RunPlan
from megazero.training.parallelize import build_model_chunks
from tests.helpers.dist import spawn
from tests.helpers.saved_tensors import SavedTensorMeter
from tests.helpers.tool_module import load_tool

VOCAB, BATCH, SEQ, EOD = 1000, 2, 64, 2
ARCHS = {"gpt2": {"arch": "gpt2", "num_attention_heads": 4},
         "llama": {"arch": "llama", "num_attention_heads": 8, "num_query_groups": 2}}
LENGTHS = (SEQ, 16, 12)


def packed_config(arch: str, length: int | None, cp: int = 1, comm: str = "p2p", dropout: float = 0.0,
                  recompute: str = "none", **flat) -> Config:
    """A tiny model planning documents of ``length`` (None: without the mask)."""
    docs = {"reset_attention_mask": True, "plan_document_length": length} if length else {}
    return Config.from_flat({**ARCHS[arch], "num_layers": 2, "hidden_size": 64, "seq_length": SEQ,
                             "vocab_size": VOCAB, "micro_batch_size": BATCH, "global_batch_size": 2 * BATCH,
                             "device": "cpu", "seed": 5, "context_parallel_size": cp, "cp_comm_type": comm,
                             "attention_dropout": dropout, "hidden_dropout": dropout, "recompute": recompute,
                             **docs, **flat})


def _saved_and_planned(pstate: ParallelState, cfg: Config) -> tuple[int, int, int]:
    """(measured, planned with the mask, planned without) bytes one forward of packed samples saves."""
    plan = RunPlan.resolve(cfg, pstate.layout.world_size)
    (model,) = build_model_chunks(cfg, plan, pstate)
    apply_recompute(blocks_of(model), cfg.training.recompute)
    length = cfg.data.plan_document_length
    tokens = torch.randint(3, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    tokens[:, :SEQ] = torch.where(torch.arange(SEQ) % length == length - 1, EOD, tokens[:, :SEQ])
    documents = PackingRule(EOD, reset_attention_mask=True).documents(tokens[:, :-1])
    with SavedTensorMeter(model.parameters()) as meter:
        loss = model.train()(tokens[:, :-1], tokens[:, 1:], documents=documents)
    loss.backward()
    masked = PlanSpec.from_plan(cfg, plan, "cpu").activation_spec()
    plain = PlanSpec.for_world(cfg.updated(reset_attention_mask=False, plan_document_length=None),
                               pstate.layout.world_size, "cpu").activation_spec()
    return (meter.bytes, *(chunk_activation_bytes(cfg.model, a, 2, True, True) for a in (masked, plain)))


def _check(cases: dict[str, tuple[int, int, int]]) -> None:
    bad = {k: (m, p) for k, (m, p, _) in cases.items() if abs(p - m) > 0.01 * m}
    assert not bad, f"(measured, planned) off by more than 1%: {bad}"


def test_planned_activations_match_measured_per_document_attention():
    cases = {}
    for arch, dropout, recompute, length in itertools.product(ARCHS, (0.0, 0.1), ("none", "selective"), LENGTHS):
        cfg = packed_config(arch, length, dropout=dropout, recompute=recompute)
        cases[f"{arch} dropout={dropout} {recompute} L={length}"] = _saved_and_planned(ParallelState.serial(), cfg)
    _check(cases)
    for arch in ARCHS:  # the plan without the mask keeps the whole S x S scores: far off
        measured, _, plain = cases[f"{arch} dropout=0.1 none L=12"]
        assert plain > 1.1 * measured, (arch, measured, plain)


def _cp_world(pstate: ParallelState) -> dict[str, tuple[int, int, int]]:
    return {f"{arch} {comm}": _saved_and_planned(pstate, packed_config(arch, 12, cp=2, comm=comm))
            for arch, comm in itertools.product(ARCHS, ("p2p", "a2a"))}


def test_planned_cp_activations_match_measured_with_documents():
    for per_rank in spawn(_cp_world, 2, cp=2):
        _check(per_rank)


def _square_sum(length: int) -> int:
    """sum_d L_d^2 of a sample of SEQ tokens cut every ``length`` tokens, counted document by document."""
    sizes = [min(length, SEQ - start) for start in range(0, SEQ, length)]
    return sum(n * n for n in sizes)


def _activations(cfg: Config) -> float:
    return plan_memory(PlanSpec.for_world(cfg, 1, "cpu")).stages[0].activations_bytes


@pytest.mark.parametrize("length", LENGTHS[1:])
def test_mask_changes_the_attention_bytes_as_the_formula_says(length):
    for arch in ARCHS:
        math_saved = _activations(packed_config(arch, None, dropout=0.1)) - _activations(
            packed_config(arch, length, dropout=0.1))
        heads, layers = ARCHS[arch]["num_attention_heads"], 2
        assert math_saved == layers * 3 * BATCH * heads * (SEQ * SEQ - _square_sum(length)) * 4, arch
        flash_added = _activations(packed_config(arch, length)) - _activations(packed_config(arch, None))
        assert flash_added == 0, arch  # the per-document calls write into one output


def _mask_share(length: int, split: CPSplit | None = None) -> float:
    """Attended pairs over causal pairs, counted on the block-diagonal causal mask (busiest CP rank)."""
    doc = torch.arange(SEQ) // length
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    rows = [split.positions(SEQ, r) for r in range(split.cp)] if split else [torch.arange(SEQ)]
    return max(allowed[r].sum().item() / causal[r].sum().item() for r in rows)


@pytest.mark.parametrize("length", LENGTHS[1:])
def test_step_time_counts_the_attended_pairs(length):
    hw = Hardware(gpus=2, gpu_memory_gib=80, intra_node_bandwidth=1e30, inter_node_bandwidth=1e30)
    for cp, comm in ((1, "p2p"), (2, "p2p"), (2, "a2a")):
        specs = [PlanSpec.for_world(packed_config("llama", n, cp=cp, comm=comm), 2) for n in (None, length)]
        times = [step_time(s, plan_memory(s), hw) for s in specs]  # compute only: communication is free here
        share = _mask_share(length, CPSplit(cp=2) if comm == "p2p" and cp == 2 else None)
        model = specs[0].model
        flops = [flops_per_token(model, vocab_size=specs[0].run.padded_vocab_size, attended_share=a)
                 for a in (None, share)]
        assert times[1] / times[0] == pytest.approx(flops[1] / flops[0], rel=1e-9), (cp, comm)
        assert times[1] < times[0]


def _ring_spec(length: int | None, seq: int = 4096, cp: int = 4) -> PlanSpec:
    return PlanSpec.for_world(packed_config("llama", length, cp=cp, seq_length=seq), cp)


def test_ring_exchange_carries_only_the_rows_the_planned_documents_need():
    """Documents inside the 2 x cp chunks: no ring hop carries anything; L = S: the unmasked exchange;
    documents crossing chunks: between, and the K/V hops of the busiest sender counted on the mask."""
    hw = Hardware(gpus=4, gpu_memory_gib=80)
    unmasked = cp_seconds(_ring_spec(None), hw)
    assert cp_seconds(_ring_spec(4096), hw) == pytest.approx(unmasked, rel=1e-12)
    assert cp_seconds(_ring_spec(512), hw) == 0.0  # chunks of 512 tokens: every document inside one
    hops, accumulators = ring_hop_shares(48, 4, 10)  # chunks of 6: documents of 10 cross them
    assert (hops, accumulators) == (_mask_hop_rows(48, 4, 10), 3 * _mask_hop_rows(48, 4, 10, only_first=True))
    assert 0 < cp_seconds(_ring_spec(640), hw) < unmasked


def _mask_hop_rows(seq: int, ring: int, length: int, only_first: bool = False) -> float:
    """Rows of a ring rank's K/V the hops carry (per hop, the busiest sender; in local rows), from the mask:
    hop h of rank src's K/V carries the span of its key rows some query of ranks src+h .. src+R-1 attends."""
    doc = torch.arange(seq) // length
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    split, local = CPSplit(cp=ring), seq // ring
    total = 0
    for hop in (1,) if only_first else range(1, ring):
        most = 0
        for src in range(ring):
            keys = split.positions(seq, src)
            queries = torch.cat([split.positions(seq, (src + h) % ring) for h in range(hop, ring)])
            used = allowed[queries][:, keys].any(dim=0)  # [local] rows of src some rank ahead attends to
            spans = 0
            for half in (used[:local // 2], used[local // 2:]):  # a span per chunk, first to last used row
                rows = torch.nonzero(half).flatten()
                spans += int(rows[-1] - rows[0] + 1) if rows.numel() else 0
            most = max(most, spans)
        total += most
    return total / local


def test_planner_output_says_the_documents_it_assumed():
    tool = load_tool("plan_memory")
    base = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "4096", "--vocab-size", "1000", "--dp", "1", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--recompute", "none", "--reset-attention-mask"]
    _, text = tool.report(base + ["--plan-document-length", "512"])
    assert "planned as documents of 512 tokens; attention work x 0.125 of causal" in text
    _, text = tool.report(base)
    assert "planned as documents of 4096 tokens (--seq-length: one document per sample, the upper bound)" in text
    _, text = tool.report(base + ["--plan-document-length", "512", "--json"])
    assert json.loads(text)["layouts"][0]["layout"]["document_length"] == 512
    assert "documents:" not in format_plan(plan_memory(PlanSpec.for_world(packed_config("gpt2", None), 1)))
    with pytest.raises(ConfigError, match="--plan-document-length 512 only applies with --reset-attention-mask"):
        packed_config("gpt2", None, plan_document_length=512)
