"""Text or JSONL files -> tokens -> ``PREFIX.bin/.idx``.

Reading and tokenising go through HF ``datasets`` (``load_dataset`` on local
files, ``.map(num_proc=...)``) so big inputs stream from Arrow files and use
every core. The datasets cache lives in a temporary folder beside the output
and is removed afterwards; the network is never touched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from .indexed import IndexedDatasetWriter
from .tokenizer import TokenizerLike, load_tokenizer

_JSON_EXTS = (".json", ".jsonl", ".ndjson")


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

    def __init__(self, model: str, tokenizer_type: str, key: str) -> None:
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


def _input_format(inputs: Sequence[str]) -> str:
    """'json' or 'text' for the whole input list; files must exist and agree."""
    if not inputs:
        raise ValueError("no input files; pass at least one with --input")
    for path in inputs:
        if not os.path.isfile(path):
            raise ValueError(f"input file {path!r} does not exist; check --input")
    kinds = {"json" if p.lower().endswith(_JSON_EXTS) else "text" for p in inputs}
    if len(kinds) > 1:
        raise ValueError("--input mixes JSON and text files; preprocess them separately")
    if all(os.path.getsize(p) == 0 for p in inputs):
        raise ValueError(f"input {', '.join(inputs)} is empty; nothing to preprocess (check --input)")
    return kinds.pop()


def _load(inputs: Sequence[str], key: str, cache_dir: str):  # -> datasets.Dataset
    """Load local files as one Arrow dataset with a ``key`` column of strings."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    fmt = _input_format(inputs)
    try:
        ds = datasets.load_dataset(fmt, data_files=list(inputs), split="train", cache_dir=cache_dir)
    except Exception as exc:  # datasets wraps parser errors in many types
        raise ValueError(f"could not read --input {', '.join(inputs)} as {fmt}: {exc}") from None
    if fmt == "text":
        key_in = "text"
        ds = ds.filter(lambda b: [bool(t.strip()) for t in b["text"]], batched=True)
    else:
        key_in = key
        if key not in ds.column_names:
            raise ValueError(
                f"JSON key {key!r} not found in {', '.join(inputs)} (keys: {ds.column_names}); "
                "set --json-keys"
            )
        missing = ds.data.column(key).null_count
        if missing:
            raise ValueError(f"{missing} JSON records in {', '.join(inputs)} lack key {key!r}; "
                             "fix the input or --json-keys")
    if len(ds) == 0:
        raise ValueError(f"input {', '.join(inputs)} has no documents; nothing to preprocess")
    return ds, key_in


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
                     workers: int = 1, tokenizer_type: str = "sentencepiece",
                     log: Callable[[str], None] = print) -> PreprocessStats:
    """The whole tool: read ``inputs``, tokenise with ``workers`` processes, write."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    tokenizer = load_tokenizer(tokenizer_model, tokenizer_type)  # fail before reading data
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    cache_dir = tempfile.mkdtemp(prefix=".hf-cache-", dir=out_dir)
    start = time.perf_counter()
    try:
        ds, key = _load(inputs, json_key, cache_dir)
        log(f"tokenizing {len(ds)} documents with {workers} worker(s) ...")
        encode = _Encode(tokenizer_model, tokenizer_type, key)
        tokens = ds.map(encode, batched=True, batch_size=1000, num_proc=workers if workers > 1 else None,
                        remove_columns=ds.column_names, desc="tokenizing")
        docs = (row for batch in tokens.iter(batch_size=1000) for row in batch["input_ids"])
        stats = write_documents(docs, output_prefix, tokenizer.vocab_size, log)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    stats = PreprocessStats(stats.documents, stats.tokens, time.perf_counter() - start)
    log(f"wrote {output_prefix}.bin/.idx: {stats.documents} documents, {stats.tokens} tokens, "
        f"{stats.seconds:.1f} s, {stats.tokens_per_sec:,.0f} tokens/s")
    return stats
