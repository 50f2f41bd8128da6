"""An HF export into a folder that holds an earlier export replaces it whole.

Exports run through tools/convert_checkpoint.py (in process) from two tiny megazero
checkpoints with different weights. After the second export, transformers'
``AutoModelForCausalLM.from_pretrained`` and megazero's ``load_hf`` must both give the
second checkpoint's weights, and only one layout's files (and no stale tokenizer) may be
left. A crash at any step of the commit must leave a folder neither reader loads the old
weights from.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megazero.checkpoint.convert import load_hf, save_hf, write_checkpoint
from megazero.checkpoint.hf import to_hf
from megazero.config import Config, ModelConfig
from megazero.data.tokenizer import train_sentencepiece
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
from megazero.tensor_parallel.layers import initialize_parameters

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = ModelConfig(arch="llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                    seq_length=16, vocab_size=300)
SHARDED, SINGLE = ["--max-shard-size", str(20_000 / 2**30)], []  # ~20 kB shards: several files


def _tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", os.path.join(ROOT, "tools",
                                                                                     "convert_checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _state(seed: int) -> dict[str, torch.Tensor]:
    model = GPTModel(MODEL, TPContext())
    initialize_parameters(model, seed, None)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two checkpoints (seeds 1 and 2); the first ships a tokenizer, the second none."""
    root = tmp_path_factory.mktemp("reexport")
    words = [f"w{i} token{i % 37} text{i % 11}" for i in range(800)]
    tok = train_sentencepiece(words, str(root / "tok"), vocab_size=280)
    out = {}
    for seed, extra in ((1, dict(tokenizer_model=tok, data_path=[str(root / "data")])),
                        (2, dict(tokenizer_model=None, data_path=[str(root / "data")]))):
        cfg = Config(model=MODEL).updated(**extra)
        state = _state(seed)
        out[seed] = (write_checkpoint(str(root / f"mz{seed}"), cfg, state, tp=1, pp=1), to_hf(state, MODEL))
    return out


def _matches(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return all(k in loaded and torch.equal(loaded[k], v) for k, v in expected.items())


def _readers(folder: str) -> dict[str, dict[str, torch.Tensor] | None]:
    """What each reader loads from the folder (None: it refuses)."""
    out: dict[str, dict[str, torch.Tensor] | None] = {}
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        out["transformers"] = {k: v.detach() for k, v in model.state_dict().items()}
    except Exception:  # noqa: BLE001 - any refusal is fine; loading the old weights is not
        out["transformers"] = None
    try:
        out["megazero"] = load_hf(folder)[1]
    except (ValueError, OSError):
        out["megazero"] = None
    return out


@pytest.mark.parametrize("first,second", [(SHARDED, SINGLE), (SINGLE, SHARDED)], ids=["sharded-then-single",
                                                                                     "single-then-sharded"])
def test_reexport_replaces_the_other_layout(ckpts, tmp_path, capsys, first, second) -> None:
    tool, hf = _tool(), str(tmp_path / "hf")
    os.makedirs(hf)
    (tmp_path / "hf" / "README.md").write_text("model card\n")  # a user's file: kept
    assert tool.main(["--input", ckpts[1][0], "--output", hf, "--to", "hf", *first]) == 0
    assert os.path.isfile(os.path.join(hf, "tokenizer.json"))
    assert tool.main(["--input", ckpts[2][0], "--output", hf, "--to", "hf", *second]) == 0
    new, old = ckpts[2][1], ckpts[1][1]
    for reader, loaded in _readers(hf).items():
        assert loaded is not None and _matches(loaded, new) and not _matches(loaded, old), reader
    names = sorted(os.listdir(hf))
    single = "model.safetensors" in names
    shards = [n for n in names if n.startswith("model-")]
    assert single != ("model.safetensors.index.json" in names), names  # exactly one layout
    assert (not shards) if single else len(shards) > 1, names
    # the first export's tokenizer does not belong to the second model; a user's file stays
    assert not {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"} & set(names), names
    assert "README.md" in names and not [n for n in names if n.startswith(".")], names
    assert "removed the earlier export's" in capsys.readouterr().out


COMMIT_STEPS = 6  # over a 3-shard export: remove the index and 3 shards, rename config.json, model.safetensors


@pytest.mark.parametrize("fail_at", range(1, COMMIT_STEPS + 2))  # every step, then none
def test_a_crash_mid_commit_never_leaves_the_old_weights(ckpts, tmp_path, monkeypatch, fail_at) -> None:
    """Each of the commit's removes and renames in turn raises (a crash there).

    Every reader then refuses, or loads the new weights; the old ones only while the folder
    is still the untouched earlier export (the crash came before the commit's first step).
    """
    from megazero.checkpoint import hf_folder

    hf = str(tmp_path / "hf")
    old, new = ckpts[1][1], ckpts[2][1]
    save_hf(hf, MODEL, _full(ckpts[1][0]), None, max_shard_bytes=80_000)
    before = sorted(os.listdir(hf))
    calls, real_remove, real_replace = [0], os.remove, os.replace

    def crashing(real):
        def op(*args, **kwargs):
            calls[0] += 1
            if calls[0] == fail_at:
                raise OSError("simulated crash")
            return real(*args, **kwargs)
        return op

    monkeypatch.setattr(hf_folder.os, "remove", crashing(real_remove))
    monkeypatch.setattr(hf_folder.os, "replace", crashing(real_replace))
    try:
        save_hf(hf, MODEL, _full(ckpts[2][0]), None)  # single file over the sharded export
        crashed = False
    except OSError:
        crashed = True
    monkeypatch.undo()
    assert crashed == (fail_at <= COMMIT_STEPS) and calls[0] == min(fail_at, COMMIT_STEPS)
    untouched = sorted(n for n in os.listdir(hf) if not n.startswith(".")) == before
    for reader, loaded in _readers(hf).items():
        got_new = loaded is not None and _matches(loaded, new) and not _matches(loaded, old)
        got_old = loaded is not None and _matches(loaded, old) and not _matches(loaded, new)
        assert loaded is None or got_new or (got_old and untouched), (reader, fail_at)
        if not crashed:
            assert got_new, reader


def _full(ckpt: str) -> dict[str, torch.Tensor]:
    from megazero.checkpoint.convert import read_full_state

    return read_full_state(ckpt, tp=1)[1]


def test_reconversion_to_megazero_replaces_the_earlier_one(ckpts, tmp_path) -> None:
    """--to megazero into a folder holding an earlier conversion (another tp): --load reads the new weights."""
    from megazero.checkpoint.convert import hf_to_checkpoint, read_full_state

    tool, out = _tool(), str(tmp_path / "mz")
    for seed, tp in ((1, 2), (2, 1)):
        hf = str(tmp_path / f"hf{seed}")
        assert tool.main(["--input", ckpts[seed][0], "--output", hf, "--to", "hf"]) == 0
        hf_to_checkpoint(hf, out, tp=tp, pp=1)
    cfg, full = read_full_state(out, tp=1)
    assert cfg.parallel.tensor_model_parallel_size == 1
    assert _matches(to_hf(full, MODEL), ckpts[2][1]) and not _matches(to_hf(full, MODEL), ckpts[1][1])
