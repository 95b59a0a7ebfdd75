"""The per-example terms of an unrolled result, chunk by chunk: sharded over ranks, streamed to a score store.

A stage's score is a sum over its pieces ℓ of example terms, score_z = Σ_ℓ (1/n) ∇ℓ(z; θ_ℓ)·u_ℓ (u_ℓ: the adjoint
of the forcing a data weight adds to the piece's steps, :mod:`.segments`). Once the u_ℓ are known the examples are
independent, so they are scored like :meth:`influkit.Query.scores` rows: in chunks of ``chunk_size`` (default: what
the memory budget holds, :class:`influkit.scoring.Scorer`, by contraction or per-example gradients), chunk c on
rank c·R // n_chunks of R (contiguous ranges, the rows gathered in order, so every rank returns the whole
result), and with ``out=DIR`` each finished chunk written to a :class:`~influkit.store.ScoreStore` as soon as it
is computed: a re-run of the same call skips the chunks already there, and the values come back memory-mapped.
The store's fingerprint is a digest of the θ_ℓ and u_ℓ themselves, so only a call that would compute the same
numbers resumes into it.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from pathlib import Path

import torch

from ..scoring import Rows, Scorer, gather_chunks, store_header, stream_chunks
from ..store import resumed_chunk_size


@contextmanager
def holding(model: torch.nn.Module, values: dict):
    """The model's parameters set to ``values`` (name → tensor) inside the block, its own values restored after."""
    named = dict(model.named_parameters())
    kept = {n: named[n].detach().clone() for n in values}
    with torch.no_grad():
        for n, v in values.items():
            named[n].copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for n, v in kept.items():
                named[n].copy_(v)


def fingerprint(method: str, k: int, pieces: list[tuple[dict, torch.Tensor]]) -> str:
    """A digest of what a stage's terms depend on: the method, the stage and every piece's θ_ℓ and u_ℓ bytes."""
    digest = hashlib.sha256(f"{method}|stage {k}".encode())
    for theta, u in pieces:
        for t in [*(theta[n] for n in sorted(theta)), u]:
            digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class Terms:
    """score_z = Σ_ℓ (1/n) ∇ℓ(z; θ_ℓ)·u_ℓ for every example of ``stage``: pieces [(θ_ℓ over ``names``, u_ℓ (q, p))]."""

    def __init__(self, stage, names: list[str], pieces: list[tuple[dict, torch.Tensor]], *, chunk_size: int | None,
                 gradients: str, memory: int | None, out: str | Path | None):
        self.stage, self.names, self.pieces = stage, list(names), pieces
        self.rows = Rows.of(stage, None)
        if chunk_size is None and out is not None:
            chunk_size = resumed_chunk_size(out)  # resuming: the chunks already on disk decide
        self.scorer = Scorer(stage, names, pieces[0][1].T, self.rows, gradients=gradients, chunk_size=chunk_size,
                             memory=memory)
        self.chunk_size = self.scorer.chunk_size

    def chunk(self, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values (rows, q), ids) of chunk c."""
        start, stop = c * self.chunk_size, min((c + 1) * self.chunk_size, len(self.rows))
        x, y = self.rows.take(start, stop)
        total = 0
        for theta, u in self.pieces:
            with holding(self.stage.model, theta):
                total = total + self.scorer(x, y, u.T)
        return total / len(self.stage), self.rows.id_range(start, stop)

    def compute(self, *, fingerprint: str, out: str | Path | None, progress: bool):
        """(values (n, q), index, chunk counts): every rank's chunks gathered in order, or streamed to ``out``."""
        n, q = len(self.rows), self.pieces[0][1].shape[0]
        dtype = self.pieces[0][1].dtype
        if out is None:
            values, counts = gather_chunks(self.chunk, n, self.chunk_size, torch.zeros(0, q, dtype=dtype),
                                           progress=progress, trim_every=self.scorer.trim_every, desc="example terms")
            return values, self.rows.ids, counts
        return stream_chunks(self.chunk, n, self.chunk_size, store_header(fingerprint, self.rows, self.chunk_size, q),
                             dtype, out=out, progress=progress, trim_every=self.scorer.trim_every, desc="example terms")

    def describe(self) -> dict:
        return self.scorer.describe()
