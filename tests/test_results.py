"""InfluenceResult: the removal rule, per-test values, frames, and safe files (save/load, refusing anything else)."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

import influkit as ik
from influkit import files
from influkit.results import InfluenceResult


def result(per_test: bool = False, removal_eps=None, dtype=torch.float64) -> InfluenceResult:
    """Seven examples with ids 10, 12, ..., 22 and known scores; per_test adds a second, scaled test column."""
    total = torch.tensor([0.5, -2.0, 3.0, 0.0, -0.25, 1.5, -1.0], dtype=dtype)
    values = torch.stack([0.25 * total, 0.75 * total], dim=1) if per_test else total
    diagnostics = {"solves": [{"stage": 0, "method": "direct", "residual": 1e-15}], "seconds": {"solve": 0.5},
                   "settings": {"damping": 0.0, "params": ["fc.weight", "fc.bias"]}}
    return InfluenceResult(values, n_train=40, index=torch.arange(10, 24, 2), method="test",
                           diagnostics=diagnostics, removal_eps=removal_eps)


# ---- the removal rule ----

def test_default_removal_is_minus_values_over_n():
    res = result()
    assert res.removal_eps == -1 / 40
    assert torch.allclose(res.removal, -res.values / 40, rtol=1e-15, atol=0)


def test_removal_eps_number_and_tensor():
    assert torch.equal(result(removal_eps=-1.0).removal, -result().values)
    eps = -torch.linspace(0.1, 0.7, 7)
    res = result(removal_eps=eps)
    assert torch.equal(res.removal, eps * res.values)
    per = result(per_test=True, removal_eps=eps)
    assert per.removal.shape == (7, 2)
    assert torch.equal(per.removal, eps[:, None] * per.values)  # one ε per row, broadcast over test points


def test_removal_eps_follows_the_values_dtype_and_needs_one_per_row():
    res = result(removal_eps=-torch.ones(7, dtype=torch.float64), dtype=torch.float32)
    assert res.removal_eps.dtype == torch.float32 and res.removal.dtype == torch.float32
    with pytest.raises(ik.InputError, match="one value per row"):
        result(removal_eps=-torch.ones(6))


def test_index_must_match_the_rows():
    with pytest.raises(ik.InputError, match="one example id per row"):
        InfluenceResult(torch.zeros(3), n_train=3, index=torch.arange(4))
    assert torch.equal(InfluenceResult(torch.zeros(3), n_train=3).index, torch.arange(3))


def test_diagnostics_always_have_the_three_parts():
    bare = InfluenceResult(torch.zeros(2), n_train=2)
    assert bare.diagnostics == {"solves": [], "seconds": {}, "settings": {}}
    assert set(result().diagnostics) == {"solves", "seconds", "settings"}


# ---- views: per_test, total, to_frame, top ----

def test_per_test_total_and_frame():
    one, per = result(), result(per_test=True)
    assert not one.per_test and per.per_test
    assert torch.equal(one.total, one.values)
    assert torch.allclose(per.total, one.values, rtol=0, atol=1e-15)
    frame = per.to_frame()
    assert list(frame.columns) == ["example", "score", "removal", "score_t0", "score_t1"]
    assert frame["example"].tolist() == list(range(10, 24, 2))
    assert frame["score_t1"].tolist() == per.values[:, 1].tolist()
    assert torch.allclose(torch.tensor(frame["removal"].to_numpy()), -per.total / 40, rtol=0, atol=1e-15)


def test_frame_removal_uses_a_per_row_eps():
    eps = -torch.arange(1.0, 8.0)
    frame = result(removal_eps=eps).to_frame()
    assert torch.equal(torch.tensor(frame["removal"].to_numpy()), eps * result().values)


def test_top_orders_by_score():
    res = result()
    harmful = res.top(3)
    assert list(harmful.columns) == ["example", "score", "removal"]
    assert harmful["example"].tolist() == [14, 20, 10]  # scores 3.0, 1.5, 0.5
    assert res.top(2, harmful=False)["example"].tolist() == [12, 22]  # scores −2.0, −1.0
    assert len(res.top(100)) == 7


# ---- files ----

@pytest.mark.parametrize(
    "res",
    [result(), result(per_test=True, removal_eps=-torch.linspace(0.1, 0.7, 7)), result(removal_eps=-1.0, dtype=torch.float32)],
    ids=["summed", "per-test-tensor-eps", "float32"],
)
def test_save_load_round_trip_bit_identical(res, tmp_path):
    path = res.save(tmp_path / "any name.without-suffix")
    back = ik.load(path)
    assert back.values.dtype == res.values.dtype and torch.equal(back.values, res.values)
    assert torch.equal(back.index, res.index) and torch.equal(back.removal, res.removal)
    if torch.is_tensor(res.removal_eps):
        assert torch.equal(back.removal_eps, res.removal_eps)
    else:
        assert back.removal_eps == res.removal_eps
    assert (back.n_train, back.method) == (res.n_train, res.method)
    assert json.dumps(back.diagnostics, sort_keys=True) == json.dumps(res.diagnostics, sort_keys=True)  # NaN-safe
    assert back.to_frame().equals(res.to_frame())
    assert not list(tmp_path.glob("*.partial"))  # written atomically


class _Payload:
    """Unpickling this runs ``touch marker``: a loader that unpickles would leave the marker behind."""

    marker = None

    def __reduce__(self):
        return (os.system, (f"touch {_Payload.marker}",))


def test_pickle_and_torch_save_files_are_refused_and_never_executed(tmp_path):
    _Payload.marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps({"values": _Payload()}))
    with open(tmp_path / "evil_torch.pt", "wb") as handle:
        torch.save({"values": torch.zeros(3), "payload": _Payload()}, handle)
    assert not _Payload.marker.exists()
    for bad in (evil, tmp_path / "evil_torch.pt"):
        with pytest.raises(ik.FileFormatError, match="not an influkit file"):
            ik.load(bad)
    assert not _Payload.marker.exists()
    with pytest.raises(ik.FileFormatError, match="does not exist"):
        ik.load(tmp_path / "missing")


def test_tampered_or_foreign_files_are_refused(tmp_path):
    path = result(per_test=True).save(tmp_path / "r")
    raw = path.read_bytes()
    flipped = bytearray(raw)
    flipped[-1] ^= 0xFF  # the last byte of a tensor
    (tmp_path / "tensor").write_bytes(bytes(flipped))
    edited = raw.replace(b'\\"method\\": \\"test\\"', b'\\"method\\": \\"TEST\\"')  # JSON inside the header
    assert edited != raw
    (tmp_path / "meta").write_bytes(edited)
    for name in ("tensor", "meta"):
        with pytest.raises(ik.FileFormatError, match="modified"):
            ik.load(tmp_path / name)
    other = files.write(tmp_path / "q", "query", {"s": torch.zeros(3)}, {})
    with pytest.raises(ik.FileFormatError, match="holds an influkit 'query'"):
        ik.load(other)
    from safetensors.torch import save_file

    save_file({"values": torch.zeros(3)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ik.FileFormatError, match="no influkit header"):
        ik.load(tmp_path / "plain.safetensors")


def test_top_indices_index_the_training_data_in_the_order_of_top():
    """top_indices(k) are top(k)'s example ids as a LongTensor, in the same order, usable to index the data."""
    values = torch.tensor([0.5, -2.0, 3.0, 1.0, -0.1], dtype=torch.float64)
    res = InfluenceResult(values=values, n_train=50, index=torch.tensor([10, 11, 12, 13, 14]))
    data = torch.arange(50) * 100
    harmful = res.top_indices(3)
    assert harmful.dtype == torch.long and harmful.tolist() == res.top(3)["example"].tolist() == [12, 13, 10]
    assert res.top_indices(2, harmful=False).tolist() == res.top(2, harmful=False)["example"].tolist() == [11, 14]
    assert data[harmful].tolist() == [1200, 1300, 1000]
