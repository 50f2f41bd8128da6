"""An offline wandb run leaves a run directory whose history holds the loss and the lr."""
from __future__ import annotations

import glob
import json
import struct

import pytest

from tests.helpers.launch import launch

BLOCK, HEADER = 32768, 7  # the .wandb file: 7-byte ":W&B" header, then LevelDB-log records in 32 KiB blocks


def wandb_records(path: str) -> list[bytes]:
    """The protobuf payloads of a .wandb file (LevelDB log format: crc32, length, type, data)."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", "not a wandb run file"
    out, pending, pos = [], b"", HEADER
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a record header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST: one record complete
            out.append(pending)
            pending = b""
    return out


def test_offline_run_history_holds_loss_and_lr(tmp_path):
    pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")
    flags = ["--num-layers", "2", "--hidden-size", "64", "--seq-length", "32", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--train-iters", "3", "--log-interval", "1", "--wandb-project", "mz-test",
             "--wandb-mode", "offline", "--wandb-dir", str(tmp_path), "--metrics-file", str(tmp_path / "m.jsonl")]
    result = launch("pretrain_gpt.py", flags, 1)[0]
    assert result.returncode == 0, result.stderr[-2000:]
    [run_file] = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = []
    for payload in wandb_records(run_file):
        record = pb.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    logged = [json.loads(line) for line in open(tmp_path / "m.jsonl") if '"loss"' in line]
    assert [h["loss"] for h in history] == pytest.approx([r["loss"] for r in logged])
    assert [h["lr"] for h in history] == pytest.approx([r["lr"] for r in logged])
