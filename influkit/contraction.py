"""Scores ⟨∇ℓ_i, s_j⟩ of a batch against k directions without forming the (batch, p) per-example gradients.

One forward with hooks on the layers that own trained parameters and one backward of Σ_i ℓ_i to the layers'
outputs give every layer's inputs a_it and output-gradients g_it = ∂ℓ_i/∂y_it (examples do not mix in eval
mode, so g_it belongs to example i alone). A layer's per-example gradient is then a sum over its tokens t,
and its inner product with a direction is contracted token by token, never formed:

- ``nn.Linear`` y = W a + b:           ⟨∇W_i, S⟩ = Σ_t g_tᵀ S a_t,        ⟨∇b_i, s⟩ = Σ_t g_tᵀ s;
- transformers ``Conv1D`` y = a W + b (GPT-2): the same with S transposed;
- ``nn.Embedding`` y_t = W[x_t]:       ⟨∇W_i, S⟩ = Σ_t g_tᵀ S[x_t]   (``padding_idx`` tokens carry no gradient; ids
  shared by the whole batch, like position ids of shape (1, T), are expanded to the batch in the hook so that
  their output-gradients stay per example);
- ``nn.LayerNorm`` y = â ⊙ w + b:      ⟨∇w_i, s⟩ = Σ_t (g_t ⊙ â_t)ᵀ s, ⟨∇b_i, s⟩ = Σ_t g_tᵀ s  (â the normalized input).

Every call of a module counts (a weight tied between the word embeddings and the decoder gets both terms).
Each term costs one matrix product of the layer's size per direction — memory O(batch · tokens · min(in, out))
per direction, never O(batch · p). Trained parameters outside these layers (and layers whose hooks cannot
follow them: ``max_norm``/``scale_grad_by_freq`` embeddings, modules not called through ``forward``) are
scored from their own per-example gradients (``torch.func.vmap``, :mod:`influkit.gradients`), the fallback.

The first batch is checked: Σ_i of the contracted scores must equal ⟨∇Σ_i ℓ_i, s_j⟩ from an ordinary backward
(same pass); a parameter used outside its module's ``forward`` would break that, and then every batch falls back
to per-example gradients with a warning. ``autocast`` runs the forward and backward in bfloat16/float16
(``torch.autocast``), contracting in the directions' dtype (float32 accumulation).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ContractionWarning, InputError, warn
from .gradients import project_per_example_grads
from .params import ParamSpace, point
from .stage import Stage, check_finite


def _conv1d_class():
    """transformers' ``Conv1D`` (GPT-2's linear layers) when transformers is loaded, else None: a model holding one
    has imported it already, so ``import influkit`` never loads transformers itself."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)

AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class _Module:
    """A hooked module: its kind and the trained names of its weight and bias (None when not trained)."""

    name: str
    kind: str
    module: nn.Module
    weight: str | None
    bias: str | None


def _kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.Linear):
        return "linear"
    conv1d = _conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        return "conv1d"
    if isinstance(module, nn.Embedding) and module.max_norm is None and not module.scale_grad_by_freq:
        return "embedding"
    if isinstance(module, nn.LayerNorm):
        return "layernorm"
    return None


@dataclass
class ContractionPlan:
    """Which trained parameters are contracted in which modules, and which fall back to per-example gradients."""

    modules: list[_Module]
    fallback: list[str]
    covered: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)

    def describe(self) -> dict:
        return {"contracted": len(self.covered), "fallback": {n: self.reasons.get(n, "no hooked layer") for n in self.fallback},
                "modules": sorted({m.kind for m in self.modules})}


def plan_contraction(model: nn.Module, names: Sequence[str]) -> ContractionPlan:
    """The hooked modules of ``model`` that own the trained ``names`` (weights tied across modules included)."""
    trained = set(names)
    canonical: dict[int, str] = {}
    for pname, param in model.named_parameters():  # first name of each tensor, as Stage.param_names uses
        canonical.setdefault(id(param), pname)
    modules, covered = [], set()
    for mname, module in model.named_modules():
        kind = _kind(module)
        if kind is None:
            continue
        w = getattr(module, "weight", None)
        b = getattr(module, "bias", None)
        weight = canonical.get(id(w)) if isinstance(w, torch.Tensor) else None
        bias = canonical.get(id(b)) if isinstance(b, torch.Tensor) else None
        weight = weight if weight in trained else None
        bias = bias if bias in trained and kind != "embedding" else None
        if weight is None and bias is None:
            continue
        modules.append(_Module(mname, kind, module, weight, bias))
        covered.update(n for n in (weight, bias) if n is not None)
    fallback = [n for n in names if n not in covered]
    return ContractionPlan(modules, fallback, [n for n in names if n in covered])


def _linear_term(a: torch.Tensor, g: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """(B,) Σ_t g_tᵀ S a_t for a (B, T, in), g (B, T, out), S (out, in): the cheaper side multiplied first."""
    if s.shape[0] <= s.shape[1]:
        return ((a @ s.T) * g).sum((1, 2))
    return ((g @ s) * a).sum((1, 2))


class Contractor:
    """Contracted scores G·S of batches for one stage and parameter block (S given per call, (p, k)).

    ``verified``: whether the first batch's check passed; ``fallback_all``: every batch uses per-example gradients.
    """

    def __init__(self, stage: Stage, names: Sequence[str] | None = None, *, autocast: torch.dtype | None = None):
        if autocast is not None and autocast not in AUTOCAST_DTYPES:
            raise InputError(f"autocast must be one of {AUTOCAST_DTYPES} or None, got {autocast!r}.")
        self.stage = stage
        self.names = list(stage.param_names if names is None else names)
        self.space = ParamSpace(point(stage.state(), self.names))
        self.plan = plan_contraction(stage.model, self.names)
        self.autocast = autocast
        self.verified = False
        self.transient_bytes = 0
        self.fallback_all = not self.plan.covered
        offsets, offset = {}, 0
        for n, size in zip(self.space.names, self.space.sizes):
            offsets[n] = (offset, size)
            offset += size
        self.offsets = offsets

    def describe(self) -> dict:
        return self.plan.describe() | {"verified": self.verified, "per_example_fallback": self.fallback_all,
                                       "autocast": None if self.autocast is None else str(self.autocast)}

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
        if self.plan.fallback:
            out = out + project_per_example_grads(self.stage, inputs, targets, self._rows(directions, self.plan.fallback),
                                                  self.plan.fallback, chunk_size=max(inputs.shape[0], 1)).to(out.dtype)
        return out

    def _contract(self, inputs, targets, directions, check: bool) -> torch.Tensor | None:
        stage, plan = self.stage, self.plan
        leaves = {n: t.detach().requires_grad_(True) for n, t in point(stage.state(), plan.covered).items()}
        calls: list[tuple[_Module, torch.Tensor, torch.Tensor]] = []

        batch = inputs.shape[0]

        def hook(entry, module, args, output):
            if not (args and torch.is_tensor(args[0]) and torch.is_tensor(output) and output.requires_grad):
                return None
            a = args[0].detach()
            if entry.kind == "embedding" and a.shape[0] == 1 != batch:
                # ids shared by the batch (position ids (1, T)): expanded, so the output-gradient stays per example
                a, output = a.expand(batch, *a.shape[1:]), output.expand(batch, *output.shape[1:])
                calls.append((entry, a, output))
                return output
            calls.append((entry, a, output))
            return None

        handles = [m.module.register_forward_hook(lambda mod, a, o, e=m: hook(e, mod, a, o)) for m in plan.modules]
        device_type = inputs.device.type
        try:
            with torch.enable_grad(), torch.autocast(device_type, dtype=self.autocast or torch.bfloat16,
                                                    enabled=self.autocast is not None):
                losses = stage.losses(leaves, inputs, targets)
        finally:
            for h in handles:
                h.remove()
        unbatched = {id(e): e for e, a, y in calls if a.shape[0] != batch or y.shape[0] != batch}
        if unbatched:  # e.g. GPT-2's position embedding, called on (1, T) ids: its gradient sums over the batch
            self._demote(unbatched.values(), "called on inputs that are not batch-first")
            return self._contract(inputs, targets, directions, check) if self.plan.covered else None
        targets_of_grad = [c[2] for c in calls] + (list(leaves.values()) if check else [])
        grads = torch.autograd.grad(losses.sum(), targets_of_grad, allow_unused=True)
        held = [c[2] for c in calls]
        self.transient_bytes = sum(t.numel() * t.element_size() for t in held) + 3 * max(
            (t.numel() * directions.element_size() for t in held), default=0)
        k = directions.shape[1]
        dtype = directions.dtype
        scores = torch.zeros(batch, k, dtype=dtype, device=directions.device)
        for (entry, a, y), g in zip(calls, grads[: len(calls)]):
            if g is None:
                continue
            scores += self._call_term(entry, a.to(dtype), y, g.to(dtype), directions, batch)
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
        fallback, its rows and its own forward/backward (counted as much again as the measured one)."""
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
        else:
            self.verified = True
        batch = max(inputs.shape[0], 1)
        fallback = self.names if self.fallback_all else self.plan.fallback
        rows = sum(self.offsets[n][1] for n in fallback) * directions.element_size() * 2
        again = saved.total if fallback and not self.fallback_all else 0
        return -(-(saved.total + again + self.transient_bytes) // batch) + rows

    def _demote(self, entries, why: str) -> None:
        """Move the parameters of ``entries`` to the per-example-gradient fallback, for this and every later batch.

        A parameter is contracted in all of its uses or in none (its fallback gradient covers every use)."""
        names = {n for e in entries for n in (e.weight, e.bias) if n is not None}
        modules = []
        for m in self.plan.modules:
            weight, bias = (None if m.weight in names else m.weight), (None if m.bias in names else m.bias)
            if weight is not None or bias is not None:
                modules.append(_Module(m.name, m.kind, m.module, weight, bias))
        reasons = self.plan.reasons | {n: why for n in names}
        self.plan = ContractionPlan(modules, [n for n in self.names if n in names or n in self.plan.fallback],
                                    [n for n in self.plan.covered if n not in names], reasons)
        self.fallback_all = not self.plan.covered

    def _call_term(self, entry: _Module, a, y, g, directions, batch) -> torch.Tensor:
        """(B, k) contribution of one call of one module."""
        k = directions.shape[1]
        out = torch.zeros(batch, k, dtype=directions.dtype, device=directions.device)
        kind = entry.kind
        if kind == "embedding":
            ids = a.reshape(batch, -1).long()
            g = g.reshape(batch, ids.shape[1], -1)
            if entry.module.padding_idx is not None:
                g = g * (ids != entry.module.padding_idx).unsqueeze(-1).to(g.dtype)
            for j in range(k):
                out[:, j] = (self._direction(directions, entry.weight, j)[ids] * g).sum((1, 2))
            return out
        if kind == "layernorm":
            dims = len(entry.module.normalized_shape)
            normed = F.layer_norm(a, entry.module.normalized_shape, None, None, entry.module.eps)
            g = g.reshape(batch, -1, *g.shape[g.dim() - dims :])
            normed = normed.reshape(g.shape)
            for j in range(k):
                if entry.weight is not None:
                    out[:, j] += (g * normed * self._direction(directions, entry.weight, j)).reshape(batch, -1).sum(1)
                if entry.bias is not None:
                    out[:, j] += (g * self._direction(directions, entry.bias, j)).reshape(batch, -1).sum(1)
            return out
        a = a.reshape(batch, -1, a.shape[-1])
        g = g.reshape(batch, -1, g.shape[-1])
        for j in range(k):
            if entry.weight is not None:
                s = self._direction(directions, entry.weight, j)
                out[:, j] += _linear_term(a, g, s if kind == "linear" else s.T)
            if entry.bias is not None:
                out[:, j] += g.sum(1) @ self._direction(directions, entry.bias, j)
        return out


def contract_scores(stage: Stage, inputs: torch.Tensor, targets: torch.Tensor, directions: torch.Tensor,
                    names: Sequence[str] | None = None, *, autocast: torch.dtype | None = None) -> torch.Tensor:
    """(N, k) = G · directions (G the per-example gradients over ``names``) by contraction, in one batch."""
    return Contractor(stage, names, autocast=autocast)(inputs, targets, directions)
