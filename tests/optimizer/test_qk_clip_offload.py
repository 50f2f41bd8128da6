"""QK-clip with the optimizer state offloaded (``--offload-optimizer cpu|disk``): the clip scales the master shards
where they live (host memory; the disk tier's file, streamed through its buffers) and stores them into the
parameters as the step does.

One process at ZeRO 1, llama (GQA) and MLA, 3 Muon steps with some heads clipped every step: each offloaded run
equals the in-memory run bitwise (on a CPU-only machine host = device, so the stores run the same kernels on the
same numbers): the heads clipped per step, every step's per-head max-logit table, and the final weights.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from megazero.parallel.state import ParallelState
from tests.helpers.optimizer_harness import train
from tests.helpers.tiny_config import degrees, family, tiny_config

MODELS = {  # name: (model settings, tau clipping some heads of 8 every step)
    "gqa": (family("llama"), 0.052),
    "mla": (dict(arch="llama", multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
                 qk_pos_emb_head_dim=4, v_head_dim=6), 0.025),
}


def clipped_run(model: dict[str, Any], tau: float, **offload: Any) -> dict[str, Any]:
    cfg = tiny_config(**model, **degrees(zero=1), optimizer="muon", lr=0.02, train_iters=3, micro_batch_size=2,
                      global_batch_size=8, qk_clip_threshold=tau, bucket_size=3000, **offload)
    tables: list[torch.Tensor] = []

    def keep_tables(built, _) -> None:
        step = built.optimizer.step

        def step_and_keep(lr: float):
            result = step(lr)
            tables.append(built.optimizer.after_update.__self__.max_logits.clone())
            return result
        built.optimizer.step = step_and_keep

    result = train(ParallelState.serial(), cfg, hook=keep_tables)
    return {"counts": [r["qk_clip_count"] for r in result["records"]], "tables": tables, "params": result["params"]}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_offloaded_clip_is_the_in_memory_clip(name, tmp_path):
    model, tau = MODELS[name]
    ref = clipped_run(model, tau)
    assert all(0 < count < 8 for count in ref["counts"]), ref["counts"]
    runs = {"cpu": clipped_run(model, tau, offload_optimizer="cpu"),
            "disk": clipped_run(model, tau, offload_optimizer="disk", offload_path=str(tmp_path),
                                offload_buffer_size=256)}  # pieces smaller than a bucket's shard
    for where, run in runs.items():
        assert run["counts"] == ref["counts"], where
        assert all(torch.equal(a, b) for a, b in zip(run["tables"], ref["tables"])), where
        assert run["params"].keys() == ref["params"].keys()
        assert all(torch.equal(p, ref["params"][n]) for n, p in run["params"].items()), where
