"""Tiny model shapes (tied and untied embeddings, GQA, q/k head norms, odd vocabularies) the planner tests count
and build."""
from __future__ import annotations

MODELS = {
    "gpt2": dict(arch="gpt2", num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1100),
    "gpt2_untied": dict(arch="gpt2", num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=24,
                        max_position_embeddings=40, vocab_size=1000, untie_embeddings_and_output_weights=True),
    "llama_gqa": dict(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                      seq_length=16, vocab_size=1100),
    "llama_qk_norm": dict(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                          seq_length=16, vocab_size=1100, qk_layernorm=True, kv_channels=32),
    "llama_tied": dict(arch="llama", num_layers=2, hidden_size=96, num_attention_heads=4, ffn_hidden_size=200,
                       seq_length=16, vocab_size=999, untie_embeddings_and_output_weights=False),
}
