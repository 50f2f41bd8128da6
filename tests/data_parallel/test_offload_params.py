"""--offload-params cpu|disk (ZeRO 3): the parameter shards live on the host or in a file between uses.

On a CPU-only machine host memory is the device, so an offloaded run gathers the same shard bytes
in the same order of all-gathers per unit and runs the same AdamW as the in-memory ZeRO-3 run:
losses, grad norms, evaluation losses and final weights must be *equal*, not close.

- dp2 (2 ranks): zero 3 in memory vs parameters on the host and on disk (with the optimizer state on
  the host or on disk), fp32 and bf16, with prefetch 0, 1 and 2 units (2 blocks a unit) and with
  reshard-after-forward off; the memory record moves the parameter shards off the device; close()
  removes the files; a checkpoint saved with parameters on disk resumes in memory, and one saved in
  memory resumes with parameters on disk and on the host, each equal to the uninterrupted run;
- tp2 x pp2 x dp2 (8 ranks): zero 3 in memory vs parameters and optimizer state on the host and on disk.

The flag errors run in this process.
"""
from __future__ import annotations

from typing import Any

import pytest

from megazero.config import Config, ConfigError
from megazero.parallel.state import ParallelState
from megazero.training.preflight import output_paths
from tests.helpers.dist import spawn
from tests.helpers.offload_runs import differences, train_closed
from tests.helpers.optimizer_harness import make_cfg, train
from tests.helpers.resume import cfg_for, segment


def offloaded(cfg: Config, params: str, optimizer: str, folder: str) -> Config:
    """``cfg`` with the parameter shards at ``params`` and the optimizer state at ``optimizer``."""
    path = {"offload_path": folder} if "disk" in (params, optimizer) else {}
    if optimizer == "disk":  # buffers smaller than a bucket shard: updated shards are written back in pieces
        path["offload_buffer_size"] = 320
    return cfg.updated(offload_params=params, offload_optimizer=optimizer, **path)


# (name, extra make_cfg settings, params, optimizer); the reference of each is the same settings in memory
RUNS = [("fp32.cpu", {}, "cpu", "cpu"), ("fp32.disk", {}, "disk", "cpu"),
        ("bf16.cpu", {"bf16": True}, "cpu", "disk"), ("bf16.disk", {"bf16": True}, "disk", "disk"),
        ("p0.disk", {"prefetch": 0}, "disk", "disk"), ("p2u2.disk", {"prefetch": 2, "unit_layers": 2, "layers": 4},
                                                        "disk", "cpu"),
        ("keep.disk", {"reshard": False}, "disk", "disk")]


def world_dp2(pstate: ParallelState, folder: str) -> dict[str, Any]:
    folder = f"{folder}/offload"
    out: dict[str, Any] = {}
    for name, kw, params, optimizer in RUNS:
        base = make_cfg(zero=3, mbs=2, **kw)
        out[f"{name}.ref"] = train_closed(pstate, base)
        out[name] = train_closed(pstate, offloaded(base, params, optimizer, folder))
    ck = f"{folder}/../ck"
    out["ck.straight"] = segment(pstate, cfg_for(zero=3))
    segment(pstate, offloaded(cfg_for(zero=3, iters=2), "disk", "disk", folder), save=f"{ck}/disk")
    out["ck.memory<-disk"] = segment(pstate, cfg_for(zero=3), load=f"{ck}/disk")
    segment(pstate, cfg_for(zero=3, iters=2), save=f"{ck}/memory")
    out["ck.disk<-memory"] = segment(pstate, offloaded(cfg_for(zero=3), "disk", "cpu", folder), load=f"{ck}/memory")
    out["ck.cpu<-memory"] = segment(pstate, offloaded(cfg_for(zero=3), "cpu", "cpu", folder), load=f"{ck}/memory")
    return out


def world_8(pstate: ParallelState, folder: str) -> dict[str, Any]:
    base = make_cfg(zero=3, tp=2, pp=2, mbs=2)
    folder = f"{folder}/offload"
    return {"none": train(pstate, base), "cpu": train(pstate, offloaded(base, "cpu", "cpu", folder)),
            "disk": train(pstate, offloaded(base, "disk", "disk", folder))}


def test_offload_params_dp2_bitwise_memory_and_checkpoints(tmp_path):
    results = spawn(world_dp2, 2, str(tmp_path))
    bad: dict[str, list[str]] = {}
    for rank, out in enumerate(results):
        for name, _, params, _ in RUNS:
            run, ref = out[name], out[f"{name}.ref"]
            bad.update({f"rank{rank}.{name}": d for d in [differences(run, ref)] if d})
            assert not run["files_left"], f"{name}: close() left {run['files_left']}"
            mem, ref_mem = run["memory"], ref["memory"]
            # after the step nothing is gathered: the device holds no parameter bytes, the store the shards
            assert mem["params_bytes"] == 0 < ref_mem["params_bytes"], (name, mem, ref_mem)
            where = f"params_{'host' if params == 'cpu' else 'disk'}_bytes"
            assert mem[where] == ref_mem["params_bytes"] and "params_host_bytes" not in ref_mem, (name, mem)
        straight = out["ck.straight"]
        tail = {"records": straight["records"][2:], "evals": straight["evals"][1:], "params": straight["params"]}
        for name in ("ck.memory<-disk", "ck.disk<-memory", "ck.cpu<-memory"):  # iterations 3 and 4, resumed
            bad.update({f"rank{rank}.{name}": d for d in [differences(out[name], tail)] if d})
    assert not bad, f"{len(bad)} runs with offloaded parameters differ: {dict(list(bad.items())[:6])}"


def test_offload_params_tp2_pp2_dp2_bitwise(tmp_path):
    results = spawn(world_8, 8, str(tmp_path), tp=2, pp=2)
    for rank, out in enumerate(results):
        for where in ("cpu", "disk"):
            assert not differences(out[where], out["none"]), (rank, where, differences(out[where], out["none"]))


def test_offload_params_flags(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"--offload-params cpu needs --zero 3 \(got 2\)"):
        make_cfg(zero=2).updated(offload_params="cpu", offload_optimizer="cpu")
    with pytest.raises(ConfigError, match=r"--offload-params disk needs .*--offload-optimizer cpu or disk"):
        make_cfg(zero=3).updated(offload_params="disk", offload_path=str(tmp_path))
    with pytest.raises(ConfigError, match="--offload-params disk needs --offload-path"):
        make_cfg(zero=3).updated(offload_params="disk", offload_optimizer="cpu")
    with pytest.raises(ConfigError, match="--offload-params must be none, cpu or disk"):
        make_cfg(zero=3).updated(offload_params="gpu", offload_optimizer="cpu")
    cfg = offloaded(make_cfg(zero=3), "disk", "cpu", str(tmp_path / "off"))
    assert ("--offload-path", str(tmp_path / "off")) in output_paths(cfg)  # probed at start-up
    from pretrain_gpt import main
    assert main(["--offload-params", "cpu", "--offload-optimizer", "cpu", "--zero", "1"]) == 2
    assert "--offload-params cpu needs --zero 3" in capsys.readouterr().err
