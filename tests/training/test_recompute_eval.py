"""Activation recompute keeps the math (tp=2 x pp=2, sequence parallel, dropout on) and saves memory;
the validation loss through a pipeline equals a direct serial computation on the same batches."""
from __future__ import annotations

import torch

from megazero.model.chunk import blocks_of
from megazero.model.gpt import GPTModel
from megazero.model.recompute import apply_recompute
from megazero.model.transformer import TPContext
from megazero.parallel.state import ParallelState
from megazero.run_plan import RunPlan
from megazero.tensor_parallel.layers import initialize_parameters
from megazero.tensor_parallel.random import seed_everything
from megazero.training.evaluate import evaluate
from megazero.training.parallelize import build_model_chunks
from tests.helpers.compare import rel_err
from tests.helpers.dist import spawn
from tests.helpers.pipeline_harness import SyntheticBatches, make_cfg, train
from tests.helpers.saved_tensors import SavedTensorMeter

MODES = ("none", "selective", "full")


def _with_dropout(arch: str, mode: str, **layout):
    cfg = make_cfg(arch, **layout)
    return cfg.updated(hidden_dropout=0.1, attention_dropout=0.1, recompute=mode)


def recompute_parity_and_eval(pstate) -> dict[str, float]:
    errs: dict[str, float] = {}
    for arch in ("gpt2", "llama"):
        runs = {}
        for mode in MODES:
            seed_everything(7, pstate.pp_rank)  # the shared dropout stream starts alike for every mode
            runs[mode] = train(_with_dropout(arch, mode, tp=2, pp=2, sp=True), pstate)
        for mode in ("selective", "full"):
            pairs = zip(runs[mode]["losses"], runs["none"]["losses"])
            errs[f"{arch}.{mode}.losses"] = max(abs(a - b) for a, b in pairs)
            for name, p in runs[mode]["params"].items():
                errs[f"{arch}.{mode}.{name}"] = rel_err(p, runs["none"]["params"][name])
        # only its first loss (the forward before any step) is compared: one iteration is the whole check
        no_dropout = train(make_cfg(arch, tp=2, pp=2, sp=True).updated(train_iters=1), pstate)["losses"][0]
        errs[f"{arch}.dropout_had_no_effect"] = float(runs["none"]["losses"][0] == no_dropout)  # must be 0
        errs[f"{arch}.eval"] = _eval_error(arch, pstate)
    return errs


def _eval_error(arch: str, pstate) -> float:
    """evaluate() through tp=2 x pp=2 vs the serial model's mean loss on the same two global batches."""
    cfg = make_cfg(arch, tp=2, pp=2)
    plan = RunPlan.resolve(cfg, pstate.layout.world_size)
    chunks = build_model_chunks(cfg, plan, pstate)
    got = evaluate(chunks, SyntheticBatches(cfg, 0, 1), 2, pstate, plan.stage_shape, plan.compute_dtype)["val_loss"]
    serial_cfg = make_cfg(arch)
    serial = ParallelState.serial()
    model = build_model_chunks(serial_cfg, RunPlan.resolve(serial_cfg, serial.layout.world_size), serial)[0].eval()
    batches = SyntheticBatches(serial_cfg, 0, 1)
    with torch.no_grad():
        losses = [model(mb[:, :-1], mb[:, 1:]) for _ in range(2) for mb in batches.next_step()]
    want = float(torch.stack(losses).mean())
    return abs(got - want) / abs(want)


def test_recompute_parity_and_eval_tp2_pp2():
    for rank, errs in enumerate(spawn(recompute_parity_and_eval, 4, tp=2, pp=2)):
        bad = {k: v for k, v in errs.items() if not v <= 1e-6}
        assert not bad, f"rank {rank}: {bad}"


def test_recompute_saves_activation_memory():
    cfg = make_cfg("gpt2", seq=64).model
    saved = {}
    for mode in MODES:
        model = GPTModel(cfg, TPContext())
        initialize_parameters(model, 1, None)
        apply_recompute(blocks_of(model), mode)
        tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length + 1), generator=torch.Generator().manual_seed(0))
        with SavedTensorMeter(model.parameters()) as meter:
            model(tokens[:, :-1], tokens[:, 1:])
        saved[mode] = meter.bytes
    assert saved["full"] < saved["selective"] < saved["none"], saved
