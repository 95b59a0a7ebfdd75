"""The optimizers' closed-form pullbacks (what the exact reverse pass uses instead of autograd through the update)
equal autograd's vector-Jacobian product of the same update in float64: SGD (momentum, Nesterov, dampening, weight
decay, maximize; the first step and a later one), Adam and AdamW (coupled / decoupled decay, maximize, coordinates
whose second moment is exactly 0), parameter groups, and a recorded step with gradient clipping active and not; and
a batched pull of a step's gradient graph gives every input the leading q."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from influkit.unrolled import Record
from influkit.unrolled.optimizers import SGD, Adam, AdamW, Groups

from conftest import cross_entropy

SHAPES = {"w": (3, 4), "b": (4,), "s": ()}


def tensors(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(shape, generator=gen, dtype=torch.float64) for n, shape in SHAPES.items()}


def autograd_pullback(update, params, state, grads, bar):
    """(θ̄, s̄, ḡ) by autograd through ``update`` for each of the cotangents' q columns."""
    leaves = [{n: v.clone().requires_grad_() for n, v in tree.items()} for tree in (params, grads)]
    state_leaves = {slot: {n: v.clone().requires_grad_() for n, v in s.items()} for slot, s in state.items()}
    new_params, new_state = update(leaves[0], state_leaves, leaves[1])
    outputs = list(new_params.values()) + [v for s in new_state.values() for v in s.values()]
    inputs = list(leaves[0].values()) + [v for s in state_leaves.values() for v in s.values()] + \
        list(leaves[1].values())
    cotangents = list(bar[0].values()) + [v for s in bar[1].values() for v in s.values()]
    columns = [torch.autograd.grad(outputs, inputs, [c[j] for c in cotangents], retain_graph=True, allow_unused=True,
                                   materialize_grads=True) for j in range(cotangents[0].shape[0])]
    return [torch.stack([column[i] for column in columns]) for i in range(len(inputs))]


def flat(params_bar, state_bar, grad_bar, state) -> list[torch.Tensor]:
    """The closed form's (θ̄, s̄, ḡ) in :func:`autograd_pullback`'s order."""
    return list(params_bar.values()) + [state_bar[slot][n] for slot, s in state.items() for n in s] + \
        list(grad_bar.values())


RULES = {
    "SGD": SGD(lr=0.1),
    "SGD + momentum, dampening, decay": SGD(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.05),
    "SGD Nesterov, maximize": SGD(lr=0.1, momentum=0.8, nesterov=True, weight_decay=0.01, maximize=True),
    "Adam": Adam(lr=0.01, betas=(0.8, 0.95), eps=1e-6),
    "Adam coupled decay, maximize": Adam(lr=0.01, weight_decay=0.1, maximize=True),
    "AdamW": AdamW(lr=0.01, betas=(0.85, 0.99), weight_decay=0.2),
}


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("q", [1, 3])
@pytest.mark.parametrize("name", list(RULES))
def test_each_rules_pullback_is_autograds_vjp_of_its_update(name, q, step):
    rule = RULES[name]
    params, grads = tensors(0), tensors(1)
    state = rule.init(params)
    if step > 1:  # a state from earlier steps, with coordinates whose every gradient so far was exactly 0
        grads["w"][0] = 0.0
        for t in range(1, step):
            params, state = rule.update(params, state, tensors(10 + t) | {"w": grads["w"]}, rule.lr, t)
    new = rule.update(params, state, grads, rule.lr, step)
    bar = ({n: torch.randn(q, *v.shape, dtype=v.dtype) for n, v in params.items()},
           {slot: {n: torch.randn(q, *v.shape, dtype=v.dtype) for n, v in s.items()} for slot, s in state.items()})
    ours = flat(*rule.pullback(params, state, grads, rule.lr, step, new, bar), state)
    theirs = autograd_pullback(lambda p, s, g: rule.update(p, s, g, rule.lr, step), params, state, grads, bar)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert all(torch.isfinite(a).all() for a in ours)


def test_parameter_groups_pull_back_each_group_with_its_own_rule():
    groups = Groups((AdamW(lr=0.01, weight_decay=0.1), AdamW(lr=0.03, weight_decay=0.0)), (("w", "s"), ("b",)))
    params, grads = tensors(0), tensors(1)
    state = groups.init(params)
    params, state = groups.update(params, state, tensors(2), (0.01, 0.03), 1)
    new = groups.update(params, state, grads, (0.005, 0.02), 2)
    bar = ({n: torch.randn(2, *v.shape, dtype=v.dtype) for n, v in params.items()},
           {slot: {n: torch.randn(2, *v.shape, dtype=v.dtype) for n, v in s.items()} for slot, s in state.items()})
    ours = flat(*groups.pullback(params, state, grads, (0.005, 0.02), 2, new, bar), state)
    theirs = autograd_pullback(lambda p, s, g: groups.update(p, s, g, (0.005, 0.02), 2), params, state, grads, bar)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("norm_type", [2.0, 1.0])  # the closed form, and autograd through another norm
@pytest.mark.parametrize("max_norm", [1e-3, 1e3])  # the clipping active (every step scaled) and idle
def test_a_recorded_steps_update_vjp_with_clipping_is_autograds(max_norm, norm_type):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, generator=gen, dtype=torch.float64), torch.randint(0, 2, (8,), generator=gen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    record = Record()
    with record.watch(model, optimizer, loader, cross_entropy) as run:
        for xb, yb in loader:
            optimizer.zero_grad()
            cross_entropy(model(xb), yb).mean().backward()
            run.clip_grad_norm_(max_norm, norm_type)
            optimizer.step()
    run = record.runs[0]
    assert run.clips[1] is not None
    _, xb, yb = run.batch(0)
    theta, state = run.step(0, *run.checkpoints[0], run.anchors, torch.ones(4, dtype=torch.float64), xb, yb)
    grads = {n: torch.randn(v.shape, generator=gen, dtype=v.dtype) for n, v in theta.items()}
    coefficient = run.optimizer.clip_coefficient(grads, *run.clips[1])
    assert (coefficient < 1) == (max_norm < 1)
    new_theta, new_state, pullback = run.update_vjp(1, theta, state, grads)
    expected = run.update(1, theta, state, grads)
    assert all(torch.equal(new_theta[n], expected[0][n]) for n in theta)
    bar = ({n: torch.randn(2, *v.shape, generator=gen, dtype=v.dtype) for n, v in theta.items()},
           {slot: {n: torch.randn(2, *v.shape, generator=gen, dtype=v.dtype) for n, v in s.items()}
            for slot, s in state.items()})
    ours = flat(*pullback(*bar), state)
    theirs = autograd_pullback(lambda p, s, g: run.update(1, p, s, g), theta, state, grads, bar)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_a_batched_pull_gives_every_input_the_leading_q():
    """One backward batched over q = 3 cotangents: an input the outputs do not reach gets (q, *shape) zeros too (its
    adjoint is summed over ranks by shape), the others each column's own vector-Jacobian product."""
    from influkit.unrolled.metagradient import _Graph

    used, unused = torch.randn(2, 4, dtype=torch.float64, requires_grad=True), torch.randn(5, requires_grad=True)
    graph = _Graph({"out": (used**2).sum(0)}, {"used": used, "unused": unused}, batched=True)
    cotangents = torch.randn(3, 4, dtype=torch.float64)
    pulled = graph.pull({"out": cotangents})
    assert pulled["unused"].shape == (3, 5) and not pulled["unused"].any()
    torch.testing.assert_close(pulled["used"], 2 * used.detach() * cotangents[:, None, :])
