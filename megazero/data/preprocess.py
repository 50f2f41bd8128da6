"""Text, JSONL, parquet or ``save_to_disk`` inputs -> tokens -> ``PREFIX.bin/.idx``.

Reading and tokenising go through HF ``datasets`` (``load_dataset`` on local
files or ``load_from_disk``, then ``.map(num_proc=...)``) so big inputs stream
from Arrow files and use every core. The datasets cache and the tokenised
Arrow files live in a temporary folder beside the output (never beside a
saved dataset, which may be read-only) and are removed afterwards; the
network is never touched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from .fingerprint import fingerprint_path, remove_fingerprint, write_fingerprint
from .indexed import IndexedDatasetWriter
from .preprocess_inputs import load_inputs
from .tokenizer import TokenizerLike, load_tokenizer, resolve_tokenizer

@dataclass(frozen=True)
class PreprocessStats:
    """Summary of one preprocessing run."""

    documents: int
    tokens: int
    seconds: float

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


class _Encode:
    """Picklable batched map function; loads the tokenizer once per worker."""

    def __init__(self, model: str, tokenizer_type: str | None, key: str) -> None:
        self.model, self.tokenizer_type, self.key = model, tokenizer_type, key
        self._tok: TokenizerLike | None = None

    def __getstate__(self) -> dict:
        return {"model": self.model, "tokenizer_type": self.tokenizer_type, "key": self.key, "_tok": None}

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        if self._tok is None:
            self._tok = load_tokenizer(self.model, self.tokenizer_type)
        eos = self._tok.eos_id
        ids = self._tok.encode_batch(batch[self.key])
        return {"input_ids": [doc + [eos] for doc in ids]}


def write_documents(token_docs: Iterable[Sequence[int]], output_prefix: str, vocab_size: int,
                    log: Callable[[str], None] = print, log_every: int = 100_000) -> PreprocessStats:
    """Write already-tokenised documents (EOS included) to ``PREFIX.bin/.idx``."""
    start = time.perf_counter()
    with IndexedDatasetWriter(output_prefix, vocab_size) as writer:
        for doc in token_docs:
            writer.add_document(doc)
            if writer.num_documents % log_every == 0:
                secs = time.perf_counter() - start
                log(f"  {writer.num_documents} docs, {writer.num_tokens} tokens, "
                    f"{writer.num_tokens / secs:,.0f} tokens/s")
        docs, tokens = writer.num_documents, writer.num_tokens
    return PreprocessStats(docs, tokens, time.perf_counter() - start)


def write_token_files(token_docs: Iterable[Sequence[int]], output_prefix: str, tokenizer: TokenizerLike,
                      tokenizer_model: str, log: Callable[[str], None] = print) -> PreprocessStats:
    """``PREFIX.bin/.idx`` and, beside them, the fingerprint of the tokenizer that made them (``tokenizer_model``
    is the path it was loaded from). The old fingerprint goes first, so a crash never leaves one that names
    another tokenizer than the files' (see fingerprint.py)."""
    remove_fingerprint(output_prefix)
    stats = write_documents(token_docs, output_prefix, tokenizer.vocab_size, log)
    write_fingerprint(output_prefix, tokenizer.fingerprint(), tokenizer_model)
    return stats


def tokenize_documents(texts: Iterable[str], tokenizer: TokenizerLike, batch_size: int = 1000) -> Iterable[list[int]]:
    """In-process tokenisation (no ``datasets``): each document + EOS."""
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == batch_size:
            yield from (ids + [tokenizer.eos_id] for ids in tokenizer.encode_batch(batch))
            batch = []
    if batch:
        yield from (ids + [tokenizer.eos_id] for ids in tokenizer.encode_batch(batch))


def preprocess_files(inputs: Sequence[str], output_prefix: str, tokenizer_model: str, json_key: str = "text",
                     workers: int = 1, tokenizer_type: str | None = None,
                     log: Callable[[str], None] = print) -> PreprocessStats:
    """The whole tool: read ``inputs``, tokenise with ``workers`` processes, write.

    ``tokenizer_type`` None infers sentencepiece or hf from ``tokenizer_model`` (see ``load_tokenizer``).
    """
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    tokenizer_type, tokenizer_file = resolve_tokenizer(tokenizer_model, tokenizer_type)
    tokenizer = load_tokenizer(tokenizer_file, tokenizer_type)  # fail before reading data
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    cache_dir = tempfile.mkdtemp(prefix=".hf-cache-", dir=out_dir)
    start = time.perf_counter()
    try:
        ds, key = load_inputs(inputs, json_key, cache_dir)
        log(f"tokenizing {len(ds)} documents with {workers} worker(s) ...")
        encode = _Encode(tokenizer_file, tokenizer_type, key)
        tokens = ds.map(encode, batched=True, batch_size=1000, num_proc=workers if workers > 1 else None,
                        remove_columns=ds.column_names, desc="tokenizing",
                        cache_file_name=os.path.join(cache_dir, "tokens.arrow"))
        docs = (row for batch in tokens.iter(batch_size=1000) for row in batch["input_ids"])
        stats = write_token_files(docs, output_prefix, tokenizer, tokenizer_model, log)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    stats = PreprocessStats(stats.documents, stats.tokens, time.perf_counter() - start)
    log(f"wrote {output_prefix}.bin/.idx and {fingerprint_path(output_prefix)}: {stats.documents} documents, "
        f"{stats.tokens} tokens, {stats.seconds:.1f} s, {stats.tokens_per_sec:,.0f} tokens/s")
    return stats
