"""The on-disk token format: ``PREFIX.bin`` (all token ids back to back) and
``PREFIX.idx`` (where each document starts).

``.idx`` layout, little endian::

    magic    8 bytes  b"MZIDX\\x00\\x00\\x00"
    version  uint32   2 (1: no vocab_size/max_id fields; still read)
    dtype    uint32   1 = uint16 tokens, 2 = uint32 tokens
    n_docs   uint64
    vocab    uint64   vocabulary size of the tokenizer the data was made with   (v2)
    max_id   int64    largest token id in the .bin, -1 when it holds no tokens  (v2)
    offsets  int64 x (n_docs + 1)   token offset of each document; last = total

The vocabulary fields let training refuse data that its model cannot embed
(an id past the vocabulary is an IndexError at tp 1 and a silent zero
embedding at tp > 1). A version-1 file is scanned once for its largest id.

Both files are memory-mapped, never read whole, so a corpus larger than RAM
is fine. Files are written under temporary names, synced and renamed at the
end, the old ``.idx`` removed first: a crash never leaves a half-written file
under the final name, nor a new ``.bin`` beside the old ``.idx`` (the same
documents in another order fill a ``.bin`` of the same size, so that pair
would load without complaint and cut the documents at the old boundaries).
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Iterable

import numpy as np

MAGIC = b"MZIDX\x00\x00\x00"
VERSION = 2
_HEADER_V1 = struct.Struct("<8sIIQ")
_HEADER = struct.Struct("<8sIIQQq")
_SCAN_CHUNK = 1 << 24  # tokens per slice when scanning a version-1 .bin
_DTYPES = MappingProxyType({1: np.dtype(np.uint16), 2: np.dtype(np.uint32)})


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest token dtype that holds every id of the vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


def _dtype_code(dtype: np.dtype) -> int:
    return next(code for code, d in _DTYPES.items() if d == dtype)


class IndexedDatasetWriter:
    """Append documents, then ``finalize()`` to publish ``PREFIX.bin/.idx``.

    Used as a context manager, an exception discards the temporary files.
    """

    def __init__(self, prefix: str, vocab_size: int) -> None:
        self.prefix = prefix
        self.dtype = dtype_for_vocab(vocab_size)
        self._vocab_size = vocab_size
        folder = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(folder, exist_ok=True)
        self._tmp_bin = f"{prefix}.bin.tmp{os.getpid()}"
        self._tmp_idx = f"{prefix}.idx.tmp{os.getpid()}"
        self._bin = open(self._tmp_bin, "wb")
        self._offsets: list[int] = [0]
        self._max_id = -1

    def add_document(self, ids: Iterable[int] | np.ndarray) -> None:
        """Append one document's token ids."""
        arr = np.asarray(ids)
        if arr.size and (arr.min() < 0 or arr.max() >= self._vocab_size):
            raise ValueError(
                f"token id out of range [0, {self._vocab_size}) while writing {self.prefix}.bin"
            )
        if arr.size:
            self._max_id = max(self._max_id, int(arr.max()))
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._offsets.append(self._offsets[-1] + int(arr.size))

    @property
    def num_documents(self) -> int:
        return len(self._offsets) - 1

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def finalize(self) -> None:
        """Sync both files, then publish them as a pair: old ``.idx`` out, new ``.bin`` in, new ``.idx`` in.

        A crash between the steps leaves a prefix with no ``.idx`` (a clear error on open),
        never one whose ``.idx`` describes another ``.bin``.
        """
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        offsets = np.asarray(self._offsets, dtype="<i8")
        with open(self._tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _dtype_code(self.dtype), len(offsets) - 1,
                                 self._vocab_size, self._max_id))
            f.write(offsets.tobytes())
            f.flush()
            os.fsync(f.fileno())
        if os.path.lexists(self.prefix + ".idx"):
            os.remove(self.prefix + ".idx")
        os.replace(self._tmp_bin, self.prefix + ".bin")
        os.replace(self._tmp_idx, self.prefix + ".idx")

    def discard(self) -> None:
        """Drop the temporary files (after an error)."""
        self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.discard()
            return
        try:
            self.finalize()
        except BaseException:  # a full disk mid-publish: no temporary files left behind
            self.discard()
            raise


@dataclass(frozen=True)
class IndexHeader:
    """The fixed fields of an ``.idx`` file (vocab_size and max_id are None in version 1)."""

    version: int
    dtype: np.dtype
    n_docs: int
    vocab_size: int | None
    max_id: int | None
    size: int  # header bytes; the offsets follow


def _read_header(path: str) -> IndexHeader:
    """Parse and check the header of either version; every defect is a ValueError."""
    size = os.path.getsize(path)
    if size < _HEADER_V1.size:
        raise ValueError(f"index file {path} is truncated ({size} bytes, header needs {_HEADER_V1.size}); "
                         "re-run preprocessing")
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
    magic, version, code, n_docs = _HEADER_V1.unpack(head[:_HEADER_V1.size])
    if magic != MAGIC:
        raise ValueError(f"index file {path} has bad magic bytes {magic!r}; it is not a megazero .idx file")
    if version not in (1, VERSION):
        raise ValueError(f"index file {path} has version {version}, this code reads versions 1 and {VERSION}; "
                         "re-run preprocessing")
    if code not in _DTYPES:
        raise ValueError(f"index file {path} has unknown dtype code {code}; re-run preprocessing")
    if version == 1:
        return IndexHeader(1, _DTYPES[code], n_docs, None, None, _HEADER_V1.size)
    if len(head) < _HEADER.size:
        raise ValueError(f"index file {path} is truncated ({size} bytes, header needs {_HEADER.size}); "
                         "re-run preprocessing")
    _, _, _, _, vocab_size, max_id = _HEADER.unpack(head)
    return IndexHeader(version, _DTYPES[code], n_docs, vocab_size, max_id, _HEADER.size)


def _read_index(path: str) -> tuple[IndexHeader, np.ndarray]:
    """Validate ``.idx`` and memory-map its offsets; every defect is a ValueError."""
    header = _read_header(path)
    size, n_docs = os.path.getsize(path), header.n_docs
    expected = header.size + 8 * (n_docs + 1)
    if size != expected:
        raise ValueError(f"index file {path} is {size} bytes but {n_docs} documents need {expected}; "
                         "it is truncated or corrupt")
    offsets = np.memmap(path, dtype="<i8", mode="r", offset=header.size, shape=(n_docs + 1,))
    if offsets[0] != 0 or (n_docs and np.any(np.diff(offsets) < 0)):
        raise ValueError(f"index file {path} has non-monotonic document offsets; it is corrupt")
    return header, offsets


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.bin/.idx``; item i = document i."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise ValueError(f"data file {prefix + ext} does not exist; "
                                 "check --data-path (give the prefix, without .bin/.idx)")
        self._header, self._offsets = _read_index(prefix + ".idx")
        self.dtype = self._header.dtype
        self._max_id = self._header.max_id
        self._digest: str | None = None
        bin_path = prefix + ".bin"
        expected = int(self._offsets[-1]) * self.dtype.itemsize
        actual = os.path.getsize(bin_path)
        if actual != expected:
            raise ValueError(
                f"data file {bin_path} is {actual} bytes but its index expects {expected}; "
                "it is truncated or does not match the .idx, re-run preprocessing"
            )
        if expected == 0:  # np.memmap cannot map an empty file
            self._tokens = np.empty(0, dtype=self.dtype)
        else:
            self._tokens = np.memmap(bin_path, dtype=self.dtype, mode="r")

    def __reduce__(self) -> tuple:
        # Reopen in DataLoader workers instead of pickling the mapped bytes.
        return (IndexedDataset, (self.prefix,))

    def __len__(self) -> int:
        return len(self._offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self._offsets[-1])

    @property
    def version(self) -> int:
        return self._header.version

    @property
    def vocab_size(self) -> int | None:
        """Vocabulary the data was tokenized with (None for a version-1 file, which did not record it)."""
        return self._header.vocab_size

    @property
    def max_token_id(self) -> int:
        """Largest token id in the data, -1 if none: from the header, or one scan of a version-1 ``.bin``."""
        if self._max_id is None:
            self._max_id = max((int(self._tokens[i:i + _SCAN_CHUNK].max())
                                for i in range(0, self.num_tokens, _SCAN_CHUNK)), default=-1)
        return self._max_id

    @property
    def offsets_digest(self) -> str:
        """sha1 of the document offsets: what every index derived from the document lengths is keyed on.

        Names and counts are not enough: the same documents in another order have the same
        count and total but other lengths at each position. Computed once per open dataset.
        """
        if self._digest is None:
            h = hashlib.sha1()
            for i in range(0, len(self._offsets), _SCAN_CHUNK):
                h.update(np.ascontiguousarray(self._offsets[i:i + _SCAN_CHUNK]).tobytes())
            self._digest = h.hexdigest()
        return self._digest

    @property
    def doc_lengths(self) -> np.ndarray:
        """Tokens per document (int64, in memory: 8 bytes per document)."""
        return np.diff(np.asarray(self._offsets))

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``doc`` (a view)."""
        n = len(self)
        if not -n <= doc < n:
            raise IndexError(f"document {doc} out of range for {n} documents in {self.prefix}")
        doc %= n
        start, end = int(self._offsets[doc]), int(self._offsets[doc + 1])
        lo = start + offset
        hi = end if length is None else lo + length
        if offset < 0 or hi > end or hi < lo:
            raise IndexError(f"span offset={offset} length={length} outside document {doc} of {end - start} tokens")
        return self._tokens[lo:hi]
