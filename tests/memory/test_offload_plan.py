"""The planner with offload: device / host / disk bytes per rank against real runs, and the search.

One dp2 gloo world builds six offloaded optimizers (zero 0/1/2/3; fp32 and bf16; host, and disk
with 2 and 3 buffers; ZeRO 3's parameter shards on the host and on disk too), runs two real
steps of each under ``StepStateMeter`` and reads the optimizer's own accounting
(``measured_state_bytes``). The planner must give:

- the host and disk bytes exactly (12 bytes x the padded shard elements for the optimizer state,
  the disk tier's K buffers of the largest bucket's state, w bytes x the shard elements for
  offloaded parameters: no rounding anywhere);
- no optimizer state on the device, exactly;
- the device's parameter and gradient peak within 2%, as ``test_model_state`` requires of the
  in-memory planner (parameters on disk: the replay runs without prefetch, since a prefetch there
  only starts the read; with prefetch it overstates this run's peak by ~7%, which fails here).

The search case needs no processes: a 7B model on one 80 GiB GPU fits only with the optimizer
state offloaded, and with too little host memory only on disk.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from megazero.config import Config, ConfigError, ModelConfig, Placement
from megazero.memory import GIB, Hardware, PlanSpec, format_candidates, plan_memory, search_layouts
from megazero.memory.offload import STATE_BYTES, OffloadHardware, offload_seconds
from megazero.optimizer.accounting import measured_state_bytes
from megazero.run_plan import RunPlan
from tests.helpers.dist import spawn
from tests.helpers.step_meter import run_metered
from tests.helpers.tool_module import load_tool

MODELS = {
    "gpt2": dict(arch="gpt2", num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1100),
    "llama": dict(arch="llama", num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                  seq_length=16, vocab_size=1100),
}
RUNS = [  # (zero, precision, model, offload optimizer, buffers, offload params)
    (0, "fp32", "gpt2", "cpu", 2, "none"),  # fp32: 8 bytes/element in memory, 12 offloaded (a separate master)
    (1, "bf16", "llama", "cpu", 2, "none"),
    (2, "fp32", "llama", "disk", 2, "none"),
    (3, "bf16", "gpt2", "disk", 3, "none"),
    (3, "bf16", "llama", "cpu", 2, "cpu"),
    (3, "fp32", "gpt2", "cpu", 2, "disk"),
]
EXACT = ("optimizer_bytes", "optimizer_host_bytes", "optimizer_disk_bytes", "params_host_bytes", "params_disk_bytes")


def _config(zero: int, precision: str, model: str, offload: str, buffers: int, params: str, folder: str) -> Config:
    flat = {**MODELS[model], "zero": zero, "bf16": precision == "bf16", "micro_batch_size": 2,
            "global_batch_size": 8, "device": "cpu", "bucket_size": 3000, "offload_optimizer": offload,
            "offload_params": params, "offload_path": folder if "disk" in (offload, params) else None}
    if offload == "disk":  # the host buffers exist only for the disk tier of the optimizer state
        flat.update(offload_buffers=buffers,
                    offload_buffer_size=500)  # below a bucket's shard: the buffers follow it, not the bucket
    return Config.from_flat(flat)


def measured(pstate, folder: str) -> list[dict]:
    """Per run: this rank's device peak over two real steps and the optimizer's host / disk record."""
    out = []
    for run in RUNS:
        opt, record = run_metered(pstate, _config(*run, folder))
        out.append({**record, **{k: v for k, v in measured_state_bytes(opt).items() if k in EXACT}})
        opt.close()
    return out


def test_offload_plan_matches_measured_bytes(tmp_path):
    results = spawn(measured, 2, str(tmp_path / "offload"))
    bad = []
    for run_index, run in enumerate(RUNS):
        cfg = _config(*run, str(tmp_path / "offload"))
        plan = plan_memory(PlanSpec.from_plan(cfg, RunPlan.resolve(cfg, 2), device="cpu"))
        stage = plan.stages[0]
        where = plan.spec.run.placement
        assert (where.optimizer_state.flag_word, where.offload_buffers, where.parameters.flag_word) == run[3:], where
        for rank, rec in enumerate(r[run_index] for r in results):
            exact = {k: getattr(stage, k) for k in EXACT}
            bad += [f"{run} rank {rank} {k}: planned {v:.0f}, measured {rec.get(k, 0)}" for k, v in exact.items()
                    if rec.get(k, 0) != v]  # a record without params_*: nothing offloaded there
            for key in ("params_bytes", "grads_bytes"):
                err = abs(getattr(stage, key) - rec[key]) / rec[key]
                if err > 0.02:
                    bad.append(f"{run} rank {rank} {key}: planned {getattr(stage, key):.0f}, measured {rec[key]}")
        assert stage.optimizer_bytes == 0 and stage.host_bytes > 0, stage
        if run[3] == "disk":  # the file holds the whole state, the host only K buffers of 500 elements of it
            assert stage.optimizer_disk_bytes == STATE_BYTES * stage.shard_elements > stage.optimizer_host_bytes
            assert stage.optimizer_host_bytes == run[4] * STATE_BYTES * 500, stage
    assert not bad, "\n".join(bad)


LLAMA_7B = ModelConfig(arch="llama", num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                       seq_length=4096, vocab_size=32000)


def test_search_lists_layouts_that_fit_only_with_offload():
    """One 80 GiB GPU: 7B's 16 bytes/parameter never fit; moving the 12 of the optimizer off the device does
    (to the host, or with 64 GiB of host memory to disk), at a cost the table labels as assumed."""
    base = Config(model=LLAMA_7B).updated(recompute="full", bf16=True, global_batch_size=8)
    hw = Hardware(gpus=1, gpu_memory_gib=80)
    assert search_layouts(base, hw) == []
    found = search_layouts(base, hw, recomputes=("full",), offload=True)
    assert found and all(c.offload_only and c.spec.run.placement.optimizer_state is Placement.HOST
                         for c in found), found
    best = found[0]
    st, n = best.plan.peak, best.plan.peak.shard_elements
    assert n >= 6_738_415_616 and st.optimizer_bytes == 0 and st.optimizer_host_bytes == 12 * n, st
    in_memory = plan_memory(best.spec.updated(offload_optimizer="none")).peak
    assert st.total_bytes <= hw.usable_bytes < in_memory.total_bytes
    # assumed cost: grads down (4 n) and params up (2 n) at 25 GB/s, AdamW at 1e9 elements/s
    assert best.plan.offload_seconds() == pytest.approx(6 * n / 25e9 + n / 1e9)
    table = format_candidates(found, hw, top=3)
    assert "opt:cpu" in table and "assumed" in table, table
    small_host = search_layouts(base, replace(hw, host_memory_gib=64), recomputes=("full",), offload=True)
    assert small_host and all(c.spec.run.placement.optimizer_state is Placement.DISK for c in small_host), small_host
    disk = small_host[0].plan.peak
    assert disk.optimizer_disk_bytes == 12 * n and disk.host_bytes < 64 * GIB, disk
    assert small_host[0].step_seconds > best.step_seconds  # the disk tier costs more under the same assumptions
    assert offload_seconds(n, 2, 4, 1, True, Placement.DISK, Placement.DEVICE, OffloadHardware()) == pytest.approx(
        6 * n / 25e9 + n / 1e9 + 12 * n * 2 / 3e9)


def test_zero3_parameter_offload_and_errors():
    """--offload-params moves ZeRO 3's shards off the device (w bytes each); any other stage is refused;
    the tool plans disk offload without a real --offload-path."""
    cfg = Config(model=LLAMA_7B).updated(zero=3, recompute="full", bf16=True, micro_batch_size=1, global_batch_size=8)
    spec = PlanSpec.for_world(cfg, 8)
    plain = plan_memory(spec).peak
    moved = plan_memory(spec.updated(offload_optimizer="cpu", offload_params="cpu")).peak
    assert moved.params_host_bytes == 2 * moved.shard_elements == plain.params_bytes - moved.params_bytes, moved
    for bad in (dict(zero=2, offload_optimizer="cpu", offload_params="cpu"), dict(offload_params="disk")):
        with pytest.raises(ConfigError, match="--offload-params .* needs --zero 3"):
            plan_memory(spec.updated(**bad))
    tool = load_tool("plan_memory")
    flags = ["--arch", "llama", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "16", "--vocab-size", "1000", "--dp", "2", "--zero", "3", "--offload-optimizer", "disk",
             "--offload-params", "cpu"]
    code, text = tool.report(flags)
    assert code == 0 and "offload: optimizer disk, params cpu" in text and "assumed" in text, text
