"""convert_checkpoint.py --to megazero checks the target layout as a run would, before writing anything.

Before: ``--tp 3`` wrote a checkpoint with gaps (hidden 64 does not split in 3), printed "wrote" and
exited 0; ``--tp 0``, ``--pp 0`` and ``--tp -2`` ended in tracebacks. Now each is one line naming the
flag, exit 2, and no output folder; a good ``--tp 2 --pp 2`` still converts and loads.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megazero.checkpoint import storage
from megazero.checkpoint.convert import load_hf, read_full_state
from megazero.checkpoint.hf import from_hf, hf_config

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint",
                                                  os.path.join(ROOT, "tools", "convert_checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny HF Llama: hidden 64, 8 heads, 2 query groups, 2 layers."""
    from tests.helpers.hf_configs import CONFIGS

    folder = str(tmp_path_factory.mktemp("hf") / "llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf_config(CONFIGS["llama"])).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("flags,named", [
    (["--tp", "3"], "--tp 3"),  # divides neither hidden (64), heads (8) nor query groups (2)
    (["--tp", "4"], "--num-query-groups (2)"),  # divides hidden and heads, not the 2 key/value groups
    (["--tp", "0"], "--tp must be >= 1"),
    (["--tp", "-2"], "--tp must be >= 1"),
    (["--pp", "0"], "--pp must be >= 1"),
    (["--pp", "3"], "--pp (3)"),  # 2 layers
    (["--pp", "2", "--virtual-pipeline-size", "2"], "--virtual-pipeline-size"),  # 2 layers in 4 chunks
], ids=["tp3", "tp4-groups", "tp0", "tp-2", "pp0", "pp3", "vp2"])
def test_bad_target_layout_is_one_line_and_writes_nothing(hf_llama, tmp_path, capsys, flags, named):
    out = tmp_path / "mz"
    rc = _tool().main(["--input", hf_llama, "--output", str(out), "--to", "megazero", *flags])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, captured
    assert named in lines[0] and "wrote" not in captured.out, lines[0]
    assert not out.exists()


def test_good_target_layout_converts_and_loads(hf_llama, tmp_path):
    out = tmp_path / "mz"
    assert _tool().main(["--input", hf_llama, "--output", str(out), "--to", "megazero", "--tp", "2", "--pp", "2"]) == 0
    meta = storage.read_metadata(storage.resolve(str(out)))  # the checks a loading run makes (no gaps)
    assert (meta["layout"]["tp"], meta["layout"]["pp"]) == (2, 2)
    mz_cfg, full = read_full_state(str(out), tp=1)
    model_cfg, hf_state = load_hf(hf_llama)
    expected = from_hf(hf_state, model_cfg, model_cfg.padded_vocab_size(1))
    assert full.keys() == expected.keys()
    assert all(torch.equal(full[k], expected[k]) for k in full)
