"""Pseudo output-gradients: vectors u whose outer products estimate the loss curvature in output space.

For a per-example loss ℓ(f, y) of the model output f, the Gauss-Newton matrix of the mean objective is
(1/n) Σ_i J_iᵀ H_i J_i, with J_i = ∂f_i/∂θ and H_i = ∇²_f ℓ(f_i, y_i). Back-propagating an output-gradient u_i
with E[u_i u_iᵀ] = H_i gives a parameter gradient J_iᵀ u_i whose outer product is that curvature in
expectation; this is all K-FAC, EK-FAC and the diagonal Fisher need. Three choices of u (``fisher=``):

- ``"sampled"`` (default): the Fisher with labels sampled from the model's predictive distribution. For the
  negative log-likelihoods influkit recognises, the Fisher equals the Gauss-Newton matrix, the positive
  semi-definite part of the Hessian that K-FAC approximates (Martens & Grosse 2015), and its sample is unbiased.
  It is also kronfluence's default, so scores are comparable. Recognised (each up to a constant or a
  per-example factor c_i, which is read off the loss on the first batch and then per batch):
  cross-entropy on class logits (integer targets; classes on dim 1 or on the last dim; targets −100 ignored),
  ℓ = c_i·Σ CE, sampled as u = √c_i (softmax(f) − onehot(ŷ)), ŷ ~ softmax(f); and squared error
  ℓ = c_i·‖f − y‖² (sum or mean), whose Gauss-Newton matrix 2c_i·I is sampled as u = √(2c_i)·ξ, ξ ~ N(0, I).
  Any other loss raises :class:`FactoredCurvatureError` (use ``"empirical"`` or ``"exact"`` there).
  A loss may instead **declare** itself a categorical negative log-likelihood (:func:`declare_categorical`:
  which position predicts which target, and c_i): influkit's own ``hf.masked_lm_losses`` and
  ``hf.causal_lm_losses`` (whose position t predicts the label at t + 1) do, so they are recognised whatever their
  values — read off the loss, c_i and the ratio test lose their precision on a trained float32 model whose
  losses are near 0.
  The draws of example i are a pure function of (seed, i) — counter-based Philox4x32-10 words
  (:func:`influkit.philox.random_words`) — not of a generator stream consumed in batch order, so the
  labels and hence the factors do not depend on the batch size, on which other examples are fitted
  (``hessian_samples``), on repeated passes (EK-FAC) or on how ``torch.distributed`` shards the data.
- ``"empirical"``: u = ∇_f ℓ(f, y) with the true labels — the empirical Fisher (1/n) Σ ∇ℓ_i ∇ℓ_iᵀ, any loss.
  Cheaper to reason about but a poor curvature model (Kunstner et al. 2019): it vanishes on well-fit examples and
  scales with the loss instead of the curvature.
- ``"exact"``: the columns of H_i^{1/2} (eigenvalues clipped at 0), so Σ_j u_ij u_ijᵀ = H_i exactly and the
  factors are the deterministic Kronecker factors of the Gauss-Newton matrix; costs one backward pass per output
  dimension (at most :data:`EXACT_MAX_OUTPUTS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import InputError
from ..philox import random_words

FISHER = ("sampled", "empirical", "exact")
EXACT_MAX_OUTPUTS = 256
IGNORE_INDEX = -100
_STREAM_CATEGORICAL, _STREAM_GAUSSIAN = 0, 1


class FactoredCurvatureError(InputError):
    """The factored curvature cannot be built for this stage (loss, layers or settings); the message says what to change."""


@dataclass(frozen=True)
class Categorical:
    """A loss's declaration ℓ(f, y)_i = c_i · Σ_t CE(f_it, ŷ_it): cross-entropy of the logits at each position
    (classes on ``class_dim``) against ``targets(y)`` (ignored where −100), weighted per example by
    ``weights(y)`` = c_i (default 1)."""

    class_dim: int = -1
    targets: Callable[[torch.Tensor], torch.Tensor] | None = None
    weights: Callable[[torch.Tensor], torch.Tensor] | None = None


def declare_categorical(loss, *, class_dim: int = -1, targets=None, weights=None):
    """Mark ``loss`` (a function of (outputs, targets)) as the categorical negative log-likelihood
    :class:`Categorical` describes, so ``fisher="sampled"`` uses it without reading it off the values. Returns it."""
    loss.categorical = Categorical(class_dim, targets, weights)
    return loss


def _categorical_reference(outputs: torch.Tensor, targets: torch.Tensor, class_dim: int) -> torch.Tensor:
    """(B,) Σ over positions of the cross-entropy with classes on ``class_dim`` (ignored targets contribute 0)."""
    logits = outputs if class_dim == 1 else outputs.movedim(-1, 1)
    per = F.cross_entropy(logits, targets, reduction="none", ignore_index=IGNORE_INDEX)
    return per.reshape(per.shape[0], -1).sum(1)


def _squared_reference(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B,) ‖f − y‖² per example."""
    return ((outputs - targets.reshape(outputs.shape)) ** 2).reshape(outputs.shape[0], -1).sum(1)


def _candidates(outputs: torch.Tensor, targets: torch.Tensor):
    """(family, class_dim, reference loss) pairs that fit the shapes of outputs and targets."""
    found = []
    if not targets.is_floating_point() and not targets.is_complex() and outputs.dim() >= 2:
        if targets.shape == outputs.shape[:1] + outputs.shape[2:]:
            found.append(("categorical", 1))
        if outputs.dim() > 2 and targets.shape == outputs.shape[:-1]:
            found.append(("categorical", -1))
    if targets.is_floating_point() and targets.numel() == outputs.numel():
        found.append(("gaussian", 0))
    return found


def _reference(family: str, class_dim: int, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if family == "categorical":
        return _categorical_reference(outputs, targets, class_dim)
    return _squared_reference(outputs, targets)


def detect_family(loss, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[str, int]:
    """(family, class_dim) of ``loss``: "categorical" (cross-entropy) or "gaussian" (squared error), up to a factor.

    The ratio ℓ(f, y) / reference(f, y) must be the same per example at f and at a random perturbation of f,
    i.e. ℓ = c_i·reference with c_i independent of the outputs; otherwise :class:`FactoredCurvatureError`.
    """
    f = outputs.detach()
    gen = torch.Generator(device="cpu").manual_seed(20221)
    noise = torch.randn(f.shape, generator=gen, dtype=f.dtype).to(f.device) * (float(f.std()) + 1.0 if f.numel() > 1 else 1.0)
    rtol = 1e-8 if f.dtype == torch.float64 else 2e-4
    with torch.no_grad():
        for family, class_dim in _candidates(f, targets):
            ratios = []
            try:
                for o in (f, f + noise):
                    value = loss(o, targets).reshape(-1).to(torch.float64)
                    ref = _reference(family, class_dim, o, targets).to(torch.float64)
                    ratios.append((value, ref))
            except (RuntimeError, ValueError, IndexError):
                continue
            (v0, r0), (v1, r1) = ratios
            usable = (r0 > 1e-12) & (r1 > 1e-12)
            if not usable.any():
                continue
            c0, c1 = v0[usable] / r0[usable], v1[usable] / r1[usable]
            if (c0 > 0).all() and torch.allclose(c0, c1, rtol=rtol, atol=0):
                return family, class_dim
    raise FactoredCurvatureError(
        "fisher='sampled' samples labels from the model's predictive distribution, which influkit reads off the "
        "loss: it recognises cross-entropy on class logits (integer targets, classes on dim 1 or the last dim) and "
        "squared error (sum or mean over outputs), each up to a constant or per-example factor. This loss is "
        "neither (e.g. label smoothing, binary cross-entropy, Huber, per-token weights); use fisher='empirical' "
        "(true labels) or fisher='exact' (the exact Gauss-Newton matrix, one backward pass per output)."
    )


class PseudoGradients:
    """Draws the pseudo output-gradients u (shape (k, *outputs.shape)) of one batch for a ``fisher`` choice.

    The family of a ``"sampled"`` loss is detected once, from the first batch (:func:`detect_family`).
    """

    def __init__(self, loss, fisher: str, outputs: torch.Tensor, targets: torch.Tensor, seed: int = 0):
        if fisher not in FISHER:
            raise InputError(f"unknown fisher {fisher!r}; choose one of {FISHER}.")
        self.loss, self.fisher = loss, fisher
        self.declared: Categorical | None = getattr(loss, "categorical", None) if fisher != "exact" else None
        if fisher == "empirical":
            self.family, self.class_dim = "", 0
        elif self.declared is not None:
            self.family, self.class_dim = "categorical", self.declared.class_dim
        else:
            self.family, self.class_dim = detect_family(loss, outputs, targets) if fisher == "sampled" else ("", 0)
        if fisher == "exact":
            size = outputs[0].numel()
            if size > EXACT_MAX_OUTPUTS:
                raise FactoredCurvatureError(
                    f"fisher='exact' needs one backward pass per output dimension and the model has {size} outputs per "
                    f"example (limit {EXACT_MAX_OUTPUTS}); use fisher='sampled' (cross-entropy or squared error) or "
                    "'empirical'."
                )
        self.seed = int(seed)
        self._next = 0  # example ids of batches given without ``index``: consecutive from 0

    def describe(self) -> str:
        if self.fisher == "sampled":
            return f"sampled labels ({'cross-entropy' if self.family == 'categorical' else 'squared error'})"
        return {"empirical": "empirical Fisher (true labels)", "exact": "exact Gauss-Newton (output Hessian)"}[self.fisher]

    def _uniforms(self, index: torch.Tensor | None, batch: int, count: int, stream: int) -> torch.Tensor:
        """(batch, count) float64 uniforms in (0, 1), row b a function of (seed, index[b]) only."""
        if index is None:
            index = torch.arange(self._next, self._next + batch)
            self._next += batch
        index = torch.as_tensor(index).reshape(-1).to("cpu", torch.int64)
        if index.numel() != batch:
            raise InputError(f"got {index.numel()} example indices for a batch of {batch}.")
        words = random_words(index, count, seed=self.seed, stream=stream)
        return (words.to(torch.float64) + 0.5) / 2.0**32

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        """(k, *outputs.shape): k = 1 for sampled and empirical, the output dimension for exact.

        index: the batch's example ids (their sampled labels depend on them only); default consecutive ids.
        """
        f = outputs.detach()
        if self.fisher == "empirical":
            return self.true_gradient(f, targets)[None]
        if self.fisher == "exact":
            return self._hessian_root(f, targets)
        with torch.no_grad():
            shape = (-1,) + (1,) * (f.dim() - 1)
            if self.declared is not None:
                declared = self.declared
                positions = declared.targets(targets) if declared.targets is not None else targets
                scale = (declared.weights(targets).to(torch.float64) if declared.weights is not None
                         else torch.ones(f.shape[0], dtype=torch.float64))
                u = self._categorical_sample(f, positions, index)
                return (u * scale.sqrt().to(f.dtype).to(f.device).reshape(shape))[None]
            ref = _reference(self.family, self.class_dim, f, targets).to(torch.float64)
            value = self.loss(f, targets).reshape(-1).to(torch.float64)
            scale = torch.where(ref > 1e-12, value / ref.clamp_min(1e-12), torch.zeros_like(ref)).clamp_min(0)
            if self.family == "categorical":
                u = self._categorical_sample(f, targets, index)
                return (u * scale.sqrt().to(f.dtype).reshape(shape))[None]
            batch = f.shape[0]
            size = f[0].numel() if batch else 0
            uniforms = self._uniforms(index, batch, 2 * size, _STREAM_GAUSSIAN)  # Box-Muller
            noise = (-2.0 * uniforms[:, :size].log()).sqrt() * torch.cos(2.0 * torch.pi * uniforms[:, size:])
            noise = noise.reshape(f.shape).to(f.dtype).to(f.device)
            return (noise * (2 * scale).sqrt().to(f.dtype).reshape(shape))[None]

    def _categorical_sample(self, f: torch.Tensor, targets: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(f) − onehot(ŷ), ŷ ~ softmax(f), zero where the target is ignored.

        Computed (in float64) on the labelled positions only: a masked-LM batch labels 15% of them, and each
        costs a vocabulary-sized row of probabilities and their cumulative sum (30,522 classes for BERT)."""
        logits = f if self.class_dim == -1 else f.movedim(1, -1)
        classes, batch = logits.shape[-1], f.shape[0]
        rows = logits.reshape(-1, classes)
        positions = rows.shape[0] // batch if batch else 0
        uniform = self._uniforms(index, batch, positions, _STREAM_CATEGORICAL).reshape(-1).to(rows.device)
        keep = (targets.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
        probs = torch.softmax(rows[keep].to(torch.float64), dim=-1)
        sampled = (probs.cumsum(-1) < uniform[keep, None]).sum(-1).clamp_max(classes - 1)
        probs[torch.arange(keep.numel(), device=rows.device), sampled] -= 1.0
        u = torch.zeros_like(rows)
        u[keep] = probs.to(f.dtype)
        u = u.reshape(logits.shape)
        return u if self.class_dim == -1 else u.movedim(-1, 1)

    def true_gradient(self, f: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """∇_f ℓ(f, y) with the true labels (the empirical Fisher's u). For a categorical loss, declared or detected by
        ``fisher="sampled"`` (ℓ_i = c_i Σ_t CE(f_it, y_it)): c_i (softmax(f_it) − onehot(y_it)) on the labelled
        positions, 0 elsewhere, in float64 on those positions only — a masked-LM batch labels 15% of them, where
        autograd through the loss would take the log-softmax of every position's vocabulary-sized row; c_i is the
        declared weight, or read off the loss as the sampled labels' scale is. Else autograd through the loss."""
        f = f.detach()
        if self.declared is not None:
            declared = self.declared
            labels = declared.targets(targets) if declared.targets is not None else targets
            scale = (declared.weights(targets).to(torch.float64) if declared.weights is not None
                     else torch.ones(f.shape[0], dtype=torch.float64))
            return self._categorical_gradient(f, labels, scale, declared.class_dim)
        if self.family == "categorical":
            with torch.no_grad():
                ref = _reference(self.family, self.class_dim, f, targets).to(torch.float64)
                value = self.loss(f, targets).reshape(-1).to(torch.float64)
            scale = torch.where(ref > 1e-12, value / ref.clamp_min(1e-12), torch.zeros_like(ref)).clamp_min(0)
            return self._categorical_gradient(f, targets, scale, self.class_dim)
        return self._loss_gradient(f, targets)

    @staticmethod
    def _categorical_gradient(f: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, class_dim: int) -> torch.Tensor:
        """c_i (softmax(f_it) − onehot(y_it)) where y_it ≠ −100, else 0 (classes on ``class_dim``, c = ``scale``)."""
        logits = f if class_dim == -1 else f.movedim(class_dim, -1)
        classes, batch = logits.shape[-1], f.shape[0]
        rows = logits.reshape(-1, classes)
        labels = labels.reshape(-1).to(rows.device)
        keep = (labels != IGNORE_INDEX).nonzero().squeeze(1)
        probs = torch.softmax(rows[keep].to(torch.float64), dim=-1)
        probs[torch.arange(keep.numel(), device=rows.device), labels[keep]] -= 1.0
        per_row = scale.to(rows.device).repeat_interleave(rows.shape[0] // batch if batch else 0)
        u = torch.zeros_like(rows)
        u[keep] = (probs * per_row[keep, None]).to(f.dtype)
        u = u.reshape(logits.shape)
        return u if class_dim == -1 else u.movedim(-1, class_dim)

    def _loss_gradient(self, f: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            leaf = f.clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(self.loss(leaf, targets).sum(), leaf, allow_unused=True)
        return torch.zeros_like(f) if grad is None else grad.detach()

    def _hessian_root(self, f: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Columns of H_i^{1/2}, H_i = ∇²_f ℓ(f_i, y_i): (D, B, *shape) with D = outputs per example."""
        batch, size = f.shape[0], f[0].numel()
        with torch.enable_grad():
            leaf = f.clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(self.loss(leaf, targets).sum(), leaf, create_graph=True)
            flat = grad.reshape(batch, size)
            rows = []
            for d in range(size):  # row d of every example's Hessian (the loss is separable over examples)
                if not flat.requires_grad:
                    rows.append(torch.zeros(batch, size, dtype=f.dtype, device=f.device))
                    continue
                (row,) = torch.autograd.grad(flat[:, d].sum(), leaf, retain_graph=True, allow_unused=True)
                rows.append(torch.zeros(batch, size, dtype=f.dtype, device=f.device) if row is None else row.reshape(batch, size))
        hessian = torch.stack(rows, dim=1).to(torch.float64)  # (B, D, D)
        hessian = 0.5 * (hessian + hessian.transpose(1, 2))
        evals, evecs = torch.linalg.eigh(hessian)
        root = evecs * evals.clamp_min(0).sqrt().unsqueeze(1)  # (B, D, D): columns are the u_j
        return root.permute(2, 0, 1).reshape(size, *f.shape).to(f.dtype)
