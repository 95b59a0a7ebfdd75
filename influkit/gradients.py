"""Per-example gradients ∇_θ ℓ(z_i; θ) by ``vmap(grad(...))`` in bounded-memory chunks.

``per_example_grads`` returns the (N, p) matrix; ``project_per_example_grads`` streams it and returns only
G·S for a (p, k) matrix S, so memory stays O(chunk·p) however many examples are scored. The serial
autograd loop ``per_example_grads_serial`` is the reference the tests compare against.

A ``chunk_size`` of None is sized from the memory budget (:mod:`influkit.memory`; the ``memory=`` bytes passed,
else a share of what is free): the bytes of one example's gradient row plus its
measured activations (a probe on two examples).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.func import grad
from .progress import steps as progress_steps

from . import memory
from .memory import PROBE_EXAMPLES, Probe
from .params import Params, ParamSpace, point
from .stage import Stage, check_finite
from .vectorize import vmap_or_loop


def _single_loss(stage: Stage):
    def loss(params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return stage.losses(params, x.unsqueeze(0), y.unsqueeze(0)).squeeze(0)

    return loss


def _chunks(inputs: torch.Tensor, targets: torch.Tensor, chunk_size: int, progress: bool, desc: str):
    starts = range(0, inputs.shape[0], chunk_size)
    for s in progress_steps(starts, desc, progress):
        yield inputs[s : s + chunk_size], targets[s : s + chunk_size]


def probed_gradient(stage: Stage, inputs, targets, names=None, at=None) -> tuple[int, list[torch.Tensor]]:
    """(measured bytes per example, the gradients over ``names`` of the summed loss) of one forward and backward on
    the first two examples (:class:`influkit.memory.Probe`): the activations a chunk of vmapped per-example
    gradients keeps too, and a gradient a caller summing over all examples keeps instead of computing it again.
    Probed with plain autograd, since ``torch.func`` transforms refuse to run under the probe's saved-tensor hooks."""
    names = stage.param_names if names is None else list(names)
    x, y = inputs[:PROBE_EXAMPLES], targets[:PROBE_EXAMPLES]
    leaves = {n: t.detach().requires_grad_(True) for n, t in point(stage.state(), names, at).items()}
    with Probe(stage.model, x.shape[0]) as probe, torch.enable_grad():
        found = torch.autograd.grad(stage.losses(leaves, x, y).sum(), list(leaves.values()), allow_unused=True)
    return probe.per_example, [torch.zeros_like(t) if g is None else g for g, t in zip(found, leaves.values())]


def backward_bytes(stage: Stage, inputs, targets, names=None, at=None) -> int:
    """Measured bytes per example of one forward and backward over ``names`` (:func:`probed_gradient`)."""
    return probed_gradient(stage, inputs, targets, names, at)[0]


def chunk_for(stage: Stage, inputs, targets, names, at, row_bytes: int, phase: str, budget: int | None = None,
              least: int = memory.DEFAULT_EXAMPLES) -> int:
    """Examples per chunk that fit the memory budget (bytes; None: the default rule, :mod:`influkit.memory`, with
    ``least`` its floor of examples): ``row_bytes`` per example (the rows kept) plus the measured activations of one
    forward and backward (:func:`backward_bytes`)."""
    return _fitting(backward_bytes(stage, inputs, targets, names, at) + row_bytes, inputs, phase, budget, least)


def _fitting(per_example: int, inputs, phase: str, budget: int | None, least: int = memory.DEFAULT_EXAMPLES) -> int:
    """Examples of ``per_example`` bytes per chunk that fit the budget, at most all of ``inputs``."""
    return memory.fit_count(memory.resolve(budget, inputs.device), per_example, phase, most=max(inputs.shape[0], 1),
                            default=not memory.given(budget), least=least)


def _grad_rows(stage: Stage, inputs, targets, names, at, chunk_size: int | None, progress: bool,
               budget: int | None = None):
    """Yield (chunk, p) blocks of per-example gradients over ``names``, one vmap call per chunk."""
    names = stage.param_names if names is None else list(names)
    params = point(stage.state(), names, at)
    space = ParamSpace(params)
    per_grad = grad(_single_loss(stage))
    check_finite(inputs, "inputs")
    if chunk_size is None:
        row = 2 * space.dim * torch.empty(0, dtype=space.dtype).element_size()  # the row and vmap's copy of it
        chunk_size = chunk_for(stage, inputs, targets, names, at, row, "per-example gradients", budget)
    for x, y in _chunks(inputs, targets, chunk_size, progress, "per-example gradients"):
        yield space.flatten(vmap_or_loop(per_grad, (None, 0, 0), stage, params, x, y), batched=True).T


def per_example_grads(
    stage: Stage,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    names: Sequence[str] | None = None,
    *,
    at: Params | None = None,
    chunk_size: int | None = None,
    progress: bool = False,
    memory: int | None = None,
) -> torch.Tensor:
    """(N, p): row i is ∇ ℓ(x_i, y_i) over the parameters ``names`` (default: the trained ones), flattened.
    memory: the budget in bytes a ``chunk_size`` of None is sized from (None: a share of what is free)."""
    return torch.cat(list(_grad_rows(stage, inputs, targets, names, at, chunk_size, progress, memory)), dim=0)


def per_example_grad_rows(
    stage: Stage, inputs: torch.Tensor, targets: torch.Tensor, names: Sequence[str] | None = None, *,
    chunk_size: int | None = None, memory: int | None = None, progress: bool = False,
):
    """Yield the (chunk, p) blocks of :func:`per_example_grads` one at a time (chunks sized from the budget
    ``memory`` in bytes when ``chunk_size`` is None): memory O(chunk · p) for a reduction over all rows."""
    return _grad_rows(stage, inputs, targets, names, None, chunk_size, progress, memory)


def project_per_example_grads(
    stage: Stage,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    directions: torch.Tensor,
    names: Sequence[str] | None = None,
    *,
    at: Params | None = None,
    chunk_size: int | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """(N, k) = G · directions, with G the (N, p) per-example gradients, never holding more than a chunk of G."""
    cols = directions.reshape(directions.shape[0], -1)
    rows = _grad_rows(stage, inputs, targets, names, at, chunk_size, progress)
    return torch.cat([block @ cols.to(block.dtype) for block in rows], dim=0)


def per_example_grads_serial(
    stage: Stage, inputs: torch.Tensor, targets: torch.Tensor, names: Sequence[str] | None = None
) -> torch.Tensor:
    """(N, p) by one ``torch.autograd.grad`` call per example: slow, the reference for tests."""
    names = stage.param_names if names is None else list(names)
    params = {n: t.clone().requires_grad_(True) for n, t in point(stage.state(), names).items()}
    rows = []
    for i in range(inputs.shape[0]):
        loss = stage.losses(params, inputs[i : i + 1], targets[i : i + 1]).sum()
        grads = torch.autograd.grad(loss, [params[n] for n in names])
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def total_grad(
    stage: Stage,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    names: Sequence[str] | None = None,
    *,
    at: Params | None = None,
    chunk_size: int | None = None,
    memory: int | None = None,
) -> torch.Tensor:
    """(p,) = Σ_i ∇ ℓ(x_i, y_i) over ``names``: the gradient of the summed loss, streamed in chunks (of
    ``chunk_size``, or as many as the budget ``memory`` in bytes holds; None: a share of what is free)."""
    names = stage.param_names if names is None else list(names)
    params = point(stage.state(), names, at)
    space = ParamSpace(params)
    check_finite(inputs, "inputs")
    total = space.zeros()
    if chunk_size is None:  # the probe that sizes the chunks computes the first examples' gradient: kept, not redone
        per, head = probed_gradient(stage, inputs, targets, names, at)
        chunk_size = min(512, _fitting(per, inputs, "the test gradient", memory))
        total += torch.cat([g.reshape(-1) for g in head])
        inputs, targets = inputs[PROBE_EXAMPLES:], targets[PROBE_EXAMPLES:]
    summed = grad(lambda p, x, y: stage.losses(p, x, y).sum())
    for x, y in _chunks(inputs, targets, chunk_size, False, ""):
        total += space.flatten(summed(params, x, y))
    return total
