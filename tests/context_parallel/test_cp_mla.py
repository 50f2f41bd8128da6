"""Multi-head latent attention under context parallelism equals one process (issue 43).

MLA's core pads v to the query/key width (or q, k to a wider v), so the CP forms take it unchanged; this
proves it in one spawned 4-rank world, fp32:

- training of the model with one MTP depth (DeepSeek-V3's), 5 iterations (``MEGAZERO_PARITY_ITERS`` sets them),
  through the real build, schedule and ``Trainer``: cp 2 with the ring (p2p, dp 2), cp 2 all-to-all (dp 2), cp 4
  ring, cp 4 all-to-all, cp 4 hybrid (a2a 2 x ring 2) on synthetic and on packed documents, and cp 2 ring on packed
  documents (all three packing flags, documents straddling the CP chunks) without q LoRA and with a value head
  wider than the query/key head, and tp 2 x cp 2 with sequence parallelism (the shared RoPE key gathered over TP
  inside each CP rank). Per-iteration loss, MTP loss and grad norm within 1e-5 relative of one process, and every
  final weight (MTP's included) within 1e-5 (``rel_err``) of its;
- per-parameter gradients of one MLA layer (every weight's and the input's, summed over the CP ranks)
  within 1e-5 of the same layer run whole in the same rank, in each of those layouts' CP groups.

The one-process runs: one per distinct serial config (the six on synthetic batches share one), computed once per
session (``session_cache.cached``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megazero.config import Config
from megazero.context_parallel import CPContext, CPSplit
from megazero.model.documents import Documents, PackingRule, document_positions
from megazero.model.mla import MLA
from megazero.model.transformer import TPContext
from megazero.parallel.layout import Layout
from megazero.parallel.state import ParallelState
from megazero.pipeline.schedules import build_schedule
from megazero.run_plan import RunPlan
from megazero.training.metrics import MetricsLog
from megazero.training.trainer import Trainer
from tests.helpers.batches import PACKED_RULE, PackedBatches, SyntheticBatches
from tests.helpers.compare import full_parameters, full_params, rel_err
from tests.helpers.cp_runs import serial_config
from tests.helpers.dist import spawn
from tests.helpers.optimizer_harness import build
from tests.helpers.session_cache import cached
from tests.helpers.tiny_config import degrees, parity_iters, tiny_config

WORLD, ITERS, TOL = 4, parity_iters(), 1e-5
KEYS = ("loss", "grad_norm", "mtp_1_loss")  # one MTP depth, as DeepSeek-V3: its shifted targets cross CP chunks


def mla_cfg(cp: int, comm: str = "p2p", a2a: int | None = None, **flat: Any) -> Config:
    """A 2-layer MLA llama (q LoRA 16, latent 8, q/k 8 + 4 RoPE, v 6 unless given), 32 tokens, 2 x 2 samples."""
    mla = dict(arch="llama", multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
               qk_pos_emb_head_dim=4, v_head_dim=6, mtp_num_layers=1)
    return tiny_config(**degrees(cp=cp, comm=comm, a2a=a2a), **{**mla, **flat}, seq_length=32, vocab_size=512,
                       micro_batch_size=2, global_batch_size=4, train_iters=ITERS)


RUNS = {  # key: (config, packed documents)
    "cp2.p2p": (mla_cfg(2), False),
    "cp2.a2a": (mla_cfg(2, "a2a"), False),
    "cp4.p2p": (mla_cfg(4), False),
    "cp4.a2a": (mla_cfg(4, "a2a"), False),
    "cp4.hybrid": (mla_cfg(4, "a2a+p2p", 2), False),
    "cp4.hybrid.documents": (mla_cfg(4, "a2a+p2p", 2), True),
    "cp2.p2p.documents.no_q_lora.wide_v": (mla_cfg(2, q_lora_rank=None, v_head_dim=16), True),
    "tp2.cp2.sp": (mla_cfg(2, **degrees(tp=2, sp=True)), False),
}


def train_run(pstate: ParallelState, cfg: Config, packed: bool) -> dict[str, Any]:
    """Loss and grad norm per iteration and the final full weights, on synthetic or packed batches."""
    rule: PackingRule | None = PACKED_RULE if packed else None
    model = build(pstate, cfg)
    batches = (PackedBatches if packed else SyntheticBatches)(cfg, pstate.dp_rank, pstate.dp)
    schedule = build_schedule(RunPlan.resolve(cfg, pstate.layout.world_size), packing=rule)
    records = Trainer(cfg, pstate, model, schedule, batches, MetricsLog(None, enabled=False)).train()
    with full_parameters(model):
        params = {k: v.float() for chunk in model.chunks for k, v in full_params(chunk, pstate.tp_group).items()}
    return {"records": [tuple(r[k] for k in KEYS) for r in records], "params": params}


def layer_grad_errors(pstate: ParallelState, cfg: Config, packed: bool) -> dict[str, float]:
    """One MLA layer on this CP rank's tokens against the same layer on the whole sequence: output and every
    gradient (the weights' summed over the CP group), as ``rel_err``."""
    p, m = cfg.parallel, cfg.model
    split = CPSplit(cp=p.cp, a2a=p.cp_a2a)
    cp = CPContext(group=pstate.cp_group, rank=pstate.cp_rank, comm_type=p.cp_comm_type, split=split,
                   a2a_group=pstate.cp_a2a_group, ring_group=pstate.cp_ring_group)
    gen = torch.Generator().manual_seed(5)
    seq, batch = m.seq_length, 2
    whole, mine = MLA(m, TPContext()), MLA(m, TPContext(cp=cp))
    with torch.no_grad():
        for param in whole.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2 + (1.0 if param.ndim == 1 else 0.0))
    mine.load_state_dict(whole.state_dict())
    x, probe = torch.randn(seq, batch, m.hidden_size, generator=gen), torch.randn(seq, batch, m.hidden_size,
                                                                                   generator=gen)
    docs = mine_docs = None
    if packed:
        bounds = ((0, 5, 13, 22, seq), (0, 9, seq))  # documents across the 2 x cp chunks, of uneven lengths
        positions = document_positions(bounds, "cpu")
        docs = Documents(bounds=bounds, positions=positions)
        mine_docs = Documents(bounds=bounds, positions=split.take(positions, 1, pstate.cp_rank))
    x_whole = x.clone().requires_grad_()
    (whole(x_whole, documents=docs) * probe).sum().backward()
    x_mine = split.take(x, 0, pstate.cp_rank).requires_grad_()
    out_mine = mine(x_mine, documents=mine_docs)
    (out_mine * split.take(probe, 0, pstate.cp_rank)).sum().backward()
    with torch.no_grad():
        out_whole = whole(x, documents=docs)
    errs = {"output": rel_err(out_mine, split.take(out_whole, 0, pstate.cp_rank)),
            "input grad": rel_err(x_mine.grad, split.take(x_whole.grad, 0, pstate.cp_rank))}
    for (name, theirs), ours in zip(whole.named_parameters(), mine.parameters()):
        grad = ours.grad.clone()
        dist.all_reduce(grad, group=pstate.cp_group)
        assert theirs.grad.abs().max() > 0, name
        errs[name + " grad"] = rel_err(grad, theirs.grad)
    return errs


def _world(pstate: ParallelState) -> dict[str, Any]:
    states: dict[tuple, ParallelState] = {}
    out: dict[str, Any] = {}
    for key, (cfg, packed) in RUNS.items():
        p = cfg.parallel
        layout = (p.tp, WORLD // (p.tp * p.cp), 1, p.cp, p.cp_a2a)
        if layout not in states:  # collective: every rank builds every layout's groups in the same order
            states[layout] = ParallelState.build(Layout(*layout[:4]), "cpu", cp_a2a=p.cp_a2a)
        out[key] = train_run(states[layout], cfg, packed)
        out[key]["layer"] = layer_grad_errors(states[layout], cfg, packed)
    return out


def _serial_run(cfg: Config, packed: bool) -> dict[str, Any]:
    return train_run(ParallelState.serial(), cfg, packed)


def serial_run(cfg: Config, packed: bool) -> dict[str, Any]:
    """The one-process run of ``cfg``'s serial config, once per session."""
    return cached(_serial_run, serial_config(cfg), packed)


def test_mla_under_every_cp_form_trains_what_one_process_trains():
    world = spawn(_world, WORLD)
    bad: list[str] = []
    for key, (cfg, packed) in RUNS.items():
        serial = serial_run(cfg, packed)
        assert len(serial["records"]) == ITERS and all(torch.isfinite(torch.tensor(serial["records"])).flatten())
        for rank, per_run in enumerate(world):
            got = per_run[key]
            for i, (step, want) in enumerate(zip(got["records"], serial["records"], strict=True)):
                for what, g, w in zip(KEYS, step, want):
                    if not abs(g - w) <= TOL * abs(w):
                        bad.append(f"{key} rank {rank} {what}[{i}]: {g} vs {w}")
            assert got["params"].keys() == serial["params"].keys(), key
            bad += [f"{key} rank {rank} weight {name}: {rel_err(v, serial['params'][name])}"
                    for name, v in got["params"].items() if not rel_err(v, serial["params"][name]) <= TOL]
            bad += [f"{key} rank {rank} layer {name}: {err}" for name, err in got["layer"].items() if not err <= TOL]
    assert not bad, "\n".join(bad)
