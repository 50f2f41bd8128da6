"""Tiny model configs for the megazero <-> HF transformers tests: gpt2, llama (GQA), llama3 RoPE scaling, untied."""
from __future__ import annotations

from megazero.config import ModelConfig

CONFIGS = {
    "gpt2": ModelConfig(arch="gpt2", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                        vocab_size=300),
    "llama": ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                         seq_length=32, vocab_size=300),
    # wavelengths 6.3, 63, 628, 6283 against cut-offs 16 and 64: kept, blended, divided, divided
    "llama3_rope": ModelConfig(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                               seq_length=32, vocab_size=300, rope_scaling_type="llama3", rope_scaling_factor=4.0,
                               rope_scaling_original_max_position_embeddings=64,
                               untie_embeddings_and_output_weights=False),
    "gpt2_untied": ModelConfig(arch="gpt2", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                               vocab_size=300, untie_embeddings_and_output_weights=True),
}
