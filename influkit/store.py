"""The on-disk score store: a directory of score chunks that a streamed, resumable scoring run fills.

Layout of a store ``DIR``: ``DIR/manifest.json`` holds what the scores are of — the query's fingerprint (chain,
parameters, stage data sizes, links, solve settings, test set), the rows' digest, the number of rows and columns
and the chunk size; every finished chunk c is ``DIR/chunk-NNNNNN.safetensors`` (values and example ids, written
by atomic rename; the query's fingerprint and the rank that wrote it inside). A store whose manifest describes
another job is refused, so a rerun of the same call resumes it and nothing else does. At the end the chunks are
copied in order into ``DIR/values.npy`` and ``DIR/index.npy`` (plain appends, chunk by chunk: memory O(chunk))
and read back memory-mapped. Computing the chunks is :mod:`influkit.scoring`'s; this module only keeps them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from . import files
from .errors import FileFormatError, InputError

CHUNK_KIND = "score-chunk"
MANIFEST = "manifest.json"


class ScoreStore:
    """The chunks of one scoring job in ``directory``; ``manifest`` (JSON-able) says which job."""

    def __init__(self, directory: str | Path, manifest: dict):
        self.directory, self.manifest = Path(directory), dict(manifest)

    def claim(self) -> None:
        """Create the directory with the manifest, or check that the manifest already there describes this job."""
        path = self.directory / MANIFEST
        if path.exists():
            try:
                existing = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise FileFormatError(f"{path} is not an influkit scores manifest; use another directory.") from exc
            if existing != self.manifest:
                changed = sorted(k for k in self.manifest if existing.get(k) != self.manifest[k])
                raise InputError(
                    f"{self.directory} holds scores of another job (different {', '.join(changed)}: the chain, its "
                    "parameters, data sizes, links, solve settings, test set, rows or chunk size changed); refusing to "
                    "resume into it — pass a new directory or delete this one."
                )
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = self.directory / (MANIFEST + ".partial")
        partial.write_text(json.dumps(self.manifest, indent=1, sort_keys=True))
        os.replace(partial, path)

    def _chunk(self, c: int) -> Path:
        return self.directory / f"chunk-{c:06d}.safetensors"

    def has(self, c: int) -> bool:
        """True when chunk c is on disk, whole and of this job's query (a torn or foreign file is recomputed)."""
        path = self._chunk(c)
        if not path.exists():
            return False
        try:
            _, meta = files.read(path, CHUNK_KIND)
        except FileFormatError:
            return False
        return meta.get("query") == self.manifest["query"]

    def put(self, c: int, values: torch.Tensor, ids: torch.Tensor, rank: int = 0) -> None:
        """Write chunk c: its (rows, columns) values and the example ids of its rows."""
        files.write(self._chunk(c), CHUNK_KIND, {"values": values, "index": ids},
                    {"query": self.manifest["query"], "chunk": c, "rank": rank})

    def get(self, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, ids) of chunk c, as :meth:`put` wrote them."""
        tensors, _ = files.read(self._chunk(c), CHUNK_KIND)
        return tensors["values"], tensors["index"]

    def assemble(self, dtype: torch.dtype) -> None:
        """Append the chunks in order to ``values.npy`` (n_rows, columns) and ``index.npy`` (plain writes, no map kept)."""
        n_rows, columns = self.manifest["n_rows"], self.manifest["columns"]
        n_chunks = -(-n_rows // self.manifest["chunk_size"])
        out = self.directory
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        with open(out / "values.npy.partial", "wb") as values, open(out / "index.npy.partial", "wb") as index:
            for handle, kind, shape in ((values, np_dtype, (n_rows, columns)), (index, np.dtype(np.int64), (n_rows,))):
                np.lib.format.write_array_header_1_0(
                    handle, {"descr": np.lib.format.dtype_to_descr(kind), "fortran_order": False, "shape": shape})
            row = 0
            for c in range(n_chunks):
                tensors, _ = files.read(self._chunk(c), CHUNK_KIND)
                k = tensors["values"].shape[0]
                values.write(np.ascontiguousarray(tensors["values"].reshape(k, columns).numpy(), dtype=np_dtype).data)
                index.write(np.ascontiguousarray(tensors["index"].numpy(), dtype=np.int64).data)
                row += k
                del tensors
            if row != n_rows:
                raise FileFormatError(f"{out}: the chunks hold {row} rows, the manifest {n_rows}; delete the directory and rerun.")
        os.replace(out / "values.npy.partial", out / "values.npy")
        os.replace(out / "index.npy.partial", out / "index.npy")

    def arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, index) of the assembled store, memory-mapped (copy-on-write) from ``values.npy``, ``index.npy``."""
        values = torch.from_numpy(np.load(self.directory / "values.npy", mmap_mode="c"))
        index = torch.from_numpy(np.load(self.directory / "index.npy", mmap_mode="c"))
        return values, index


def resumed_chunk_size(directory: str | Path) -> int | None:
    """The chunk size recorded in the manifest of the store in ``directory`` (a run to resume), or None."""
    path = Path(directory) / MANIFEST
    try:
        return int(json.loads(path.read_text())["chunk_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
