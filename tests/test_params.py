"""Parameter-space plumbing: resolve_names, shared_parameters, point and ParamSpace flattening."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import influkit as ik
from influkit.params import ParamSpace, point, resolve_names, shared_parameters


class Encoder(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.embed = nn.Linear(3, width)
        self.block = nn.Sequential(nn.Linear(width, width), nn.Tanh())


class Model(nn.Module):
    """enc.embed, enc.block.0, head; plus a module named "enc2" to check that prefixes end at a dot."""

    def __init__(self, width: int = 4, classes: int = 2):
        super().__init__()
        self.enc = Encoder(width)
        self.enc2 = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)


# ---- resolve_names ----

def test_default_is_every_parameter_requiring_grad_in_model_order():
    model = Model()
    model.enc2.weight.requires_grad_(False)
    names = resolve_names(model, None)
    assert names == [n for n, p in model.named_parameters() if n != "enc2.weight"]


def test_names_and_prefixes_in_model_order_without_duplicates():
    model = Model()
    assert resolve_names(model, "enc") == ["enc.embed.weight", "enc.embed.bias", "enc.block.0.weight", "enc.block.0.bias"]
    assert resolve_names(model, "enc.") == resolve_names(model, "enc")  # a trailing dot is the same prefix
    assert resolve_names(model, "enc2") == ["enc2.weight", "enc2.bias"]  # "enc" does not swallow "enc2"
    assert resolve_names(model, ["head.bias", "enc.block", "head", "enc.block.0.bias"]) == [
        "enc.block.0.weight", "enc.block.0.bias", "head.weight", "head.bias",
    ]
    frozen = Model()
    frozen.head.requires_grad_(False)
    assert resolve_names(frozen, "head") == ["head.weight", "head.bias"]  # explicit names need no grad


def test_unknown_selectors_and_frozen_models_raise():
    model = Model()
    with pytest.raises(ik.ParameterError, match=r"'encoder' matches no parameter.*\['enc', 'enc2', 'head'\]"):
        resolve_names(model, ["head", "encoder"])
    with pytest.raises(ik.ParameterError, match="pass params= explicitly"):
        resolve_names(Model().requires_grad_(False), None)


# ---- shared_parameters ----

def test_shared_prefix_and_mappings():
    earlier, later = Model(), Model()
    enc = shared_parameters(earlier, later, "enc")
    assert enc == {n: n for n in resolve_names(later, "enc")}
    renamed = nn.ModuleDict({"encoder": Encoder(), "out": nn.Linear(4, 5)})
    mapped = shared_parameters(earlier, renamed, {"encoder": "enc"})
    assert mapped == {"encoder." + n[len("enc."):]: n for n in resolve_names(earlier, "enc")}
    exact = shared_parameters(earlier, renamed, {"encoder.embed.weight": "enc.embed.weight"})
    assert exact == {"encoder.embed.weight": "enc.embed.weight"}


@pytest.mark.parametrize(
    "shared,match",
    [
        ({}, "shared is empty"),
        ("encoder", "matches no parameter of the later model"),
        ({"head": "enc2"}, "has shape"),
        ({"enc.block": "enc.embed.block"}, "does not have"),
    ],
)
def test_shared_parameter_errors(shared, match):
    with pytest.raises(ik.ParameterError, match=match):
        shared_parameters(Model(), Model(), shared)


def test_shared_shape_mismatch_names_both_sides():
    with pytest.raises(ik.ParameterError, match=r"'enc\.embed\.weight' has shape \(6, 3\).*\(4, 3\)"):
        shared_parameters(Model(width=4), Model(width=6), "enc")


# ---- point ----

def test_point_prefers_given_values_and_rejects_unknown_names():
    state = {"a": torch.zeros(2), "b": torch.ones(3)}
    at = {"b": torch.full((3,), 7.0), "c": torch.zeros(1)}
    got = point(state, ["a", "b"], at)
    assert got["a"] is state["a"] and got["b"] is at["b"] and list(got) == ["a", "b"]
    with pytest.raises(ik.ParameterError, match="unknown parameter names"):
        point(state, ["a", "z"])


# ---- ParamSpace ----

def test_param_space_round_trip(mlp_stage):
    space = ParamSpace(mlp_stage.trained())
    v = torch.randn(space.dim, 3)
    assert torch.equal(space.flatten(space.unflatten(v), batched=True), v)
    assert torch.equal(space.flatten(space.unflatten(v[:, 0])), v[:, 0])


def test_param_space_layout_matches_the_names():
    params = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([10.0, 11.0])}
    space = ParamSpace(params)
    assert (space.dim, space.sizes, space.dtype) == (8, [6, 2], params["w"].dtype)
    flat = space.flatten(params)
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 11.0]
    parts = space.unflatten(flat)
    assert torch.equal(parts["w"], params["w"]) and torch.equal(parts["b"], params["b"])
    batched = space.unflatten(torch.stack([flat, 2 * flat], dim=1))  # (p, k) -> dict of (k, *shape)
    assert batched["w"].shape == (2, 2, 3) and torch.equal(batched["w"][1], 2 * params["w"])
    assert space.zeros().shape == (8,) and space.zeros(4).shape == (8, 4)


def test_param_space_errors():
    with pytest.raises(ik.ParameterError, match="empty"):
        ParamSpace({})
    space = ParamSpace({"w": torch.zeros(3)})
    with pytest.raises(ik.InputError, match="4 entries, the parameter block has 3"):
        space.unflatten(torch.zeros(4))
