"""Train a tokenizer on text or JSONL files: sentencepiece, or an HF byte-level BPE tokenizer.json.

    python tools/train_tokenizer.py --input a.txt b.jsonl --model-prefix out/tok --vocab-size 8000
    python tools/train_tokenizer.py --input a.txt --model-prefix out/hf_tok --vocab-size 8000 --model-type byte-bpe

Text files: every line is text. JSONL files (.json/.jsonl): one object per
line, the text under --json-key. bpe and unigram write PREFIX.model and
PREFIX.vocab (sentencepiece); byte-bpe writes the folder PREFIX holding
tokenizer.json and tokenizer_config.json (the Llama 3 / Qwen / GPT-2 kind,
EOS <|endoftext|>).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megazero.data.hf_tokenizer import train_byte_level_bpe  # noqa: E402
from megazero.data.tokenizer import train_sentencepiece  # noqa: E402


def read_texts(paths: list[str], json_key: str) -> Iterator[str]:
    """Stream the texts of every input file; bad input raises ValueError."""
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"input file {path!r} does not exist; check --input")
        is_json = path.lower().endswith((".json", ".jsonl", ".ndjson"))
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not is_json:
                    yield line.rstrip("\n")
                    continue
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno} is not valid JSON ({exc.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
                    raise ValueError(f"{path}:{lineno} has no string key {json_key!r}; set --json-key")
                yield record[json_key]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="text or JSONL files")
    parser.add_argument("--model-prefix", required=True, help="output path without .model (byte-bpe: a folder)")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--model-type", choices=("bpe", "unigram", "byte-bpe"), default="bpe")
    parser.add_argument("--json-key", default="text", help="text field of JSONL records")
    args = parser.parse_args(argv)
    try:
        texts = read_texts(args.input, args.json_key)
        if args.model_type == "byte-bpe":
            model = train_byte_level_bpe(texts, args.model_prefix, args.vocab_size)
        else:
            model = train_sentencepiece(texts, args.model_prefix, args.vocab_size, args.model_type)
    except (ValueError, OSError) as exc:  # user errors: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
