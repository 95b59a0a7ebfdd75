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
Lorraine & Grosse 2024), here with momentum kept exactly and the discrete steps in place of SOURCE's exponential.
Past the edge of stability (η_t λ > 2(1 + μ): one step's linear map expands that coordinate, as it does in the top
directions of runs trained at large learning rates) the discrete map grows exponentially while the run it
linearizes did not diverge, so there the piece takes SOURCE's exponential (gradient flow at the effective learning
rate η_t/(1 − μ)), which keeps a direction's share at its minimum's 1/λ; each result's
``diagnostics["stability"]`` gives the stage's largest η_t λ and how many eigen-coordinates were so treated. The
adjoints on the stage's start and on its inherited block are handed to the previous stage as in
:mod:`.metagradient` (same sign: score = d measure / d w_z, removal predicts −score). Nesterov momentum, SGD in
parameter groups (a watched ``torch.optim.SGD``) and Adam groups with different β's are refused (use the exact
:func:`~.metagradient.metagradients`).

When the objective is quadratic and the per-example losses are linear in θ, every step is exactly this map and
the result equals the exact metagradient (``tests/test_unrolled.py``).

Adam and AdamW. Step t (counted from the stage's start, t = 0, 1, …) of torch's Adam is m ← β₁m + (1 − β₁)d,
v ← β₂v + (1 − β₂)d², θ ← ρ_t θ − η_t/(1 − β₁^{t+1}) · m/(√v̂ + ε) with d = c_t g (+ λθ, Adam's coupled decay),
c_t the recorded clipping's factor (1 without clipping; coupled decay and clipping together are refused, so
c_t(g + λθ) is d either way), v̂ = v/(1 − β₂^{t+1}) and ρ_t = 1 − η_t κ (AdamW's decoupled decay κ; 1 for Adam).
Inside piece ℓ = [a, b) the second moment is frozen at the piece's end: P = diag(1/(√v̂_b + ε)) from the record (or
its replay) at step b, and c_t is kept as a constant gain (its dependence on the gradient dropped; a clipped
stage's gains and piece ends come from one replay of it). The step is then linear in (δθ, δm):
δm' = β₁δm + (1 − β₁)c_t((H_ℓ + λ)δθ + f),
δθ' = ρ_t δθ − η_t/(1 − β₁^{t+1}) P δm'. With b = δm/(1 − β₁) and φ = P^{−1/2}δθ, b̃ = P^{1/2}b this is the
heavy-ball recursion above in φ, with momentum μ = β₁, curvature K_ℓ = P^{1/2}(H_ℓ + λ)P^{1/2}, forcing P^{1/2}f and
learning rate η'_t = η_t(1 − β₁)/(1 − β₁^{t+1}), and each step's gain and decay entering the 2×2 recursion exactly:

    b̃_{t+1} = β₁ b̃_t + c_t(κ_i φ_t + f̃),     φ_{t+1} = ρ_t φ_t − η'_t b̃_{t+1}     (κ_i an eigenvalue of K_ℓ),

whose transpose (with γ = β − η'_t α: u += c_t γ, α ← ρ_t α + c_t κ_i γ, β ← β₁γ) runs per eigen-coordinate as for
SGD. The adjoints move into the scaled coordinates at the piece's end and back at its start: (α, β) =
(P^{1/2}v, P^{−1/2}w), u = P^{1/2}ũ, (v, w) = (P^{−1/2}α, P^{1/2}β) — (v, w) stay the adjoints of (δθ, b) in θ's own
coordinates between pieces, whose P differ. Parameter groups: each group's learning rate η_{g,t} = r_g η_t (η_t
the largest group's) is folded into P (r_g must be constant within a piece, else refused); κ_i = r_g κ_g, and where
κ differs across groups (ρ_t then is not a scalar in K's eigenbasis) the pieces take its mean over the trained
coordinates, noting the largest relative change of δθ so left out (``diagnostics["stability"]``; a warning above
:data:`DECAY_WARNING`).
``curvature="hessian"``: K_ℓ is formed densely and eigendecomposed — exact for the frozen-P linearization (a test
checks it against autograd through that recursion). Factored curvatures: a piece's map is a function F(K) of
K = P^{1/2}(C + λ)P^{1/2} with C's eigenbasis Q not diagonalizing P, so it is split by its order in the curvature,
F = F(0) + F'(0)·K + R. The first two use the diagonal P itself: F(0) acts per coordinate (f_ij(0, P_k), no
curvature), and F'(0)·K is P^{[i]}(C + λ)P^{[j]} times one number φ'_ij(0) per output/input pair (P on the left of
the outputs u and the buffer's adjoint, on the right of the input v: two products with C per piece), C's
eigenvalues there kept only where the piece's map of the eigen-coordinate is still close to linear in it (its part
past the first order at most half the first order, :func:`_first_order`; past it the first order outgrows the map,
and its remainder in the projected P would cancel it only where P_Q = P). Only the remainder R uses P projected onto Q, P_Q = Q diag(d) Qᵀ with d_i = q_iᵀ P q_i
(:meth:`FactoredCurvature.functions` with ``diagonal=``, per block (L∘L)ᵀ P_M (R∘R)), which commutes with C: per
eigen-coordinate f_ij(λ_i, d_i) − f_ij(0, d_i) − λ_i d_i^{a_ij+1} φ'_ij(0), with f_ij(λ, d) = d^{a_ij} φ_ij(dλ)
(:data:`ORDERS`) — no refit per piece (the shared eigenbasis stays shared), cost O(rows·cols·(rows + cols)) per
layer. So where the piece barely curves (η P λ small, as in a short run at a small learning rate) the map is
Adam's own per-coordinate step, to second order (a test checks it against autograd through the frozen-P
recursion); the whole map with P_Q in its place changes Adam's step already at zeroth order, wherever P varies
within a layer. It is exact where P is a scalar on a block or C is diagonal (a diagonal block). Adam's coupled
decay λ enters the factored pieces as a shift (one λ for all groups, else refused).

Runs with dropout and Trainer runs. Each piece linearizes a deterministic objective. A run recorded with dropout on
is linearized with the model in eval mode: the expected (dropout-off) objective, dropout ignored — its replayed
steps (piece ends, clipping factors) still use the recorded masks. A Trainer run (``influkit.hf.RecordCallback``)
trained on its collator's batches (a masked-LM collator masks each batch anew, so an example trained for several
epochs was seen with several masks): its pieces take a copy of the stage with one row per fed example per step, as
the collator fed it (the recorded masks), so the objective they linearize — the mean over those rows — is the mean
of the recorded steps' objectives, the expectation over the recorded masks; its data term is scaled by the recorded
batches' mean examples per predicted token (the Trainer divides a masked-LM batch's summed loss by its predicted
tokens; 1 for classification), and an example's score is the sum of its rows' terms. (The stage's own data, every
token a target, is not what the Trainer trained on.) Such a stage is linearized at the recorded weights, in one
process, without ``out=`` (its rows are summed into examples in memory); else refused. Each result's
``diagnostics["linearized"]`` lists what its stage's pieces so approximated.

At other data weights (``at=``, or a record from :func:`~.replay.reweighted`) the pieces linearize the re-run
record: θ_ℓ are its parameters, H_ℓ the Hessian of the weighted objective (1/n) Σ w_z ℓ(z; θ) + R, and the forcing's
data term keeps its derivative (1/n) ∇ℓ(z; θ_ℓ). A factored curvature is fitted on the unweighted examples and its
data part scaled by the stage's weight (:meth:`FactoredCurvature.scale_data`), so it takes one weight per stage.

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

Top directions (``top=k``, factored curvatures only). A block-diagonal curvature misses the cross-layer top of a
transformer's spectrum (its largest eigenvalue can fall well below the Gauss-Newton matrix's and the Hessian's), so
its pieces barely damp the directions the run contracts fastest. With ``top``
the k largest eigenpairs (g_i, V_i) of each stage's Hessian H at its final parameters (``top_curvature="hessian"``,
the matrix each piece linearizes with; ``"gauss-newton"``: its positive semi-definite part G) are put in exactly:
each piece splits (v, w) into their coordinates in span V and the complement, runs the factored map f(C) on the
complement (its output projected back onto it) and the scalar map f(g_i) on each coordinate — the curvature
V diag(g) Vᵀ + (I − VVᵀ) C (I − VVᵀ), with f of the second taken as (I − VVᵀ) f(C) (I − VVᵀ). Where H = C the split
changes nothing, and with every eigenpair one piece per stage is the dense Hessian's map (tests; under Adam this
curvature enters the split above: its products in F'(0)·K, its eigenvalues in the remainder, with P projected onto
the span V there). The default
``top="auto"`` takes k = :data:`TOP_AUTO` pairs per stage of at most :data:`TOP_AUTO_PARAMETERS` trained parameters
(above, their products cost several times the pieces), fewer where ARPACK's workspace (ncv = max(2k + 1, 20)
float64 vectors of p) and the k kept vectors would take more than half of the budget left (:func:`top_count`; 0
with the dense Hessian, which is exact in every direction). How the three choices rank drop sets is measured by
``studies/fidelity.py`` and ``studies/fidelity_lm.py`` (``studies/results/fidelity/``, the docs' Results page).

The scores are computed in two passes. First the reverse pass over the pieces (every rank the same) gives each
piece's θ_ℓ and u_ℓ and the adjoints handed across the boundary; then the example terms
score_z = Σ_ℓ (1/n) ∇ℓ(z; θ_ℓ)·u_ℓ are computed chunk by chunk like :meth:`influkit.Query.scores` rows
(:mod:`.terms`: by contraction within the memory budget, sharded over ranks, streamed to ``out`` and resumable).

Memory. What the pass holds across its phases: per piece u_ℓ (q × p, the model's dtype) and θ_ℓ — the record's own
checkpoint when the piece ends on one (no copy), else replayed from the last checkpoint before it and kept — the
adjoints (v, w) of the piece being unrolled (q × p each, moved to the piece's start in place, with block-sized
temporaries: :meth:`FactoredCurvature.functions`; under Adam five more q × p: F(0)'s three outputs and the two
products with C), S̄'s adjoint, and under ``basis="shared"`` one eigenbasis per
stage. Each phase that batches data sizes its batches from the budget (:mod:`influkit.memory`): a piece's
curvature fit (:func:`fit_curvature`), the shared block's adjoint (∂(∇_θL·u)/∂S̄ over batches sized by the bytes
one example's double-backward graph keeps, measured on a probe) and the example terms (:class:`Terms`). With
``memory=`` the budget bounds what the whole call adds: every phase gets ``memory`` minus what the call holds then
(:class:`influkit.memory.Held`, reported as ``held_bytes``); without it each phase's default budget is a share of
what is free when the phase starts, which already leaves out what is held. After each phase the C allocator's freed
pages go back to the system. The replay of a piece's steps costs what the recorded steps cost (their batches as
recorded).
"""

from __future__ import annotations

import copy
import importlib.util
import numbers
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.func import hessian
from tqdm.auto import tqdm

from .. import distributed
from ..curvature import HVP_TRANSIENT, HessianOperator
from ..errors import InputError
from ..extras import require
from ..factored.curvature import FactoredCurvature, fit_curvature
from ..fitted import CurvatureConfig
from ..memory import PROBE_EXAMPLES, Held, probe_bytes
from ..memory import given as budget_given
from ..memory import plan as memory_plan
from ..memory import resolve as budget_of
from ..results import InfluenceResult
from ..scoring import release_freed_memory
from .metagradient import hand_over, measure_adjoint, reweighted_at
from .optimizers import SGD, Adam, Groups
from .record import Record
from .run import StageRun
from .replay import start, unit_weights
from .terms import Terms, fingerprint, holding
from .watch import eval_stage

METHOD = "unrolled approximate (segments, dense Hessian)"
CURVATURES = ("hessian", "ekfac", "kfac")
BASES = ("each", "shared")


def approximate(record: Record, measure, *, segments: int = 1, per_test: bool = False, curvature: str = "hessian",
                basis: str = "each", config: CurvatureConfig | None = None, chunk_size: int | None = None,
                out: str | Path | None = None, gradients: str = "contraction", memory: int | None = None,
                at=None, top: int | str = "auto", top_curvature: str = "hessian",
                progress: bool = False) -> list[InfluenceResult]:
    """One :class:`InfluenceResult` per stage: the segment-wise closed-form estimate of d measure / d w_z.

    Same arguments and sign as :func:`influkit.unrolled.metagradients` (score = d measure / d w_z at w = 1, or at
    the weights ``at``: the record re-run there and each piece linearized on that run with the weighted objective's
    curvature; removing z predicts −score: ``removal``); SGD (heavy-ball) and Adam / AdamW stages, with dropout
    (eval-mode objective) and Trainer stages (their recorded batches) — module docstring, what each stage's pieces
    approximated in ``diagnostics["linearized"]``; ``segments`` pieces per stage; curvature: ``"hessian"`` (dense,
    exact) or ``"ekfac"``/``"kfac"`` (factored, fitted with ``config``, default ``CurvatureConfig()``: the sampled
    Fisher on every example); basis: ``"each"`` (a fit per piece) or ``"shared"`` (EK-FAC: one eigenbasis per stage,
    eigenvalues re-estimated per piece) — module docstring — or one fitted EK-FAC curvature (or None) per stage, fitted
    at that stage's final parameters over its trained parameters, e.g. ``chain.curvature(0).approximations["ekfac"]``
    of the plain chain on the recorded models: used as its last piece's curvature and shared basis, not refitted. The example terms as :meth:`influkit.Query.scores`:
    ``chunk_size`` rows at a time (default: what ``memory`` bytes hold, default budget when None), ``gradients``
    "contraction" or "per-example", split over the ranks under ``torch.distributed``, and with ``out=DIR`` streamed
    to a score store per stage (``DIR/stage-k``), resumable: a re-run skips the chunks already written.
    top: with a factored curvature, the ``top`` largest eigenpairs of each stage's Hessian (``top_curvature``:
    ``"hessian"``, or ``"gauss-newton"`` for its positive semi-definite part) at its final parameters (ARPACK's
    Lanczos, ``scipy.sparse.linalg.eigsh``: ``pip install 'influkit[unrolled]'``; dense when top ≥ p − 1) are put
    into every piece exactly: in their span the piece's map uses those eigenvalues, in the complement the factored
    curvature's (module docstring, Top directions). Memory: top·p more per stage. Default ``"auto"``: TOP_AUTO per
    stage of ≤ TOP_AUTO_PARAMETERS trained parameters, fewer where the budget is short, none with the dense Hessian
    or where scipy is missing (a warning says so): :func:`top_count`. ``diagnostics["top"]`` says how many each
    stage used, from which matrix, and why.
    """
    if int(segments) < 1:
        raise InputError(f"segments must be ≥ 1, got {segments!r}.")
    if curvature not in CURVATURES:
        raise InputError(f"unknown curvature {curvature!r}; choose one of {CURVATURES}.")
    if top != "auto" and (isinstance(top, bool) or not isinstance(top, numbers.Integral) or top < 0
                          or (top and curvature == "hessian")):
        raise InputError(f"top={top!r}: the exact top eigenpairs complete a factored curvature (curvature='ekfac' or "
                         "'kfac', top ≥ 0, or 'auto'); the dense Hessian is exact in every direction already.")
    if top_curvature not in TOP_CURVATURES:
        raise InputError(f"unknown top_curvature {top_curvature!r}; choose one of {TOP_CURVATURES}.")
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
        _rules(run)
    record = reweighted_at(record, measure, at, progress)
    linearized = [_linearized(run) for run in record.runs]
    if out is not None and any(rows is not None for *_, rows in linearized):
        raise InputError("out= streams each row's terms, and a Trainer stage's rows are its fed batches, summed into "
                         "examples in memory; leave out= unset for a record with Trainer stages.")
    if given is not None and any(g is not None and rows is not None for g, (*_, rows) in zip(given, linearized)):
        raise InputError("a fitted curvature given as basis= was fitted on the stage's own data, and a Trainer stage "
                         "is linearized on its collated batches; pass None for that stage (its curvature is then "
                         "fitted on them).")
    for k, run in enumerate(record.runs):
        uniform = run.weights is None or bool((run.weights == run.weights[0]).all())
        if curvature != "hessian" and not uniform:
            raise InputError(
                f"stage {k} is weighted unevenly (at= or ik.unrolled.reweighted), and a factored curvature is fitted "
                "on the unweighted examples, so it can only be rescaled by one weight per stage. Pass one float per "
                "stage in at= (e.g. the drop sets' mean weight 1 − f), or curvature='hessian'."
            )
        if given is not None and given[k] is not None and run.weights is not None:
            raise InputError(f"basis[{k}] was fitted at w = 1 and stage {k} is reweighted; pass None for it (its "
                             "curvature is then fitted on the reweighted run).")
    began = time.perf_counter()
    adjoint, q, outputs = measure_adjoint(record, measure, per_test)
    pieces: list = [None] * len(record)
    plans: list = [None] * len(record)
    stability: list = [None] * len(record)
    existing = [[run.checkpoints for run in record.runs], [b.tensors() for c in given or () if c is not None
                                                           for b in c.blocks]]
    held = Held(before=existing)  # the record's checkpoints and the given curvatures are not this call's
    held.hold(adjoint)
    for k in range(len(record) - 1, -1, -1):
        run, scale, _, _ = linearized[k]
        with holding(run.stage.model, _moved_frozen(run)), evaluating(run.stage.model):
            theta_bar, anchor_bar, pieces[k], plans[k], stability[k] = _stage(
                run, adjoint, q, int(segments), curvature, basis, config, memory, held, progress,
                given[k] if given else None, top, top_curvature, scale)
        del adjoint
        if k:
            adjoint = hand_over(record, k, theta_bar, anchor_bar, q)
            held.hold(adjoint)
        held.drop(theta_bar, anchor_bar)
        del theta_bar, anchor_bar
    directions_s = time.perf_counter() - began
    where = "dense Hessian at each segment's end" if curvature == "hessian" else \
        f"{curvature} ({config.fisher} Fisher, hessian_samples={config.hessian_samples}) " + \
        ("fitted at each segment's end" if basis == "each" else "eigenbasis fitted at the stage's end, eigenvalues at "
         "each segment's end")
    method = METHOD if curvature == "hessian" else f"unrolled approximate (segments, {curvature})"
    results = []
    for k, (run, _, notes, owner) in enumerate(linearized):
        t0 = time.perf_counter()
        stage_out = None if out is None else Path(out) / f"stage-{k}"
        terms = Terms(run.stage, run.trained, pieces[k], chunk_size=chunk_size, gradients=gradients,
                      memory=held.left(memory, "the example terms"), out=stage_out)
        terms.scorer.memory["held_bytes"] = held.bytes  # with memory=: its budget is memory − this
        with holding(run.stage.model, _moved_frozen(run)), evaluating(run.stage.model):
            values, index, counts = terms.compute(fingerprint=fingerprint(f"{method}|{basis}", k, pieces[k]),
                                                  out=stage_out, progress=progress)
        diagnostics = {"seconds": {"approximate (pieces)": directions_s, "example terms": time.perf_counter() - t0},
                       "settings": {"segments": int(segments), "curvature": where, "basis": basis,
                                    "per_test": per_test, "measure_outputs": int(outputs)},
                       "chunks": counts | {"chunk_size": terms.chunk_size, "ranks": distributed.world_size()},
                       "scoring": terms.describe(), "memory": plans[k] + [terms.scorer.memory], "stage": k,
                       "top": stability[k].pop("top", {"directions": 0, "why": "the dense Hessian is exact in "
                                                                                  "every direction"}),
                       "stability": stability[k], "linearized": notes}
        n = len(run.stage)
        if owner is not None:  # a Trainer stage's rows summed into their examples
            n = len(record.runs[k].stage)
            values = torch.zeros(n, *values.shape[1:], dtype=values.dtype, device=values.device).index_add_(
                0, (owner if index is None else owner[torch.as_tensor(index)]).to(values.device), values)
            index = None
        results.append(InfluenceResult(values=values if per_test else values[:, 0], n_train=n, index=index,
                                       method=f"{method}, stage {k}", diagnostics=diagnostics, removal_eps=-1.0))
        held.drop(pieces[k])  # this stage's θ_ℓ and u_ℓ: not needed by the next stage's terms
        pieces[k] = terms = None
    return results


def _rules(run: StageRun) -> tuple[list, list[list[str]]]:
    """(update rules, the trained names each updates) of a stage's optimizer, refused (with the fix) where the pieces
    have no linear recursion: Nesterov momentum, SGD in parameter groups, Adam groups with different β's, maximize."""
    optimizer = run.optimizer
    rules, groups = (list(optimizer.rules), [list(g) for g in optimizer.names]) if isinstance(optimizer, Groups) \
        else ([optimizer], [list(run.trained)])
    if isinstance(rules[0], Adam):
        if all(isinstance(r, Adam) and r.betas == rules[0].betas and not r.maximize for r in rules):
            return rules, groups
    elif isinstance(optimizer, SGD) and not optimizer.nesterov:
        return rules, groups
    raise InputError(f"approximate unrolling linearizes SGD (with or without heavy-ball momentum) and Adam / AdamW "
                     f"(one β₁, β₂ for every parameter group, minimizing); a stage was trained with {optimizer!r}. Use "
                     "ik.unrolled.metagradients (exact) for it.")


@contextmanager
def evaluating(model: torch.nn.Module):
    """The model in eval mode inside the block (dropout off: the objective the pieces linearize), its modules'
    modes restored after; a replayed step still sets the recorded modes itself."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _linearized(run: StageRun) -> tuple[StageRun, float, list[str], torch.Tensor | None]:
    """(the run whose stage the pieces linearize, the factor of its data term, notes for ``diagnostics["linearized"]``,
    the example each of its stage's rows belongs to — None where the rows are the examples).

    A run with dropout on keeps its stage: its objective in eval mode (the expected objective, dropout off). A
    Trainer run (its batches as the collator made them, ``run.inputs``) gets a copy whose stage has one row per fed
    example per step, as the collator fed it (the recorded masks; padded to the stage's length with the stage's own
    padding), so the stage's mean over rows is the mean of the recorded steps' objectives; its data term is scaled by
    c, the steps' mean examples per predicted token (the Trainer divides a masked-LM batch's summed loss by its
    number of predicted tokens; 1 for classification), and an example's score sums its rows'."""
    notes = []
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and training for m, training in run.mode_list() or ()):
        notes.append("eval-mode objective; dropout ignored (the pieces linearize the expected objective, dropout off)")
    if isinstance(_rules(run)[0][0], Adam):
        notes.append("Adam: second moment frozen at each segment's end (P = 1/(√v̂ + ε)), heavy-ball form with "
                     "momentum β₁")
    if any(clip is not None for clip in run.clips):
        notes.append("gradient clipping: each step's recorded clipping factor kept as a constant gain")
    rules = _rules(run)[0]
    if any(clip is not None for clip in run.clips) and any(
            isinstance(r, Adam) and not r.decoupled and r.weight_decay for r in rules):
        raise InputError("a stage trained by Adam with coupled weight decay and gradient clipping: its decay term is "
                         "not clipped, so no single gain per step linearizes it; use AdamW (decoupled decay) or "
                         "ik.unrolled.metagradients (exact).")
    if run.inputs is None:
        return run, 1.0, notes, None
    if run.weights is not None or distributed.world_size() > 1:
        raise InputError("the approximate unrolling of a Trainer stage (its collated batches) runs at the recorded "
                         "weights in one process; use ik.unrolled.metagradients (exact) for at= or several ranks.")
    x, y = run.stage.data.take(torch.cat([run.batches[t] for t in range(run.steps)]))
    begin = 0
    for t in range(run.steps):
        xb, yb = (v.to(x.device) for v in run.inputs[t])
        rows = slice(begin, begin + xb.shape[0])
        begin += xb.shape[0]
        x[rows, ..., :xb.shape[-1]] = xb  # positions past the batch's length are padding in both
        if y.dim() == 2:
            y[rows, :yb.shape[-1]] = yb
        else:
            y[rows] = yb
    scale = sum(run.data_scale(t) for t in range(run.steps)) / run.steps
    collated = copy.copy(run)
    collated.stage = eval_stage(run.stage.model, lambda: run.stage.with_(data=(x, y)))
    notes.append(f"Trainer batches: the stage's rows are the {begin} examples as the collator fed them step by step "
                 f"(their recorded masks; an example's score sums its rows'), the data term scaled by {scale:.4g} (the "
                 "recorded batches' mean examples per predicted token)")
    return collated, float(scale), notes, torch.cat([run.batches[t] for t in range(run.steps)])


def _moved_frozen(run: StageRun) -> dict:
    """The frozen inherited block's values where they differ from the model's own (a record re-run at other weights
    ends its previous stage elsewhere): the curvature fits and the example terms read the block from the model."""
    named = dict(run.stage.model.named_parameters())
    return {n: run.anchors[n] for n in run.frozen if not torch.equal(named[n].detach(), run.anchors[n])}


def _boundaries(run: StageRun, pieces: int) -> list[tuple[int, int]]:
    """[(a, b)]: the run's steps cut into ``pieces`` contiguous pieces."""
    cuts = sorted({round(run.steps * i / pieces) for i in range(pieces + 1)})
    return list(zip(cuts[:-1], cuts[1:]))


def _parameters_at(run: StageRun, b: int) -> dict:
    """θ_b: the recorded checkpoint when step b has one (held by the record already, not copied), else replayed from
    the last checkpoint before b."""
    return _checkpoint_at(run, b)[0]


def _checkpoint_at(run: StageRun, b: int) -> tuple[dict, dict]:
    """(θ_b, optimizer state_b): the recorded checkpoint when step b has one, else replayed from the last before b."""
    if b in run.checkpoints:
        return run.checkpoints[b]
    a = max(t for t in run.checkpoints if t < b)
    theta, state = run.checkpoints[a] if a else (start(run, run.anchors), run.checkpoints[0][1])
    for t in range(a, b):
        idx, x, y = run.batch(t)
        theta, state = run.step(t, theta, state, run.anchors, unit_weights(run, idx, None, x), x, y)
    return {n: v.detach() for n, v in theta.items()}, state


def _clipped_trajectory(run: StageRun, ends: list[int]) -> tuple[dict, list[float]]:
    """({b: (θ_b, state_b)} at the pieces' ends, [c_t for every step]): one replay of the stage from its start, each
    step's gradient giving the factor c_t its recorded clipping scaled it by (1.0 where it did not clip) — one
    gradient per step in all; an end with a checkpoint keeps the record's own tensors."""
    theta, state = start(run, run.anchors), run.checkpoints[0][1]
    kept, gains = {}, []
    for t in range(max(ends)):
        idx, x, y = run.batch(t)
        grads = run.gradient(t, theta, run.anchors, x, y, unit_weights(run, idx, None, x))
        clip = run.clips[t] if t < len(run.clips) else None
        gains.append(1.0 if clip is None else float(run.optimizer.clip_coefficient(grads, *clip, order=run.clip_order)))
        theta, state = run.update(t, theta, state, grads)
        if t + 1 in ends:
            kept[t + 1] = run.checkpoints[t + 1] if t + 1 in run.checkpoints else \
                ({n: v.detach() for n, v in theta.items()}, state)
    return kept, gains


class AdamPiece:
    """Adam linearized on one piece (module docstring, Adam): the frozen preconditioner P (p,) over the trained
    parameters in their order (each group's learning-rate ratio folded in), and per step the learning rate
    η'_t = η_t (1 − β₁)/(1 − β₁^{t+1}) of the heavy-ball form, the gain c_t of the recorded clipping, the decoupled
    decay ρ_t = 1 − η_t κ; ``coupled``: Adam's coupled weight decay per coordinate (added to the curvature) or None;
    ``notes``: what was approximated beyond the frozen P (a non-uniform decoupled decay taken at its mean)."""

    def __init__(self, run: StageRun, a: int, b: int, state: dict, names: list[str], gains: list[float]):
        rules, groups = _rules(run)
        beta1, beta2 = rules[0].betas
        lrs = [run.lrs[t] if isinstance(run.optimizer, Groups) else (run.lrs[t],) for t in range(a, b)]
        reference = [max(rates) for rates in lrs]
        moving = [rates for rates, top in zip(lrs, reference) if top > 0]
        ratios = [rate / max(moving[0]) for rate in moving[0]] if moving else [1.0] * len(rules)
        if any(abs(rate - ratio * max(rates)) > 1e-12 * max(rates) for rates in moving
               for rate, ratio in zip(rates, ratios)):
            raise InputError("the parameter groups' learning rates change their ratios within a segment, so Adam's "
                             "frozen preconditioner cannot absorb them; use ik.unrolled.metagradients (exact) or "
                             "schedule every group by the same factor.")
        group_of = {n: g for g, members in enumerate(groups) for n in members}
        correction = 1 - beta2 ** b
        parts, decay, coupled = [], [], []
        for n in names:
            g = group_of[n]
            rule, v = rules[g], state["v"][n].reshape(-1)
            parts.append(ratios[g] / ((v / correction).sqrt() + rule.eps))
            rate = ratios[g] * rule.weight_decay
            decay.append(torch.full_like(v, rate if rule.decoupled else 0.0))
            coupled.append(torch.full_like(v, 0.0 if rule.decoupled else rule.weight_decay))
        self.P = torch.cat(parts)
        kappa, lam = torch.cat(decay), torch.cat(coupled)
        self.coupled = lam if bool(lam.any()) else None
        self.coupled_uniform = self.coupled is None or bool((lam == lam[0]).all())
        self.notes = []
        mean = float(kappa.mean())
        if not bool((kappa == kappa[0]).all()):
            self.notes.append("decoupled weight decay differs across parameter groups: the pieces take its mean over "
                              "the trained coordinates (diagnostics['stability']['decay_ignored']: the largest "
                              "relative change of δθ over a segment this leaves out)")
        self.decay_ignored = float((kappa - mean).abs().max()) * sum(reference)
        self.momentum = beta1
        self.lrs = [top * (1 - beta1) / (1 - beta1 ** (t + 1)) for t, top in zip(range(a, b), reference)]
        self.rho = [1 - top * mean for top in reference]
        self.gains = gains


def _piece(lam: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, lrs: list[float], momentum: float,
           stability: dict | None = None, rho: list[float] | None = None, gains: list[float] | None = None):
    """The transposed recursion of one piece, elementwise per eigen-coordinate (eigenvalue ``lam``): from the
    adjoints (α, β) of (δθ, δb) at the piece's end, (α, β) at its start and the forcing's adjoint u.

    Step t: b' = μb + c_t(λδ + f), δ' = ρ_t δ − η_t b' (``gains`` c_t, default 1; ``rho`` ρ_t, default 1); its
    transpose with γ = β − η_t α: u += c_t γ, α ← ρ_t α + c_t λ γ, β ← μ γ.
    A coordinate past the edge of stability (η_t c_t λ > 2(1 + μ) at some step of the piece, where one step's linear
    map has spectral radius > 1) is unrolled as gradient flow with the effective learning rate η_t c_t / (1 − μ) and
    the momentum buffer slaved to it (b = (λδ + f)/(1 − μ)): with τ = Σ_t η_t c_t/(1 − μ), the decay's rate
    λ' = λ + Σ_t (1 − ρ_t)/τ and A = exp(−λ'τ), u = −(1 − A)/λ' · α + c A/(1 − μ) · β, α ← A α + c λA/(1 − μ) · β,
    β ← 0 (c: the last step's gain). The discrete map there grows as |1 − ηλ|^K
    (10⁵ over 13 steps at ηλ = 3.5), while the run it linearizes did not diverge (its sharpness adapts, Cohen et
    al. 2021); the flow keeps such a direction's share at its minimum's 1/λ. ``stability`` (a dict) collects the
    piece's largest η_t c_t λ and the count of coordinates so treated."""
    rho = [1.0] * len(lrs) if rho is None else rho
    gains = [1.0] * len(lrs) if gains is None else gains
    largest = max(lr * c for lr, c in zip(lrs, gains))
    edge = 2 * (1 + momentum) / largest if largest > 0 else float("inf")
    unstable = lam > edge
    stable_lam = torch.where(unstable, torch.zeros_like(lam), lam)  # no overflow in the coordinates replaced below
    a0, b0 = alpha, beta
    forcing = torch.zeros_like(alpha)
    for lr, r, c in zip(reversed(lrs), reversed(rho), reversed(gains)):
        gamma = beta - lr * alpha
        forcing = forcing + c * gamma
        alpha, beta = r * alpha + (c * stable_lam) * gamma, momentum * gamma
    if stability is not None:
        stability["largest_lr_times_eigenvalue"] = max(stability.get("largest_lr_times_eigenvalue", 0.0),
                                                       float(lam.max()) * largest)
        stability["coordinates_past_the_edge"] = stability.get("coordinates_past_the_edge", 0) + int(unstable.sum())
        stability["coordinates"] = stability.get("coordinates", 0) + lam.numel()
    if not bool(unstable.any()):
        return alpha, beta, forcing
    slaved = gains[-1] / (1 - momentum)
    time_ = sum(lr * c for lr, c in zip(lrs, gains)) / (1 - momentum)
    rate = lam + sum(1 - r for r in rho) / time_
    decayed = torch.exp(-rate * time_)
    safe = torch.where(unstable, rate, torch.ones_like(rate))
    forcing = torch.where(unstable, -(1 - decayed) / safe * a0 + decayed * slaved * b0, forcing)
    alpha = torch.where(unstable, decayed * a0 + lam * decayed * slaved * b0, alpha)
    beta = torch.where(unstable, torch.zeros_like(beta), beta)
    return alpha, beta, forcing


def _maps(lam: torch.Tensor, d: torch.Tensor | None, lrs: list[float], momentum: float, stability: dict | None = None,
          rho: list[float] | None = None, gains: list[float] | None = None) -> list[list[torch.Tensor]]:
    """[[f_ij]]: the piece's map from the end adjoints j = (α, β) to i = (u, α_start, β_start), per coordinate with
    eigenvalue ``lam`` and learning-rate scale d (None: 1) — in the scaled coordinates φ = δ/√d, b̃ = √d b the
    coordinate is the plain recursion with eigenvalue dλ (:func:`_piece`), so with (ũ, α̃, β̃) its maps from the unit
    inputs: f = [[d ũ_α, ũ_β], [α̃_α, α̃_β / d], [d β̃_α, β̃_β]]."""
    one, zero = torch.ones_like(lam), torch.zeros_like(lam)
    scaled = lam if d is None else d * lam
    from_v = _piece(scaled, one, zero, lrs, momentum, stability, rho, gains)
    from_w = _piece(scaled, zero, one, lrs, momentum, None, rho, gains) if momentum else None
    (alpha_v, beta_v, u_v) = from_v
    if d is not None:
        u_v, beta_v = d * u_v, d * beta_v
    maps = [[u_v], [alpha_v], [beta_v]]
    if from_w is not None:
        alpha_w, beta_w, u_w = from_w
        maps = [[u_v, u_w], [alpha_v, alpha_w if d is None else alpha_w / d], [beta_v, beta_w]]
    return maps


def _stage(run: StageRun, adjoint: dict, q: int, pieces: int, curvature: str, basis: str, config: CurvatureConfig,
           memory: int | None, held: Held, progress: bool, fitted_end=None, top: int | str = 0,
           top_curvature: str = "hessian", scale: float = 1.0):
    """Reverse pass of one stage through its pieces: (θ̄_0, S̄'s adjoint, [(θ_ℓ, u_ℓ (q, p))] in run order, the
    memory plans of its phases, the pieces' stability summary (``_piece``)); ``adjoint`` (the stage's final adjoint,
    this call's own dict) is consumed.
    fitted_end: an EK-FAC curvature already fitted at the stage's final parameters (its last piece's), reused.
    top: how many eigenpairs of ``top_curvature`` at the stage's end to put into the factored pieces
    (``_top_directions``), or "auto" (:func:`top_count`); the stability summary records them under "top".
    scale: the factor of the objective's data term (a Trainer stage's examples per predicted token,
    :func:`_linearized`); the stored u_ℓ carry it (the example terms and the shared block's adjoint read the data term only).
    ``held`` counts what the pass keeps (module docstring, Memory)."""
    names, anchor_names = list(run.trained), list(run.anchors)
    shapes = {n: v.shape for n, v in run.checkpoints[0][0].items()} | {n: v.shape for n, v in run.anchors.items()}
    sizes = {n: shapes[n].numel() for n in shapes}
    reference = run.checkpoints[0][0][names[0]]

    def flat(tensors: dict, keys: list[str]) -> torch.Tensor:  # (q, p) from {name: (q, *shape)}
        return torch.cat([tensors[n].reshape(q, -1) for n in keys], dim=1)

    def zeros(m: str) -> torch.Tensor:
        return torch.zeros(q, *shapes[m], dtype=reference.dtype, device=reference.device)

    v = flat({m: adjoint.get(m, zeros(m)) for m in names}, names)
    w = torch.zeros_like(v)  # the adjoint of the momentum buffer (0 at the end: the measure does not read it)
    anchor_bar = {m: adjoint[m].clone() if m in run.frozen and m in adjoint else zeros(m) for m in anchor_names}
    held.drop(adjoint)
    adjoint.clear()  # consumed (v and S̄'s adjoint are copies): its tensors freed before the pieces allocate theirs
    held.hold(v, w, anchor_bar)
    adam = isinstance(_rules(run)[0][0], Adam)
    momentum = _rules(run)[0][0].betas[0] if adam else run.optimizer.momentum
    decay = 0.0 if adam else run.optimizer.weight_decay
    out, plans, kept = [], [], None
    stability = {"edge": 2 * (1 + momentum)}
    directions = None
    if curvature != "hessian":
        k, why = top_count(top, v.shape[1], v.element_size(), held.left(memory, "the top directions"))
        stability["top"] = {"directions": k, "curvature": top_curvature, "why": why}
        if k:
            began = time.perf_counter()
            directions, products = _top_directions(run, _parameters_at(run, run.steps), k, v.dtype, top_curvature,
                                                   scale)
            stability["top"] |= {"products": products, "seconds": time.perf_counter() - began}
    held.hold(directions)
    cuts = _boundaries(run, pieces)
    clipped = adam and any(clip is not None for clip in run.clips)
    trajectory, gains = _clipped_trajectory(run, [b for _, b in cuts]) if clipped else ({}, [1.0] * run.steps)
    held.hold(trajectory)  # the replayed ends' θ and optimizer state, each dropped once its piece is done
    for a, b in tqdm(list(reversed(cuts)), desc="segments", disable=not progress, leave=False):
        theta_end, state_end = trajectory.pop(b) if clipped else _checkpoint_at(run, b)
        held.hold(theta_end)  # counted only when replayed (a checkpoint is the record's)
        release_freed_memory()  # each phase's freed buffers back to the system before the next allocates its own
        linear = AdamPiece(run, a, b, state_end, names, gains[a:b]) if adam else None
        held.drop(state_end)
        del state_end
        if linear is not None:
            for note in linear.notes:
                if note not in stability.setdefault("notes", []):
                    stability["notes"].append(note)
            if linear.decay_ignored:
                if linear.decay_ignored > DECAY_WARNING >= stability.get("decay_ignored", 0.0):
                    warnings.warn(f"approximate unrolling, steps [{a}, {b}): the parameter groups' decoupled weight "
                                  f"decays differ, and the pieces take their mean, which leaves out a relative change "
                                  f"of δθ up to {linear.decay_ignored:.2g} over the segment; more segments shrink it "
                                  "(to one step's η_t·|κ − mean κ| at one step per segment), "
                                  "ik.unrolled.metagradients is exact.",
                                  stacklevel=4)
                stability["decay_ignored"] = max(stability.get("decay_ignored", 0.0), linear.decay_ignored)
            if curvature != "hessian" and not linear.coupled_uniform:
                raise InputError("Adam's coupled weight decay differs across parameter groups, and a factored "
                                 "curvature's eigenbasis cannot take a per-coordinate decay; use AdamW (decoupled) "
                                 "or curvature='hessian'.")
            if curvature != "hessian" and linear.coupled is not None:
                decay = float(linear.coupled[0])
        lrs = run.lrs[a:b]
        if curvature == "hessian":
            held.drop(v, w)
            u, v, w = _dense_piece(run, theta_end, v, w, lrs, momentum, decay, stability, linear, scale)
            held.hold(v, w)
        else:
            fitted = fitted_end if b == run.steps and fitted_end is not None else \
                _fit(run, curvature, config, theta_end, kept, held.left(memory, "a piece's curvature fit"), scale)
            if fitted is not fitted_end:
                plans.append({"piece": [a, b]} | fitted.info["memory"])
            if basis == "shared":  # the eigenbases stay for the next piece (its fit shares them)
                held.drop([blk.tensors() for blk in kept.blocks] if kept is not None else [])
                held.hold([blk.tensors() for blk in fitted.blocks])
                kept = fitted
            release_freed_memory()
            u = _factored_piece(fitted, v, w, lrs, momentum, decay, stability, directions, linear)
            del fitted
        if scale != 1.0:
            u.mul_(scale)
        held.hold(u)
        out.append((theta_end, u))
        if anchor_names:
            plans.append(_anchor_adjoint(run, theta_end, u, anchor_bar, held.left(memory, "the shared block's adjoint")))
            release_freed_memory()
    if kept is not None:
        held.drop([blk.tensors() for blk in kept.blocks])
    held.drop(directions)
    theta_bar = {m: t.reshape(q, *shapes[m]) for m, t in zip(names, v.split([sizes[m] for m in names], dim=1))}
    held.drop(w)
    return theta_bar, anchor_bar, out[::-1], plans, stability


def _dense_piece(run: StageRun, theta_end: dict, v: torch.Tensor, w: torch.Tensor, lrs: list[float], momentum: float,
                 decay: float, stability: dict, adam: AdamPiece | None = None, scale: float = 1.0):
    """(u, v', w') of one piece with the dense Hessian of the stage objective at θ_ℓ (its data term times ``scale``),
    eigendecomposed; under Adam (``adam``) that of K = P^{1/2}(H + coupled decay)P^{1/2}, with the adjoints moved
    into and out of the scaled coordinates (module docstring, Adam)."""
    names = list(run.trained)
    n = len(run.stage)
    every = torch.arange(n)
    x_all, y_all = run.stage.data.take(every)
    weights = unit_weights(run, every, None, v) * scale  # the run's data weights (ones for a recorded run)
    shapes = {m: theta_end[m].shape for m in names}

    def objective(theta_flat):
        theta = dict(zip(names, (t.reshape(shapes[m]) for m, t in zip(names, theta_flat.split(
            [theta_end[m].numel() for m in names])))))
        return run.objective(theta, run.anchors, x_all, y_all, weights) * run.accumulate  # not a micro-batch's share

    h = hessian(objective)(torch.cat([theta_end[m].reshape(-1) for m in names]))
    if adam is None:
        lam, eigvecs = torch.linalg.eigh(h)
        alpha, beta, forcing = _piece(lam + decay, v @ eigvecs, w @ eigvecs, lrs, momentum, stability)
        return forcing @ eigvecs.T, alpha @ eigvecs.T, beta @ eigvecs.T
    root = adam.P.to(h.dtype).sqrt()
    if adam.coupled is not None:
        h = h + torch.diag(adam.coupled.to(h.dtype))
    lam, eigvecs = torch.linalg.eigh(root[:, None] * h * root[None, :])
    alpha, beta, forcing = _piece(lam, (v * root) @ eigvecs, (w / root) @ eigvecs, adam.lrs, adam.momentum, stability,
                                  adam.rho, adam.gains)
    return (forcing @ eigvecs.T) * root, (alpha @ eigvecs.T) / root, (beta @ eigvecs.T) * root


def _anchor_adjoint(run: StageRun, theta_end: dict, u: torch.Tensor, anchor_bar: dict, memory: int | None) -> dict:
    """S̄'s adjoint += Cᵀu (in place), C = ∂∇_θL/∂S̄ at θ_ℓ: ∂(∇_θL_B · u_j)/∂S̄ summed over batches B of the data,
    sized from the memory budget by the bytes one example's double-backward graph keeps (measured on a probe, the
    parameter values excluded, × HVP_TRANSIENT as a Hessian-vector product's,
    :func:`influkit.curvature.hvp_bytes_per_example`) besides one S̄-sized gradient (fixed). Returns the memory plan."""
    n, q = len(run.stage), u.shape[0]
    names = list(run.trained)
    theta = {m: theta_end[m].detach().requires_grad_(True) for m in names}
    anchors = {m: run.anchors[m].detach().requires_grad_(True) for m in anchor_bar}
    directions = [dict(zip(names, (t.reshape(theta[m].shape) for m, t in zip(names, u[j].split(
        [theta[m].numel() for m in names]))))) for j in range(q)]

    def pull(idx, first: bool, probe: bool = False) -> None:
        """S̄'s adjoint += ∂(∇_θL_B · u_j)/∂S̄ for each j on one batch B (the run's data weights); ``probe``: only
        its double-backward graph."""
        x, y = run.stage.data.take(idx)
        with torch.enable_grad():
            weights = unit_weights(run, idx, None, u)
            value = run.objective(theta, anchors, x, y, weights, size=n, penalties=first) * run.accumulate
            gradient = torch.autograd.grad(value, list(theta.values()), create_graph=True)
            if probe:
                return
            for j in range(q):
                dot = sum((g * directions[j][m]).sum() for g, m in zip(gradient, names))
                back = torch.autograd.grad(dot, list(anchors.values()), retain_graph=j < q - 1, allow_unused=True)
                for m, t in zip(anchors, back):
                    if t is not None:
                        anchor_bar[m][j] += t.detach()

    count = min(PROBE_EXAMPLES, n)
    leaves = [*theta.values(), *anchors.values()]
    per = int(HVP_TRANSIENT * probe_bytes(lambda _: pull(torch.arange(count), False, probe=True), run.stage.model,
                                          count, leaves))
    gradient_bytes = sum(t.numel() * t.element_size() for t in anchors.values())  # ∂/∂S̄ of one j at a time
    plan = memory_plan(budget_of(memory, u.device), per, "shared block's adjoint", most=n, fixed=gradient_bytes,
                       default=not budget_given(memory))
    for i, idx in enumerate(torch.arange(n).split(plan["batch"])):
        pull(idx, i == 0)
    return plan


def _fit(run: StageRun, kind: str, config: CurvatureConfig, theta_end: dict, basis, memory: int | None,
         scale: float = 1.0):
    """The factored curvature C_ℓ at θ_ℓ (with ``basis``: its eigenvalues in that curvature's kept eigenbases), its
    data part scaled by ``scale`` times, on a run reweighted by one weight c (``approximate`` checks it is uniform),
    c."""
    n = len(run.stage)
    indices = None
    if config.hessian_samples is not None and config.hessian_samples < n:
        indices = torch.randperm(n, generator=torch.Generator().manual_seed(config.seed))[:config.hessian_samples]
    fitted = fit_curvature(run.stage, run.trained, kind=kind, fisher=config.fisher, indices=indices,
                           extra=run.proximal(), at=theta_end, seed=config.seed, memory=memory, basis=basis)
    weight = scale * (1.0 if run.weights is None else float(run.weights[0]))
    if weight != 1.0:
        fitted.scale_data(weight)
    return fitted


DECAY_WARNING = 0.01
"""The relative change of δθ over a segment (``decay_ignored``) above which taking the groups' mean decoupled decay
warns; below it the note is in ``diagnostics["stability"]`` only (transformers' decay / no-decay groups leave ~10⁻⁵)."""
TOP_CURVATURES = ("hessian", "gauss-newton")
TOP_AUTO = 20
"""The most eigenpairs per stage ``top="auto"`` puts into the factored pieces."""
TOP_AUTO_PARAMETERS = 1_000_000
"""The most trained parameters of a stage for which ``top="auto"`` computes them: ARPACK needs 2k + 1 to 4k
products in float64, which cost several times the plain EK-FAC pieces and grow with the stage (the costs measured are
in ``benchmarks/results/bench_transformer/`` and ``studies/results/fidelity/``); above it pass ``top=k``."""


def top_count(top: int | str, p: int, itemsize: int, budget: int | None) -> tuple[int, str]:
    """(k, why): the number of top eigenpairs of a stage with p trained parameters. ``top`` itself when
    it is a number; for "auto" none when p > TOP_AUTO_PARAMETERS, else the largest k ≤ TOP_AUTO whose ARPACK
    workspace (ncv = max(2k + 1, 20) float64 vectors of p; none when k ≥ p − 1, which is dense: p² float64) plus the
    k kept vectors (``itemsize`` bytes per entry) fit in half of ``budget`` (bytes; None: the default budget), and 0
    where scipy is missing (with a warning naming the extra)."""
    if top != "auto":
        return int(top), "given"
    if p > TOP_AUTO_PARAMETERS:
        return 0, (f"auto: {p:,} trained parameters > TOP_AUTO_PARAMETERS ({TOP_AUTO_PARAMETERS:,}), where the "
                   "eigenpairs' products cost several times the pieces; pass top=k to have them")
    half = budget_of(budget) // 2

    def workspace(k: int) -> int:
        lanczos = p * p * 8 if k >= p - 1 else max(2 * k + 1, 20) * p * 8
        return lanczos + k * p * itemsize

    k = min(TOP_AUTO, p)
    while k and workspace(k) > half:
        k -= 1
    if not k:
        return 0, f"auto: one eigenpair's workspace ({workspace(1) / 2**30:.2f} GiB) is over half the budget left"
    if importlib.util.find_spec("scipy") is None:
        warnings.warn("approximate(top='auto') found no scipy, so its factored pieces have no exact top curvature "
                      "directions (top=0); pip install 'influkit[unrolled]' to add them.", stacklevel=4)
        return 0, "auto: scipy (ARPACK) is not installed"
    return k, "auto" if k == min(TOP_AUTO, p) else f"auto: as many as fit half the budget left ({half / 2**30:.2f} GiB)"


def _top_directions(run: StageRun, theta_end: dict, k: int, dtype: torch.dtype, curvature: str = "hessian",
                    scale: float = 1.0) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
    """((g (k,), V (p, k)), products taken): the k largest (algebraic) eigenpairs of the stage objective's Hessian,
    or its Gauss-Newton matrix (``curvature``), at ``theta_end`` (the model holds the stage's inherited block), by
    ARPACK's Lanczos on its products, or densely when k ≥ p − 1 (either way through scipy: ``top_count`` takes none
    without it). A stage re-run at one weight c per example (``at=``) has c·H_data + ∇²(R + proximal) (the
    operator's ``data_weight``), times ``scale`` (a Trainer stage's, :func:`_linearized`)."""
    linalg = require("scipy.sparse.linalg", "approximate(..., top=k)")
    weight = scale * (1.0 if run.weights is None else float(run.weights[0]))
    operator = HessianOperator(run.stage, list(run.trained), at=theta_end, curvature=curvature,
                               extra=run.proximal(), data_weight=weight)
    p = operator.dim
    if k >= p - 1:
        dense = operator.matvec(torch.eye(p, dtype=operator.dtype, device=operator.device)).double()
        values, vectors = torch.linalg.eigh(0.5 * (dense + dense.T))
        return (values[-k:].to(dtype), vectors[:, -k:].to(dtype)), operator.products
    matvec = lambda x: operator.matvec(torch.as_tensor(x, dtype=operator.dtype, device=operator.device  # noqa: E731
                                               ).reshape(p, -1)).double().cpu().numpy().reshape(x.shape)
    values, vectors = linalg.eigsh(linalg.LinearOperator((p, p), matvec=matvec, dtype=float), k=k, which="LA")
    device = theta_end[next(iter(theta_end))].device
    return (torch.as_tensor(values, dtype=dtype, device=device),
            torch.as_tensor(vectors, dtype=dtype, device=device)), operator.products


def _factored_piece(fitted, v: torch.Tensor, w: torch.Tensor, lrs: list[float], momentum: float, decay: float,
                    stability: dict, directions: tuple[torch.Tensor, torch.Tensor] | None = None,
                    adam: AdamPiece | None = None):
    """u of one piece with the factored curvature C fitted at θ_ℓ, and (v, w) moved to the piece's start **in
    place**: each output is Σ_j f_j(C)·input_j with f_j the piece's coefficient functions of one eigenvalue (``_maps``
    on unit inputs), all applied in one pass over C's blocks (:meth:`FactoredCurvature.functions`). Under Adam
    (``adam``) the map is split by its order in the curvature (module docstring, Adam): F(0) and F'(0) with the
    diagonal P itself (F(0) elementwise, F'(0) through products with C, on the eigenvalues :func:`_first_order`
    keeps), the rest in C's eigenbasis with P projected onto it (d = q_iᵀ P q_i); the steps are Adam's (heavy-ball
    learning rates, clipping gains, decoupled decay). Adds u, and under Adam three more (q, p) outputs and two
    products with C."""
    steps = (lrs, momentum, stability) if adam is None else (adam.lrs, adam.momentum, stability, adam.rho, adam.gains)
    quiet = steps[:2] + (None,) + steps[3:]  # the same steps, their stability not counted again
    preconditioner = None if adam is None else adam.P.to(v.dtype)
    carried = steps[1] > 0  # with momentum the buffer's adjoint w is carried (else it stays 0)
    top = directions is not None
    low, slopes = ((), None) if preconditioner is None else \
        _low_orders(fitted, v, w if carried else None, preconditioner, decay, directions, quiet)

    def remainder(maps, lam, d):  # f(λ, d) − f(0, d) − λ' f_λ(0, d), f_ij = d^{a_ij} φ_ij(dλ) (a = ORDERS)
        zero = _maps(torch.zeros_like(lam), d, *quiet)
        lam = _first_order(lam, d, quiet, slopes[0][0])
        return [[f - f0 - lam * d ** (a + 1) * s for f, f0, s, a in zip(row, row0, slope, orders)]
                for row, row0, slope, orders in zip(maps, zero, slopes, ORDERS)]

    def coefficients(lam, d=None):  # [[f_ij]]: outputs i = (u, v', w'), inputs j = (v, w)
        maps = _maps(lam + decay, d, *steps)
        return maps if d is None else remainder(maps, lam + decay, d)

    if top:  # the top span's coordinates kept apart, the factored map runs on the complement
        g, basis = directions
        v_top, w_top = v @ basis, w @ basis
        v -= v_top @ basis.T
        w -= w_top @ basis.T
    u = torch.zeros_like(v)
    fitted.functions([v.T, w.T] if carried else [v.T], coefficients if carried else
                     (lambda lam, d=None: coefficients(lam, d)[:2]), out=[u.T, v.T, w.T] if carried else [u.T, v.T],
                     diagonal=preconditioner)
    if top:  # the complement's outputs projected back onto it, the span's own map added
        for x in (u, v, w):
            x -= (x @ basis) @ basis.T
        d_top = None if preconditioner is None else (basis ** 2).T @ preconditioner
        maps = _maps(g + decay, d_top, *steps)
        if d_top is not None:
            maps = remainder(maps, g + decay, d_top)
        top_in = (v_top, w_top) if carried else (v_top,)
        for x, row in zip((u, v, w), maps):
            x += sum(f * t for f, t in zip(row, top_in)) @ basis.T
    for x, part in zip((u, v, w), low):
        x += part
    return u


def _first_order(lam: torch.Tensor, d: torch.Tensor, quiet, slope: float) -> torch.Tensor:
    """λ where an Adam piece's map of the eigen-coordinate is still close to linear in its curvature, else 0: the
    eigenvalues whose first order the piece takes with the diagonal P (:func:`_factored_piece`). Close: the map
    u ← v past its first order, |f(λ, d) − f(0, d) − λ d² φ'(0)|, is at most half that first order |λ d² φ'(0)|
    (``slope`` φ'(0)). Past it the first order outgrows the map (a long piece saturates at the minimum's response)
    and its remainder, in the projected P, would cancel it only where P_Q = P, so there it stays in the remainder."""
    first = lam * d * d * slope
    rest = _maps(lam, d, *quiet)[0][0] - _maps(torch.zeros_like(lam), d, *quiet)[0][0] - first
    return torch.where(rest.abs() <= 0.5 * first.abs(), lam, torch.zeros_like(lam))


ORDERS = ((1, 0), (0, -1), (1, 0))
"""a_ij of f_ij(λ, d) = d^{a_ij} φ_ij(dλ), the piece's maps (``_maps``) from the inputs j = (α, β) to the outputs
i = (u, α_start, β_start): u and β_start carry P^{1/2} on the left, α P^{1/2} on the right, so the first order
λ d^{a_ij + 1} φ'_ij(0) is P^{[i ≠ α]} C P^{[j = α]} φ'_ij(0) in θ's coordinates (module docstring, Adam)."""


def _low_orders(fitted, v: torch.Tensor, w: torch.Tensor | None, P: torch.Tensor, decay: float, directions,
                quiet) -> tuple[list, list]:
    """([u, α, β parts], slopes): the zeroth and first order in the curvature of one Adam piece's map, applied to
    (v, w) with the diagonal P itself — F(0) elementwise (f_ij(0, P)), and the first order λ d^{a_ij + 1} φ'_ij(0)
    as P^{[i ∈ (u, β)]} K P^{[j = α]} (K the piece's curvature: C plus the coupled decay, the top directions' exact
    eigenvalues in their span) — and the slopes φ'_ij(0) (one number each) for :func:`_factored_piece`'s remainder."""
    lam = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():
        unit = _maps(lam, None, *quiet)
        slopes = [[float(torch.autograd.grad(f.sum(), lam, retain_graph=True, allow_unused=True)[0] or 0.0)
                   if f.requires_grad else 0.0 for f in row] for row in unit]
    inputs = (v, w) if w is not None else (v,)
    zero = _maps(torch.zeros_like(P), P, *quiet)
    parts = [sum(f * x for f, x in zip(row, inputs)) for row in zero]

    def kept(e, d):  # K's eigenvalues where the first order is kept, else 0
        return [[_first_order(e + decay, d, quiet, slopes[0][0])]]

    def curvature(x: torch.Tensor) -> torch.Tensor:  # K' x for x (q, p): K's eigenvalues past _first_order's bound 0
        out = torch.empty_like(x)
        if directions is None:
            fitted.functions([x.T], kept, out=[out.T], diagonal=P)
        else:
            g, basis = directions
            inside = x @ basis
            fitted.functions([(x - inside @ basis.T).T], kept, out=[out.T], diagonal=P)
            out -= (out @ basis) @ basis.T
            out += (inside * _first_order(g + decay, (basis ** 2).T @ P, quiet, slopes[0][0])) @ basis.T
        return out

    products = [curvature(P * v)] + ([curvature(w)] if w is not None else [])
    for i, (part, row) in enumerate(zip(parts, slopes)):
        for slope, product in zip(row, products):
            if slope:
                part += slope * (P * product if ORDERS[i][0] == 1 else product)
    return parts, slopes
