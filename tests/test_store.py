"""influkit.store: a score store claims its directory, keeps whole chunks of its own job only, resumes, and
assembles the chunks in order into memory-mapped arrays."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import influkit as ik
from influkit.store import MANIFEST, ScoreStore, resumed_chunk_size


def manifest(**changes):
    return {"query": "q-123", "rows": "digest", "n_rows": 10, "columns": 3, "chunk_size": 4} | changes


def chunk(c, n_rows=10, columns=3, size=4):
    """Chunk c's rows: values (k, columns) = 100·id + column, ids 10..19 (row r holds id 10 + r)."""
    ids = torch.arange(c * size, min((c + 1) * size, n_rows)) + 10
    return ids[:, None] * 100.0 + torch.arange(columns), ids


def test_claim_writes_the_manifest_and_refuses_another_job(tmp_path):
    store = ScoreStore(tmp_path / "scores", manifest())
    store.claim()
    assert json.loads((tmp_path / "scores" / MANIFEST).read_text()) == manifest()
    assert resumed_chunk_size(tmp_path / "scores") == 4
    ScoreStore(tmp_path / "scores", manifest()).claim()  # the same job: a resume, accepted
    with pytest.raises(ik.InputError, match="different chunk_size, query.*refusing to resume"):
        ScoreStore(tmp_path / "scores", manifest(query="q-other", chunk_size=5)).claim()
    (tmp_path / "scores" / MANIFEST).write_text("{not json")
    with pytest.raises(ik.FileFormatError, match="not an influkit scores manifest"):
        ScoreStore(tmp_path / "scores", manifest()).claim()
    assert resumed_chunk_size(tmp_path / "scores") is None and resumed_chunk_size(tmp_path / "none") is None


def test_chunks_round_trip_and_a_rerun_resumes_only_whole_chunks_of_its_own_query(tmp_path):
    first = ScoreStore(tmp_path, manifest())
    first.claim()
    for c in (0, 1):
        first.put(c, *chunk(c), rank=c)
    values, ids = first.get(1)
    assert torch.equal(values, chunk(1)[0]) and torch.equal(ids, chunk(1)[1])
    # a later run of the same job (a new object, as after a crash) sees the finished chunks and only those
    again = ScoreStore(tmp_path, manifest())
    again.claim()
    assert [again.has(c) for c in range(3)] == [True, True, False]
    # a torn chunk (the write cut short) and a chunk of another query are recomputed, not trusted
    path = tmp_path / "chunk-000000.safetensors"
    path.write_bytes(path.read_bytes()[:-7])
    ScoreStore(tmp_path, manifest(query="q-other")).put(1, *chunk(1))
    assert [again.has(c) for c in range(3)] == [False, False, False]


def test_assemble_in_chunk_order_into_memory_mapped_arrays(tmp_path):
    store = ScoreStore(tmp_path, manifest())
    store.claim()
    for c in (2, 0, 1):  # finished in any order, e.g. by several ranks
        store.put(c, *chunk(c))
    store.assemble(torch.float32)
    values, index = store.arrays()
    assert values.dtype == torch.float32 and values.shape == (10, 3)
    assert torch.equal(index, torch.arange(10, 20))
    assert torch.equal(values, (index[:, None] * 100.0 + torch.arange(3)).float())
    assert not list(tmp_path.glob("*.partial"))
    # memory-mapped: the file is mapped into this process, and writes to the tensor stay private (copy-on-write)
    maps = open("/proc/self/maps").read()
    assert str(tmp_path / "values.npy") in maps and str(tmp_path / "index.npy") in maps
    values[0, 0] = -1.0
    assert np.load(tmp_path / "values.npy")[0, 0] == 1000.0


def test_assemble_refuses_chunks_that_do_not_add_up(tmp_path):
    store = ScoreStore(tmp_path, manifest(n_rows=11))  # 3 chunks of 4 rows would hold 12, these hold 10
    store.claim()
    for c in range(3):
        store.put(c, *chunk(c))
    with pytest.raises(ik.FileFormatError, match="the chunks hold 10 rows, the manifest 11"):
        store.assemble(torch.float64)
    assert not (tmp_path / "values.npy").exists()
