"""Approximate unrolling (SOURCE, Bae, Lin, Lorraine & Grosse 2024) across stages: segments with a closed form each.

Each stage's recorded steps are cut into ``segments`` contiguous pieces. Inside piece ℓ the run is linearized as
(heavy-ball) gradient descent on the stage's full-data objective L(θ; S̄) with one Hessian H_ℓ, taken at the
piece's last parameters θ_ℓ, and the recorded learning rates η_t; a data weight w_z enters every step's gradient
with its expected weight 1/n (exact for full batches), and the shared block through C_ℓ = ∂∇_θL/∂S̄. In H_ℓ's
eigenbasis every coordinate (eigenvalue λ) follows the 2×2 linear recursion of SGD with momentum μ,

    b_{t+1} = μ b_t + λ δ_t + f,     δ_{t+1} = δ_t − η_t b_{t+1},     f = (1/n) ∇ℓ(z; θ_ℓ) δw_z + C_ℓ δS̄,

so the reverse pass runs the transposed recursion over the piece's learning rates for all coordinates at once
(from the adjoints (v, w) of (δθ, δb) at the end of the piece) and collects u = d measure / d f; then
score_z += (1/n) ∇ℓ(z; θ_ℓ)·u, the shared block's adjoint += C_ℓᵀ u, and (v, w) move to the piece's start. Without
momentum the collected u is −(I − A_ℓ) H_ℓ⁻¹ v with A_ℓ = Π_t (I − η_t H_ℓ): SOURCE's closed form (Bae, Lin,
Lorraine & Grosse 2024), here with momentum kept exactly. The adjoints on the stage's start and on its inherited
block are handed to the previous stage as in :mod:`.metagradient` (same sign: score = d measure / d w_z, removal
predicts −score). Adam has no such linear recursion and is refused; so is Nesterov momentum.

When the objective is quadratic and the per-example losses are linear in θ, every step is exactly this map and
the result equals the exact metagradient (``tests/test_unrolled.py``).

Curvature per piece (``curvature=``): ``"hessian"`` — the dense Hessian of L at θ_ℓ and its eigendecomposition
(exact; models of up to a few thousand trained parameters); ``"ekfac"`` or ``"kfac"`` — SOURCE's choice at scale: the
factored Gauss-Newton approximation C_ℓ (:func:`influkit.factored.curvature.fit_curvature`, settings from
``config``: fisher, hessian_samples, seed) fitted at θ_ℓ. C_ℓ is block diagonal with a Kronecker eigenbasis per
layer, and the piece's map (v, w) → (v', w', u) is linear with coefficients that are functions of one eigenvalue,
so it is applied as f(C_ℓ)·v, elementwise in each layer's eigenbasis (:meth:`FactoredCurvature.function`): memory
O(the factors + q·p), never p². Where C_ℓ equals H (one linear layer under squared error with the exact Fisher)
the two agree (a test). ``basis="shared"`` (EK-FAC only) fits one eigenbasis per stage, at its final parameters,
and re-estimates only the eigenvalues at each other piece's end (:func:`fit_curvature` with ``basis=``): one full
fit per stage plus one streamed pass per further piece, instead of a fit (covariances and eigendecompositions, most
of EK-FAC's cost at scale) per piece — SOURCE's practical variant.

The scores are computed in two passes. First the reverse pass over the pieces (every rank the same) gives each
piece's θ_ℓ and u_ℓ and the adjoints handed across the boundary; then the example terms
score_z = Σ_ℓ (1/n) ∇ℓ(z; θ_ℓ)·u_ℓ are computed chunk by chunk like :meth:`influkit.Query.scores` rows
(:mod:`.terms`: by contraction within the memory budget, sharded over ranks, streamed to ``out`` and resumable).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.func import grad, hessian, vjp
from tqdm.auto import tqdm

from .. import distributed
from ..errors import InputError
from ..factored.curvature import FactoredCurvature, fit_curvature
from ..fitted import CurvatureConfig
from ..results import InfluenceResult
from .metagradient import hand_over, measure_adjoint
from .optimizers import SGD
from .record import Record, StageRun
from .replay import start, unit_weights
from .terms import Terms, fingerprint

METHOD = "unrolled approximate (segments, dense Hessian)"
CURVATURES = ("hessian", "ekfac", "kfac")
BASES = ("each", "shared")


def approximate(record: Record, measure, *, segments: int = 1, per_test: bool = False, curvature: str = "hessian",
                basis: str = "each", config: CurvatureConfig | None = None, chunk_size: int | None = None,
                out: str | Path | None = None, gradients: str = "contraction", memory: int | None = None,
                progress: bool = False) -> list[InfluenceResult]:
    """One :class:`InfluenceResult` per stage: the segment-wise closed-form estimate of d measure / d w_z.

    Same arguments and sign as :func:`influkit.unrolled.metagradients` (score = d measure / d w_z at w = 1;
    removing z predicts −score: ``removal``); ``segments`` pieces per stage; curvature: ``"hessian"`` (dense,
    exact) or ``"ekfac"``/``"kfac"`` (factored, fitted with ``config``, default ``CurvatureConfig()``: the sampled
    Fisher on every example); basis: ``"each"`` (a fit per piece) or ``"shared"`` (EK-FAC: one eigenbasis per stage,
    eigenvalues re-estimated per piece) — module docstring — or one fitted EK-FAC curvature (or None) per stage, fitted
    at that stage's final parameters over its trained parameters, e.g. ``chain.curvature(0).approximations["ekfac"]``
    of the plain chain on the recorded models: used as its last piece's curvature and shared basis, not refitted. The example terms as :meth:`influkit.Query.scores`:
    ``chunk_size`` rows at a time (default: what ``memory`` bytes hold, default budget when None), ``gradients``
    "contraction" or "per-example", split over the ranks under ``torch.distributed``, and with ``out=DIR`` streamed
    to a score store per stage (``DIR/stage-k``), resumable: a re-run skips the chunks already written.
    """
    if int(segments) < 1:
        raise InputError(f"segments must be ≥ 1, got {segments!r}.")
    if curvature not in CURVATURES:
        raise InputError(f"unknown curvature {curvature!r}; choose one of {CURVATURES}.")
    given = None if isinstance(basis, str) else list(basis)
    if given is not None:
        if len(given) != len(record) or not all(b is None or isinstance(b, FactoredCurvature) for b in given):
            raise InputError(f"basis as a list needs one fitted EK-FAC curvature (or None) per recorded stage "
                             f"({len(record)}), e.g. [chain.curvature(0).approximations['ekfac'], None].")
        basis = "shared"
    if basis not in BASES or (basis == "shared" and curvature != "ekfac"):
        raise InputError(f"basis must be one of {BASES} or a list of fitted curvatures, and a shared eigenbasis "
                         f"needs curvature='ekfac'; got basis={basis!r} with curvature={curvature!r}.")
    config = CurvatureConfig() if config is None else config
    for run in record.runs:
        if not isinstance(run.optimizer, SGD) or run.optimizer.nesterov:
            raise InputError(
                f"approximate unrolling needs SGD steps (with or without heavy-ball momentum); a stage was trained "
                f"with {run.optimizer!r}. Use ik.unrolled.metagradients (exact) for it."
            )
    began = time.perf_counter()
    adjoint, q, outputs = measure_adjoint(record, measure, per_test)
    pieces: list = [None] * len(record)
    for k in range(len(record) - 1, -1, -1):
        run = record.runs[k]
        theta_bar, anchor_bar, pieces[k] = _stage(run, adjoint, q, int(segments), curvature, basis, config, memory,
                                                  progress, given[k] if given else None)
        if k:
            adjoint = hand_over(record, k, theta_bar, anchor_bar, q)
    directions_s = time.perf_counter() - began
    where = "dense Hessian at each segment's end" if curvature == "hessian" else \
        f"{curvature} ({config.fisher} Fisher, hessian_samples={config.hessian_samples}) " + \
        ("fitted at each segment's end" if basis == "each" else "eigenbasis fitted at the stage's end, eigenvalues at "
         "each segment's end")
    method = METHOD if curvature == "hessian" else f"unrolled approximate (segments, {curvature})"
    results = []
    for k, run in enumerate(record.runs):
        t0 = time.perf_counter()
        stage_out = None if out is None else Path(out) / f"stage-{k}"
        terms = Terms(run.stage, run.trained, pieces[k], chunk_size=chunk_size, gradients=gradients, memory=memory,
                      out=stage_out)
        values, index, counts = terms.compute(fingerprint=fingerprint(f"{method}|{basis}", k, pieces[k]),
                                              out=stage_out, progress=progress)
        diagnostics = {"seconds": {"approximate (pieces)": directions_s, "example terms": time.perf_counter() - t0},
                       "settings": {"segments": int(segments), "curvature": where, "basis": basis,
                                    "per_test": per_test, "measure_outputs": int(outputs)},
                       "chunks": counts | {"chunk_size": terms.chunk_size, "ranks": distributed.world_size()},
                       "scoring": terms.describe(), "memory": [terms.scorer.memory], "stage": k}
        results.append(InfluenceResult(values=values if per_test else values[:, 0], n_train=len(run.stage), index=index,
                                       method=f"{method}, stage {k}", diagnostics=diagnostics, removal_eps=-1.0))
    return results


def _boundaries(run: StageRun, pieces: int) -> list[tuple[int, int, dict]]:
    """[(a, b, θ_b)] for the pieces of the run, θ_b replayed from the recorded start."""
    cuts = sorted({round(run.steps * i / pieces) for i in range(pieces + 1)})
    theta, state = start(run, run.anchors), run.checkpoints[0][1]
    ends = {}
    for t in range(run.steps):
        idx, x, y = run.batch(t)
        theta, state = run.step(t, theta, state, run.anchors, unit_weights(run, idx, None, x), x, y)
        if t + 1 in cuts:
            ends[t + 1] = {n: v.detach() for n, v in theta.items()}
    return [(a, b, ends[b]) for a, b in zip(cuts[:-1], cuts[1:])]


def _piece(lam: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, lrs: list[float], momentum: float):
    """The transposed recursion of one piece, elementwise per eigen-coordinate (eigenvalue ``lam``): from the
    adjoints (α, β) of (δθ, δb) at the piece's end, (α, β) at its start and the forcing's adjoint u."""
    forcing = torch.zeros_like(alpha)
    for lr in reversed(lrs):  # step t: b' = μb + λδ + f, δ' = δ − η b'
        forcing = forcing + beta - lr * alpha
        alpha, beta = alpha * (1 - lr * lam) + beta * lam, momentum * (beta - lr * alpha)
    return alpha, beta, forcing


def _stage(run: StageRun, adjoint: dict, q: int, pieces: int, curvature: str, basis: str, config: CurvatureConfig,
           memory: int | None, progress: bool, fitted_end=None):
    """Reverse pass of one stage through its pieces: (θ̄_0, S̄'s adjoint, [(θ_ℓ, u_ℓ (q, p))] in run order).
    fitted_end: an EK-FAC curvature already fitted at the stage's final parameters (its last piece's), reused."""
    names, anchor_names = list(run.trained), list(run.anchors)
    shapes = {n: v.shape for n, v in run.checkpoints[0][0].items()} | {n: v.shape for n, v in run.anchors.items()}
    sizes = {n: shapes[n].numel() for n in shapes}
    reference = run.checkpoints[0][0][names[0]]

    def flat(tensors: dict, keys: list[str]) -> torch.Tensor:  # (q, p) from {name: (q, *shape)}
        return torch.cat([tensors[n].reshape(q, -1) for n in keys], dim=1)

    def unflat(vector: torch.Tensor, keys: list[str]) -> dict:
        if not keys:
            return {}
        return dict(zip(keys, (v.reshape(shapes[n]) for n, v in zip(keys, vector.split([sizes[n] for n in keys])))))

    n = len(run.stage)
    ones = torch.ones(n, dtype=reference.dtype, device=reference.device)

    def objective(theta_flat, anchor_flat, x, y, w, **parts):  # the stage objective L(θ; S̄) on (x, y) with weights w
        return run.objective(unflat(theta_flat, names), unflat(anchor_flat, anchor_names), x, y, w, **parts)

    def zeros(m: str) -> torch.Tensor:
        return torch.zeros(q, *shapes[m], dtype=reference.dtype, device=reference.device)

    v = flat({m: adjoint.get(m, zeros(m)) for m in names}, names)
    anchor_flat = torch.cat([run.anchors[m].reshape(-1) for m in anchor_names]) if anchor_names else \
        torch.zeros(0, dtype=reference.dtype, device=reference.device)
    anchor_bar = flat({m: adjoint[m] if m in run.frozen and m in adjoint else zeros(m) for m in anchor_names},
                      anchor_names) if anchor_names else torch.zeros(q, 0, dtype=reference.dtype)
    momentum, decay = run.optimizer.momentum, run.optimizer.weight_decay
    chunk = run.stage.data.batch_size or 256
    w = torch.zeros_like(v)  # the adjoint of the momentum buffer (0 at the end: the measure does not read it)
    out, kept = [], None
    for a, b, theta_end in tqdm(list(reversed(_boundaries(run, pieces))), desc="segments", disable=not progress,
                                leave=False):
        theta_flat = torch.cat([theta_end[m].reshape(-1) for m in names])
        lrs = run.lrs[a:b]
        if curvature == "hessian":
            x_all, y_all = run.stage.data.take(torch.arange(n))
            lam, eigvecs = torch.linalg.eigh(hessian(objective)(theta_flat, anchor_flat, x_all, y_all, ones))
            alpha, beta, forcing = _piece(lam + decay, v @ eigvecs, w @ eigvecs, lrs, momentum)
            u, v, w = forcing @ eigvecs.T, alpha @ eigvecs.T, beta @ eigvecs.T
        else:
            fitted = fitted_end if b == run.steps and fitted_end is not None else \
                _fit(run, curvature, config, theta_end, kept, memory)
            kept = fitted if basis == "shared" else None
            u, v, w = _factored_piece(fitted, v, w, lrs, momentum, decay)
        out.append((theta_end, u))
        if anchor_names:  # S̄'s adjoint += Cᵀu, C = ∂∇_θL/∂S̄: mixed vector-Jacobian products, a chunk of data at a time
            for i, idx in enumerate(torch.arange(n).split(chunk)):
                x, y = run.stage.data.take(idx)
                weights = ones[: idx.numel()]
                gradient = lambda th, an: grad(objective)(th, an, x, y, weights, size=n, penalties=i == 0)  # noqa: E731
                _, pullback = vjp(lambda an: gradient(theta_flat, an), anchor_flat)
                anchor_bar = anchor_bar + torch.stack([pullback(u[j])[0] for j in range(q)])
    theta_bar = {m: t.reshape(q, *shapes[m]) for m, t in zip(names, v.split([sizes[m] for m in names], dim=1))}
    anchors_out = {m: t.reshape(q, *shapes[m]) for m, t in zip(anchor_names, anchor_bar.split(
        [sizes[m] for m in anchor_names], dim=1))} if anchor_names else {}
    return theta_bar, anchors_out, out[::-1]


def _fit(run: StageRun, kind: str, config: CurvatureConfig, theta_end: dict, basis, memory: int | None):
    """The factored curvature C_ℓ at θ_ℓ (with ``basis``: its eigenvalues in that curvature's kept eigenbases)."""
    n = len(run.stage)
    indices = None
    if config.hessian_samples is not None and config.hessian_samples < n:
        indices = torch.randperm(n, generator=torch.Generator().manual_seed(config.seed))[:config.hessian_samples]
    extra = None
    if run.alpha:
        anchors, alpha = run.anchors, run.alpha
        extra = lambda p: alpha * sum(((p[m] - anchors[m]) ** 2).sum() for m in run.inherited)  # noqa: E731
    return fit_curvature(run.stage, run.trained, kind=kind, fisher=config.fisher, indices=indices, extra=extra,
                         at=theta_end, seed=config.seed, memory=memory, basis=basis)


def _factored_piece(fitted, v: torch.Tensor, w: torch.Tensor, lrs: list[float], momentum: float, decay: float):
    """(u, v', w') of one piece with the factored curvature C fitted at θ_ℓ: each output is Σ f(C)·input with f
    the piece's coefficient functions of one eigenvalue (``_piece`` run on unit inputs)."""

    def coefficient(output: int, unit: int):
        def fn(lam):
            one, zero = torch.ones_like(lam), torch.zeros_like(lam)
            begin = (one, zero) if unit == 0 else (zero, one)
            return _piece(lam + decay, *begin, lrs, momentum)[output]
        return fn

    inputs = [v.T] + ([w.T] if momentum else [])  # (p, q) each; without momentum w stays 0
    outputs = []
    for output in (2, 0, 1):  # u, v', w'
        total = sum(fitted.function(x, coefficient(output, unit)) for unit, x in enumerate(inputs))
        outputs.append(total.T.to(v.dtype))
    return tuple(outputs)
