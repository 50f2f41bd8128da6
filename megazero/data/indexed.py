"""The on-disk token format: ``PREFIX.bin`` (all token ids back to back) and
``PREFIX.idx`` (where each document starts).

``.idx`` layout, little endian::

    magic    8 bytes  b"MZIDX\\x00\\x00\\x00"
    version  uint32   1
    dtype    uint32   1 = uint16 tokens, 2 = uint32 tokens
    n_docs   uint64
    offsets  int64 x (n_docs + 1)   token offset of each document; last = total

Both files are memory-mapped, never read whole, so a corpus larger than RAM
is fine. Files are written under temporary names and renamed at the end, so
a crash never leaves a half-written file under the final name.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from types import MappingProxyType, TracebackType

import numpy as np

MAGIC = b"MZIDX\x00\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<8sIIQ")
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

    def add_document(self, ids: Iterable[int] | np.ndarray) -> None:
        """Append one document's token ids."""
        arr = np.asarray(ids)
        if arr.size and (arr.min() < 0 or arr.max() >= self._vocab_size):
            raise ValueError(
                f"token id out of range [0, {self._vocab_size}) while writing {self.prefix}.bin"
            )
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._offsets.append(self._offsets[-1] + int(arr.size))

    @property
    def num_documents(self) -> int:
        return len(self._offsets) - 1

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def finalize(self) -> None:
        """Flush both files and rename them to their final names."""
        self._bin.close()
        offsets = np.asarray(self._offsets, dtype="<i8")
        with open(self._tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _dtype_code(self.dtype), len(offsets) - 1))
            f.write(offsets.tobytes())
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
        if exc_type is None:
            self.finalize()
        else:
            self.discard()


def _read_index(path: str) -> tuple[np.dtype, np.ndarray]:
    """Validate ``.idx`` and memory-map its offsets; every defect is a ValueError."""
    size = os.path.getsize(path)
    if size < _HEADER.size:
        raise ValueError(f"index file {path} is truncated ({size} bytes, header needs {_HEADER.size}); re-run preprocessing")
    with open(path, "rb") as f:
        magic, version, code, n_docs = _HEADER.unpack(f.read(_HEADER.size))
    if magic != MAGIC:
        raise ValueError(f"index file {path} has bad magic bytes {magic!r}; it is not a megazero .idx file")
    if version != VERSION:
        raise ValueError(f"index file {path} has version {version}, this code reads version {VERSION}; re-run preprocessing")
    if code not in _DTYPES:
        raise ValueError(f"index file {path} has unknown dtype code {code}; re-run preprocessing")
    expected = _HEADER.size + 8 * (n_docs + 1)
    if size != expected:
        raise ValueError(f"index file {path} is {size} bytes but {n_docs} documents need {expected}; it is truncated or corrupt")
    offsets = np.memmap(path, dtype="<i8", mode="r", offset=_HEADER.size, shape=(n_docs + 1,))
    if offsets[0] != 0 or (n_docs and np.any(np.diff(offsets) < 0)):
        raise ValueError(f"index file {path} has non-monotonic document offsets; it is corrupt")
    return _DTYPES[code], offsets


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.bin/.idx``; item i = document i."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise ValueError(f"data file {prefix + ext} does not exist; check --data-path (give the prefix, without .bin/.idx)")
        self.dtype, self._offsets = _read_index(prefix + ".idx")
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
