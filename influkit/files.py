"""Safe result files: tensors in safetensors, everything else as JSON in its header, never pickle.

A file holds one object of a named ``kind`` ("influence-result", "query", ...). Its header carries
``{"format": "influkit", "kind", "version", "meta": <JSON>, "checksum": <sha256>}``; the checksum covers
the kind, the JSON and every tensor's name, dtype, shape and bytes, so a file edited after it was written
is refused. Reading parses only the safetensors header and raw tensor bytes: opening a file someone sent
you cannot run code.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .errors import FileFormatError

FORMAT = "influkit"
VERSION = "1"


def _checksum(kind: str, meta_json: str, tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    digest.update(kind.encode())
    digest.update(meta_json.encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def write(path: str | Path, kind: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write ``tensors`` and the JSON-serializable ``meta`` to ``path`` (any file name), atomically."""
    path = Path(path)
    cpu = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    meta_json = json.dumps(meta, sort_keys=True, default=_json_default)
    header = {
        "format": FORMAT, "kind": kind, "version": VERSION, "meta": meta_json,
        "checksum": _checksum(kind, meta_json, cpu),
    }
    partial = path.with_name(path.name + ".partial")
    save_file(cpu, str(partial), metadata=header)
    os.replace(partial, path)
    return path


def read(path: str | Path, kind: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, meta) of an influkit file of ``kind``; anything else raises :class:`FileFormatError`."""
    path = Path(path)
    if not path.is_file():
        raise FileFormatError(f"{path} does not exist or is not a file.")
    try:
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size)) if 0 < size <= path.stat().st_size - 8 else None
        tensors = load_file(str(path)) if isinstance(header, dict) else None
    except (SafetensorError, ValueError, UnicodeDecodeError, OSError) as exc:
        raise FileFormatError(
            f"{path} is not an influkit file (not a safetensors file: {exc}); influkit never unpickles files — "
            "re-create it with .save() from influkit."
        ) from exc
    header_meta = (header or {}).get("__metadata__", {}) if isinstance(header, dict) else {}
    if tensors is None or header_meta.get("format") != FORMAT:
        raise FileFormatError(
            f"{path} is not an influkit file (no influkit header); influkit never unpickles files — re-create it "
            "with .save() from influkit."
        )
    if header_meta.get("kind") != kind:
        raise FileFormatError(f"{path} holds an influkit {header_meta.get('kind')!r}, not a {kind!r}.")
    if header_meta.get("version") != VERSION:
        raise FileFormatError(f"{path} was written by format version {header_meta.get('version')!r}; this is {VERSION}.")
    meta_json = header_meta.get("meta", "")
    if _checksum(kind, meta_json, tensors) != header_meta.get("checksum"):
        raise FileFormatError(f"{path} was modified after influkit wrote it (checksum mismatch); refusing to load it.")
    return tensors, json.loads(meta_json)


def _json_default(value: Any) -> Any:
    """JSON for the values diagnostics hold besides plain types: tensors, numpy numbers, dtypes, paths."""
    if torch.is_tensor(value):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"cannot store {type(value).__name__} in an influkit file's JSON header.")
