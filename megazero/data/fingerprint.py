"""Which tokenizer made a token file: its fingerprint, written beside ``PREFIX.bin/.idx``.

Two tokenizers of one vocabulary size make files that the vocabulary check accepts, yet their ids
name other pieces and their end-of-document ids may differ (document masking then cuts at the wrong
token). ``PREFIX.tokenizer-fingerprint.json`` records the tokenizer's kind, vocabulary size, special
ids and a sha256 of its id -> piece list (stable across processes, unlike ``hash()``), and the path
it was loaded from, so a mismatch can name it. Files written before fingerprints existed have none.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Sequence

FINGERPRINT_SUFFIX = ".tokenizer-fingerprint.json"
FORMAT = 1
_LABELS = {"kind": "kind", "vocab_size": "vocabulary size", "bos_id": "bos id", "eos_id": "eos id",
           "pad_id": "pad id", "unk_id": "unk id", "vocab_sha256": "vocabulary hash"}


def vocab_sha256(pieces: Sequence[str | None]) -> str:
    """sha256 of the id -> piece list (None where an id has no piece), as JSON: the same in every process."""
    return hashlib.sha256(json.dumps(list(pieces), ensure_ascii=False).encode("utf-8")).hexdigest()


def special_id(value: int | None) -> int | None:
    """A special id as recorded: None where the tokenizer has none (sentencepiece says -1)."""
    return None if value is None or value < 0 else int(value)


@dataclass(frozen=True)
class TokenizerFingerprint:
    """What identifies a tokenizer's ids: two tokenizers with equal fingerprints tokenize to the same ids."""

    kind: str  # sentencepiece or hf, as --tokenizer-type
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    vocab_sha256: str

    def differences(self, other: "TokenizerFingerprint") -> str:
        """The fields that differ, as 'eos id 2 vs 5' (hashes shortened), joined by ', '; '' when equal."""
        shown = []
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                if f.name == "vocab_sha256":
                    mine, theirs = mine[:12], theirs[:12]
                shown.append(f"{_LABELS[f.name]} {mine} vs {theirs}")
        return ", ".join(shown)


def fingerprint_path(prefix: str) -> str:
    return prefix + FINGERPRINT_SUFFIX


def write_fingerprint(prefix: str, fingerprint: TokenizerFingerprint, tokenizer_model: str) -> None:
    """Write ``PREFIX.tokenizer-fingerprint.json`` atomically (a temporary name, synced, then renamed)."""
    record = {"format": FORMAT, **asdict(fingerprint), "tokenizer_model": os.path.abspath(tokenizer_model)}
    path = fingerprint_path(prefix)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1, ensure_ascii=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def remove_fingerprint(prefix: str) -> None:
    """Drop an old fingerprint before new token files are written: a crash midway then leaves files that
    cannot be checked, never files that claim the old tokenizer."""
    if os.path.lexists(fingerprint_path(prefix)):
        os.remove(fingerprint_path(prefix))


def read_fingerprint(prefix: str) -> tuple[TokenizerFingerprint, str] | None:
    """(fingerprint, the tokenizer path it was made with) of ``prefix``; None for files without one."""
    path = fingerprint_path(prefix)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        made_with = str(record["tokenizer_model"])
        return TokenizerFingerprint(**{f.name: record[f.name] for f in fields(TokenizerFingerprint)}), made_with
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"tokenizer fingerprint {path} is not readable ({type(exc).__name__}: {exc}); re-run "
                         "tools/preprocess_data.py for that data, or delete the file to train unchecked") from None
