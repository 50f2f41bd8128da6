"""A small indexed dataset on disk whose tokens say which document and position they came from."""
from __future__ import annotations

import os

import numpy as np

from megazero.data.indexed import IndexedDataset, IndexedDatasetWriter


def make_indexed(folder: str, n_docs: int = 50, seed: int = 0, name: str = "data") -> IndexedDataset:
    """Random documents (some empty) whose tokens encode (doc, position) uniquely."""
    rng = np.random.RandomState(seed)
    prefix = os.path.join(folder, name)
    with IndexedDatasetWriter(prefix, vocab_size=100_000) as w:
        for d in range(n_docs):
            length = 0 if d % 17 == 5 else rng.randint(1, 40)
            w.add_document(d * 100 + np.arange(length))
    return IndexedDataset(prefix)
