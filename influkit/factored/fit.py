"""The fit of a factored curvature: K-FAC, EK-FAC and diagonal approximations of a stage's curvature.

For the stage objective L(θ) = (1/n) Σ_i ℓ_i(θ) + R(θ) [+ extra(θ)], :func:`fit_curvature` returns
C ≈ GGN + ∇²R block-diagonal over layers, each block of a layer with block matrix M (see :mod:`.layers`):

- K-FAC (Martens & Grosse 2015; Grosse & Martens 2016 for convolutions):
  C_M = G ⊗ A with A = (1/#tokens) Σ_{i,t} ā_it ā_itᵀ and G = (1/n) Σ_{i,t,j} g_itj g_itjᵀ (g: back-propagated
  pseudo output-gradients, :mod:`.fisher`); in row-major vec(M) order the block is ``kron(G, A)``
  (an embedding's block, M = W of shape vocabulary × dim, is ``kron(diag(A), G)``).
- EK-FAC (George et al. 2018): the same eigenbasis Q_G ⊗ Q_A with the eigenvalues replaced by the second moments
  of the per-example gradients in it, Λ = (1/n) Σ_{i,j} (Q_Gᵀ ∇_M ℓ_ij Q_A)² — exact where the Gauss-Newton
  block is diagonal in that basis (one linear layer with squared error).
- diagonal: diag(GGN) = (1/n) Σ_{i,j} (∇_θ ℓ_ij)², every parameter its own block.

Parameters outside supported layers get the diagonal block whatever the kind (``info["diagonal"]`` says why).
The Hessian of R + extra enters as its diagonal, probed with one Rademacher vector (exact for any separable
R, e.g. L2 and the Case 2 proximal term), averaged over each Kronecker block. One streamed pass over the data
(module hooks on the layers' forward inputs, autograd for their output-gradients) gives every statistic: each
batch's products run in the model's dtype and are accumulated across batches in the model's dtype, at least
float32 (a float64 model: float64; a float32 model: float32, as kronfluence does — half the accumulator memory); eigendecompositions are float64, and the eigenbases and eigenvalues are then stored in the parameters' dtype (a float32 model's in
float32: half the memory; widened layer by layer when applied), each layer's covariances freed once decomposed;
EK-FAC's Λ comes from the same pass's inputs and gradients, kept while they fit ``cache_bytes`` (else from a
second pass with the same sampled labels).

Under ``torch.distributed`` each rank streams its contiguous shard of the examples (:func:`influkit.distributed.shard`)
and the sums (covariances, token counts, squares; EK-FAC's corrections after the eigenbasis of the all-reduced
covariances) are all-reduced, so every rank holds the same factors, equal to one process's up to summation
order; sampled labels depend on (seed, example index) only (:mod:`.fisher`).

The fit is a :class:`FactorFit` run through its passes — the statistics pass, the eigendecomposition, EK-FAC's
eigenvalue-correction pass — in the order the kind's registered class (``Diagonal``, ``KFAC``, ``EKFAC`` in
:mod:`.kinds`) gives; :func:`fit_curvature` is the one-call form, returning the
:class:`~influkit.factored.operator.FactoredCurvature` (:mod:`.operator`) of the blocks (:mod:`.blocks`).
:func:`objective_gradient` runs the statistics pass without its statistics: the objective's gradient alone, for the
stationarity check.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch.func import grad

from .. import distributed
from ..curvature import penalty_gradient
from ..errors import InputError, warn
from ..layers import Dense, Embedding, Layer, Recorder, plan
from ..memory import DEFAULT_WORKING, PROBE_EXAMPLES, fit_count, probe_bytes
from ..memory import given as memory_given
from ..memory import resolve as memory_budget
from ..params import ParamSpace, point
from ..progress import steps as progress_steps
from ..stage import Stage
from ..vectorize import vmap_or_loop
from .approximations import APPROXIMATIONS
from .blocks import DiagonalBlock, KroneckerBlock, layer_index
from .fisher import FISHER, PseudoGradients
from .gradient import GradientSums, ObjectiveGradient
from .head import HeadRecorder, find_head
from .head import backward as head_backward
from .layers import plan_layers
from .operator import FactoredCurvature
from .regularizer import regularizer_diagonal

KINDS = ("kfac", "ekfac", "diagonal")
CACHE_BYTES = 2**30  # at most this much of the first pass is kept for EK-FAC's correction (else a second pass)
# a batch also holds output-sized tensors the saved-tensor probe does not see: the outputs, their pseudo-gradients
# and the loss's log-probabilities for the sampled labels' scale (vocabulary-sized for a language model)
OUTPUT_COPIES = 4


class _Accumulator:
    """Running sums of one layer in ``dtype``: Σ ā āᵀ (embedding: token counts), Σ g gᵀ, and Σ squares (diag / EK-FAC)."""

    def __init__(self, layer: Layer, device, diagonal: bool = False, dtype: torch.dtype = torch.float64):
        self.layer = layer
        in_dim, out_dim = (0, 0) if diagonal else layer.factor_dims()  # a diagonal block keeps only the squares
        self.inputs = torch.zeros(in_dim, dtype=dtype, device=device) if layer.one_hot \
            else torch.zeros(in_dim, in_dim, dtype=dtype, device=device)
        self.grads = torch.zeros(out_dim, out_dim, dtype=dtype, device=device)
        self.squares = torch.zeros(*layer.shape, dtype=dtype, device=device)
        self.tokens = 0

    def release_covariances(self) -> None:
        """Drop the covariance sums once their eigendecomposition is taken (an embedding's token counts stay)."""
        if not self.layer.one_hot:
            self.inputs = self.inputs.new_zeros(0, 0)
        self.grads = self.grads.new_zeros(0, 0)

    def covariances(self, a: torch.Tensor, g: torch.Tensor) -> None:
        """Add one batch: Σ ā āᵀ (embedding: token counts) and Σ g gᵀ (:meth:`influkit.layers.Dense.add_covariances`)."""
        self.tokens += self.layer.add_covariances(self.inputs, self.grads, a, g)


def factor_bytes(layer: Layer) -> int:
    """Bytes of a layer's float64 factors and their eigenvectors: 2 · 8 · (in² + out²) (embedding: in, not in²)."""
    a, g = layer.factor_dims()
    return 16 * ((a if layer.one_hot else a * a) + g * g)


def _forward_pass(stage, layers, leaves, x, y, pseudo_factory, truth=None, summed=(), heads=(), true_only=()):
    """One hooked forward and the backward passes of the pseudo output-gradients: ({layer: (a, g)}, U, dead layers,
    the true-label backward). truth: the true-label output-gradients' maker (:class:`.fisher.PseudoGradients` on the
    empirical Fisher), back-propagated once more through the same graph when the pseudo-gradients are not them:
    then the last item is ({layer: g (B, T, out)}, its U (B, ...), its seconds, the batch gradients), else None.
    summed: names of ``leaves`` whose batch gradient Σ_i ∇ℓ_i (no per-example row) the true-label backward also gives
    — the last item's (None, None, 0, {name: gradient}) on the empirical Fisher, whose column 0 is that backward.
    heads: dense layers that may produce the model's output; where one does, the true-label backward (the last one
    of the pass) runs that layer's part on the output rows that carry a gradient only (:mod:`.head`).
    true_only: names of hooked layers whose output-gradients only the true-label backward needs: with ``truth``
    the pseudo backward passes skip them (their pooled g is None), so a vocabulary-wide decoder's is not copied."""
    with Recorder(layers, x.shape[0]) as rec, HeadRecorder(heads) as head_rec, torch.enable_grad():
        outputs = stage.outputs(leaves, x)
    pseudo = pseudo_factory(outputs, y)
    u = pseudo(outputs, y)
    dead = rec.misfits()
    live = [layer for layer in layers if layer.name not in dead]
    handles = [(layer, inp, out) for layer in live for inp, out in rec.calls[layer.name]]
    wanted = [leaves[name] for name in summed]
    head = find_head(head_rec, outputs, leaves) if heads else None
    per_call = [[] for _ in handles]
    pseudo = [c for c, (layer, _, _) in enumerate(handles) if truth is None or layer.name not in true_only]
    batch = {}
    if pseudo or (wanted and truth is None):
        for j in range(u.shape[0]):
            last = j == u.shape[0] - 1 and truth is None
            extra = summed if j == 0 and truth is None else []
            grads = _backward(outputs, u[j], [handles[c][2] for c in pseudo], extra, leaves, head if last else None,
                              retain=not last)
            for c, g in zip(pseudo, grads):
                per_call[c].append(handles[c][0].grads(torch.zeros_like(handles[c][2]) if g is None else g))
            batch |= _leaf_grads(summed, wanted, grads[len(pseudo):])
    true_grads = (None, None, 0.0, batch) if summed and truth is None else None
    if truth is not None:
        start = time.perf_counter()
        true_u = truth(outputs, y)[0]
        grads = _backward(outputs, true_u, [h[2] for h in handles], summed, leaves, head,
                          retain=False) if handles or wanted else ()
        true_calls = [[layer.grads(torch.zeros_like(out) if g is None else g)] for (layer, _, out), g in zip(handles, grads)]
        true_grads = (_pool(live, handles, true_calls, 1), true_u, time.perf_counter() - start,
                      _leaf_grads(summed, wanted, grads[len(handles):]))
    return _pool(live, handles, per_call, 0), u, dead, true_grads


def _backward(outputs, u, targets, names, leaves, head, *, retain: bool) -> list:
    """The gradients of ⟨outputs, u⟩ with respect to ``targets`` and the ``leaves`` named ``names``: through the
    output layer's nonzero rows only where ``head`` is found (:func:`.head.backward`), else plain autograd."""
    if head is not None:
        return head_backward(outputs, u, targets, head, names, leaves)
    return list(torch.autograd.grad(outputs, list(targets) + [leaves[name] for name in names], grad_outputs=u,
                                    retain_graph=retain, allow_unused=True))


def _leaf_grads(names, leaves, grads) -> dict:
    """{name: the leaf's gradient} (zeros where autograd found no path)."""
    return {name: torch.zeros_like(leaf) if g is None else g for name, leaf, g in zip(names, leaves, grads)}


def _pool(live, handles, per_call, true: int) -> dict:
    """{layer: (a, g)} (``true`` 0: g (k, B, T, out), every pseudo-gradient column) or {layer: g (B, T, out)} (1: the
    one true-label column); a layer called several times in one forward has its tokens pooled."""
    data = {}
    for layer in live:
        a_parts, g_parts = [], []
        for c, (owner, inp, _) in enumerate(handles):
            if owner is layer:
                a_parts.append(layer.inputs(inp))
                g_parts.append(None if not per_call[c] else per_call[c][0] if true else torch.stack(per_call[c]))
        a = a_parts[0] if len(a_parts) == 1 else torch.cat(a_parts, dim=1)
        g = g_parts[0] if len(g_parts) == 1 or None in g_parts else torch.cat(g_parts, dim=2 - true)
        data[layer.name] = g if true else (a, g)
    return data


def _diagonal_rows(stage: Stage, names, params, x, u) -> torch.Tensor:
    """(B, p_names) the per-example gradients ∂⟨f(x_i), u_i⟩/∂θ over the parameters ``names`` (vmap), for one
    pseudo-gradient column u (B, ...)."""
    sub = {n: params[n] for n in names}

    def dot(p, xi, ui):
        return (stage.outputs(p, xi.unsqueeze(0)) * ui.unsqueeze(0)).sum()

    return ParamSpace(sub).flatten(vmap_or_loop(grad(dot), (None, 0, 0), stage, sub, x, u), batched=True).T


def _diagonal_squares(stage: Stage, names, params, x, u, first: torch.Tensor | None = None) -> torch.Tensor:
    """(p_names,) Σ_{i,j} (∂⟨f(x_i), u_ij⟩/∂θ)² over the parameters ``names``; ``first``: column 0's rows, formed."""
    total = torch.zeros(sum(params[n].numel() for n in names), dtype=torch.float64, device=params[names[0]].device)
    for j in range(u.shape[0]):
        rows = first if j == 0 and first is not None else _diagonal_rows(stage, names, params, x, u[j])
        total += (rows.to(torch.float64) ** 2).sum(0)
    return total


@dataclass(frozen=True, eq=False)
class FitSettings:
    """How one factored fit runs: the settings of :func:`fit_curvature` beside the stage and its parameter names
    (documented there), and ``kronecker``, whether the approximation has Kronecker factors (else no layer is too
    wide for them)."""

    kind: str = "ekfac"
    fisher: str = "sampled"
    indices: torch.Tensor | None = None
    extra: Callable | None = None
    at: dict | None = None
    seed: int = 0
    batch_size: int | None = None
    cache_bytes: int | None = None
    memory: int | None = None
    max_factor_bytes: int | None = None
    progress: bool = False
    kronecker: bool = True
    basis: FactoredCurvature | None = None
    gradient: bool = False
    statistics: bool = True  # False: the pass measures the objective's gradient only (:func:`objective_gradient`)


def objective_gradient(stage: Stage, names: Sequence[str] | None = None, *, extra=None, indices=None, at=None,
                       memory: int | None = None, progress: bool = False) -> ObjectiveGradient:
    """‖∇L‖ and g = ((1/n) Σ_i ‖∇ℓ_i‖²)^½ over every example (``indices``, default all) in one streamed pass: a
    factored fit's statistics pass without its statistics (no covariance, no square, no eigendecomposition). Each
    registered layer's batch gradient and per-example squared norms come from its recorded inputs and true-label
    output-gradients (:meth:`influkit.layers.Layer.example_norms`: no per-example gradient row; a decoder tied to the
    word embeddings from both layers', :func:`tied_pairs`), the other parameters' batch gradient from the same
    backward (their per-example norms left out: ``unmeasured``); ∇L adds
    ∇(R + extra). Raises
    :class:`~influkit.factored.fisher.FactoredCurvatureError` for a loss whose output-gradients it cannot form."""
    fit = FactorFit(stage, names, FitSettings(fisher="empirical", indices=indices, extra=extra, at=at, memory=memory,
                                              progress=progress, gradient=True, statistics=False))
    return fit.gradient_pass()


def fit_curvature(
    stage: Stage,
    names: Sequence[str] | None = None,
    *,
    kind: str = "ekfac",
    fisher: str = "sampled",
    indices: torch.Tensor | None = None,
    extra=None,
    at=None,
    seed: int = 0,
    batch_size: int | None = None,
    cache_bytes: int | None = None,
    memory: int | None = None,
    max_factor_bytes: int | None = None,
    basis: FactoredCurvature | None = None,
    gradient: bool = False,
    progress: bool = False,
) -> FactoredCurvature:
    """The factored curvature C of ``stage``'s objective over ``names`` (default: its trained parameters).

    kind: "kfac", "ekfac" or "diagonal" (module docstring; each a registered class running its passes on a
    :class:`FactorFit`). fisher: "sampled" (default), "empirical" or "exact"
    (:mod:`influkit.factored.fisher`). indices: the examples the objective averages over (default: all; the
    Hessian's ``hessian_samples`` subset). extra: an additional term of the objective (the Case 2 proximal term),
    whose curvature is added like R's. seed: of the sampled labels (the same labels in both EK-FAC passes).
    memory: the budget in bytes (default: a share of what is free, :func:`influkit.memory.resolve`);
    the statistics are streamed per module, so memory does not grow with the number of examples:
    the accumulators (fixed) + a batch of activations and layer statistics (measured per example on a 2-example
    probe) + the cache. batch_size: examples per streamed batch (default: what half of the budget left after the
    accumulators holds, at most the stage's batch size and 1,024, and without ``memory=`` at most
    :func:`influkit.memory.default_count`). cache_bytes: EK-FAC keeps the first pass's
    layer inputs and output-gradients up to this size and corrects the eigenvalues from them, so the data are read
    once; larger data are streamed a second time (``info["passes"]``); default: the other half, at most
    :data:`CACHE_BYTES` (1 GiB), or without ``memory=`` :data:`influkit.memory.DEFAULT_WORKING` (256 MiB).
    max_factor_bytes: a layer whose factors (:func:`factor_bytes`, float64 plus eigenvectors) exceed this
    (default: budget / 8) gets a **diagonal block** instead of Kronecker factors, with a warning — e.g. a
    30,522-word decoder's output-gradient factor alone is 30,522² floats (7.5 GB in float64); its diagonal
    Gauss-Newton comes from the same hooks (Σ_i (Σ_t g_it a_itᵀ)², :meth:`influkit.layers.Dense.example_squares`), memory
    O(rows · cols). ``info["memory"]`` records the sizes chosen.
    basis: an EK-FAC curvature fitted earlier over the same parameters (kind "ekfac" only): its Kronecker
    eigenbases are kept and only the eigenvalues Λ (and the diagonal blocks) are re-estimated at ``at`` — one
    streamed pass, no covariances and no eigendecompositions (SOURCE's segments sharing one eigenbasis).
    gradient: the first pass also measures the objective's gradient with the true labels, ``curvature.gradient``
    (:class:`ObjectiveGradient`: ‖∇L‖ and the RMS per-example gradient norm over the fit's examples) — what
    :mod:`influkit.stationarity` needs of the data —, adding no per-example backward pass of its own: a parameter
    whose per-example gradient no layer hook gives (:func:`unhooked_parameters`) adds its batch gradient from the
    true-label backward, and its per-example norms are left to the check (``ObjectiveGradient.unmeasured``) unless
    the fit forms its rows anyway (``fisher="empirical"``).
    """
    if kind not in KINDS:
        raise InputError(f"unknown factored curvature {kind!r}; choose one of {KINDS}.")
    if fisher not in FISHER:
        raise InputError(f"unknown fisher {fisher!r}; choose one of {FISHER}.")
    approximation = APPROXIMATIONS[kind]
    if basis is not None and (kind != "ekfac" or basis.kind != "ekfac"):
        raise InputError(f"a kept eigenbasis (basis=) re-estimates EK-FAC eigenvalues: kind and the basis must be "
                         f"'ekfac', got kind={kind!r} and a {basis.kind!r} basis.")
    fit = FactorFit(stage, names, FitSettings(
        kind=kind, fisher=fisher, indices=indices, extra=extra, at=at, seed=seed, batch_size=batch_size,
        cache_bytes=cache_bytes, memory=memory, max_factor_bytes=max_factor_bytes, progress=progress,
        kronecker=approximation.kronecker, basis=basis, gradient=gradient))
    if basis is not None:
        return fit.assemble(fit.kept_eigenbasis(), fit.eigenvalues_in_kept_basis())
    return approximation.passes(fit)


class FactorFit:
    """The state one factored fit carries through its passes: the parameters and the layers that get Kronecker
    factors (``tracked``; the rest get diagonal blocks, ``diag_names``), this rank's examples, the sizes chosen
    from the memory budget, each layer's running sums (:class:`_Accumulator`) and the diagonal-block squares.

    The passes — :meth:`statistics_pass` (covariances or squares, one streamed pass), :meth:`eigendecomposition`,
    :meth:`correction_pass` (EK-FAC's eigenvalues in that basis) — and :meth:`assemble` (the blocks) are run in
    order by each registered approximation's ``passes``. Settings (:class:`FitSettings`): those of
    :func:`fit_curvature`, and ``kronecker``: whether the approximation has Kronecker factors (else no layer is too
    wide for them); ``basis``: a fitted EK-FAC curvature whose eigenbases are kept (then no covariance is accumulated: its Kronecker layers get
    Λ from :meth:`eigenvalues_in_kept_basis`, its other layers diagonal blocks); ``gradient``: the statistics pass
    also sums the true-label per-example gradients (:class:`ObjectiveGradient`).
    """

    def __init__(self, stage: Stage, names: Sequence[str] | None, settings: "FitSettings"):
        self.start = time.perf_counter()
        kind, fisher, indices, extra, at, seed = (settings.kind, settings.fisher, settings.indices, settings.extra,
                                                  settings.at, settings.seed)
        batch_size, cache_bytes, memory, basis = settings.batch_size, settings.cache_bytes, settings.memory, settings.basis
        max_factor_bytes, gradient, kronecker = settings.max_factor_bytes, settings.gradient, settings.kronecker
        self.stage, self.kind, self.fisher, self.extra, self.at, self.seed = stage, kind, fisher, extra, at, seed
        self.names = list(stage.param_names if names is None else names)
        self.params = point(stage.state(), self.names, at)
        self.space = ParamSpace(self.params)
        layers, self.reasons = plan_layers(stage.model, self.names)
        self.n = len(stage) if indices is None else len(indices)
        self.local = distributed.shard(torch.arange(len(stage)) if indices is None else torch.as_tensor(indices).reshape(-1))
        budget = memory_budget(memory, self.space.device)
        limit = budget // 8 if max_factor_bytes is None else max_factor_bytes
        self.basis = basis
        if not settings.statistics:
            self.wide = set()  # no factor is formed: no layer is too wide
        elif basis is not None:
            if basis.space.names != self.space.names:
                raise InputError("the kept eigenbasis (basis=) was fitted over other parameters; fit it over these names.")
            kept = {b.layer for b in basis.blocks if isinstance(b, KroneckerBlock)}
            self.wide = {layer.name for layer in layers if layer.name not in kept}
        else:
            self.wide = {layer.name for layer in layers if kronecker and factor_bytes(layer) > limit}
        for layer in layers if basis is None else ():
            if layer.name in self.wide:
                warn(
                    f"layer {layer.name} ({layer.shape[0]}×{layer.shape[1]}) would need {factor_bytes(layer) / 2**30:.2f} GiB of "
                    f"Kronecker factors, more than max_factor_bytes = {limit / 2**30:.2f} GiB (1/8 of the memory budget); "
                    "it gets a diagonal Gauss-Newton block instead (raise memory= or max_factor_bytes= to factor it).")
        self.leaves = {nm: t.detach().requires_grad_(True) for nm, t in self.params.items()}
        self.tracked = list(layers)  # layers whose hooks give a and g (also used for the diagonal kind's squares)
        accumulate = torch.promote_types(self.space.dtype, torch.float32)  # float64 models: float64; float32: float32
        self.accumulators = {layer.name: _Accumulator(layer, self.space.device, layer.name in self.wide or basis is not None,
                                                      accumulate)
                             for layer in (self.tracked if settings.statistics else ())}
        self.diag_names: list[str] = [nm for nm in self.names if nm in self.reasons]
        # the sums; each layer's eigenbases replace its covariances, so they add at most one layer's
        fixed = sum(t.numel() * t.element_size() for acc in self.accumulators.values() for t in (acc.inputs, acc.grads, acc.squares))
        self.sizing = {"phase": "factor fitting", "budget": budget, "fixed_bytes": fixed, "diagonal_layers": sorted(self.wide)}
        self.statistics_bytes = 0  # per example, the layer statistics one batch keeps (set by the probe)
        self.sums = GradientSums() if gradient else None  # the true-label gradients, summed in the first pass
        self.pseudo: PseudoGradients | None = None  # the pass's pseudo-gradients' maker (made on its first batch)
        self.heads = [layer for layer in plan(stage.model, self.names)[0]] if gradient else []  # :mod:`.head`
        # a LayerNorm's per-example gradients from its hooks where the pass forms no rows of its own for the squares
        hooks = gradient and (fisher != "empirical" or not settings.statistics)  # the pass forms no rows of its own
        self.measured = self._measured_layers() if hooks else []
        # a decoder tied to the word embeddings: its per-example norms from both layers' hooks (:func:`tied_pairs`)
        self.tied = tied_pairs(stage.model, self.diag_names) if hooks else []
        if batch_size is None:
            per = self._probe_bytes()
            share = (budget - fixed) // 2 if cache_bytes is None else budget - fixed
            batch_size = fit_count(share + fixed, per, "factor fitting", fixed=fixed, most=min(stage.data.batch_size, 1024),
                                   default=not memory_given(memory))
            self.sizing["bytes_per_example"] = per
        if cache_bytes is None:
            cache_bytes = min(max(0, (budget - fixed) // 2), CACHE_BYTES if memory_given(memory) else DEFAULT_WORKING)
            if "bytes_per_example" in self.sizing and self.statistics_bytes * len(self.local) > cache_bytes:
                cache_bytes = 0  # the first pass would not fit: a second pass, without filling memory first
        self.batch_size, self.cache_bytes = int(batch_size), int(cache_bytes)
        self.sizing |= {"batch": self.batch_size, "cache_bytes": self.cache_bytes}
        self.progress = settings.progress and distributed.rank() == 0
        self.diag_total: torch.Tensor | None = None  # Σ squared per-example gradients of the diagonal-block parameters
        self.cache: list | None = None  # the first pass's (a, g) per batch, for EK-FAC's correction
        self.dead: dict[str, str] = {}
        self.objective: ObjectiveGradient | None = None
        self.passes = 0
        self.seconds: dict[str, float] = {}

    def _probe_bytes(self) -> int:
        """Measured bytes per example of one streamed batch (activations and layer statistics, and with a measured
        objective gradient under non-empirical labels the true-label backward's output-gradients) + diagonal rows."""
        stage, params = self.stage, self.params
        local = self.local
        probe = torch.as_tensor(local[:PROBE_EXAMPLES]) if len(local) else torch.arange(min(PROBE_EXAMPLES, len(stage)))
        px, py = next(iter(stage.batches(probe, len(probe))))
        outputs = stage.outputs(params, px).detach()
        pseudo = PseudoGradients(stage.loss, self.fisher, outputs, py, seed=self.seed)
        truth = self._true_labels if self.sums is not None and self.fisher != "empirical" else None

        def run(_):
            data, _, _, true = _forward_pass(stage, self._hooked_layers(self.sums is not None), self.leaves, px, py,
                                             lambda outputs, targets: partial(pseudo, index=probe), truth,
                                             true_only=self._tied_layer_names())
            tracked = {layer.name for layer in self.tracked}
            kept = [t for name, pair in data.items() if name in tracked for t in pair]  # what the cache keeps
            self.statistics_bytes = sum(t.numel() * t.element_size() for t in kept) // max(len(probe), 1)
            measured = [t for name, pair in data.items() if name not in tracked for t in pair if t is not None]
            return kept + measured + ([] if true is None else list(true[0].values()))

        rows = 2 * sum(params[nm].numel() * params[nm].element_size() for nm in self.diag_names)
        output_bytes = OUTPUT_COPIES * outputs.numel() * outputs.element_size() // max(len(probe), 1)
        return probe_bytes(run, stage.model, len(probe)) + rows + output_bytes

    def _drop(self, name: str, why: str) -> None:
        """Layer ``name`` cannot be factored (found on the first batch): its parameters get a diagonal block."""
        layer = next(item for item in self.tracked if item.name == name)
        self.tracked.remove(layer)
        self.accumulators.pop(name, None)
        self.dead[name] = why
        for pname in (layer.weight, layer.bias):
            if pname is not None:
                self.reasons[pname] = why
        self.diag_names = [nm for nm in self.names if nm in self.reasons]

    def _labels(self, outputs, targets):
        """The pseudo output-gradients' sampler, made once per pass from its first batch (same seed: same labels)."""
        if self.pseudo is None:
            self.pseudo = PseudoGradients(self.stage.loss, self.fisher, outputs, targets, seed=self.seed)
        return self.pseudo

    def _measured_layers(self) -> list[Layer]:
        """The registered layers that own diagonal-block parameters alone, hooked in the first pass too, so that
        their true-label per-example gradients come from their recorded inputs and output-gradients, not from
        per-example backward passes (the diagonal block's own squares, of the pseudo-gradients, are formed as
        before): :func:`measured_layers`."""
        return measured_layers(self.stage.model, self.diag_names)

    def _true_labels(self, outputs, targets):
        """(1, *outputs.shape) the true-label output-gradients, from the pass's pseudo-gradients' maker
        (:meth:`.fisher.PseudoGradients.true_gradient`: a categorical loss's in closed form)."""
        return self._labels(outputs, targets).true_gradient(outputs, targets)[None]

    def stream(self, label: str, consume, *, diagonal: bool, keep: bool = False, sums: "GradientSums | None" = None) -> None:
        """One pass over this rank's examples: ``consume(layer, a, g)`` for each tracked layer and batch; with
        ``diagonal`` the diagonal-block parameters' squared per-example gradients are summed too, with ``keep``
        the batches' (a, g) are cached while they fit ``cache_bytes``, and with ``sums`` the true-label per-example
        gradients are added to them (from the pass's own backward on the empirical Fisher, else one more backward)."""
        self.pseudo, self.passes = None, self.passes + 1
        empirical = self.fisher == "empirical"
        truth = None if sums is None or empirical else self._true_labels
        cached = 0
        batches = -(-len(self.local) // self.batch_size)
        for start in progress_steps(range(0, len(self.local), self.batch_size), label, self.progress, batches):
            index = self.local[start : start + self.batch_size]
            x, y = next(iter(self.stage.batches(index, self.batch_size)))
            labelled = lambda outputs, targets: partial(self._labels(outputs, targets), index=index)  # noqa: E731
            rowless = sums is not None and not (empirical and diagonal)  # no per-example rows of the diagonal blocks
            summed = self.diag_names if rowless else []  # (a measured layer found unusable on this batch among them)
            data, u, dead, true = _forward_pass(self.stage, self._hooked_layers(sums is not None), self.leaves, x, y,
                                                labelled, truth, summed, heads=self.heads if rowless else (),
                                                true_only=self._tied_layer_names())
            for name, why in dead.items():  # found on the first batch: these layers fall back to diagonal blocks
                if any(layer.name == name for layer in self.measured):  # its gradients by per-example passes
                    self.measured = [layer for layer in self.measured if layer.name != name]
                    continue
                if name in self._tied_layer_names():  # the pair's norms from the check's sample instead
                    self.tied = [pair for pair in self.tied if name not in (pair[0].name, pair[1].name)]
                    continue
                if self.diag_total is not None:
                    raise InputError(f"layer {name} stopped being usable after the first batch ({why}).")
                self._drop(name, why)
            for layer in self.tracked:
                consume(layer, *data[layer.name])
            first = None  # column 0's diagonal-block rows, formed for the squares and the sums (empirical Fisher)
            if sums is not None:
                if empirical and diagonal and self.diag_names:  # the fit's own work: not counted in the sums' seconds
                    first = _diagonal_rows(self.stage, self.diag_names, self.params, x, u[0].detach())
                start_sums = time.perf_counter()
                true_g = {name: g[0] for name, (_, g) in data.items()} if empirical else true[0]
                for layer in self.tracked + self.measured:
                    sums.add_layer(layer, data[layer.name][0], true_g[layer.name])
                for embedding, decoder in self.tied:
                    sums.add_tied(embedding, data[embedding.name][0], true_g[embedding.name], decoder,
                                  data[decoder.name][0], true_g[decoder.name])
                rest = [nm for nm in self.diag_names if nm not in self._hooked_names()]
                if rest and first is not None:
                    sums.add(rest, first.split([self.params[nm].numel() for nm in rest], dim=1))
                elif rest:  # their batch gradient alone; the per-example norms of any not tied are the check's sample's
                    sums.add_summed({nm: true[3][nm] for nm in rest},
                                    normed={nm for pair in self.tied for nm in pair[1].params})
                sums.seconds += time.perf_counter() - start_sums + (0.0 if empirical else true[2])
            if diagonal and self.diag_names:
                part = _diagonal_squares(self.stage, self.diag_names, self.params, x, u.detach(),
                                         first if empirical else None)
                self.diag_total = part if self.diag_total is None else self.diag_total + part
            if keep and self.cache is not None:
                factored = {layer.name for layer in self.tracked} - self.wide
                data = {name: pair for name, pair in data.items() if name in factored}
                cached += sum(t.numel() * t.element_size() for pair in data.values() for t in pair)
                self.cache = self.cache + [data] if cached <= self.cache_bytes else None

    def _hooked_names(self) -> set[str]:
        """The diagonal-block parameters whose per-example gradients the measured layers' hooks give."""
        return {name for layer in self.measured for name in layer.params}

    def _hooked_layers(self, measuring: bool) -> list[Layer]:
        """The layers a pass hooks: the tracked ones and, when it measures the gradient, the measured and tied ones."""
        extra = self.measured + [layer for pair in self.tied for layer in pair] if measuring else []
        names = {layer.name for layer in self.tracked}
        return list(self.tracked) + [layer for layer in extra if layer.name not in names]

    def _tied_layer_names(self) -> set[str]:
        return {layer.name for pair in self.tied for layer in pair}

    def gradient_pass(self) -> ObjectiveGradient:
        """One streamed pass measuring the objective's gradient alone (:func:`objective_gradient`)."""
        sums = GradientSums()
        self.stream("the objective's gradient", lambda layer, a, g: None, diagonal=False, sums=sums)
        return self._objective_gradient(sums)

    def statistics_pass(self, *, squares: bool, keep: bool = False) -> None:
        """The first pass: each tracked layer's Kronecker covariances Σ ā āᵀ, Σ g gᵀ (or, with ``squares`` and for
        layers too wide to factor, its squared per-example gradients) and the diagonal-block squares, summed over
        the ranks. ``keep``: cache the batches for :meth:`correction_pass` (EK-FAC)."""
        start = time.perf_counter()
        self.cache = [] if keep and self.cache_bytes > 0 else None

        def statistics(layer, a, g):
            acc = self.accumulators[layer.name]
            if squares or layer.name in self.wide:
                acc.squares.add_(layer.example_squares(a, g))
            else:
                acc.covariances(a, g)

        self.stream("diagonal Fisher" if squares else "K-FAC covariances", statistics, diagonal=True, keep=keep,
                    sums=self.sums)
        self.detail = self.pseudo.describe() if self.pseudo is not None else None
        if distributed.active():
            self._all_reduce(squares)
        if self.sums is not None:
            self.objective = self._objective_gradient(self.sums)
            self.sums = None
        self.seconds["squares" if squares else "covariances"] = time.perf_counter() - start

    def _objective_gradient(self, sums: GradientSums) -> ObjectiveGradient:
        """‖∇L‖ and g from the summed true-label gradients (over the ranks), ∇L = (1/n) Σ_i ∇ℓ_i + ∇(R + extra)."""
        start = time.perf_counter()
        zero = lambda nm: torch.zeros(self.params[nm].numel(), dtype=torch.float64, device=self.space.device)  # noqa: E731
        total = torch.cat([sums.total.get(nm, zero(nm)).reshape(-1) for nm in self.space.names])
        squares = torch.tensor([sums.squares], dtype=torch.float64, device=self.space.device)
        distributed.all_reduce_(total)
        distributed.all_reduce_(squares)
        objective = total.div_(max(self.n, 1))
        penalty = penalty_gradient(self.stage, self.names, at=self.at, extra=self.extra)
        if penalty is not None:
            objective += ParamSpace(penalty).flatten(penalty).to(torch.float64)
        return ObjectiveGradient(norm=float(objective.norm()), typical=float(squares.div(max(self.n, 1)).sqrt()),
                                 examples=self.n, seconds=sums.seconds + time.perf_counter() - start,
                                 unmeasured=tuple(nm for nm in self.space.names if nm in sums.unmeasured))

    def _all_reduce(self, squares: bool) -> None:
        """Every rank's sums over its shard, added up; the same layers on every rank first."""
        shared = distributed.gather_objects((len(self.local) > 0, sorted(self.dead.items()), self.detail))
        everywhere = dict(item for _, dead, _ in shared for item in dead)
        if any(busy and dict(dead) != everywhere for busy, dead, _ in shared):
            raise InputError(f"the layers usable for Kronecker factors differ between ranks' data ({everywhere}).")
        for name, why in everywhere.items():
            if name not in self.dead:
                self._drop(name, why)
        self.detail = next((d for _, _, d in shared if d is not None), None)
        _all_reduce_sums(self.accumulators, self.tracked, squares=squares, wide=self.wide)
        if self.diag_names:
            if self.diag_total is None:
                size = sum(self.params[nm].numel() for nm in self.diag_names)
                self.diag_total = torch.zeros(size, dtype=torch.float64, device=self.space.device)
            distributed.all_reduce_(self.diag_total)

    def factored(self):
        """The tracked layers that get Kronecker blocks (not too wide to factor)."""
        return [layer for layer in self.tracked if layer.name not in self.wide]

    def eigendecomposition(self) -> dict[str, tuple]:
        """{layer: (A eigenvalues, A eigenvectors | None, G eigenvalues, G eigenvectors)} of the averaged
        covariances (float64; eigenvectors stored like the parameters), each layer's covariances freed once done."""
        start = time.perf_counter()
        eigen = {}
        for layer in self.factored():
            acc = self.accumulators[layer.name]
            g_cov = acc.grads.to(torch.float64) / self.n
            g_evals, g_evecs = torch.linalg.eigh(0.5 * (g_cov + g_cov.T))
            if layer.one_hot:
                a_evals, a_evecs = acc.inputs.to(torch.float64) / max(acc.tokens, 1), None
            else:
                a_cov = acc.inputs.to(torch.float64) / max(acc.tokens, 1)
                a_evals, a_evecs = torch.linalg.eigh(0.5 * (a_cov + a_cov.T))
            keep = self.space.dtype  # stored like the parameters (float32 model: half the bytes of float64)
            eigen[layer.name] = (a_evals.clamp_min(0), None if a_evecs is None else a_evecs.to(keep).contiguous(),
                                 g_evals.clamp_min(0), g_evecs.to(keep).contiguous())
            acc.release_covariances()  # peak: the covariances or the bases, not both
        self.seconds["eigendecomposition"] = time.perf_counter() - start
        return eigen

    def correction_pass(self, eigen: dict[str, tuple]) -> dict[str, torch.Tensor]:
        """EK-FAC's eigenvalues {layer: (rows, cols)} = (1/n) Σ_{i,j} (Q_Gᵀ ∇_M ℓ_ij Q_A)², from the cached first
        pass when it fit, else from a second streamed pass with the same sampled labels."""
        start = time.perf_counter()

        def correct(layer, a, g):
            if layer.name in self.wide:
                return
            _, a_evecs, _, g_evecs = eigen[layer.name]
            left, right = layer.oriented(a_evecs, g_evecs)
            self.accumulators[layer.name].squares.add_(layer.example_squares(a, g, left=left, right=right))

        if self.cache is not None:  # the first pass's inputs and output-gradients fit in memory: no second data pass
            for data in self.cache:
                for layer in self.factored():
                    correct(layer, *data[layer.name])
            self.cache = None
        else:
            self.stream("EK-FAC eigenvalue correction", correct, diagonal=False)
        values = {}
        for layer in self.factored():
            squares = self.accumulators[layer.name].squares
            distributed.all_reduce_(squares)
            values[layer.name] = squares.div_(self.n)
        self.seconds["eigenvalue_correction"] = time.perf_counter() - start
        return values

    def kept_eigenbasis(self) -> dict[str, tuple]:
        """{layer: (None, A eigenvectors | None, None, G eigenvectors)} of the ``basis`` curvature's Kronecker blocks."""
        eigen = {}
        for block in self.basis.blocks:
            if isinstance(block, KroneckerBlock):
                layer = next(item for item in self.tracked if item.name == block.layer)
                a_evecs, g_evecs = layer.oriented(block.left, block.right)  # (rows, cols) sides back to (A, G)
                eigen[block.layer] = (None, a_evecs, None, g_evecs)
        return eigen

    def eigenvalues_in_kept_basis(self) -> dict[str, torch.Tensor]:
        """EK-FAC's Λ {layer: (rows, cols)} = (1/n) Σ_{i,j} (Q_Gᵀ ∇_M ℓ_ij Q_A)² in the kept bases, at ``at``, and the
        other layers' and parameters' squared per-example gradients: one streamed pass, summed over the ranks."""
        start = time.perf_counter()
        eigen = self.kept_eigenbasis()

        def squares(layer, a, g):
            if layer.name in self.wide:
                self.accumulators[layer.name].squares.add_(layer.example_squares(a, g))
                return
            left, right = layer.oriented(eigen[layer.name][1], eigen[layer.name][3])
            self.accumulators[layer.name].squares.add_(layer.example_squares(a, g, left=left, right=right))

        self.stream("EK-FAC eigenvalues in a kept basis", squares, diagonal=True)
        self.detail = self.pseudo.describe() if self.pseudo is not None else None
        for layer in self.tracked:
            distributed.all_reduce_(self.accumulators[layer.name].squares)
        if self.diag_names and distributed.active():
            if self.diag_total is None:
                size = sum(self.params[nm].numel() for nm in self.diag_names)
                self.diag_total = torch.zeros(size, dtype=torch.float64, device=self.space.device)
            distributed.all_reduce_(self.diag_total)
        values = {layer.name: self.accumulators[layer.name].squares / self.n for layer in self.factored()}
        self.seconds["eigenvalues_in_kept_basis"] = time.perf_counter() - start
        return values

    def kfac_values(self, eigen: dict[str, tuple]) -> dict[str, torch.Tensor]:
        """K-FAC's eigenvalues {layer: (rows, cols)}: the outer product of the two factors' eigenvalues, oriented
        like the layer's block matrix M."""
        values = {}
        for layer in self.factored():
            a_evals, _, g_evals, _ = eigen[layer.name]
            rows, cols = layer.oriented(a_evals, g_evals)
            values[layer.name] = rows[:, None] * cols[None, :]
        return values

    def assemble(self, eigen: dict[str, tuple], values: dict[str, torch.Tensor]) -> FactoredCurvature:
        """The FactoredCurvature: a Kronecker block per layer in ``values`` (its eigenvalues in the bases ``eigen``),
        a diagonal block per other tracked layer (its squares) and one for the remaining parameters, each shifted by
        the regularizer's (and ``extra``'s) curvature."""
        space, n = self.space, self.n
        reg = regularizer_diagonal(self.stage, self.names, self.extra, self.at, self.seed)
        offsets, offset = {}, 0
        for nm, size in zip(space.names, space.sizes):
            offsets[nm] = offset
            offset += size
        blocks: list = []
        layer_info = []
        for layer in self.tracked:
            acc = self.accumulators[layer.name]
            idx = layer_index(layer, offsets, space.device)
            if layer.name in values:
                _, a_evecs, _, g_evecs = eigen[layer.name]
                left, right = layer.oriented(a_evecs, g_evecs)
                shift = float(reg[idx].mean()) if reg is not None else 0.0
                blocks.append(KroneckerBlock(layer.name, layer.kind, layer.weight, layer.bias, *layer.shape,
                                             left, right, values[layer.name].to(space.dtype), shift, layer.inputs_first))
            else:
                pos = idx.reshape(-1)
                blocks.append(DiagonalBlock([layer.weight] + ([layer.bias] if layer.bias else []), pos,
                                            (acc.squares.to(torch.float64) / n).reshape(-1),
                                            reg[pos] if reg is not None else torch.zeros_like(pos, dtype=torch.float64)))
            acc.squares = None
            layer_info.append(layer.describe() | {"tokens_per_example": acc.tokens / max(n, 1)})
        if self.diag_names:
            pos = torch.cat([torch.arange(offsets[nm], offsets[nm] + self.params[nm].numel(), device=space.device)
                             for nm in self.diag_names])
            diag = self.diag_total / n if self.diag_total is not None else \
                torch.zeros(pos.shape[0], dtype=torch.float64, device=space.device)
            blocks.append(DiagonalBlock(self.diag_names, pos, diag, reg[pos] if reg is not None else torch.zeros_like(diag)))
        self.seconds["total"] = time.perf_counter() - self.start
        info = {
            "kind": self.kind,
            "fisher": self.fisher,
            "fisher_detail": self.detail if self.detail is not None else self.fisher,
            "layers": layer_info,
            "diagonal": {nm: self.reasons[nm] for nm in self.diag_names},
            "examples": n,
            "passes": self.passes,
            "seed": self.seed,
            "seconds": self.seconds,
            "memory": self.sizing,
        }
        return FactoredCurvature(space, self.kind, blocks, info, gradient=self.objective)


def measured_layers(model, names: Sequence[str]) -> list[Layer]:
    """The registered layers of ``model`` that own parameters of ``names`` alone (a LayerNorm, a bias without its
    weight: each parameter in one layer), whose per-example gradients their hooks give."""
    layers, _ = plan(model, names)
    owners = _owners(layers)
    return [layer for layer in layers if all(len(owners[name]) == 1 for name in layer.params)]


def _owners(layers: Sequence[Layer]) -> dict[str, list[Layer]]:
    """{parameter: the layers that use it}."""
    owners: dict[str, list[Layer]] = {}
    for layer in layers:
        for name in layer.params:
            owners.setdefault(name, []).append(layer)
    return owners


def tied_pairs(model, names: Sequence[str]) -> list[tuple[Embedding, Dense]]:
    """(embedding, decoder) pairs of registered layers over ``names`` that share their trained weight — a decoder
    tied to the word embeddings, its weight stored (vocabulary, dim) — and own their other parameters alone (the
    decoder's bias): their per-example squared norms come from both layers' hooks
    (:meth:`influkit.layers.Embedding.tied_example_norms`)."""
    owners = _owners(plan(model, names)[0])
    pairs = []
    for name, owning in owners.items():
        embedding = next((layer for layer in owning if isinstance(layer, Embedding)), None)
        decoder = next((layer for layer in owning if isinstance(layer, Dense) and not layer.inputs_first), None)
        if (len(owning) == 2 and embedding is not None and decoder is not None and embedding.weight == name
                and decoder.weight == name and (decoder.bias is None or len(owners[decoder.bias]) == 1)):
            pairs.append((embedding, decoder))
    return pairs


def unhooked_parameters(model, names: Sequence[str]) -> list[str]:
    """The parameters of ``names`` whose per-example gradients no layer hook gives (:func:`objective_gradient` forms
    their rows by per-example backward passes): in no registered layer, or shared by two layers other than a decoder
    tied to the word embeddings (:func:`tied_pairs`, whose norms the hooks give)."""
    _, reasons = plan_layers(model, names)
    diagonal = [name for name in names if name in reasons]
    hooked = {name for layer in measured_layers(model, diagonal) for name in layer.params}
    hooked |= {name for pair in tied_pairs(model, diagonal) for layer in pair for name in layer.params}
    return [name for name in diagonal if name not in hooked]


def _all_reduce_sums(accumulators: dict, tracked: list, squares: bool, wide=()) -> None:
    """Sum every tracked layer's covariances and token count (and ``squares``; a diagonal ``wide`` layer's
    squares) over the ranks, in place."""
    for layer in tracked:
        acc = accumulators[layer.name]
        distributed.all_reduce_(acc.inputs)
        distributed.all_reduce_(acc.grads)
        if squares or layer.name in wide:
            distributed.all_reduce_(acc.squares)
        tokens = distributed.all_reduce_(torch.tensor([float(acc.tokens)], dtype=torch.float64, device=acc.grads.device))
        acc.tokens = int(tokens.item())
