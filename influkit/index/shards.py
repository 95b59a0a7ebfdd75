"""The on-disk form of a gradient index: a manifest, the projections and one ``.npy`` file per shard of rows.

Layout of an index ``DIR``:

- ``DIR/manifest.json``: what the rows are of — the checkpoint's fingerprint (every value of the model's state and
  the trained names), the settings, the layout of a row (its blocks and their widths), and the planned shards,
  each a range of example rows with the digest of those examples (their inputs' and targets' bytes). Written
  atomically (rename) before any shard of a build or an append is computed; an append adds shards to it.
- ``DIR/projections.safetensors``: every block's projection matrices (an influkit file, never pickle).
- ``DIR/shard-NNNNNN.npy``: the (rows, D) compressed gradients of shard N (an int8 index: (rows, D + 4), each
  row's int8 values and its float32 scale, :mod:`.quantization`), written to a ``.partial`` file and
  renamed, so a shard file on disk is whole: the done shards are the shard files present. A killed build loses
  at most the shards in flight, and the same call resumes it.

Shards are read back memory-mapped (copy-on-write): a query streams them through one matrix product each.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from ..errors import FileFormatError
from ..stage import Stage

FORMAT = "influkit-gradient-index"
VERSION = 3  # 2: whitening (the config's whiten and damping, the blocks' whitened flag); 3: int8 rows and scales
MANIFEST = "manifest.json"
PROJECTIONS = "projections.safetensors"
PROJECTIONS_KIND = "index-projections"
_HASH_ROWS = 4096


def checkpoint_fingerprint(stage: Stage, names) -> str:
    """sha256 of every tensor of the stage model's state (names, dtypes, shapes, values) and the trained ``names``."""
    h = hashlib.sha256()
    for name, tensor in sorted(stage.model.state_dict(keep_vars=False).items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    h.update(("|".join(names)).encode())
    return h.hexdigest()


def data_digest(stage: Stage, start: int, stop: int) -> str:
    """sha256 of the bytes of examples start..stop−1 of the stage's data (inputs, then targets, per piece)."""
    h = hashlib.sha256()
    for s in range(start, stop, _HASH_ROWS):
        for t in stage.data.take(torch.arange(s, min(stop, s + _HASH_ROWS))):
            t = t.detach().cpu().contiguous()
            h.update(f"{t.dtype}|{tuple(t.shape[1:])}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class ShardFiles:
    """The files of the index in ``directory``."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    def exists(self) -> bool:
        return (self.directory / MANIFEST).is_file()

    def read_manifest(self) -> dict:
        path = self.directory / MANIFEST
        try:
            manifest = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise FileFormatError(f"{path} is not a gradient index manifest ({exc}); build the index again.") from exc
        if manifest.get("format") != FORMAT:
            raise FileFormatError(f"{path} is not a gradient index manifest; build the index again.")
        if manifest.get("version") != VERSION:
            raise FileFormatError(f"{path} is a gradient index of format version {manifest.get('version')}; this "
                                  f"influkit reads version {VERSION}: build the index again (GradientIndex.build into "
                                  "a new directory, or remove this one first).")
        return manifest

    def write_manifest(self, manifest: dict) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = self.directory / (MANIFEST + ".partial")
        partial.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(partial, self.directory / MANIFEST)

    def shard(self, c: int) -> Path:
        return self.directory / f"shard-{c:06d}.npy"

    def has(self, c: int, rows: int, width: int) -> bool:
        """True when shard c is on disk with its (rows, width) shape (a rename made it whole; ``width``: the stored
        columns)."""
        path = self.shard(c)
        if not path.is_file():
            return False
        try:
            array = np.load(path, mmap_mode="r")
        except (OSError, ValueError):
            return False
        return array.shape == (rows, width)

    def put(self, c: int, rows: torch.Tensor) -> None:
        """Write shard c atomically (a ``.partial`` file renamed)."""
        partial = self.directory / f"shard-{c:06d}.npy.partial"
        with open(partial, "wb") as handle:
            np.save(handle, rows.detach().cpu().contiguous().numpy())
        os.replace(partial, self.shard(c))

    def get(self, c: int) -> torch.Tensor:
        """Shard c memory-mapped (copy-on-write: never written back), as stored."""
        return torch.from_numpy(np.load(self.shard(c), mmap_mode="c"))
