"""Data pipeline throughput on the embedded default corpus (not run in CI).

    .venv/bin/python -m bench.bench_data

Prints preprocessing tokens/s (HF ``datasets`` path with 1 and 2 workers,
and the in-process path the corpus builder uses) and the time to fetch one
step's micro-batches for a tiny config (seq 128, micro 4, global 16).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from bench.results import results_header
from megazero.data import MicroBatchIterator, build_data, default_corpus
from megazero.data.corpus import corpus_documents
from megazero.data.preprocess import preprocess_files, tokenize_documents, write_documents
from megazero.data.tokenizer import Tokenizer


def bench_preprocess(folder: str, tokenizer_model: str) -> list[tuple[str, float, int]]:
    """(label, tokens/s, tokens) for each preprocessing path."""
    docs = corpus_documents()
    path = os.path.join(folder, "corpus.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    rows = []
    for workers in (1, 2):
        stats = preprocess_files([path], os.path.join(folder, f"w{workers}"), tokenizer_model,
                                 workers=workers, log=lambda s: None)
        rows.append((f"datasets, {workers} worker(s)", stats.tokens_per_sec, stats.tokens))
    tok = Tokenizer.load(tokenizer_model)
    stats = write_documents(tokenize_documents(docs, tok), os.path.join(folder, "inproc"), tok.vocab_size,
                            log=lambda s: None)
    rows.append(("in-process (corpus builder)", stats.tokens_per_sec, stats.tokens))
    return rows


def bench_step(steps: int = 50) -> float:
    """Mean seconds for one DP rank (dp=1) to fetch one step's micro-batches."""
    bundle = build_data(data_path=None, tokenizer_model=None, split="969,30,1", seq_length=128,
                        train_samples=16 * steps, eval_samples=0, seed=1234, is_builder=True,
                        log=lambda s: None)
    it = MicroBatchIterator(bundle.train, micro_batch_size=4, micro_batches=4, dp_rank=0, dp_size=1)
    start = time.perf_counter()
    for _ in range(steps):
        it.next_step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    print(results_header("bench.bench_data") + "\n")
    start = time.perf_counter()
    corpus = default_corpus()
    print(f"default corpus ready in {time.perf_counter() - start:.2f} s")
    with tempfile.TemporaryDirectory() as folder:
        rows = bench_preprocess(folder, corpus.tokenizer_model)
    print(f"\n{'preprocessing path':<32}{'tokens':>12}{'tokens/s':>14}")
    for label, rate, tokens in rows:
        print(f"{label:<32}{tokens:>12,}{rate:>14,.0f}")
    step = bench_step()
    print(f"\n{'step fetch (seq 128, mbs 4, gbs 16, dp 1)':<44}{step * 1e3:>8.3f} ms/step")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
