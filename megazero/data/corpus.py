"""The embedded default corpus: docstrings of the Python standard library.

Every Python install carries a few MB of good English technical prose in its
docstrings, so ``pretrain_gpt.py`` can train something meaningful with no
``--data-path`` and no network. Files are parsed with ``ast`` (never
imported), in sorted order, so the corpus, the tokenizer and the token files
are byte-identical for a given Python version. The result is cached and
published atomically (built in a temp folder, then renamed), in a folder
named by a fingerprint of the files it is built from (path, size and mtime of
every candidate file), so a changed standard library gets a fresh corpus
instead of the tokens of the old one.
"""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

from .fingerprint import fingerprint_path, write_fingerprint
from .preprocess import tokenize_documents, write_token_files
from .tokenizer import load_tokenizer, train_sentencepiece

DEFAULT_VOCAB_SIZE = 8000  # the default corpus's tokenizer: what a run without --tokenizer-model trains with

CORPUS_VERSION = 1
MAX_BYTES = 3_500_000
MIN_DOC_CHARS = 20
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass(frozen=True)
class CorpusPaths:
    """Where the built corpus lives."""

    data_prefix: str
    tokenizer_model: str


def _stdlib_files(root: str) -> Iterator[str]:
    """``.py`` files under ``root`` in a fixed order, skipping tests and site-packages."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("test"))
        for name in sorted(files):
            if name.endswith(".py") and not name.startswith("test_"):
                yield os.path.join(folder, name)


def _docstrings(path: str) -> list[str]:
    """Module, class and function docstrings of one file; [] if it fails to parse."""
    try:
        with open(path, "rb") as f:
            source = f.read()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old files
            tree = ast.parse(source)
    except (SyntaxError, ValueError, OSError):
        return []
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, _DOC_NODES):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= MIN_DOC_CHARS:
                docs.append(doc)
    return docs


def corpus_documents(max_bytes: int = MAX_BYTES, root: str | None = None) -> list[str]:
    """The corpus text: one document per docstring, capped at ``max_bytes`` of UTF-8."""
    root = root or sysconfig.get_paths()["stdlib"]
    docs: list[str] = []
    total = 0
    for path in _stdlib_files(root):
        for doc in _docstrings(path):
            size = len(doc.encode("utf-8", errors="replace"))
            if total + size > max_bytes:
                return docs
            docs.append(doc.encode("utf-8", errors="replace").decode("utf-8"))
            total += size
    return docs


def source_fingerprint(root: str | None = None) -> str:
    """Short hash of what the corpus is built from: every candidate file's path, size and mtime, and the caps.

    One ``stat`` per file (milliseconds); parsing the files each start-up would take seconds.
    """
    root = root or sysconfig.get_paths()["stdlib"]
    h = hashlib.sha1(f"{CORPUS_VERSION} {MAX_BYTES} {MIN_DOC_CHARS}".encode())
    for path in _stdlib_files(root):
        try:
            st = os.stat(path)
        except OSError:
            continue
        h.update(f"{os.path.relpath(path, root)} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:12]


def _cache_root(cache_dir: str | None) -> str:
    if cache_dir:
        return cache_dir
    env = os.environ.get("MEGAZERO_CACHE")
    return env or os.path.join(os.path.expanduser("~"), ".cache", "megazero")


def _build(folder: str, final: str, vocab_size: int, log: Callable[[str], None]) -> None:
    """Extract, train the tokenizer, tokenise and write into ``folder`` (published as ``final``, the tokenizer
    path its fingerprint records)."""
    start = time.perf_counter()
    log("building default corpus from stdlib docstrings ...")
    docs = corpus_documents()
    if not docs:
        raise ValueError("found no docstrings in the Python standard library; pass --data-path instead")
    log(f"  {len(docs)} documents, {sum(map(len, docs)) / 1e6:.1f} M characters")
    log(f"training tokenizer (sentencepiece BPE, vocab {vocab_size}) ...")
    model = train_sentencepiece(docs, os.path.join(folder, "tokenizer"), vocab_size, "bpe")
    tokenizer = load_tokenizer(model)
    log("tokenizing ...")
    stats = write_token_files(tokenize_documents(docs, tokenizer), os.path.join(folder, "data"), tokenizer,
                              os.path.join(final, "tokenizer.model"), log)
    log(f"default corpus ready: {stats.documents} documents, {stats.tokens} tokens "
        f"in {time.perf_counter() - start:.1f} s")


def corpus_paths(vocab_size: int = DEFAULT_VOCAB_SIZE, cache_dir: str | None = None) -> CorpusPaths:
    """Where the default corpus is (or will be) cached; nothing is built. ``cache_dir`` defaults to
    ``$MEGAZERO_CACHE`` or ``~/.cache/megazero``."""
    py = f"py{sys.version_info.major}.{sys.version_info.minor}"
    name = f"corpus-{py}-v{CORPUS_VERSION}-vocab{vocab_size}-{source_fingerprint()}"
    final = os.path.join(_cache_root(cache_dir), name)
    return CorpusPaths(os.path.join(final, "data"), os.path.join(final, "tokenizer.model"))


def _published(paths: CorpusPaths) -> bool:
    """Whether the corpus at ``paths`` is built. A cache built before fingerprints existed gets one now from its
    own tokenizer (which made its data), so it is checked like any token file; a read-only one stays as it is
    (training then says it cannot check it)."""
    if not os.path.isdir(os.path.dirname(paths.data_prefix)):
        return False
    if not os.path.isfile(fingerprint_path(paths.data_prefix)):
        try:
            tokenizer = load_tokenizer(paths.tokenizer_model)
            write_fingerprint(paths.data_prefix, tokenizer.fingerprint(), paths.tokenizer_model)
        except (OSError, ValueError):
            pass
    return True


def existing_corpus(vocab_size: int = DEFAULT_VOCAB_SIZE, cache_dir: str | None = None) -> CorpusPaths | None:
    """The default corpus if it is cached, else None; nothing is built."""
    paths = corpus_paths(vocab_size, cache_dir)
    return paths if _published(paths) else None


def default_corpus(vocab_size: int = DEFAULT_VOCAB_SIZE, cache_dir: str | None = None,
                   log: Callable[[str], None] = print) -> CorpusPaths:
    """Build (once) and return the default corpus and its tokenizer.

    ``cache_dir`` defaults to ``$MEGAZERO_CACHE`` or ``~/.cache/megazero``.
    """
    paths = corpus_paths(vocab_size, cache_dir)
    if _published(paths):
        return paths
    final, root = os.path.dirname(paths.data_prefix), _cache_root(cache_dir)
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".corpus-build-", dir=root)
    try:
        _build(tmp, final, vocab_size, log)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            os.rename(tmp, final)
        except OSError:  # another process published it first; theirs is identical
            if not os.path.isdir(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return paths
