"""bench/bench_mla.py at a toy size: the matched GQA shape, the caches' bytes per token and layer, the table."""
from __future__ import annotations

from bench.bench_mla import attention_flops, matched_gqa, measure, mla_config, parse, table

TOY = ["--hidden", "512", "--heads", "8", "--q-lora-rank", "128", "--kv-lora-rank", "64", "--qk-head-dim", "64",
       "--qk-pos-emb-head-dim", "32", "--v-head-dim", "64", "--seq", "32", "--batch", "1", "--prompt", "8",
       "--decode", "4", "--repeats", "1"]


def test_the_gqa_row_is_the_nearest_in_attention_flops():
    mla = mla_config(parse(TOY))
    gqa, flops = matched_gqa(mla)
    assert flops == attention_flops(gqa) and gqa.hidden_size == mla.hidden_size and not gqa.multi_latent_attention
    assert abs(flops / attention_flops(mla) - 1) < 0.1


def test_cache_bytes_and_table():
    args = parse(TOY)
    result = measure(args)
    gqa = result["gqa"]
    assert result["cache_bytes"] == {"mla": (64 + 32) * 4, "gqa": 2 * gqa.query_groups * gqa.head_dim * 4}
    assert result["expanded_bytes"] == 8 * (64 + 32 + 64) * 4
    text = table(result, args)
    assert text.startswith("## bench_mla — ") and "| mla | " in text and "| gqa | " in text
    assert "--kv-lora-rank 64" in text  # the command reproduces the run
