"""Refuse token files made with another tokenizer than the run's, before any process group exists.

Every rank reads the fingerprints beside the data (fingerprint.py) and loads ``--tokenizer-model``
itself, so a mismatch fails alike everywhere and nothing hangs. The files of a blend must agree with
each other and with the tokenizer. Files written before fingerprints existed load, with one line
(rank 0) saying that they cannot be checked.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

from .blend import parse_data_path
from .corpus import existing_corpus
from .fingerprint import FINGERPRINT_SUFFIX, TokenizerFingerprint, fingerprint_path, read_fingerprint
from .tokenizer import TokenizerLike, load_tokenizer

if TYPE_CHECKING:
    from ..config import DataConfig

_CORPUS_FIX = ("drop --tokenizer-model (the built-in corpus trains with its own tokenizer, {made_with}), or pass "
               "--data-path with data that tools/preprocess_data.py made with --tokenizer-model {model}")
_DATA_FIX = ("re-run tools/preprocess_data.py with --tokenizer-model {model}, or pass the tokenizer the data was "
             "made with (--tokenizer-model {made_with})")


def _refuse_disagreeing_files(made: dict[str, tuple[TokenizerFingerprint, str]], expected: TokenizerFingerprint,
                              model: str) -> None:
    """Two files of one blend made with different tokenizers: refused whatever --tokenizer-model is."""
    prefixes = list(made)
    for i, first in enumerate(prefixes):
        for second in prefixes[i + 1:]:
            diff = made[first][0].differences(made[second][0])
            if diff:
                others = [p for p in (first, second) if made[p][0] != expected] or [second]
                raise ValueError(
                    f"--data-path files {first} and {second} were tokenized with different tokenizers ({diff}; "
                    f"made with {made[first][1]} and {made[second][1]}); a blend needs one tokenizer: re-run "
                    f"tools/preprocess_data.py for {' and '.join(others)} with --tokenizer-model {model}")


def check_fingerprints(prefixes: list[str], tokenizer: TokenizerLike, tokenizer_model: str,
                       log: Callable[[str], None], fix: str = _DATA_FIX) -> None:
    """Refuse files whose fingerprint disagrees with each other's or with ``tokenizer`` (loaded from
    ``tokenizer_model``); say once (``log``) which files have none. ``fix`` ends the refusal line."""
    recorded = {prefix: read_fingerprint(prefix) for prefix in prefixes}
    made = {prefix: found for prefix, found in recorded.items() if found is not None}
    expected = tokenizer.fingerprint()
    _refuse_disagreeing_files(made, expected, tokenizer_model)
    for prefix, (fingerprint, made_with) in made.items():
        diff = fingerprint.differences(expected)
        if diff:
            raise ValueError(
                f"data {prefix} was tokenized with another tokenizer than --tokenizer-model {tokenizer_model} "
                f"(data vs tokenizer: {diff}; {fingerprint_path(prefix)} names {made_with}); "
                + fix.format(model=tokenizer_model, made_with=made_with))
    unchecked = [prefix for prefix, found in recorded.items() if found is None]
    if unchecked:
        verb = "has" if len(unchecked) == 1 else "have"
        log(f"megazero: data {', '.join(unchecked)} {verb} no tokenizer fingerprint (PREFIX{FINGERPRINT_SUFFIX}, "
            f"written by tools/preprocess_data.py since megazero records one), so it cannot be checked against "
            f"--tokenizer-model {tokenizer_model}; re-run tools/preprocess_data.py to have it checked")


def check_default_corpus(data_prefix: str, tokenizer: TokenizerLike, tokenizer_model: str,
                         log: Callable[[str], None]) -> None:
    """The built-in corpus against an explicit --tokenizer-model: checked like any file, with its own fix."""
    check_fingerprints([data_prefix], tokenizer, tokenizer_model, log, fix=_CORPUS_FIX)


def check_data_tokenizer(data: DataConfig, log: Callable[[str], None]) -> None:
    """run()'s start-up check, on every rank before any collective: every --data-path file (or the built-in
    corpus, once built) against --tokenizer-model. Loads the tokenizer and reads small JSON files only.

    Without --tokenizer-model there is nothing to check (the built-in corpus made with its own tokenizer, or
    --data-path without a tokenizer, which build_data refuses); a prefix without an .idx is build_data's error.
    """
    if data.tokenizer_model is None:
        return
    if data.data_path is None:
        corpus = existing_corpus()
        if corpus is not None:  # else it is built with its fingerprint, and build_data checks it then
            check_default_corpus(corpus.data_prefix, load_tokenizer(data.tokenizer_model, data.tokenizer_type),
                                 data.tokenizer_model, log)
        return
    prefixes = [prefix for _, prefix in parse_data_path(data.data_path) if os.path.isfile(prefix + ".idx")]
    check_fingerprints(prefixes, load_tokenizer(data.tokenizer_model, data.tokenizer_type), data.tokenizer_model, log)
