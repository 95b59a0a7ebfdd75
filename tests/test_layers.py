"""influkit.layers: each registered layer type's contraction equals per-example-gradient scores (float64), its
batch gradient and per-example squared norms (a factored fit's measured objective gradient) equal them, the
registry's lookup (most specific class wins) and its extension point (a new module type is one class), and a
1-d convolution's factors equal those of the same convolution written in 2-d."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import influkit as ik
from influkit.contraction import Contractor
from influkit.factored import fit_curvature, plan_layers
from influkit.gradients import per_example_grads_serial as per_example_grads  # one autograd.grad per example
from influkit.layers import LAYER_TYPES, Conv, Layer, Linear, layer_type, register
from conftest import cross_entropy


class Convs2d(nn.Module):
    """Conv2d (stride 2, zero padding) → tanh → Conv2d ('same', reflect padding, dilation 2, no bias) → Linear."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.b = nn.Conv2d(3, 4, 2, padding="same", dilation=2, padding_mode="reflect", bias=False)
        self.out = nn.Linear(4 * 16, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.b(torch.tanh(self.a(x)))).flatten(1))


class Convs1d(nn.Module):
    """Conv1d (circular padding 2, dilation 2) → tanh → Conv1d (stride 2, no bias) → Linear."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv1d(3, 4, 3, padding=2, dilation=2, padding_mode="circular")
        self.b = nn.Conv1d(4, 2, 2, stride=2, bias=False)
        self.out = nn.Linear(2 * 4, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.b(torch.tanh(self.a(x)))).flatten(1))


class Tokens(nn.Module):
    """Embedding (padding_idx 0) → LayerNorm → Linear → tanh → RMSNorm → LayerNorm over (tokens, dim) without bias
    → mean over tokens → Linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.ln = nn.LayerNorm(6)
        self.lin = nn.Linear(6, 6)
        self.rms = nn.RMSNorm(6)
        self.ln2 = nn.LayerNorm((5, 6), bias=False)
        self.out = nn.Linear(6, 3)

    def forward(self, ids):
        h = self.rms(torch.tanh(self.lin(self.ln(self.emb(ids)))))
        return self.out(self.ln2(h).mean(1))


def _randomized(model: nn.Module, seed: int) -> nn.Module:
    """Every parameter drawn at random (norm weights and biases too, so that none is at its neutral value)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def conv2d_stage():
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(9, 2, 7, 7, generator=gen), torch.randint(0, 3, (9,), generator=gen)
    return ik.Stage(_randomized(Convs2d().double(), 0).eval(), cross_entropy, (x.double(), y))


def conv1d_stage():
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(9, 3, 8, generator=gen), torch.randint(0, 3, (9,), generator=gen)
    return ik.Stage(_randomized(Convs1d().double(), 0).eval(), cross_entropy, (x.double(), y))


def tokens_stage():
    gen = torch.Generator().manual_seed(3)
    ids, y = torch.randint(0, 11, (9, 5), generator=gen), torch.randint(0, 3, (9,), generator=gen)
    ids[:, -1] = 0  # padding positions carry no gradient
    return ik.Stage(_randomized(Tokens().double(), 0).eval(), cross_entropy, (ids, y))


STAGES = {"conv2d": (conv2d_stage, {"conv2d", "linear"}), "conv1d": (conv1d_stage, {"conv1d", "linear"}),
          "tokens": (tokens_stage, {"embedding", "layernorm", "linear", "rmsnorm"})}


@pytest.mark.parametrize("model", list(STAGES))
def test_contraction_equals_per_example_gradient_scores(model):
    build, kinds = STAGES[model]
    stage = build()
    x, y = stage.data.take(torch.arange(len(stage)))
    directions = torch.randn(stage.num_trained, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    contractor = Contractor(stage)
    assert contractor.plan.fallback == [] and set(contractor.describe()["modules"]) == kinds  # no per-example fallback
    got = contractor(x, y, directions)
    expected = per_example_grads(stage, x, y) @ directions
    assert contractor.verified and not contractor.fallback_all
    assert expected.std(0).min() > 1e-3  # examples differ: the comparison can fail
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10 * float(expected.abs().max()))


@pytest.mark.parametrize("model", list(STAGES))
def test_a_factored_fit_measures_the_gradient_and_norms_the_per_example_gradients_give(model):
    """fit_curvature(gradient=True) on every layer type — each layer's batch gradient as the gradient of all its
    tokens as one example, its per-example squared norms from :meth:`Layer.example_norms` (a dense layer's Gram
    matrices where the tokens are few, its rows where they are many) — gives ‖mean ∇ℓ_i‖ and (mean ‖∇ℓ_i‖²)^½ of
    the per-example gradients."""
    stage = STAGES[model][0]()
    x, y = stage.data.take(torch.arange(len(stage)))
    rows = per_example_grads(stage, x, y)
    measured = fit_curvature(stage, kind="ekfac", gradient=True).gradient
    assert measured.examples == len(stage)
    assert measured.norm == pytest.approx(float(rows.mean(0).norm()), rel=1e-10)
    assert measured.typical == pytest.approx(float(rows.pow(2).sum(1).mean().sqrt()), rel=1e-10)


def test_a_dense_layers_gram_and_row_norms_agree():
    """Linear.example_norms: Σ_{t,t'} (ā_t·ā_t')(g_t·g_t') (few tokens) equals the squared rows (many tokens), with
    and without the bias, and the weight alone."""
    gen = torch.Generator().manual_seed(5)
    module = nn.Linear(40, 30).double()
    for weight, bias in (("w", "b"), ("w", None), (None, "b")):
        layer = Linear("lin", module, weight, bias)
        for tokens in (3, 60):  # 3·(41 + 30) < 41·30: Gram; 60·71 ≥ 1230: rows
            a = torch.randn(4, tokens, 40, generator=gen, dtype=torch.float64)
            g = torch.randn(4, tokens, 30, generator=gen, dtype=torch.float64)
            rows = torch.cat(layer.example_gradients(a, g), dim=1)
            torch.testing.assert_close(layer.example_norms(a, g), rows.pow(2).sum(1), rtol=1e-12, atol=0)


def test_grouped_convolution_is_left_to_per_example_gradients_with_its_reason():
    model = nn.Sequential(nn.Conv1d(2, 4, 3, groups=2), nn.Flatten(), nn.Linear(4 * 3, 2)).double().eval()
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(6, 2, 5, generator=gen, dtype=torch.float64), torch.randint(0, 2, (6,), generator=gen)
    stage = ik.Stage(model, cross_entropy, (x, y))
    contractor = Contractor(stage)
    fallback = contractor.describe()["fallback"]
    assert sorted(fallback) == ["0.bias", "0.weight"] and "grouped" in fallback["0.weight"]
    directions = torch.randn(stage.num_trained, 2, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(contractor(x, y, directions), per_example_grads(stage, x, y) @ directions,
                               rtol=1e-10, atol=1e-12)


def test_conv1d_factors_equal_the_same_convolution_in_2d():
    """Conv1d(k) on (B, C, L) is Conv2d((1, k)) on (B, C, 1, L): the same K-FAC and EK-FAC blocks."""
    one = conv1d_stage()
    model = one.model
    two = nn.Module()
    two.a = nn.Conv2d(3, 4, (1, 3), padding=(0, 2), dilation=(1, 2), padding_mode="circular")
    two.b = nn.Conv2d(4, 2, (1, 2), stride=(1, 2), bias=False)
    two.out = nn.Linear(8, 3)
    two.forward = lambda x: two.out(torch.tanh(two.b(torch.tanh(two.a(x)))).flatten(1))
    two.double().eval()
    with torch.no_grad():
        for name, p in two.named_parameters():
            p.copy_(model.get_parameter(name).reshape(p.shape))
    x, y = one.data.take(torch.arange(len(one)))
    stage2 = ik.Stage(two, cross_entropy, (x.unsqueeze(2), y))
    torch.testing.assert_close(stage2.outputs(stage2.trained(), x.unsqueeze(2)), model(x), rtol=1e-12, atol=1e-12)
    for kind in ("kfac", "ekfac"):
        c1, c2 = fit_curvature(one, kind=kind, fisher="exact"), fit_curvature(stage2, kind=kind, fisher="exact")
        assert c1.info["diagonal"] == {} and [b["kind"] for b in c1.info["layers"]] == ["conv1d", "conv1d", "linear"]
        torch.testing.assert_close(c1.dense(), c2.dense(), rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- the registry

class Scale(nn.Module):
    """y = x ⊙ w: a module type influkit does not know."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x):
        return x * self.weight


class ScaledLinear(nn.Linear):
    """A subclass of nn.Linear with a forward of its own: y = 2 (W a + b)."""

    def forward(self, x):
        return 2 * super().forward(x)


@pytest.fixture
def registry_snapshot():
    saved = dict(LAYER_TYPES)
    yield
    LAYER_TYPES.clear()
    LAYER_TYPES.update(saved)


def test_lookup_takes_the_most_specific_registered_class(registry_snapshot):
    assert layer_type(nn.Linear(2, 3)) is Linear and layer_type(nn.Conv2d(1, 1, 1)) is Conv
    assert layer_type(ScaledLinear(2, 3)) is Linear  # a subclass: its registered base's class
    assert layer_type(Scale(2)) is None

    @register(ScaledLinear)
    class ScaledLinearLayer(Linear):
        def grads(self, grad):
            return 2 * super().grads(grad)

    assert layer_type(ScaledLinear(2, 3)) is ScaledLinearLayer and layer_type(nn.Linear(2, 3)) is Linear
    with pytest.raises(ik.InfluenceError, match="nn.Module subclasses"):
        register(int)
    with pytest.raises(ik.InfluenceError, match="subclass of influkit.layers.Layer"):
        register(Scale)(object)


def test_a_new_module_type_is_one_registered_class(registry_snapshot):
    """Before registration Scale's weight falls back to per-example gradients and gets a diagonal block; one
    class later it is contracted (equal to per-example gradients)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), Scale(4), nn.Linear(4, 2)).double().eval()
    gen = torch.Generator().manual_seed(6)
    x, y = torch.randn(8, 3, generator=gen, dtype=torch.float64), torch.randint(0, 2, (8,), generator=gen)
    stage = ik.Stage(model, cross_entropy, (x, y))
    assert Contractor(stage).plan.fallback == ["2.weight"]
    assert "Scale is not a registered layer type" in plan_layers(model, stage.param_names)[1]["2.weight"]

    @register(Scale)
    class ScaleLayer(Layer):
        kind = "scale"

        def inputs(self, inp):
            return inp.reshape(inp.shape[0], -1, inp.shape[-1])

        def contract(self, a, g, weight, bias):
            return ((g * a).sum(1) * weight).sum(1)

    contractor = Contractor(stage)
    assert contractor.plan.fallback == [] and "scale" in contractor.describe()["modules"]
    directions = torch.randn(stage.num_trained, 2, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(contractor(x, y, directions), per_example_grads(stage, x, y) @ directions,
                               rtol=1e-10, atol=1e-12)
    assert "Scale has no Kronecker factors" in plan_layers(model, stage.param_names)[1]["2.weight"]
