"""Scoring stage-1 examples against a query's solution s: I(z, T) = −∇ℓ_1(z)ᵀ s, chunk by chunk.

The inner products are taken by contraction of the layers' inputs and output-gradients
(:mod:`influkit.contraction`), never forming the (chunk, p) gradient matrix; per-example gradients remain the
fallback and the reference (``gradients="per-example"``). The chunk size comes from the memory budget
(:class:`Scorer`, :mod:`influkit.memory`) unless given; the contraction's probe that measures it scores the first
two rows, and those scores are kept, not computed again.

Rows are split into chunks of ``chunk_size``; under ``torch.distributed`` rank r of R scores the r-th
contiguous range of chunks and the rows are gathered in order, so every rank returns the whole result.

With ``out=DIR`` the scores are *streamed* into a :class:`~influkit.store.ScoreStore` (:mod:`influkit.store`: the
manifest, one file per finished chunk, resumable): re-running the same call skips every chunk already on disk
and computes only the rest, so a process killed at any moment loses at most the chunks in flight, and the
result's tensors are memory-mapped from the store: memory stays O(chunk_size · p) however many rows. After every
chunk under a given ``memory=`` (a bound on resident growth), and every :data:`TRIM_EVERY` computed chunks under the
default budget, and after the last, the C allocator's freed pages are returned to the system (glibc
``malloc_trim``): each chunk allocates and frees buffers of chunk_size · p floats, and once glibc has raised its mmap
threshold past that size they come from the heap, whose freed pages otherwise stay resident and fragment
(``benchmarks/bench_distributed.py --part rss --rss-without-trim`` measures the growth with and without the trim).
Not after every chunk by default, because the next chunk would fault all its pages in again; under a given
``memory=`` after every chunk, because a few chunks of fragmentation can exceed a small budget (tests/test_memory.py).
Scoring all rows of a stage holds no O(m) index array (ids are ranges, hashed in pieces for the store's manifest).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
from pathlib import Path

import numpy as np
import torch
from .progress import steps as progress_steps

from . import distributed, files
from .data import as_examples
from .errors import InputError
from .contraction import Contractor
from .gradients import backward_bytes, project_per_example_grads
from .memory import DEFAULT_EXAMPLES, PROBE_EXAMPLES
from .memory import plan as memory_plan
from .memory import given as budget_given
from .memory import resolve as budget_of
from .stage import Stage, check_example_shape
from .store import ScoreStore

GRADIENTS = ("contraction", "per-example")
TRIM_EVERY = 16  # computed chunks between returns of freed heap pages (release_freed_memory)
# On CPU under the default budget a contraction chunk holds at most this many measured bytes (at least
# DEFAULT_EXAMPLES examples): small chunks keep a large vocabulary's logits in the caches, and larger ones were not
# faster (benchmarks/bench_transformer.py).
CPU_CHUNK_BYTES = 32 * 2**20
_HASH_ROWS = 1 << 20


def _load_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_MALLOC_TRIM = _load_trim()


def release_freed_memory() -> None:
    """Give the C allocator's free pages back to the system (glibc ``malloc_trim(0)``; nothing elsewhere)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class Rows:
    """The examples to score: indices into the stage's data (taken chunk by chunk) or explicit tensors.

    ids: the row ids (a 1-D tensor), or an int m for all m examples of the stage in order — then no O(m) index
    array is ever held unless :attr:`ids` is read.
    """

    def __init__(self, stage: Stage, ids: torch.Tensor | int, tensors: tuple[torch.Tensor, torch.Tensor] | None):
        self.stage, self.tensors = stage, tensors
        self._ids, self._count = (None, int(ids)) if isinstance(ids, int) else (ids, ids.shape[0])

    @property
    def ids(self) -> torch.Tensor:
        return torch.arange(self._count) if self._ids is None else self._ids

    def id_range(self, start: int, stop: int) -> torch.Tensor:
        """The ids of rows start..stop−1."""
        return torch.arange(start, min(stop, self._count)) if self._ids is None else self._ids[start:stop]

    @classmethod
    def of(cls, stage: Stage, z) -> "Rows":
        if z is None:
            return cls(stage, len(stage), None)
        if isinstance(z, (tuple, list)) and len(z) == 2 and all(torch.is_tensor(t) for t in z):
            (x, y), ids = as_examples(z, stage.data, "z")
            check_example_shape(stage, x, "z")
            return cls(stage, ids, (x, y))
        ids = torch.as_tensor(z)
        if ids.dtype == torch.bool:
            ids = ids.nonzero().reshape(-1)
        if ids.dim() != 1 or ids.is_floating_point():
            raise InputError(f"z must be (inputs, targets) tensors or 1-D integer indices, got shape {tuple(ids.shape)}.")
        if ids.numel() == 0:
            raise InputError("z is empty: give at least one example.")
        stage.data.take(ids[[0, -1]])  # range check, message from the data source
        return cls(stage, ids.long().cpu(), None)

    def __len__(self) -> int:
        return self._count

    def take(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tensors is None:
            x, y = self.stage.data.take(self.id_range(start, stop))
            check_example_shape(self.stage, x, "z")
            return x, y
        return self.tensors[0][start:stop], self.tensors[1][start:stop]

    def digest(self) -> str:
        """Identifies the rows: the indices, or the bytes of explicit inputs and targets (hashed in pieces, no copy)."""
        h = hashlib.sha256()
        for start in range(0, self._count, _HASH_ROWS):
            h.update(np.ascontiguousarray(self.id_range(start, start + _HASH_ROWS).numpy()))
        for t in self.tensors or ():
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        return h.hexdigest()


def rank_chunks(n_rows: int, chunk_size: int) -> tuple[range, list[int]]:
    """(this rank's contiguous range of chunk numbers, rows held by each rank)."""
    if chunk_size < 1:
        raise InputError(f"chunk_size must be ≥ 1, got {chunk_size}.")
    n_chunks = -(-n_rows // chunk_size)
    size, rank = distributed.world_size(), distributed.rank()
    bounds = [min(n_rows, ((n_chunks * r) // size) * chunk_size) for r in range(size + 1)]
    return range((n_chunks * rank) // size, (n_chunks * (rank + 1)) // size), [b - a for a, b in zip(bounds, bounds[1:])]


class Scorer:
    """G·S for chunks of rows (G their per-example gradients over ``names``): by contraction
    (:mod:`influkit.contraction`, memory O(chunk · activations)) or by per-example gradients (``vmap``, memory
    O(chunk · p)), and the chunk size that keeps one chunk inside the memory budget (:mod:`influkit.memory`).

    gradients: "contraction" (default), or "per-example" (the reference). chunk_size: rows per chunk, or None to
    size it from ``memory`` (bytes; None: the default budget) by probing the method on two rows.
    autocast: bfloat16/float16 passes for the contraction (float32 accumulation).
    ``probed``: (h, k) G·S of the first h rows, which the contraction's probe computed (h = 0 without a probe):
    :func:`_chunk_scores` takes them instead of scoring those rows again.
    """

    def __init__(self, stage: Stage, names, s: torch.Tensor, rows: "Rows", *, gradients: str = "contraction",
                 chunk_size: int | None = None, memory: int | None = None, autocast: torch.dtype | None = None):
        if gradients not in GRADIENTS:
            raise InputError(f"unknown gradients={gradients!r}; choose one of {GRADIENTS}.")
        if gradients == "per-example" and autocast is not None:
            raise InputError("autocast applies to gradients='contraction' only.")
        self.stage, self.names, self.gradients = stage, list(names), gradients
        # a given budget is a bound on resident growth: freed pages go back after every chunk (fragmentation across
        # TRIM_EVERY chunks measured beyond a 24 MiB budget, tests/test_memory.py)
        self.trim_every = 1 if budget_given(memory) else TRIM_EVERY
        s = s.reshape(s.shape[0], -1)
        self.probed = s.new_zeros(0, s.shape[1])
        budget = budget_of(memory, s.device)
        self.contractor = Contractor(stage, names, autocast=autocast, memory=budget) \
            if gradients == "contraction" else None
        if chunk_size is None:
            x, y = rows.take(0, min(PROBE_EXAMPLES, len(rows)))
            fixed = 0
            if self.contractor is not None:  # the per-example gradient rows it forms are set aside, not per example
                per = self.contractor.probe(x, y, s)
                if self.contractor.probed is not None:
                    self.probed = self.contractor.probed
                fixed = self.contractor.reserve(budget, per, max(len(rows), 1))
            else:
                per = backward_bytes(stage, x, y, names) + s.shape[0] * s.element_size()  # + one gradient row
            self.memory = memory_plan(budget, per, "scoring", most=max(len(rows), 1), fixed=fixed,
                                      default=not budget_given(memory))
            if self.contractor is not None and not budget_given(memory) and s.device.type == "cpu":
                cached = max(DEFAULT_EXAMPLES, CPU_CHUNK_BYTES // max(per, 1))  # a chunk that stays near the caches
                if cached < self.memory["batch"]:
                    self.memory |= {"batch": cached, "cpu_chunk_bytes": CPU_CHUNK_BYTES}
            chunk_size = min(distributed.gather_objects(self.memory["batch"])) if distributed.active() else \
                self.memory["batch"]  # every rank the same chunks
        else:
            self.memory = {"phase": "scoring", "batch": int(chunk_size), "given": True}
        self.chunk_size = int(chunk_size)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        if self.contractor is not None:
            return self.contractor(x, y, s)
        return project_per_example_grads(self.stage, x, y, s, self.names, chunk_size=max(x.shape[0], 1))

    def describe(self) -> dict:
        detail = self.contractor.describe() if self.contractor is not None else {}
        gradients = "per-example" if self.contractor is None or self.contractor.fallback_all else self.gradients
        return {"gradients": gradients, "chunk_size": self.chunk_size, **detail}


def _chunk_scores(s: torch.Tensor, scorer: Scorer, rows: Rows, c: int, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of chunk ``c``: −∇ℓ(z)ᵀ s for its rows (those the scorer's probe scored taken from it)."""
    start, stop = c * chunk_size, min((c + 1) * chunk_size, len(rows))
    values = scorer.probed[start:stop]
    rest = start + values.shape[0]
    if rest < stop:
        new = scorer(*rows.take(rest, stop), s)
        values = torch.cat([values.to(new.dtype), new]) if values.shape[0] else new
    return -values, rows.id_range(start, stop)


def gather_chunks(chunk, n_rows: int, chunk_size: int, empty: torch.Tensor, *, progress: bool, trim_every: int,
                  desc: str = "scoring") -> tuple[torch.Tensor, dict]:
    """(values (n_rows, k), chunk counts): ``chunk(c)`` → (values, ids) for this rank's chunks c
    (:func:`rank_chunks`), gathered from every rank in order; ``empty``: the (0, k) block of a rank with none.
    trim_every: computed chunks between returns of freed heap pages (:attr:`Scorer.trim_every`)."""
    mine, counts = rank_chunks(n_rows, chunk_size)
    blocks = []
    for i, c in enumerate(progress_steps(mine, desc, progress and distributed.rank() == 0)):
        blocks.append(chunk(c)[0])
        if (i + 1) % trim_every == 0:
            release_freed_memory()
    release_freed_memory()
    local = torch.cat(blocks) if blocks else empty
    return distributed.gather_rows(local, counts), {"computed": len(mine), "reused": 0}


def stream_chunks(chunk, n_rows: int, chunk_size: int, header: dict, dtype: torch.dtype, *, out: str | Path,
                  progress: bool, trim_every: int, desc: str = "scoring"):
    """:func:`gather_chunks` streamed into the :class:`~influkit.store.ScoreStore` ``out`` (``header``: what must
    match to resume): the chunks already there are reused, the others computed and written one by one; returns
    (values, index) memory-mapped, chunk counts."""
    store = ScoreStore(out, header)
    if distributed.rank() == 0:
        store.claim()
    distributed.barrier()
    if distributed.rank() != 0:
        store.claim()
    mine, _ = rank_chunks(n_rows, chunk_size)
    rank = distributed.rank()
    counts = {"computed": 0, "reused": 0}
    for c in progress_steps(mine, desc, progress and rank == 0):
        if store.has(c):
            counts["reused"] += 1
            continue
        values, ids = chunk(c)
        store.put(c, values, ids, rank)
        counts["computed"] += 1
        del values, ids
        if counts["computed"] % trim_every == 0:
            release_freed_memory()
    release_freed_memory()
    distributed.barrier()
    if rank == 0:
        store.assemble(dtype)
    distributed.barrier()
    values, index = store.arrays()
    return values, index, counts


def store_header(fingerprint: str, rows: Rows, chunk_size: int, columns: int) -> dict:
    """The score store's header: what a resumed stream must match."""
    return {"format": "influkit-scores", "version": files.VERSION, "query": fingerprint, "rows": rows.digest(),
            "n_rows": len(rows), "chunk_size": chunk_size, "columns": columns}


def score_rows(s: torch.Tensor, scorer: Scorer, rows: Rows, *, progress: bool) -> tuple[torch.Tensor, dict]:
    """(values (len(rows), k), chunk counts) of −∇ℓ(z)ᵀ s, sharded over ranks and gathered in order."""
    s = s.reshape(s.shape[0], -1)
    return gather_chunks(lambda c: _chunk_scores(s, scorer, rows, c, scorer.chunk_size), len(rows),
                         scorer.chunk_size, s.new_zeros(0, s.shape[1]), progress=progress,
                         trim_every=scorer.trim_every)


def stream_rows(query_fingerprint: str, s: torch.Tensor, scorer: Scorer, rows: Rows, *, out: str | Path, progress: bool):
    """:func:`score_rows` streamed into the :class:`~influkit.store.ScoreStore` ``out`` (:func:`stream_chunks`)."""
    s = s.reshape(s.shape[0], -1)
    return stream_chunks(lambda c: _chunk_scores(s, scorer, rows, c, scorer.chunk_size), len(rows), scorer.chunk_size,
                         store_header(query_fingerprint, rows, scorer.chunk_size, s.shape[1]), s.dtype, out=out,
                         progress=progress, trim_every=scorer.trim_every)
