"""Deterministic plain-text documents for tokenizer and preprocessing tests."""
from __future__ import annotations

import random


def make_docs(n: int, seed: int = 0) -> list[str]:
    """Deterministic ASCII documents (no leading/trailing spaces) from a small word list."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(300)]
    docs = []
    for _ in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 40)))
        docs.append(text.capitalize() + rng.choice([".", "!", "?", ", 42."]))
    return docs
