"""Crash safety, --keep-last, clear errors on bad checkpoints, and llama conversion to HF."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megazero.checkpoint import storage
from megazero.run_plan import RunPlan
from tests.helpers.launch import ROOT, launch, run_python
from tests.helpers.reference import full_logits
from tests.helpers.serial_ckpt import build, load, save


def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    save(root, 1)
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.serial_ckpt", root, "2", "--hang-mid-write"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.stdout.readline().strip() == "HALF-WRITTEN"
    proc.kill()  # SIGKILL: no handler, no cleanup
    proc.wait()
    assert open(os.path.join(root, "latest")).read().strip() == "iter_0000001"
    assert any(".tmp-" in name for name in os.listdir(root)), "the interrupted save stays under its staging name"
    assert storage.read_metadata(storage.resolve(root))["iteration"] == 1
    load(root)
    save(root, 3)  # the next save publishes and sweeps the abandoned staging folder
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000003", "latest"]


def test_keep_last(tmp_path):
    root = str(tmp_path / "ckpt")
    for it in (1, 2, 3):
        cfg, pstate, model = build()
        from megazero.checkpoint.save import CheckpointContext, save_checkpoint

        save_checkpoint(CheckpointContext(root, cfg, RunPlan.resolve(cfg, pstate.layout.world_size), pstate, model,
                                          keep_last=2), it, 0)
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000003", "latest"]


def test_clear_errors(tmp_path):
    root = str(tmp_path / "ckpt")
    folder = save(root, 1)
    with pytest.raises(ValueError, match="--arch"):
        load(root, arch="llama")
    with pytest.raises(ValueError, match="--hidden-size"):
        load(root, hidden=64)
    with pytest.raises(ValueError, match="no latest file"):
        storage.resolve(str(tmp_path / "nothing"))

    meta_path = os.path.join(folder, "metadata.json")
    meta = json.load(open(meta_path))
    meta["model"]["final_norm.weight"]["shape"] = [33]
    meta["model"]["final_norm.weight"]["files"]["model_tp00_pp00.safetensors"] = [[0, 33]]
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(ValueError, match="different size|does not match|a gap"):  # optimizer index no longer fits
        load(root)

    folder = save(root, 2)
    model_file = os.path.join(folder, "model_tp00_pp00.safetensors")
    with open(model_file, "r+b") as fh:
        fh.truncate(os.path.getsize(model_file) - 100)
    with pytest.raises(ValueError, match="truncated|unreadable"):
        load(root)
    os.remove(model_file)
    with pytest.raises(ValueError, match="missing"):
        load(root)


def test_trained_llama_converts_to_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    from megazero.checkpoint.convert import read_full_state
    from megazero.model.gpt import GPTModel
    from megazero.model.transformer import TPContext

    flags = ["--arch", "llama", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--num-query-groups", "2", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--train-iters", "3", "--tp", "2", "--save", str(tmp_path / "ckpt")]
    assert all(r.returncode == 0 for r in launch("pretrain_gpt.py", flags, 2))
    out = run_python(["tools/convert_checkpoint.py", "--input", str(tmp_path / "ckpt"), "--output",
                      str(tmp_path / "hf"), "--to", "hf"])
    assert out.returncode == 0, out.stderr
    cfg, state = read_full_state(str(tmp_path / "ckpt"), tp=1)
    model = GPTModel(cfg.model, TPContext()).eval()
    model.load_state_dict(state)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    ours = full_logits(model, ids)
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max() <= 1e-4 * ours.abs().max()
    assert hf.generate(ids[:1, :4], max_new_tokens=4, do_sample=False, pad_token_id=3).shape == (1, 8)
