"""QK-clip under --compile: the attention core's max-logit capture (``context_parallel/logit_max.py``) is traced
into the compiled block (dynamo records the sink's state as a side effect; no graph break, the core is not
made eager), so a compiled run clips what the eager run clips.

One process, 3 Muon steps of 4 micro-batches each, some heads clipped every step: the compiled run (the
``aot_eager`` backend: dynamo's graphs and AOTAutograd's forward/backward, as tests/model/test_compile.py's
multi-rank runs; inductor took 30 CPU-s here and gave the same counts, max logits within 2e-7) equals eager in
the heads clipped per step and, bitwise, in every step's per-head max-logit table (so every gamma), for GQA
llama and MLA.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from megazero.model.chunk import blocks_of
from megazero.parallel.state import ParallelState
from tests.helpers.optimizer_harness import train
from tests.helpers.tiny_config import family, tiny_config

MODELS = {  # name: (model settings, tau clipping some heads of 8 every step)
    "gqa": (family("llama"), 0.052),
    "mla": (dict(arch="llama", multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
                 qk_pos_emb_head_dim=4, v_head_dim=6), 0.025),
}


def clipped_run(compile: bool, model: dict[str, Any], tau: float) -> dict[str, Any]:
    cfg = tiny_config(**model, optimizer="muon", lr=0.02, train_iters=3, micro_batch_size=2, global_batch_size=8,
                      qk_clip_threshold=tau, compile=compile, compile_backend="aot_eager")
    tables: list[torch.Tensor] = []
    compiled: list[bool] = []

    def keep_tables(built, _) -> None:
        step = built.optimizer.step
        blocks = [b for chunk in built.chunks for b in blocks_of(chunk)]
        compiled.extend(b.compiled_body is not None and not b.attention.core_eager for b in blocks)

        def step_and_keep(lr: float):
            result = step(lr)
            tables.append(built.optimizer.after_update.__self__.max_logits.clone())
            return result
        built.optimizer.step = step_and_keep

    records = train(ParallelState.serial(), cfg, hook=keep_tables)["records"]
    return {"counts": [r["qk_clip_count"] for r in records], "tables": tables, "compiled": compiled}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_compiled_run_clips_what_eager_clips(name):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        eager, compiled = (clipped_run(on, *MODELS[name]) for on in (False, True))
    finally:
        torch.set_num_threads(threads)
    assert compiled["compiled"] == [True, True] and eager["compiled"] == [False, False]  # the core is in the graph
    assert all(0 < count < 8 for count in eager["counts"]), eager["counts"]
    assert compiled["counts"] == eager["counts"]
    assert len(compiled["tables"]) == 3 and all(torch.equal(c, e) for c, e in zip(compiled["tables"], eager["tables"]))
