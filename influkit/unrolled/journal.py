"""The on-disk journal of an exact reverse pass: each finished segment's example terms, and where the adjoint stands.

``metagradients(..., out=DIR)`` numbers the segments in the order the reverse pass takes them (j = 0: the last
stage's last checkpointed segment) and, as soon as segment j is done, writes this rank's example terms of it —
the ids and the (rows, q) values Σ_{t ∈ segment} (1/|B_t|) ∇ℓ(z; θ_t)·v_t — as chunk j·R + r of a
:class:`~influkit.store.ScoreStore` (R ranks, r this one), then, once every rank's terms are on disk, the adjoints
where the pass stands (θ̄, the optimizer state's, the shared block's; ``adjoint.safetensors``, written by rank 0,
replaced atomically). A re-run of the same call reads the adjoint back, takes the finished segments' terms from
disk and replays only the segments after it: a process killed at any moment loses at most the segment in flight.
The manifest's fingerprint (the record's schedule and checkpoints, the measure's adjoint, the number of ranks)
refuses a directory written by another job.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from .. import distributed, files
from ..store import ScoreStore
from .record import Record

ADJOINT_KIND = "unrolled-adjoint"


def fingerprint(record: Record, adjoint: dict) -> str:
    """A digest of what the reverse pass computes: every stage's optimizer, learning rates, batches, trained names,
    start and final values, data weights (a reweighted record's), the measure's adjoint, and the number of ranks."""
    digest = hashlib.sha256(f"ranks {distributed.world_size()}".encode())
    for run in record.runs:
        _add_run(digest, run)
    _add(digest, adjoint)
    return digest.hexdigest()


def stage_fingerprint(run) -> str:
    """A digest of one recorded stage run: its optimizer, learning rates, batches, trained and inherited names,
    start and final values and data weights — the same run recorded twice (bit for bit) has the same one."""
    digest = hashlib.sha256(b"stage")
    _add_run(digest, run)
    return digest.hexdigest()


def _add_run(digest, run) -> None:
    digest.update(f"{run.optimizer!r}|{run.lrs}|{run.trained}|{run.inherited}|{run.every}|{run.parts}|"
                  f"{run.clips}|{run.accumulate}|{run.divisors}".encode())
    _add(digest, {f"batch{t}": idx for t, idx in enumerate(run.batches)})
    _add(digest, run.checkpoints[0][0])
    _add(digest, run.final)
    if run.weights is not None:
        _add(digest, {"weights": run.weights})


def _add(digest, tensors: dict) -> None:
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def _flatten(theta_bar: dict, state_bar: dict, anchor_bar: dict) -> tuple[dict, dict]:
    tensors = {f"theta|{n}": v for n, v in theta_bar.items()} | {f"anchor|{n}": v for n, v in anchor_bar.items()}
    for slot, values in state_bar.items():
        tensors |= {f"state|{slot}|{n}": v for n, v in values.items()}
    return tensors, {"slots": {slot: list(values) for slot, values in state_bar.items()}}


def _unflatten(tensors: dict, meta: dict) -> tuple[dict, dict, dict]:
    theta = {k.split("|", 1)[1]: v for k, v in tensors.items() if k.startswith("theta|")}
    anchor = {k.split("|", 1)[1]: v for k, v in tensors.items() if k.startswith("anchor|")}
    state = {slot: {n: tensors[f"state|{slot}|{n}"] for n in names} for slot, names in meta["slots"].items()}
    return theta, state, anchor


class Journal:
    """The journal in ``directory`` for the job ``fingerprint`` (None: nothing is written, nothing resumed)."""

    def __init__(self, directory: str | Path | None, fingerprint: str, columns: int):
        self.directory = None if directory is None else Path(directory)
        self.store = None
        self.finished = 0
        self.query = fingerprint
        if self.directory is None:
            return
        self.store = ScoreStore(self.directory, {"format": "influkit-unrolled-terms", "version": files.VERSION,
                                                 "query": fingerprint, "ranks": distributed.world_size(),
                                                 "columns": columns})
        if distributed.rank() == 0:
            self.store.claim()
        distributed.barrier()
        if distributed.rank() != 0:
            self.store.claim()
        self.finished = distributed.broadcast_object(self._finished_on_disk() if distributed.rank() == 0 else None)

    def _path(self) -> Path:
        return self.directory / "adjoint.safetensors"

    def _finished_on_disk(self) -> int:
        if not self._path().exists():
            return 0
        _, meta = files.read(self._path(), ADJOINT_KIND)
        return int(meta["finished"]) if meta.get("query") == self.query else 0

    def done(self, j: int) -> bool:
        """Whether segment j was finished by an earlier run (its terms and the adjoint after it are on disk)."""
        return j < self.finished

    def terms(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, (rows, q) values) of this rank's terms of finished segment j."""
        values, ids = self.store.get(j * distributed.world_size() + distributed.rank())
        return ids, values

    def adjoint(self) -> tuple[dict, dict, dict]:
        """(θ̄, state adjoint, shared block's adjoint) after the last finished segment."""
        return _unflatten(*files.read(self._path(), ADJOINT_KIND))

    def finish(self, j: int, ids: torch.Tensor, values: torch.Tensor, theta_bar: dict, state_bar: dict,
               anchor_bar: dict) -> None:
        """Record segment j: this rank's terms, then (every rank's being on disk) the adjoints after it."""
        if self.store is None:
            return
        self.store.put(j * distributed.world_size() + distributed.rank(), values, ids, distributed.rank())
        distributed.barrier()
        if distributed.rank() == 0:
            tensors, meta = _flatten(theta_bar, state_bar, anchor_bar)
            files.write(self._path(), ADJOINT_KIND, tensors, meta | {"query": self.query, "finished": j + 1})
        distributed.barrier()
