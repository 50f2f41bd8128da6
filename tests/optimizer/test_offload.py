"""--offload-optimizer cpu|disk: the same training, bit for bit, with the optimizer state elsewhere.

On a CPU-only machine host memory is the device, so an offloaded run runs the same AdamW
kernel on the same numbers in the same order as the in-memory run: losses, grad norms,
evaluation losses and final weights must be *equal*, not close. Two gloo worlds do the work:

- dp2 (2 ranks): zero 1, 2 and 3 in fp32, bf16 and fp16 (loss scaling), each in memory, on the host and on disk
  (disk with 2 buffers of ``SMALL`` elements, smaller than a bucket shard, so every shard streams in
  pieces; and 3 whole-bucket buffers); a disk-offload run saves a checkpoint that resumes in memory,
  and an in-memory checkpoint resumes on disk and on the host, both equal to the uninterrupted run;
  the disk store streams every piece through its K buffers (bounded by --offload-buffer-size, not by
  the bucket) and removes its file on close;
- tp2 x pp2 x dp2 (8 ranks): zero 3 in memory, on the host and on disk.

The error cases (flags, an unusable folder, a full disk at start-up and mid-step, the CLI's
exit status) run in this process.
"""
from __future__ import annotations

import errno
import os
from typing import Any

import pytest
import torch

from megazero.arguments import parse_config
from megazero.config import Config, ConfigError
from megazero.optimizer.accounting import measured_state_bytes
from megazero.optimizer.offload import DiskStore, OffloadError
from megazero.parallel.state import ParallelState
from megazero.training.preflight import output_paths
from tests.helpers.dist import spawn
from tests.helpers.offload_runs import differences, train_closed
from tests.helpers.optimizer_harness import build, make_cfg
from tests.helpers.resume import cfg_for, segment

PRECISIONS = {"fp32": {}, "bf16": dict(bf16=True), "fp16": dict(fp16=True, initial_loss_scale=1024.0)}
SMALL = 320  # --offload-buffer-size for the disk runs: below every multi-parameter bucket shard here


def offloaded(cfg: Config, where: str, folder: str, buffers: int = 2, size: int = SMALL) -> Config:
    if where == "none":
        return cfg
    path = {"offload_path": folder, "offload_buffer_size": size} if where == "disk" else {}
    return cfg.updated(offload_optimizer=where, offload_buffers=buffers, **path)


def pool_check(pstate: ParallelState, cfg: Config) -> dict[str, Any]:
    """Which memory a disk store's sweep hands out: every piece's views must lie in its K buffers, and the
    buffers' size follows --offload-buffer-size, not the largest bucket."""
    opt = build(pstate, cfg).optimizer
    store = opt.store
    pool = {b.untyped_storage().data_ptr() for b in store.pool}
    pieces = [(i, lo, views[0].numel()) for i, lo, views in store.sweep()]
    storages = {v.untyped_storage().data_ptr() for _, _, views in store.sweep() for v in views}
    covered = [sum(n for j, _, n in pieces if j == i) for i in range(len(store.numels))]
    out = {"buckets": len(store.numels), "pieces": len(pieces), "outside_pool": len(storages - pool),
           "host": store.host_bytes(), "largest_bucket": 3 * 4 * max(store.numels),
           "k_pieces": cfg.parallel.offload_buffers * 3 * 4 * cfg.parallel.offload_buffer_size,
           "covered": covered == store.numels,
           "disk": store.disk_bytes(), "record": measured_state_bytes(opt)}
    opt.close()
    return out


def world_dp2(pstate: ParallelState, folder: str) -> dict[str, Any]:
    folder = f"{folder}/offload"
    out: dict[str, Any] = {}
    for zero in (1, 2, 3):
        for prec, kw in PRECISIONS.items():
            base = make_cfg(zero=zero, mbs=2, **kw)
            for where in ("none", "cpu", "disk"):
                out[f"z{zero}.{prec}.{where}"] = train_closed(pstate, offloaded(base, where, folder))
    out["z2.fp32.disk3"] = train_closed(pstate, offloaded(make_cfg(zero=2, mbs=2), "disk", folder, buffers=3,
                                                          size=10 ** 6))  # whole buckets
    # buckets of similar size (the embedding alone fills one), each shard larger than a buffer
    out["pool"] = pool_check(pstate, offloaded(make_cfg(zero=2, layers=6, bucket=33_000), "disk", folder,
                                               size=4000))
    ck = f"{folder}/../ck"
    out["ck.straight"] = segment(pstate, cfg_for(zero=2))
    segment(pstate, offloaded(cfg_for(zero=2, iters=2), "disk", folder), save=f"{ck}/disk")
    out["ck.memory<-disk"] = segment(pstate, cfg_for(zero=2), load=f"{ck}/disk")
    segment(pstate, cfg_for(zero=2, iters=2), save=f"{ck}/memory")
    out["ck.disk<-memory"] = segment(pstate, offloaded(cfg_for(zero=2), "disk", folder), load=f"{ck}/memory")
    out["ck.cpu<-memory"] = segment(pstate, offloaded(cfg_for(zero=2), "cpu", folder), load=f"{ck}/memory")
    return out


def world_8(pstate: ParallelState, folder: str) -> dict[str, Any]:
    base = make_cfg(zero=3, tp=2, pp=2, mbs=2)
    folder = f"{folder}/offload"
    return {where: train_closed(pstate, offloaded(base, where, folder)) for where in ("none", "cpu", "disk")}


def test_offload_dp2_bitwise_checkpoints_and_pool(tmp_path):
    results = spawn(world_dp2, 2, str(tmp_path))
    bad = {}
    for rank, out in enumerate(results):
        for name, run in out.items():
            if name.startswith("z") and not name.endswith(".none"):
                ref = out[name.rsplit(".", 1)[0] + ".none"]
                bad.update({f"rank{rank}.{name}": d for d in [differences(run, ref)] if d})
                assert not run["files_left"], f"{name}: close() left {run['files_left']}"
        straight = out["ck.straight"]
        tail = {"records": straight["records"][2:], "evals": straight["evals"][1:], "params": straight["params"]}
        for name in ("ck.memory<-disk", "ck.disk<-memory", "ck.cpu<-memory"):  # iterations 3 and 4, resumed
            bad.update({f"rank{rank}.{name}": d for d in [differences(out[name], tail)] if d})
        mem, ref_mem = out["z1.bf16.disk"]["memory"], out["z1.bf16.none"]["memory"]
        assert mem["optimizer_bytes"] == 0 and mem["optimizer_disk_bytes"] == ref_mem["optimizer_bytes"], mem
        host = out["z1.bf16.cpu"]["memory"]
        assert host["optimizer_bytes"] == 0 and host["optimizer_host_bytes"] == ref_mem["optimizer_bytes"], host
        assert mem["params_bytes"] == ref_mem["params_bytes"] and "optimizer_host_bytes" not in ref_mem
        pool = out["pool"]
        assert pool["buckets"] > 2 and pool["outside_pool"] == 0 and pool["covered"], pool  # all via the pool
        assert pool["pieces"] > pool["buckets"], pool  # shards larger than a buffer went through in pieces
        assert pool["host"] == pool["k_pieces"] < pool["largest_bucket"], pool  # K buffers of the flag's size
        assert pool["record"]["optimizer_host_bytes"] == pool["host"], pool
    assert not bad, f"{len(bad)} offloaded runs differ from in-memory: {dict(list(bad.items())[:6])}"


def test_offload_tp2_pp2_dp2_zero3_bitwise(tmp_path):
    results = spawn(world_8, 8, str(tmp_path), tp=2, pp=2)
    for rank, out in enumerate(results):
        for where in ("cpu", "disk"):
            assert not differences(out[where], out["none"]), (rank, where, differences(out[where], out["none"]))


def test_offload_flags_and_errors(tmp_path, monkeypatch, capsys):
    with pytest.raises(ConfigError, match="--offload-optimizer disk needs --offload-path"):
        make_cfg(zero=1).updated(offload_optimizer="disk")
    with pytest.raises(ConfigError, match="--offload-path .* only applies"):
        parse_config(["--zero", "1", "--offload-path", str(tmp_path)])
    with pytest.raises(ConfigError, match="--offload-buffers must be >= 2"):
        make_cfg(zero=1).updated(offload_optimizer="disk", offload_path=str(tmp_path), offload_buffers=1)
    with pytest.raises(ConfigError, match="--offload-buffer-size must be >= 64"):
        make_cfg(zero=1).updated(offload_optimizer="disk", offload_path=str(tmp_path), offload_buffer_size=10)
    cfg = make_cfg(zero=1).updated(offload_optimizer="disk", offload_path=str(tmp_path / "off"))
    assert ("--offload-path", str(tmp_path / "off")) in output_paths(cfg)  # probed at start-up as --save is
    from pretrain_gpt import main
    assert main(["--offload-optimizer", "disk", "--zero", "1"]) == 2
    assert "--offload-optimizer disk needs --offload-path" in capsys.readouterr().err

    serial = ParallelState.serial()
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(OffloadError, match=r"--offload-path .*a_file.*choose a writable folder"):
        build(serial, cfg.updated(offload_path=str(blocker / "sub")))

    def full(*_args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(os, "posix_fallocate", full)
        with pytest.raises(OffloadError, match=r"--offload-path .*needs .* MiB per rank.*free space"):
            build(serial, cfg)
    store = DiskStore([[torch.ones(10), torch.ones(7)]], str(tmp_path / "mid"), rank=0, buffers=2)
    monkeypatch.setattr(os, "pwritev", full)  # the disk fills up after start-up
    with pytest.raises(OffloadError, match=r"--offload-path .*writing the optimizer state.*free space"):
        for _ in store.sweep():
            pass
    monkeypatch.undo()
    store.close()
    assert not os.path.exists(tmp_path / "mid" / "rank0") and os.path.isdir(tmp_path / "mid")
