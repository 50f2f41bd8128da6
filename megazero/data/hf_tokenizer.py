"""An HF ``tokenizer.json`` (byte-level BPE as in Llama 3, Qwen and GPT-2, or any other model), read with
the ``tokenizers`` library the file is written for.

Reading the file directly gives the ids transformers' fast tokenizer gives, without importing
transformers in every data worker. A bare ``tokenizer.json`` does not say which token ends a document,
so the special tokens come from ``tokenizer_config.json`` beside it (what transformers reads) when
there is one; otherwise the first of the usual end-of-text tokens the vocabulary holds is EOS.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

from .fingerprint import TokenizerFingerprint, vocab_sha256

# End-of-text tokens of common tokenizers (GPT-2/Qwen, Llama 3, Llama 2/Mistral, Gemma), in that order.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


def describe_file(path: str) -> str:
    """What a file holds, for an error message: its size and first bytes."""
    with open(path, "rb") as f:
        head = f.read(24)
    return f"a {os.path.getsize(path)}-byte file starting {head!r}"


def _token_text(entry: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) else None


class HFTokenizer:
    """A loaded ``tokenizer.json`` with the ids the trainer and generation need."""

    def __init__(self, json_path: str) -> None:
        from tokenizers import Tokenizer as RawTokenizer

        try:
            self._tok = RawTokenizer.from_file(json_path)
        except Exception as exc:  # tokenizers raises a bare Exception for any parse error
            raise ValueError(f"--tokenizer-model {json_path!r} is not a readable HF tokenizer.json ({exc}; "
                             f"found {describe_file(json_path)}); pass a tokenizer.json, a folder holding one, "
                             "or a sentencepiece .model file") from None
        self.path = json_path
        self._vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(self._vocab.values()) + 1  # ids may leave gaps; the embedding must hold the largest
        config = self._config()
        self.eos_id = self._eos(config)
        self.bos_id = self._lookup(config, "bos_token")
        pad = self._lookup(config, "pad_token")
        self.pad_id = self.eos_id if pad is None else pad  # Llama 3 and Qwen pad with EOS
        self.unk_id = self._unk(config)

    def __reduce__(self) -> tuple:
        # Reload by path in worker processes instead of pickling the Rust object.
        return (HFTokenizer, (self.path,))

    def _config(self) -> dict:
        path = os.path.join(os.path.dirname(os.path.abspath(self.path)), "tokenizer_config.json")
        if not os.path.isfile(path):
            return {}
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path} beside --tokenizer-model is not readable JSON ({exc}); "
                             "fix or remove it") from None

    def _lookup(self, config: dict, key: str) -> int | None:
        text = _token_text(config.get(key))
        return None if text is None else self._vocab.get(text)

    def _eos(self, config: dict) -> int:
        named = _token_text(config.get("eos_token"))
        if named is not None:
            if named not in self._vocab:
                raise ValueError(f"tokenizer_config.json beside --tokenizer-model {self.path!r} names eos_token "
                                 f"{named!r}, which tokenizer.json does not hold; fix its eos_token")
            return self._vocab[named]
        for text in EOS_CANDIDATES:
            if text in self._vocab:
                return self._vocab[text]
        raise ValueError(f"HF tokenizer {self.path!r} names no EOS token (no tokenizer_config.json eos_token, none "
                         f"of {', '.join(EOS_CANDIDATES)}); add a tokenizer_config.json with \"eos_token\" beside it")

    def _unk(self, config: dict) -> int | None:
        """tokenizer_config.json's unk_token, else the model's own (byte-level BPE has none)."""
        named = self._lookup(config, "unk_token")
        if named is not None:
            return named
        model_unk = getattr(self._tok.model, "unk_token", None)
        return self._vocab.get(model_unk) if isinstance(model_unk, str) else None

    def fingerprint(self) -> TokenizerFingerprint:
        """What token files record of the tokenizer that made them (fingerprint.py); ids without a token: None."""
        pieces: list[str | None] = [None] * self.vocab_size
        for text, token_id in self._vocab.items():
            pieces[token_id] = text
        return TokenizerFingerprint(kind="hf", vocab_size=self.vocab_size, bos_id=self.bos_id, eos_id=self.eos_id,
                                    pad_id=self.pad_id, unk_id=self.unk_id, vocab_sha256=vocab_sha256(pieces))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))


END_OF_TEXT = "<|endoftext|>"


def train_byte_level_bpe(inputs: Iterable[str], folder: str, vocab_size: int) -> str:
    """Train a byte-level BPE (the GPT-2 / Llama 3 / Qwen kind) and write ``folder/tokenizer.json`` plus a
    ``tokenizer_config.json`` naming its EOS; returns the tokenizer.json path.

    Every byte is in the initial alphabet and no prefix space is added, so any UTF-8 text round-trips.
    """
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"--vocab-size must be at least {len(alphabet) + 1} for a byte-level BPE (its 256 "
                         f"byte symbols and {END_OF_TEXT}), got {vocab_size}")
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(inputs, trainer)
    if tok.get_vocab_size() <= len(alphabet) + 1:
        raise ValueError("tokenizer training input is empty; pass files with some text via --input")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "tokenizer.json")
    tok.save(path)
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": END_OF_TEXT}, f, indent=1)
    return path
