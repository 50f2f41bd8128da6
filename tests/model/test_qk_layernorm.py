"""--qk-layernorm (and --kv-channels) train the same model under TP, CP, recompute and ZeRO as in one process.

The q/k head-norm weights are replicated over TP, but each TP rank normalises only its own heads, so
each rank's weight gradient is a partial sum: the gradient-sync engine must sum it over TP (as it does
a sequence-parallel norm's), or the tp 2 runs drift from the serial one. Under CP the norms act on each
rank's own tokens before the K/V exchange. Loss and grad norm per iteration and the final weights are
compared with the one-process run (fp32; TP's reordered sums get the harness's TP tolerance).
"""
from __future__ import annotations

import dataclasses

import pytest

from megazero.config import Config, ConfigError, ModelConfig
from tests.helpers.cp_runs import CPRun, make_cfg, run_many, serial_reference
from tests.helpers.dist import spawn
from tests.helpers.optimizer_harness import compare_runs, failures, tolerance

ITERS = 5


def _qk(cfg: Config) -> Config:
    """--qk-layernorm with --kv-channels 16 (twice hidden / heads, as Qwen3-30B-A3B's head_dim is)."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, qk_layernorm=True, kv_channels=16))


RUNS = [CPRun("tp2.sp.zero1.selective", _qk(make_cfg("llama", tp=2, sp=True, zero=1, recompute="selective",
                                                     iters=ITERS))),
        CPRun("tp2.full", _qk(make_cfg("llama", tp=2, recompute="full", iters=ITERS))),
        CPRun("cp2.p2p", _qk(make_cfg("llama", cp=2, iters=ITERS))),
        CPRun("cp2.a2a.zero3", _qk(make_cfg("llama", cp=2, comm="a2a", zero=3, iters=ITERS)))]


def test_qk_layernorm_tp2_and_cp2_match_serial():
    ref = serial_reference(RUNS[0].cfg)  # recompute, ZeRO and the layout do not change the math
    norms = [n for n in ref["params"] if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 4 and all((ref["params"][n] != 1).any() for n in norms)  # trained, so compared
    bad = {}
    for rank, per_rank in enumerate(spawn(run_many, 2, RUNS, cp=2)):
        for run in RUNS:
            errs = compare_runs(per_rank[run.key], ref, run.key)
            bad.update({f"rank{rank}.{k}": v for k, v in failures(errs, tolerance(run.cfg.parallel.tp)).items()})
    assert not bad, dict(sorted(bad.items(), key=lambda kv: -kv[1])[:6])


def test_kv_channels_sets_the_head_dimension():
    """--kv-channels frees the head dimension from --hidden-size / --num-attention-heads; RoPE needs it even."""
    cfg = ModelConfig(arch="llama", hidden_size=60, num_attention_heads=4, kv_channels=32)
    assert cfg.head_dim == 32
    with pytest.raises(ConfigError, match="--hidden-size \\(60\\) must be divisible .* or set --kv-channels"):
        ModelConfig(arch="llama", hidden_size=60, num_attention_heads=8)
    with pytest.raises(ConfigError, match="head dimension \\(15\\) must be even for RoPE"):
        ModelConfig(arch="llama", hidden_size=64, num_attention_heads=4, kv_channels=15)


def test_a_resumed_run_compares_kv_channels_by_meaning():
    """--load: an explicit --kv-channels equal to the checkpoint's hidden / heads agrees; another one is refused."""
    from megazero.checkpoint.load import merge_config

    saved = {"arch": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 300}
    meta = {"config": Config.from_flat(saved).to_flat()}
    def given(kv_channels: int) -> Config:
        return Config.from_flat({"kv_channels": kv_channels}, explicit=frozenset({"kv_channels"}))

    assert merge_config(meta, given(16))[0].model.head_dim == 16
    with pytest.raises(ConfigError, match=r"--kv-channels 32 contradicts the checkpoint's None \(i.e. head_dim 16"):
        merge_config(meta, given(32))
