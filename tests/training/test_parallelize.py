"""``parallelize``: one visible wrap in a stated order - recompute, compile, the DP engine, loss scaling."""
from __future__ import annotations

import re

import pytest

from megazero.model.chunk import blocks_of
from megazero.model.compile import apply_compile
from megazero.model.gpt import GPTModel
from megazero.model.recompute import apply_recompute
from megazero.model.transformer import TPContext
from megazero.run_plan import RunPlan
from megazero.training.parallelize import build_training_model
from tests.helpers.dist import spawn
from tests.helpers.pipeline_harness import make_cfg


def wrapped_repr(pstate) -> dict:
    """tp 2 x pp 2, ZeRO 3 (one block per unit), full recompute, compile, fp16: what ``print(model)`` shows."""
    cfg = make_cfg("gpt2", tp=2, pp=2, sp=True).updated(zero=3, recompute="full", compile=True,
                                                        compile_backend="aot_eager", fp16=True)
    plan = RunPlan.resolve(cfg, pstate.layout.world_size)
    model = build_training_model(cfg, plan, pstate)
    hooks = [h.__qualname__ for chunk in model.chunks for h in chunk._forward_hooks.values()]
    return {"repr": repr(model), "last_forward_hook": hooks[-1]}


def test_print_model_shows_every_wrap_of_a_tp2_pp2_zero3_run():
    for rank, got in enumerate(spawn(wrapped_repr, 4, tp=2, pp=2)):
        text = got["repr"]
        head = text.splitlines()[0]
        assert head.startswith("TrainingModel(zero 3, ") and "every micro-batch, dynamic loss scale" in head, head
        blocks = re.findall(r"TransformerBlock\(\n\s*(.*)", text)
        assert len(blocks) == 2, f"rank {rank}: two of the four blocks per stage\n{text}"
        # the root unit (embedding / head) is unit 0 of each chunk, so the blocks are units 1 and 2
        for unit, line in enumerate(blocks, start=1):
            assert re.search(rf"layer \d, recompute=full, compiled, zero3 unit {unit}$", line), line
        # step 4 after step 3: the loss-scale hook is the last forward hook on the chunk, after ZeRO 3's
        assert got["last_forward_hook"].startswith("DynamicLossScaler.attach"), got["last_forward_hook"]


def _small_model() -> GPTModel:
    return GPTModel(make_cfg("llama").updated(attention_dropout=0.1).model, TPContext())


def test_compile_follows_the_recompute_set_before_it():
    """Selective recompute first: compile makes the checkpointed core a graph break, and both show."""
    model = _small_model()
    apply_recompute(blocks_of(model), "selective")
    apply_compile(model, backend="aot_eager")
    for block in blocks_of(model):
        assert "recompute=selective, compiled" in block.extra_repr()
        assert block.attention.extra_repr() == "recompute=selective, core eager"


def test_recompute_after_compile_is_refused():
    model = _small_model()
    apply_compile(model, backend="aot_eager")
    with pytest.raises(ValueError, match="recompute is set before compile"):
        apply_recompute(blocks_of(model), "full")
    assert all(block.recompute == "none" for block in blocks_of(model))
