"""influkit.files: a result file round-trips its tensors and JSON, and any edit after writing is refused.

The checksum covers the kind, the JSON and every tensor's name, dtype, shape and bytes: each is edited here in
place (same length, so the file stays a valid safetensors file) and each edit must be caught.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import influkit as ik
from influkit import files


def tensors():
    return {"aa": torch.arange(6, dtype=torch.float32).reshape(2, 3), "bb": torch.tensor([1, -2], dtype=torch.int64),
            "cc": torch.zeros(0, 4, dtype=torch.float64), "dd": torch.tensor([True, False])}


def test_round_trip_of_tensors_and_json(tmp_path):
    meta = {"n": 3, "nested": {"list": [1, 2.5, None], "text": "α"}, "tensor": torch.tensor([1.5, 2.0]),
            "dtype": torch.float64, "path": Path("/x/y"), "tuple": (1, 2), "numpy": torch.tensor(4).numpy()}
    path = files.write(tmp_path / "any.name", "thing", tensors(), meta)
    assert path == tmp_path / "any.name" and not list(tmp_path.glob("*.partial"))
    got, got_meta = files.read(path, "thing")
    assert got.keys() == tensors().keys()
    for name, tensor in tensors().items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)
    assert got_meta == {"n": 3, "nested": {"list": [1, 2.5, None], "text": "α"}, "tensor": [1.5, 2.0],
                        "dtype": "torch.float64", "path": "/x/y", "tuple": [1, 2], "numpy": 4}
    with pytest.raises(TypeError, match="cannot store object"):
        files.write(tmp_path / "bad", "thing", {}, {"x": object()})


@pytest.mark.parametrize("old,new", [
    (b'"aa"', b'"ab"'),  # a tensor's name
    (b'"dtype":"F32"', b'"dtype":"I32"'),  # its dtype (same bytes, read as integers)
    (b'"shape":[2,3]', b'"shape":[3,2]'),  # its shape
    (b'\\"n\\": 3', b'\\"n\\": 4'),  # the JSON
    (None, None),  # one byte of a tensor
])
def test_an_edit_after_writing_is_refused(tmp_path, old, new):
    path = files.write(tmp_path / "f", "thing", tensors(), {"n": 3})
    raw = path.read_bytes()
    if old is None:
        edited = bytearray(raw)
        edited[-1] ^= 0x01  # the last byte of the last tensor's data
        edited = bytes(edited)
    else:
        assert raw.count(old) == 1
        edited = raw.replace(old, new)
    path.write_bytes(edited)
    with pytest.raises(ik.FileFormatError, match="modified after influkit wrote it"):
        files.read(path, "thing")


def test_other_files_are_refused_naming_why(tmp_path):
    path = files.write(tmp_path / "f", "thing", tensors(), {})
    with pytest.raises(ik.FileFormatError, match="holds an influkit 'thing', not a 'query'"):
        files.read(path, "query")
    with pytest.raises(ik.FileFormatError, match="does not exist"):
        files.read(tmp_path / "missing", "thing")
    (tmp_path / "text").write_text("plain text")
    with pytest.raises(ik.FileFormatError, match="is not an influkit file"):
        files.read(tmp_path / "text", "thing")
    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain"))
    with pytest.raises(ik.FileFormatError, match="no influkit header"):
        files.read(tmp_path / "plain", "thing")
    header = {"format": "influkit", "kind": "thing", "version": "0", "meta": "{}", "checksum": ""}
    save_file({"x": torch.zeros(2)}, str(tmp_path / "old"), metadata=header)
    with pytest.raises(ik.FileFormatError, match="format version '0'"):
        files.read(tmp_path / "old", "thing")
    torch.save({"x": torch.zeros(2)}, tmp_path / "pickled.pt")  # never unpickled
    with pytest.raises(ik.FileFormatError, match="not an influkit file"):
        files.read(tmp_path / "pickled.pt", "thing")


def checksum(path: Path) -> str:
    raw = path.read_bytes()
    return json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])["__metadata__"]["checksum"]


def test_checksum_is_of_the_content_only(tmp_path):
    a = files.write(tmp_path / "a", "thing", tensors(), {"n": 3})
    b = files.write(tmp_path / "b", "thing", dict(reversed(tensors().items())), {"n": 3})
    assert checksum(a) == checksum(b)  # the order tensors are passed in does not matter
    c = files.write(tmp_path / "c", "other", tensors(), {"n": 3})
    assert checksum(c) != checksum(a)  # the kind is part of it
