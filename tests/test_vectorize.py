"""influkit.vectorize: vmap where it traces, the same numbers from a loop where it cannot, one warning per owner."""

from __future__ import annotations

import warnings

import pytest
import torch

import influkit as ik
from influkit.vectorize import _remembered, vmap_or_loop


class Owner:
    """Stands for the Stage whose loss is mapped (vmap_or_loop remembers its failure in a weak set, not on it)."""


def tensor_only(w, x, y):
    """Per-example squared error of a linear model and its gradient: vmap traces it."""
    err = x @ w - y
    return {"loss": err**2, "grad": 2 * err * x}


def branching(w, x, y):
    """The same numbers, but branching on a tensor's value (vmap cannot trace ``if``)."""
    err = x @ w - y
    if err.item() > 0:
        return {"loss": err**2, "grad": 2 * err * x}
    return {"loss": (-err) ** 2, "grad": -2 * (-err) * x}


@pytest.fixture
def batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, generator=gen), torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)


def test_traceable_function_is_vmapped_without_warning(batch):
    w, x, y = batch
    owner = Owner()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = vmap_or_loop(tensor_only, (None, 0, 0), owner, w, x, y)
    assert not _remembered(owner) and vars(owner) == {}
    assert torch.allclose(out["loss"], (x @ w - y) ** 2, rtol=1e-14, atol=0)
    assert torch.allclose(out["grad"], 2 * (x @ w - y)[:, None] * x, rtol=1e-14, atol=0)


def test_untraceable_function_loops_to_the_same_result_and_warns_once_per_owner(batch):
    w, x, y = batch
    expected = vmap_or_loop(tensor_only, (None, 0, 0), Owner(), w, x, y)
    owner = Owner()
    with pytest.warns(ik.VectorizationWarning, match="cannot run under torch.func.vmap.*torch.where instead of if"):
        looped = vmap_or_loop(branching, (None, 0, 0), owner, w, x, y)
    assert _remembered(owner) and vars(owner) == {}  # remembered by vectorize, nothing written onto the owner
    for key in ("loss", "grad"):
        assert looped[key].shape == expected[key].shape
        assert torch.allclose(looped[key], expected[key], rtol=1e-14, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call loops silently
        again = vmap_or_loop(branching, (None, 0, 0), owner, w, x, y)
    assert torch.equal(again["loss"], looped["loss"])
    # tensor outputs and dict inputs are looped over too, mapped over the dict's leading dimension
    with pytest.warns(ik.VectorizationWarning):
        out = vmap_or_loop(lambda d: d["a"] * d["a"].sum().item(), (0,), Owner(), {"a": x})
    assert torch.allclose(out, x * x.sum(1, keepdim=True), rtol=1e-14, atol=0)


def test_other_errors_are_not_swallowed(batch):
    w, x, y = batch

    def broken(w, x, y):
        raise RuntimeError("a real bug in the loss")

    with pytest.raises(RuntimeError, match="a real bug"):
        vmap_or_loop(broken, (None, 0, 0), Owner(), w, x, y)
