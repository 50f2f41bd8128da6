"""Tokenizers: a sentencepiece wrapper (the default) and a thin HF wrapper.

Special ids are fixed for every model we train (unk=0, bos=1, eos=2, pad=3)
so the rest of the pipeline never has to ask which id is which. Training
uses identity normalisation, no dummy prefix and byte fallback, so
``decode(encode(text)) == text`` for any UTF-8 text, and one thread, so the
same input gives the same model bytes every time.
"""

from __future__ import annotations

import io
import os
from typing import Iterable, Iterator, Protocol

import sentencepiece as spm

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3


class TokenizerLike(Protocol):
    """What preprocessing and training need from any tokenizer."""

    vocab_size: int
    eos_id: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...


class Tokenizer:
    """A loaded sentencepiece model with the ids the trainer needs."""

    def __init__(self, processor: spm.SentencePieceProcessor, path: str) -> None:
        self._sp = processor
        self.path = path

    @classmethod
    def load(cls, path: str) -> "Tokenizer":
        """Load ``path``; a missing or unparsable file is a user error."""
        if not os.path.isfile(path):
            raise ValueError(
                f"tokenizer model {path!r} does not exist; pass a sentencepiece .model file "
                "with --tokenizer-model (train one with tools/train_tokenizer.py)"
            )
        try:
            processor = spm.SentencePieceProcessor(model_file=path)
        except (RuntimeError, OSError) as exc:
            raise ValueError(
                f"tokenizer model {path!r} is not a readable sentencepiece model ({exc}); "
                "check --tokenizer-model"
            ) from None
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

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts in one C++ call (much faster than a Python loop)."""
        return [list(ids) for ids in self._sp.encode(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._sp.decode([int(i) for i in ids]))


class HFTokenizer:
    """A local HF ``AutoTokenizer`` directory, for preprocessing only."""

    def __init__(self, path: str) -> None:
        if not os.path.exists(path):
            raise ValueError(f"HF tokenizer {path!r} does not exist; check --tokenizer-model")
        try:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, ImportError) as exc:
            raise ValueError(
                f"could not load HF tokenizer {path!r} ({exc}); check --tokenizer-model"
            ) from None
        self.path = path
        if self._tok.eos_token_id is None:
            raise ValueError(f"HF tokenizer {path!r} has no EOS token; pick another --tokenizer-model")

    def __reduce__(self) -> tuple:
        return (HFTokenizer, (self.path,))

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_id(self) -> int:
        return int(self._tok.eos_token_id)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self._tok(list(texts), add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._tok.decode(list(ids)))


def load_tokenizer(path: str, tokenizer_type: str = "sentencepiece") -> TokenizerLike:
    """Pick the wrapper named by ``--tokenizer-type``."""
    if tokenizer_type == "sentencepiece":
        return Tokenizer.load(path)
    if tokenizer_type == "hf":
        return HFTokenizer(path)
    raise ValueError(f"--tokenizer-type must be 'sentencepiece' or 'hf', got {tokenizer_type!r}")


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
            unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
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
