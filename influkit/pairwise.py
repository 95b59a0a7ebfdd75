"""Pairwise scores at corpus scale: the (n_train, n_test) matrix I(z_i, x_j) in blocks on disk, with the top k
training examples of every test point kept while the blocks stream.

The test points are split into query blocks of ``query_block`` points. Per block, one :meth:`Chain.query` solves its
adjoints s (p, b) — the only O(p · b) memory — which are saved, and :meth:`Query.scores` streams the rows of the
block's (n_train, b) scores chunk by chunk into a score store (:mod:`influkit.store`: one safetensors file per
finished chunk, then ``values.npy``), resumable after a kill at any moment; then the block's rows are read back a
chunk at a time and the k highest scores of each test point merged into ``top.safetensors``. So memory stays the
adjoints of one block plus one chunk of rows, whatever n_train and n_test, and a rerun of the same call reuses every
finished block, solve and chunk. Under ``torch.distributed`` each block's chunks are split over the ranks
(:meth:`Query.scores`) and rank 0 writes the block's files.

Layout of ``out``: ``pairwise.json`` (what the matrix is of, the blocks), and per block j ``block-NNNNNN/`` with
``query.safetensors`` (its adjoints), the score store (``values.npy``: (n_train, b) in test order, ``index.npy``) and
``top.safetensors`` (``values``/``index``: (k, b), the k highest scores of each test point and their row ids,
highest first). The same call with ``out=None`` computes the same blocks in memory, bit for bit.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import distributed, files
from .chain import Chain, Measure, Query, load_query
from .data import as_examples
from .errors import FileFormatError, InputError
from .memory import resolve as budget_of
from .progress import steps as progress_steps
from .scoring import Rows, Scorer
from .store import ScoreStore, resumed_chunk_size

MANIFEST = "pairwise.json"
TOP_KIND = "pairwise-top"
ADJOINT_SHARE = 0.25  # of the memory budget, at most, for one query block's adjoints s (p, b)
VALUES_SHARE = 1 / 16  # of the memory budget, at most, for one row chunk's (rows, b) scores


@dataclass
class Pairwise:
    """The (n_train, n_test) scores in query blocks: ``blocks[j]`` = (first, stop) test points of block j,
    ``values(j)`` its (n_train, b) scores (memory-mapped from ``out`` when streamed), ``top_values`` / ``top_index``
    (k, n_test) the k highest scores of each test point and their training row ids, highest first."""

    n_train: int
    n_test: int
    blocks: list[tuple[int, int]]
    top_values: torch.Tensor
    top_index: torch.Tensor
    directory: Path | None
    _values: list[torch.Tensor]

    def values(self, block: int) -> torch.Tensor:
        return self._values[block]

    def matrix(self) -> torch.Tensor:
        """The whole (n_train, n_test) matrix in memory (small problems and tests)."""
        return torch.cat(self._values, dim=1)


def pairwise(chain: Chain, z, x_test, *, out: str | Path | None = None, measure: Measure | None = None, k: int = 10,
             query_block: int | None = None, chunk_size: int | None = None, progress: bool | None = None) -> Pairwise:
    """Every I(z_i, x_j) of stage-1 examples ``z`` (indices or (inputs, targets); None: all) on the test points
    ``x_test`` (as :meth:`Chain.query` takes them, with ``measure``), in blocks of ``query_block`` test points
    (default: the most whose adjoints fit :data:`ADJOINT_SHARE` of the chain's memory budget), ``chunk_size`` rows at a
    time (default: sized by :meth:`Query.scores`); the ``k`` highest-scoring rows of each test point kept.
    out: a directory to stream to (module docstring), resumed by the same call; None computes in memory."""
    progress = chain.progress if progress is None else progress
    last = chain.plans[-1].stage
    (tx, ty), _ = as_examples(x_test, last.data, "x_test")
    rows = Rows.of(chain.plans[0].stage, z)
    n_test, n_train = tx.shape[0], len(rows)
    if k < 1:
        raise InputError(f"k must be ≥ 1, got {k}.")
    k = min(k, n_train)
    block = query_block or _default_block(chain, n_test)
    if block < 1:
        raise InputError(f"query_block must be ≥ 1, got {block}.")
    bounds = [(a, min(a + block, n_test)) for a in range(0, n_test, block)]
    directory = None if out is None else Path(out)
    if directory is not None:
        _claim(directory, {"format": "influkit-pairwise", "version": files.VERSION, "chain": chain.fingerprint(),
                           "test": Rows(last, torch.arange(n_test), (tx, ty)).digest(), "rows": rows.digest(),
                           "measure": None if measure is None else getattr(measure, "__qualname__", repr(measure)),
                           "n_train": n_train, "n_test": n_test, "blocks": bounds, "k": k})
    values, tops = [], []
    for j in progress_steps(range(len(bounds)), "query blocks", progress and distributed.rank() == 0):
        a, b = bounds[j]
        where = None if directory is None else directory / f"block-{j:06d}"
        query = _query(chain, (tx[a:b], ty[a:b]), measure, where, progress)
        scores_dir = None if where is None else where / "scores"
        resumed = None if scores_dir is None else distributed.broadcast_object(resumed_chunk_size(scores_dir))
        rows_at_once = chunk_size or resumed or _default_chunk(chain, query, rows)
        result = query.scores(z, chunk_size=rows_at_once, out=scores_dir, progress=progress)
        block_values = result.values.reshape(n_train, b - a)
        chunk = result.diagnostics["chunks"]["chunk_size"]
        if where is None:
            top = top_rows(_row_chunks(block_values, result.index, chunk), k)
        else:
            top = _read_top(where / "top.safetensors", k, b - a) if _on_rank0(where / "top.safetensors") else None
            if top is None:  # the store's chunk files read one at a time: memory O(chunk · b), no map touched
                store = ScoreStore(where / "scores", {})
                top = top_rows((store.get(c) for c in range(-(-n_train // chunk))), k)
                if distributed.rank() == 0:
                    files.write(where / "top.safetensors", TOP_KIND, {"values": top[0], "index": top[1]}, {"k": k})
                distributed.barrier()
        values.append(block_values)
        tops.append(top)
    return Pairwise(n_train, n_test, bounds, torch.cat([t[0] for t in tops], dim=1),
                    torch.cat([t[1] for t in tops], dim=1), directory, values)


def _row_chunks(values: torch.Tensor, index: torch.Tensor, chunk: int):
    """(values, ids) of the rows ``chunk`` at a time."""
    for lo in range(0, values.shape[0], chunk):
        yield values[lo : lo + chunk], index[lo : lo + chunk]


def top_rows(chunks, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """((k, b) the k highest values of each column, (k, b) their row ids), highest first, merged over ``chunks`` of
    (values (rows, b), ids (rows,)) one at a time: each chunk's top k, then the top k of those and the best so far
    (memory O(k · b) beside the chunk)."""
    best_v = best_i = None
    for v, ids in chunks:
        top_v, order = torch.topk(v, min(k, v.shape[0]), dim=0)
        top_i = ids.reshape(-1)[order]
        if best_v is not None:
            top_v, top_i = torch.cat([best_v, top_v]), torch.cat([best_i, top_i])
            top_v, order = torch.topk(top_v, min(k, top_v.shape[0]), dim=0)
            top_i = top_i.gather(0, order)
        best_v, best_i = top_v, top_i
    return best_v, best_i


def _default_chunk(chain: Chain, query: Query, rows: Rows) -> int:
    """Rows per chunk: the scorer's own choice from the memory budget (:class:`~influkit.scoring.Scorer`), at most as
    many as keep one chunk's (rows, b) values within :data:`VALUES_SHARE` of the budget (a chunk's values are held
    about three times while it is written and merged)."""
    plan = chain.plans[0]
    scorer = Scorer(plan.stage, plan.trained, query.s, rows, memory=chain.memory)
    width = query.s.reshape(query.s.shape[0], -1).shape[1] * query.s.element_size()
    return max(1, min(scorer.chunk_size, int(VALUES_SHARE * budget_of(chain.memory)) // width))


def _default_block(chain: Chain, n_test: int) -> int:
    """Test points whose adjoints (p, b) fit ADJOINT_SHARE of the chain's memory budget (at least 1)."""
    plan = chain.plans[0]
    state = plan.stage.state()
    row = sum(state[n].numel() * state[n].element_size() for n in plan.trained)
    return max(1, min(n_test, int(ADJOINT_SHARE * budget_of(chain.memory)) // max(row, 1)))


def _query(chain: Chain, test, measure, where: Path | None, progress: bool) -> Query:
    """The block's per-test query: loaded from ``where`` when an earlier run saved it, else solved (and saved)."""
    path = None if where is None else where / "query.safetensors"
    if path is not None and _on_rank0(path):
        try:
            return load_query(path, chain)
        except FileFormatError:
            pass  # torn or foreign: solve again
    query = chain.query(test, measure=measure, per_test=True, progress=progress)
    if path is not None:
        if distributed.rank() == 0:
            where.mkdir(parents=True, exist_ok=True)
            query.save(path)
        distributed.barrier()
    return query


def _read_top(path: Path, k: int, columns: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not path.exists():
        return None
    try:
        tensors, meta = files.read(path, TOP_KIND)
    except FileFormatError:
        return None
    if meta.get("k") != k or tensors["values"].shape[1] != columns:
        return None
    return tensors["values"], tensors["index"]


def _on_rank0(path: Path) -> bool:
    """Whether ``path`` exists, as rank 0 sees it (every rank takes the same branch)."""
    return bool(distributed.broadcast_object(path.exists()))


def _claim(directory: Path, manifest: dict) -> None:
    """Write ``pairwise.json`` (rank 0, before any other rank reads it), or check that the one there describes
    this job."""
    expected = json.loads(json.dumps(manifest, sort_keys=True))
    path = directory / MANIFEST
    if _on_rank0(path):
        existing = json.loads(path.read_text())
        if existing != expected:
            changed = sorted(key for key in expected if existing.get(key) != expected[key])
            raise InputError(f"{directory} holds pairwise scores of another job (different {', '.join(changed)}: the "
                             "chain, its parameters, the test set, the rows, the blocks or k); pass a new directory or "
                             "delete this one.")
        return
    if distributed.rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / (MANIFEST + ".partial")
        partial.write_text(json.dumps(expected, indent=1, sort_keys=True))
        os.replace(partial, path)
    distributed.barrier()
