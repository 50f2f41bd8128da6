"""Tokenizers: sentencepiece models (trained here or loaded) and HF ``tokenizer.json`` files.

``load_tokenizer`` picks the kind from ``--tokenizer-type`` or from what is at the path, and every
caller reads the special ids (EOS ends each document, PAD) from the object it returns, never as
constants. The sentencepiece models trained here use unk=0, bos=1, eos=2, pad=3, identity
normalisation, no dummy prefix and byte fallback, so ``decode(encode(text)) == text`` for any UTF-8
text, and one thread, so the same input gives the same model bytes every time.
"""

from __future__ import annotations

import io
import os
from typing import Iterable, Iterator, Protocol

import sentencepiece as spm

from .fingerprint import TokenizerFingerprint, special_id, vocab_sha256
from .hf_tokenizer import HFTokenizer, describe_file

_TRAINED_SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}


class TokenizerLike(Protocol):
    """What preprocessing, training and generation need from any tokenizer."""

    vocab_size: int
    eos_id: int  # ends every document (Megatron's EOD); generation stops on it
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def fingerprint(self) -> TokenizerFingerprint: ...


class Tokenizer:
    """A loaded sentencepiece model with the ids the trainer needs."""

    def __init__(self, processor: spm.SentencePieceProcessor, path: str) -> None:
        self._sp = processor
        self.path = path

    @classmethod
    def load(cls, path: str) -> "Tokenizer":
        """Load ``path`` (a .model file, or a folder holding tokenizer.model); bad input is a user error."""
        _, path = resolve_tokenizer(path, "sentencepiece")
        try:
            processor = spm.SentencePieceProcessor(model_file=path)
        except (RuntimeError, OSError):
            hint = ("it looks like an HF tokenizer.json: pass --tokenizer-type hf or leave --tokenizer-type unset"
                    if _starts_like_json(path) else
                    "pass a .model file from tools/train_tokenizer.py or an HF tokenizer.json")
            raise ValueError(f"--tokenizer-model {path!r} is not a readable sentencepiece model (found "
                             f"{describe_file(path)}); {hint}") from None
        return cls(processor, path)

    def __reduce__(self) -> tuple:
        # Reload by path in worker processes instead of pickling the C++ object.
        return (Tokenizer.load, (self.path,))

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def eos_id(self) -> int:
        return int(self._sp.eos_id())

    @property
    def bos_id(self) -> int:
        return int(self._sp.bos_id())

    @property
    def pad_id(self) -> int:
        return int(self._sp.pad_id())

    @property
    def unk_id(self) -> int:
        return int(self._sp.unk_id())

    def fingerprint(self) -> TokenizerFingerprint:
        """What token files record of the tokenizer that made them (fingerprint.py); -1 ids are None."""
        pieces = [str(self._sp.id_to_piece(i)) for i in range(self.vocab_size)]
        return TokenizerFingerprint(kind="sentencepiece", vocab_size=self.vocab_size, bos_id=special_id(self.bos_id),
                                    eos_id=special_id(self.eos_id), pad_id=special_id(self.pad_id),
                                    unk_id=special_id(self.unk_id), vocab_sha256=vocab_sha256(pieces))

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts in one C++ call (much faster than a Python loop)."""
        return [list(ids) for ids in self._sp.encode(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._sp.decode([int(i) for i in ids]))


def _starts_like_json(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(64).lstrip().startswith(b"{")


_KIND_FILES = {"hf": "tokenizer.json", "sentencepiece": "tokenizer.model"}


def _resolve_folder(path: str, tokenizer_type: str | None) -> tuple[str, str]:
    """An HF-style folder: its tokenizer.json (or, for sentencepiece, tokenizer.model)."""
    kinds = [tokenizer_type] if tokenizer_type else ["hf", "sentencepiece"]
    for kind in kinds:
        inside = os.path.join(path, _KIND_FILES[kind])
        if os.path.isfile(inside):
            return kind, inside
    entries = sorted(os.listdir(path))
    held = ", ".join(entries[:8]) + (f" and {len(entries) - 8} more" if len(entries) > 8 else "") or "nothing"
    wanted = " or ".join(_KIND_FILES[k] for k in kinds)
    raise ValueError(f"--tokenizer-model {path!r} is a folder without {wanted} (it holds {held}); pass a folder "
                     "holding tokenizer.json, a tokenizer.json file or a sentencepiece .model file")


def resolve_tokenizer(path: str, tokenizer_type: str | None = None) -> tuple[str, str]:
    """(type, file) for ``--tokenizer-model path``: the type given, else inferred from what is there
    (a folder holding tokenizer.json, or a .json file: hf; a .model file: sentencepiece; any other
    file: hf when it reads as JSON)."""
    if tokenizer_type not in (None, "sentencepiece", "hf"):
        raise ValueError(f"--tokenizer-type must be sentencepiece or hf, got {tokenizer_type!r}")
    if not os.path.exists(path):
        raise ValueError(f"--tokenizer-model {path!r} does not exist; pass a sentencepiece .model file, an HF "
                         "tokenizer.json or a folder holding one (train one with tools/train_tokenizer.py)")
    if os.path.isdir(path):
        return _resolve_folder(path, tokenizer_type)
    if tokenizer_type:
        return tokenizer_type, path
    if path.lower().endswith(".model"):
        return "sentencepiece", path
    return ("hf" if path.lower().endswith(".json") or _starts_like_json(path) else "sentencepiece"), path


def load_tokenizer(path: str, tokenizer_type: str | None = None) -> TokenizerLike:
    """The tokenizer at ``path`` (``--tokenizer-model``), of ``--tokenizer-type`` or of the type its path shows."""
    kind, file = resolve_tokenizer(path, tokenizer_type)
    return Tokenizer.load(file) if kind == "sentencepiece" else HFTokenizer(file)


def _training_lines(inputs: Iterable[str]) -> Iterator[str]:
    """Feed sentencepiece one non-empty line at a time.

    Sentencepiece drops "sentences" longer than max_sentence_length, so whole
    documents are split into lines; newlines are then covered by byte fallback.
    """
    for text in inputs:
        for line in text.split("\n"):
            if line.strip():
                yield line


def train_sentencepiece(inputs: Iterable[str], model_prefix: str, vocab_size: int, model_type: str = "bpe",
                        max_sentences: int = 0) -> str:
    """Train a model from an iterable of texts; returns the ``.model`` path.

    ``max_sentences`` > 0 keeps only the first that many lines (no random
    sampling, so the result stays deterministic).
    """
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"--model-type must be 'bpe' or 'unigram', got {model_type!r}")
    if vocab_size < 8:
        raise ValueError(f"--vocab-size must be at least 8, got {vocab_size}")
    lines = _training_lines(inputs)
    first = next(lines, None)
    if first is None:
        raise ValueError("tokenizer training input is empty; pass files with some text via --input")
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)

    def all_lines() -> Iterator[str]:
        yield first
        yield from lines

    model = io.BytesIO()  # in memory: the proto would otherwise record model_prefix
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=all_lines(),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,
            **_TRAINED_SPECIAL_IDS,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            character_coverage=1.0,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=False,
            num_threads=1,
            minloglevel=2,
        )
    except RuntimeError as exc:
        msg = str(exc).split("] ")[-1]
        raise ValueError(f"sentencepiece training failed: {msg} (check --vocab-size)") from None
    _write_model(model.getvalue(), model_prefix)
    return model_prefix + ".model"


def _write_model(proto: bytes, model_prefix: str) -> None:
    """Atomically write PREFIX.model, plus PREFIX.vocab (piece, score) for people.

    Both are written under temporary names and synced first, then renamed (the model last, as it
    is the file everything loads), so a crash never leaves a half-written file or an old model
    beside a new one's temporary; the temporaries are removed on failure.
    """
    sp = spm.SentencePieceProcessor(model_proto=proto)
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    tmps = {ext: f"{model_prefix}.{ext}.tmp{os.getpid()}" for ext in ("vocab", "model")}
    try:
        for ext, data in (("vocab", vocab.encode("utf-8")), ("model", proto)):
            with open(tmps[ext], "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        for ext in ("vocab", "model"):
            os.replace(tmps[ext], f"{model_prefix}.{ext}")
    finally:
        for tmp in tmps.values():
            if os.path.exists(tmp):
                os.remove(tmp)
