"""Approximate top-k inner-product search over a gradient index with faiss (``pip install 'influkit[index]'``).

A hierarchical navigable small-world graph (``faiss.IndexHNSWFlat``, inner-product metric, float32) over the index's
rows answers "which rows c(z) have the largest c(z)ᵀ q" without scoring every row: for a query of the index,
q = −s̃ gives the most harmful examples. The graph is built once per index size and kept beside the shards
(``ann-<rows>.faiss``; an append makes the next search build it again).
"""

from __future__ import annotations

import numpy as np
import torch

from ..extras import require

NEIGHBOURS = 32  # HNSW links per node
SEARCH_DEPTH = 256  # efSearch: candidates explored per search (at least k)


def graph(index):
    """The faiss HNSW graph of ``index``'s rows (built and saved on first use)."""
    faiss = require("faiss", "approximate search of a gradient index")
    path = index.directory / f"ann-{index.n_rows}.faiss"
    if path.is_file():
        return faiss.read_index(str(path))
    found = faiss.IndexHNSWFlat(index.width, NEIGHBOURS, faiss.METRIC_INNER_PRODUCT)
    for _, rows in index.shards():
        found.add(np.ascontiguousarray(rows.numpy(), dtype=np.float32))
    faiss.write_index(found, str(path))
    return found


def search(index, direction: torch.Tensor, k: int) -> torch.Tensor:
    """(k,) ids of the rows with the largest inner products with ``direction`` (D,), approximately."""
    found = graph(index)
    found.hnsw.efSearch = max(SEARCH_DEPTH, k)
    _, ids = found.search(np.ascontiguousarray(direction.reshape(1, -1).numpy(), dtype=np.float32), k)
    ids = ids[0]
    return torch.from_numpy(ids[ids >= 0].astype(np.int64))
