"""The tokenizer an HF export ships, and the special ids its config.json names.

A run's tokenizer is either a sentencepiece model (megazero's own; rebuilt here as a transformers
fast tokenizer that encodes exactly as it does, plus the ``tokenizer.model`` itself) or an HF
``tokenizer.json``. The latter is already what transformers reads, so it is shipped as it is, with
the files beside it that say how to use it (special tokens, chat template): rebuilding it could only
lose something (normalisers, added tokens, a post-processor).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any

from ..data.tokenizer import Tokenizer, TokenizerLike, load_tokenizer, resolve_tokenizer

# Files of an HF tokenizer folder that transformers reads beside tokenizer.json.
HF_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def hf_fast_tokenizer(sentencepiece_model: str) -> Any:
    """A transformers fast tokenizer that encodes exactly as our sentencepiece BPE model does."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, normalizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    pieces = SentencePieceExtractor(sentencepiece_model).extract(BPE)
    tok = RawTokenizer(models.BPE(vocab=pieces["vocab"], merges=pieces["merges"], unk_token="<unk>",
                                  fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")  # trained without a dummy prefix, identity normaliser
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def special_ids(tok: TokenizerLike) -> dict[str, int | None]:
    """bos/eos/pad_token_id for config.json; a token the tokenizer lacks (sentencepiece says -1) is None."""
    ids = {"bos_token_id": getattr(tok, "bos_id", None), "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    return {key: value if value is not None and value >= 0 else None for key, value in ids.items()}


def write_tokenizer(out_dir: str, path: str, tokenizer_type: str | None = None) -> dict[str, int | None]:
    """The tokenizer at ``path`` (of ``tokenizer_type``, else of the kind its path shows) into ``out_dir``;
    returns its special ids."""
    kind, file = resolve_tokenizer(path, tokenizer_type)
    tok = load_tokenizer(file, kind)
    if isinstance(tok, Tokenizer):
        hf_fast_tokenizer(file).save_pretrained(out_dir)
        shutil.copyfile(file, os.path.join(out_dir, "tokenizer.model"))
    else:
        _copy_hf(out_dir, file, tok.eos_id)
    return special_ids(tok)


def _copy_hf(out_dir: str, json_file: str, eos_id: int) -> None:
    """tokenizer.json and its companions as they are; without a tokenizer_config.json, a minimal one naming
    the EOS megazero found, so transformers loads a fast tokenizer that knows where documents end."""
    shutil.copyfile(json_file, os.path.join(out_dir, "tokenizer.json"))
    source = os.path.dirname(os.path.abspath(json_file))
    for name in HF_COMPANIONS:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
    if not os.path.isfile(os.path.join(out_dir, "tokenizer_config.json")):
        from tokenizers import Tokenizer as RawTokenizer

        eos = RawTokenizer.from_file(json_file).id_to_token(eos_id)
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}, fh, indent=1)
