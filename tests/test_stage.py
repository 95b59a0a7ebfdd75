"""Stage: the checks it makes up front (eval mode, loss shape, finite data), its objective, with_ and without."""

from __future__ import annotations

import pytest
import torch
from conftest import cross_entropy, l2, tanh_mlp
from torch import nn

import influkit as ik
from influkit.stage import check_example_shape


def toy(n: int = 12, d: int = 8, classes: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=gen), torch.randint(0, classes, (n,), generator=gen)


# ---- checks made when a stage is built ----

@pytest.mark.parametrize("layer", [nn.Dropout(0.1), nn.BatchNorm1d(6)], ids=["dropout", "batchnorm"])
def test_train_mode_stochastic_layers_are_refused(layer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), layer, nn.Tanh(), nn.Linear(6, 3)).double()
    with pytest.raises(ik.ModelModeError, match=r"model\.eval\(\)") as info:
        ik.Stage(model, cross_entropy, toy())
    assert "'1'" in str(info.value)  # names the offending layer
    stage = ik.Stage(model.eval(), cross_entropy, toy())
    assert len(stage) == 12


def test_train_mode_without_stochastic_layers_is_fine():
    model = tanh_mlp().train()
    assert ik.Stage(model, cross_entropy, toy()).num_trained == 8 * 6 + 6 + 6 * 3 + 3


@pytest.mark.parametrize(
    "loss,match",
    [
        (lambda out, y: nn.functional.cross_entropy(out, y), r"reduction='none'"),  # a scalar
        (lambda out, y: cross_entropy(out, y)[:, None], r"\(2, 1\)"),
        (lambda out, y: cross_entropy(out, y) * float("nan"), "NaN"),
    ],
    ids=["mean", "column", "nan"],
)
def test_loss_must_return_one_finite_value_per_example(loss, match):
    with pytest.raises(ik.LossError, match=match):
        ik.Stage(tanh_mlp(), loss, toy())


def test_bad_model_loss_or_data_are_refused():
    with pytest.raises(ik.InputError, match="nn.Module"):
        ik.Stage(lambda x: x, cross_entropy, toy())
    with pytest.raises(ik.InputError, match="callable"):
        ik.Stage(tanh_mlp(), "cross_entropy", toy())
    x, y = toy()
    x[3, 2] = float("inf")
    with pytest.raises(ik.InputError, match="NaN or Inf"):
        ik.Stage(tanh_mlp(), cross_entropy, (x[2:], y[2:]))  # the first examples are checked up front
    stage = ik.Stage(tanh_mlp(), cross_entropy, (x, y))  # Inf in example 3: found when the data are streamed
    with pytest.raises(ik.InputError, match="NaN or Inf"):
        stage.objective()
    with pytest.raises(ik.InputError, match="shape"):
        check_example_shape(stage, torch.zeros(2, 5), "z")


def test_class_targets_out_of_range_name_the_bound():
    """3 outputs, a target 3 at example 7: refused when the stage is built, naming [0, 3) and the example."""
    x, y = toy()
    y[7] = 3
    with pytest.raises(ik.InputError, match=r"examples \[7\] .*outside \[0, 3\).*3\.\.3"):
        ik.Stage(tanh_mlp(), cross_entropy, (x, y))
    y[7], y[2] = 1, -4
    with pytest.raises(ik.InputError, match=r"examples \[2\] .*-4\.\.-4"):
        ik.Stage(tanh_mlp(), cross_entropy, (x, y))


def test_targets_outside_the_outputs_that_the_loss_accepts_are_fine():
    x, y = toy()
    y[5] = -100  # cross-entropy's ignore_index (masked-LM labels)
    stage = ik.Stage(tanh_mlp(), cross_entropy, (x, y))
    assert stage.losses(stage.trained(), *stage.data.take([5]))[0] == 0
    torch.manual_seed(0)
    binary = nn.Linear(8, 1).double()  # one output, integer 0/1 labels: the loss does not index by them
    bce = lambda out, t: nn.functional.binary_cross_entropy_with_logits(out[:, 0], t.double(), reduction="none")
    assert len(ik.Stage(binary, bce, (x, (y > 0).long()))) == 12


def test_class_targets_out_of_range_in_a_dataset_or_test_set_are_found_when_evaluated():
    x, y = toy()
    bad = y.clone()
    bad[9] = 5
    stage = ik.Stage(tanh_mlp(), cross_entropy, torch.utils.data.TensorDataset(x, bad))  # a Dataset: not scanned
    with pytest.raises(ik.InputError, match=r"outside the model's 3 outputs.*\[0, 3\)"):
        stage.objective()
    stage = ik.Stage(tanh_mlp(), cross_entropy, (x, y), regularizer=l2(1e-2))
    with pytest.raises(ik.InputError, match=r"\[0, 3\)"):  # the test set's summed gradient
        ik.influence(stage, torch.arange(2), (x[:4], bad[6:10]), solve=ik.SolveConfig(solver="direct"), progress=False)
    with pytest.raises(ik.InputError, match=r"\[0, 3\)"):  # per-example gradients of z, under vmap
        ik.influence(stage, (x[:4], bad[6:10]), torch.arange(2), solve=ik.SolveConfig(solver="direct"), progress=False)


# ---- the objective ----

def test_objective_is_mean_loss_plus_regularizer_over_trained_parameters():
    model, data = tanh_mlp(), toy()
    stage = ik.Stage(model, cross_entropy, data, params="2", regularizer=l2(0.3), batch_size=5)
    with torch.no_grad():
        by_hand = cross_entropy(model(data[0]), data[1]).mean()
        by_hand = by_hand + 0.15 * (model[2].weight.square().sum() + model[2].bias.square().sum())
    assert stage.param_names == ["2.weight", "2.bias"]
    assert torch.allclose(stage.objective(), by_hand, rtol=1e-14, atol=0)
    subset = torch.tensor([1, 4, 7])
    with torch.no_grad():
        sub = cross_entropy(model(data[0][subset]), data[1][subset]).mean() + (by_hand - cross_entropy(model(data[0]), data[1]).mean())
    assert torch.allclose(stage.objective(indices=subset), sub, rtol=1e-14, atol=0)


def test_objective_at_other_parameters_is_pure():
    model, data = tanh_mlp(), toy()
    stage = ik.Stage(model, cross_entropy, data, regularizer=l2(0.1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = {n: t + 0.5 for n, t in stage.trained().items()}
    value = stage.objective(moved)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])  # the model itself is untouched
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.5)
        assert torch.allclose(value, stage.objective(), rtol=1e-14, atol=0)
    # the objective is differentiable in the given parameters (what every influkit derivative uses)
    params = {n: t.clone().requires_grad_(True) for n, t in stage.trained().items()}
    grads = torch.autograd.grad(stage.objective(params), list(params.values()))
    assert all(g.shape == params[n].shape for g, n in zip(grads, params))


def test_regularizer_sees_only_the_trained_parameters():
    seen = []

    def reg(params):
        seen.append(sorted(params))
        return sum(p.sum() for p in params.values()) * 0.0

    stage = ik.Stage(tanh_mlp(), cross_entropy, toy(), params=["0.bias", "2"], regularizer=reg)
    stage.objective()
    assert seen[-1] == ["0.bias", "2.bias", "2.weight"]


# ---- with_ and without ----

def test_with_replaces_parts_and_keeps_the_rest():
    model, data = tanh_mlp(), toy()
    stage = ik.Stage(model, cross_entropy, data, params="2", regularizer=l2(0.1), batch_size=4)
    other = stage.with_(data=toy(seed=1))
    assert other.param_names == stage.param_names and other.loss is stage.loss
    assert other.regularizer is stage.regularizer and other.data.batch_size == 4
    assert not torch.equal(other.data.take([0])[0], stage.data.take([0])[0])
    assert stage.with_(params="0").param_names == ["0.weight", "0.bias"]
    unregularized = stage.with_(regularizer=lambda p: torch.zeros(()))
    with torch.no_grad():
        assert torch.allclose(unregularized.objective(), cross_entropy(model(data[0]), data[1]).mean(), rtol=1e-14)
    copy = tanh_mlp(seed=5)
    assert stage.with_(model=copy).model is copy


def test_without_leaves_examples_out():
    model, data = tanh_mlp(), toy()
    stage = ik.Stage(model, cross_entropy, data, regularizer=l2(0.1))
    assert stage.without(None) is stage and stage.without(torch.tensor([], dtype=torch.long)) is stage
    left = stage.without(torch.tensor([0, 5, 11]))
    keep = torch.tensor([i for i in range(12) if i not in (0, 5, 11)])
    assert len(left) == 9
    assert torch.equal(left.data.take(torch.arange(9))[0], data[0][keep])
    assert torch.allclose(left.objective(), stage.objective(indices=keep), rtol=1e-14, atol=0)
    assert len(stage) == 12  # the original is unchanged


def test_select_and_state():
    model = tanh_mlp()
    model[0].weight.requires_grad_(False)
    stage = ik.Stage(model, cross_entropy, toy())
    assert stage.param_names == ["0.bias", "2.weight", "2.bias"]  # default: what requires grad
    assert stage.select(None) == stage.param_names and stage.select("0") == ["0.weight", "0.bias"]
    assert set(stage.state()) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert not any(t.requires_grad for t in stage.state().values())
    assert "n=12" in repr(stage)


def test_float64_data_for_a_float32_model_names_the_cast():
    model = nn.Linear(3, 2).float()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 0, 1])
    with pytest.raises(ik.InputError, match=r"inputs are float64 but the model's parameters are float32.*"
                                            r"inputs.to\(torch.float32\).*model.to\(torch.float64\)"):
        ik.Stage(model, nn.CrossEntropyLoss(reduction="none"), (x, y))
    stage = ik.Stage(model, nn.CrossEntropyLoss(reduction="none"), (x.float(), y), regularizer=l2(1e-2))  # the cast it names
    with pytest.raises(ik.InputError, match="x_test are float64"):
        ik.influence(stage, torch.arange(2), (x, y))
    assert ik.influence(stage, torch.arange(2), (x.float(), y)).values.shape == (2,)
