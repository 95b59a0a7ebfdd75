"""Scores ⟨∇ℓ_i, s_j⟩ of a batch against k directions without forming the (batch, p) per-example gradients.

One forward with hooks on the layers that own trained parameters and one backward of Σ_i ℓ_i to the layers'
outputs give every layer's inputs a_it and output-gradients g_it = ∂ℓ_i/∂y_it (examples do not mix in eval
mode, so g_it belongs to example i alone). A layer's per-example gradient is then a sum over its tokens t,
and its inner product with a direction is contracted token by token, never formed: how, for each module type, is
its class in the layer registry (:mod:`influkit.layers`: ``nn.Linear``, ``nn.Conv1d``/``nn.Conv2d``,
``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm``; :mod:`influkit.hf` adds transformers' ``Conv1D``).

Every call of a module counts (a weight tied between the word embeddings and the decoder gets both terms).
Each term is taken one of two ways, chosen per layer call and chunk by the layer's cost rule
(:meth:`~influkit.layers.Layer.forms_rows`, flops + elements moved, k directions, T tokens per example):

- contracted once per direction: k · contract_cost(T) per example, memory O(batch · tokens · min(in, out));
- the layer's per-example gradient rows (batch, n) formed once and multiplied by its k direction rows:
  gradient_cost(T) + n · (k + 2) per example — for a dense layer T·r·c + r·c·(k + 3) against k·T·(r·c + r + c),
  so rows win as soon as T and k both exceed 2 (a convolution's positions against 100 per-test directions).
  Rows are formed only within :data:`ROWS_SHARE` of the memory budget, in slices of the chunk if need be, one layer
  at a time: a layer whose single row does not fit is contracted. Memory stays O(budget), never O(batch · p).

Trained parameters outside these layers (and layers whose hooks cannot
follow them: grouped convolutions, ``max_norm`` embeddings, modules not called through ``forward``) are
scored from their own per-example gradients (``torch.func.vmap``, :mod:`influkit.gradients`), the fallback.

The first batch is checked: Σ_i of the contracted scores must equal ⟨∇Σ_i ℓ_i, s_j⟩ from an ordinary backward
(same pass); a parameter used outside its module's ``forward`` would break that, and then every batch falls back
to per-example gradients with a warning. ``autocast`` runs the forward and backward in bfloat16/float16
(``torch.autocast``), contracting in the directions' dtype (float32 accumulation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .errors import ContractionWarning, InputError, warn
from .gradients import project_per_example_grads
from .layers import Layer, Recorder
from .layers import plan as registered_layers
from .memory import SAFETY
from .memory import resolve as budget_of
from .params import ParamSpace, point
from .stage import Stage, check_finite

AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
ROWS_SHARE = 0.25  # of the memory budget, at most, for one layer's per-example gradient rows formed at once


@dataclass
class ContractionPlan:
    """Which trained parameters are contracted in which layers, and which fall back to per-example gradients (why)."""

    modules: list[Layer]
    fallback: list[str]
    covered: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)

    def describe(self) -> dict:
        return {"contracted": len(self.covered), "fallback": {n: self.reasons[n] for n in self.fallback},
                "modules": sorted({m.kind for m in self.modules})}


def plan_contraction(model: nn.Module, names: Sequence[str]) -> ContractionPlan:
    """The registered layers of ``model`` that own the trained ``names`` (weights tied across modules included)."""
    layers, reasons = registered_layers(model, names)
    covered = {n for layer in layers for n in layer.params}
    return ContractionPlan(layers, [n for n in names if n not in covered], [n for n in names if n in covered], reasons)


class Contractor:
    """Contracted scores G·S of batches for one stage and parameter block (S given per call, (p, k)).

    ``verified``: whether the first batch's check passed; ``fallback_all``: every batch uses per-example gradients;
    ``probed``: the scores (B, k) of the last :meth:`probe`'s batch (None if it fell back), as :meth:`__call__` gives.
    ``memory``: the budget in bytes (None: the default, :func:`influkit.memory.resolve`); ``rows_bytes``, at most
    :data:`ROWS_SHARE` of it, bounds the per-example gradient rows formed at once; ``formed``: {layer: bytes of one
    row} of the layers whose rows the last batch formed.
    """

    def __init__(self, stage: Stage, names: Sequence[str] | None = None, *, autocast: torch.dtype | None = None,
                 memory: int | None = None):
        if autocast is not None and autocast not in AUTOCAST_DTYPES:
            raise InputError(f"autocast must be one of {AUTOCAST_DTYPES} or None, got {autocast!r}.")
        self.stage = stage
        self.names = list(stage.param_names if names is None else names)
        self.space = ParamSpace(point(stage.state(), self.names))
        self.plan = plan_contraction(stage.model, self.names)
        self.autocast = autocast
        device = next(iter(point(stage.state(), self.names).values())).device if self.names else "cpu"
        self.rows_bytes = int(ROWS_SHARE * budget_of(memory, device))
        self.formed: dict[str, int] = {}
        self.verified = False
        self.probed: torch.Tensor | None = None
        self.transient_bytes = 0
        self.fallback_all = not self.plan.covered
        offsets, offset = {}, 0
        for n, size in zip(self.space.names, self.space.sizes):
            offsets[n] = (offset, size)
            offset += size
        self.offsets = offsets

    def describe(self) -> dict:
        return self.plan.describe() | {"verified": self.verified, "per_example_fallback": self.fallback_all,
                                       "autocast": None if self.autocast is None else str(self.autocast),
                                       "formed_rows": sorted(self.formed), "rows_bytes": self.rows_bytes}

    def _rows(self, directions: torch.Tensor, names: Sequence[str]) -> torch.Tensor:
        return torch.cat([directions[self.offsets[n][0] : sum(self.offsets[n])] for n in names])

    def _direction(self, directions: torch.Tensor, name: str, j: int) -> torch.Tensor:
        start, size = self.offsets[name]
        return directions[start : start + size, j].reshape(self.space.shapes[self.space.names.index(name)])

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
        """(B, k) = G · directions for the batch, G its per-example gradients over the block (never formed)."""
        directions = directions.reshape(self.space.dim, -1)
        if self.fallback_all:
            return project_per_example_grads(self.stage, inputs, targets, directions, self.names,
                                             chunk_size=max(inputs.shape[0], 1))
        check_finite(inputs, "inputs")
        out = self._contract(inputs, targets, directions, check=not self.verified)
        if out is None:  # the check failed: per-example gradients from now on
            self.fallback_all = True
            return self(inputs, targets, directions)
        self.verified = True
        return self._with_fallback(out, inputs, targets, directions)

    def _with_fallback(self, out, inputs, targets, directions) -> torch.Tensor:
        """The contracted scores ``out`` plus those of the parameters left to per-example gradients."""
        if self.plan.fallback:
            out = out + project_per_example_grads(self.stage, inputs, targets, self._rows(directions, self.plan.fallback),
                                                  self.plan.fallback, chunk_size=max(inputs.shape[0], 1)).to(out.dtype)
        return out

    def _contract(self, inputs, targets, directions, check: bool) -> torch.Tensor | None:
        stage, plan = self.stage, self.plan
        leaves = {n: t.detach().requires_grad_(True) for n, t in point(stage.state(), plan.covered).items()}
        batch = inputs.shape[0]
        device_type = inputs.device.type
        with Recorder(plan.modules, batch) as recorder, torch.enable_grad(), torch.autocast(
                device_type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            losses = stage.losses(leaves, inputs, targets)
        # a layer never called adds nothing; one called on inputs that are not batch-first (a shared tensor) cannot
        # be split per example: its parameters go to the per-example fallback
        unbatched = {name: why for name, why in recorder.misfits().items() if recorder.calls[name]}
        if unbatched:
            self._demote([m for m in plan.modules if m.name in unbatched], next(iter(unbatched.values())))
            return self._contract(inputs, targets, directions, check) if self.plan.covered else None
        calls = [(layer, a, y) for layer in plan.modules for a, y in recorder.calls[layer.name]]
        targets_of_grad = [c[2] for c in calls] + (list(leaves.values()) if check else [])
        grads = torch.autograd.grad(losses.sum(), targets_of_grad, allow_unused=True)
        held = [c[2] for c in calls]
        self.transient_bytes = sum(t.numel() * t.element_size() for t in held) + 3 * max(
            (t.numel() * directions.element_size() for t in held), default=0)
        k = directions.shape[1]
        dtype = directions.dtype
        self.formed = {}
        scores = torch.zeros(batch, k, dtype=dtype, device=directions.device)
        for (layer, a, _), g in zip(calls, grads[: len(calls)]):
            if g is not None:
                a = a.to(dtype) if a.is_floating_point() else a  # token ids stay ids
                scores += self._call_term(layer, a, g.to(dtype), directions)
        if check:
            total = torch.cat([(t if t is not None else torch.zeros_like(leaves[n])).reshape(-1)
                               for n, t in zip(plan.covered, grads[len(calls):])]).to(dtype)
            expected = total @ self._rows(directions, plan.covered)
            got = scores.sum(0)
            precise = self.space.dtype == torch.float64 and dtype == torch.float64
            tol = 5e-2 if self.autocast is not None else 1e-8 if precise else 1e-3
            scale = scores.abs().sum(0) + expected.abs() + torch.finfo(dtype).tiny
            if not bool(((got - expected).abs() <= tol * scale).all()):
                warn(
                    "contracted scores do not add up to the gradient of the summed loss (relative gap "
                    f"{float(((got - expected).abs() / scale).max()):.2e}): a trained parameter is used outside its "
                    "module's forward (e.g. through F.linear); scoring falls back to per-example gradients "
                    "(slower, memory O(chunk · p)).",
                    ContractionWarning,
                )
                return None
        return scores

    def probe(self, inputs: torch.Tensor, targets: torch.Tensor, directions: torch.Tensor) -> int:
        """Measured bytes per example of :meth:`__call__` on this probe batch (:mod:`influkit.memory`): the saved
        activations, plus the output-gradients of every hooked call held at once and three temporaries the size of
        the largest output (the contraction's products), plus, for parameters left to the per-example-gradient
        fallback, its rows and its own forward/backward (counted as much again as the measured one). The batch's
        scores are kept in :attr:`probed` (the caller need not score these rows again)."""
        from .memory import SavedBytes

        self.transient_bytes = 0
        directions = directions.reshape(self.space.dim, -1)
        # torch.func transforms refuse saved-tensor hooks, so only plain-autograd passes run under them: the
        # contraction, or (no contraction possible) one backward of the summed loss standing for the fallback's
        with SavedBytes(list(self.stage.model.parameters()) + list(self.stage.model.buffers())) as saved:
            out = None if self.fallback_all else self._contract(inputs, targets, directions, check=not self.verified)
            if out is None:
                with torch.enable_grad():
                    leaves = {n: t.detach().requires_grad_(True) for n, t in point(self.stage.state(), self.names).items()}
                    torch.autograd.grad(self.stage.losses(leaves, inputs, targets).sum(), list(leaves.values()))
        if out is None:
            self.fallback_all = True
            self.probed = None
        else:
            self.verified = True
            self.probed = self._with_fallback(out, inputs, targets, directions)
        batch = max(inputs.shape[0], 1)
        fallback = self.names if self.fallback_all else self.plan.fallback
        rows = sum(self.offsets[n][1] for n in fallback) * directions.element_size() * 2
        again = saved.total if fallback and not self.fallback_all else 0
        return -(-(saved.total + again + self.transient_bytes) // batch) + rows

    def reserve(self, budget: int, per_example: int, most: int) -> int:
        """Bytes of the budget to set aside for the rows the probe formed (0: none formed, or no room for one row
        beside one example's contraction, and then every layer is contracted): at most ``most`` rows of the largest
        layer formed, within ``rows_bytes`` and what one example of ``per_example`` bytes leaves free."""
        need = max(self.formed.values(), default=0)
        room = min(self.rows_bytes, most * need, max(budget - int(SAFETY * per_example), 0))
        self.rows_bytes = room if need and room >= need else 0
        return self.rows_bytes

    def _demote(self, entries, why: str) -> None:
        """Move the parameters of ``entries`` to the per-example-gradient fallback, for this and every later batch.

        A parameter is contracted in all of its uses or in none (its fallback gradient covers every use)."""
        names = {n for e in entries for n in e.params}
        modules = [kept for m in self.plan.modules if (kept := m.without(names)) is not None]
        reasons = self.plan.reasons | {n: why for n in names}
        self.plan = ContractionPlan(modules, [n for n in self.names if n in names or n in self.plan.fallback],
                                    [n for n in self.plan.covered if n not in names], reasons)
        self.fallback_all = not self.plan.covered

    def _call_term(self, layer: Layer, a, g, directions) -> torch.Tensor:
        """(B, k) contribution of one call of one layer (a, g: its recorded input and output-gradient): its
        per-example gradient rows times its direction rows where the layer's cost rule says so and a row fits in
        ``rows_bytes`` (as many rows at a time as fit), else contracted direction by direction."""
        a, g = layer.inputs(a), layer.grads(g)
        row_bytes = layer.size * directions.element_size()
        at_once = self.rows_bytes // row_bytes
        if at_once >= 1 and layer.forms_rows(g.shape[1], directions.shape[1]):
            self.formed[layer.name] = row_bytes
            blocks = [directions[self.offsets[name][0] : sum(self.offsets[name])] for name in layer.params]
            return torch.cat([sum(rows @ block for rows, block in zip(
                layer.example_gradients(a[s : s + at_once], g[s : s + at_once]), blocks))
                for s in range(0, g.shape[0], at_once)])
        out = torch.zeros(g.shape[0], directions.shape[1], dtype=directions.dtype, device=directions.device)
        for j in range(directions.shape[1]):
            weight = None if layer.weight is None else self._direction(directions, layer.weight, j)
            bias = None if layer.bias is None else self._direction(directions, layer.bias, j)
            out[:, j] = layer.contract(a, g, weight, bias)
        return out


def contract_scores(stage: Stage, inputs: torch.Tensor, targets: torch.Tensor, directions: torch.Tensor,
                    names: Sequence[str] | None = None, *, autocast: torch.dtype | None = None,
                    memory: int | None = None) -> torch.Tensor:
    """(N, k) = G · directions (G the per-example gradients over ``names``) by contraction, in one batch."""
    return Contractor(stage, names, autocast=autocast, memory=memory)(inputs, targets, directions)
