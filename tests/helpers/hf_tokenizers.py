"""A byte-level BPE tokenizer.json trained here (the Llama 3 / Qwen kind), and strings that test what a
tokenizer keeps: code, tabs, CRLF, accents, emoji, CJK and right-to-left text, edge spaces."""
from __future__ import annotations

from megazero.data.corpus import corpus_documents
from megazero.data.hf_tokenizer import train_byte_level_bpe

HARD_STRINGS = [
    "def f(x):\n\treturn {'a': x ** 2}  # comment\n",
    "café, naïve, Ångström, Œuvre, ñandú, Straße",
    "\ttabs\tand  double  spaces\r\nand CRLF",
    "emoji 😀🤖👍🏽 and CJK 中文字 and RTL عربى",
    " leading space and trailing space ",
]


def byte_level_tokenizer(folder: str, vocab_size: int = 300) -> str:
    """Train on ~50 kB of the default corpus into ``folder`` (tokenizer.json + tokenizer_config.json naming
    its EOS, <|endoftext|>); returns the tokenizer.json path. Under a second."""
    return train_byte_level_bpe(corpus_documents(max_bytes=50_000), folder, vocab_size)
