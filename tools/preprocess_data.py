"""Tokenize text, JSONL, parquet or save_to_disk data into megazero's PREFIX.bin/.idx format.

    python tools/preprocess_data.py --input data.jsonl --output-prefix out/data \
        --tokenizer-model tok.model --workers 4

Text files: one document per line. JSONL (.json/.jsonl): one object per
line, document text under --json-keys. Parquet: files, a folder of them or a
glob, text in the --json-keys column. A folder written by datasets'
save_to_disk: text in the --json-keys column. The tokenizer is a
sentencepiece .model or an HF tokenizer.json (or a folder holding one); its
EOS token is appended to every document, and its fingerprint (kind,
vocabulary size, special ids, vocabulary hash) is written beside the token
files, so training refuses another tokenizer (docs/data.md).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megazero.data.preprocess import preprocess_files  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True,
                        help="text, JSONL or parquet files, parquet folders, globs, or save_to_disk folders")
    parser.add_argument("--output-prefix", required=True,
                        help="writes PREFIX.bin, PREFIX.idx and PREFIX.tokenizer-fingerprint.json")
    parser.add_argument("--tokenizer-model", required=True,
                        help="sentencepiece .model, HF tokenizer.json or a folder holding one")
    parser.add_argument("--tokenizer-type", choices=("sentencepiece", "hf"), default=None,
                        help="default: inferred from --tokenizer-model")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="text field or column (one key)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    args = parser.parse_args(argv)
    try:
        if len(args.json_keys) != 1:
            raise ValueError(f"--json-keys takes one key per run, got {args.json_keys}; run once per key")
        preprocess_files(args.input, args.output_prefix, args.tokenizer_model, args.json_keys[0],
                         args.workers, args.tokenizer_type)
    except (ValueError, OSError) as exc:  # user errors: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
