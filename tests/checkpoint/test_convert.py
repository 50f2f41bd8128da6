"""HF -> megazero (tp=2, pp=2) -> HF round-trips exactly; sharded HF output loads with from_pretrained."""
from __future__ import annotations

import pytest
import torch

from megazero.checkpoint.convert import hf_to_checkpoint, load_hf, read_full_state, save_hf
from megazero.checkpoint.hf import hf_config

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_round_trip_through_tp2_pp2(tmp_path, arch):
    from tests.helpers.hf_configs import CONFIGS

    cfg = CONFIGS[arch]
    klass = transformers.GPT2LMHeadModel if arch == "gpt2" else transformers.LlamaForCausalLM
    torch.manual_seed(0)
    original = klass(hf_config(cfg))
    original.save_pretrained(tmp_path / "hf_in")
    _, state_in = load_hf(str(tmp_path / "hf_in"))
    hf_to_checkpoint(str(tmp_path / "hf_in"), str(tmp_path / "mz"), tp=2, pp=2)
    mz_cfg, full = read_full_state(str(tmp_path / "mz"))
    assert full["embedding.word.weight"].shape[0] == mz_cfg.model.padded_vocab_size(2)
    save_hf(str(tmp_path / "hf_out"), mz_cfg.model, full, None, max_shard_bytes=60_000)  # forces sharding
    assert (tmp_path / "hf_out" / "model.safetensors.index.json").exists()
    _, state_out = load_hf(str(tmp_path / "hf_out"))
    assert state_out.keys() == state_in.keys()
    for k in state_in:
        assert torch.equal(state_out[k], state_in[k]), k
    reloaded = klass.from_pretrained(tmp_path / "hf_out").eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, original.eval()(ids).logits)
