"""Where a trained stage stands: its relative gradient norm, its extreme Hessian eigenvalues, and a verdict.

Influence functions differentiate the optimality condition ∇L(θ̂) = 0 and invert H = ∇²L(θ̂); they hold at a
minimum (∇L = 0, H ≻ 0). Models trained with Adam for a few epochs are rarely there. :func:`assess` measures it:

- ``gradient_norm`` r = ‖∇L(θ̂)‖ / g, where ∇L is the gradient of the whole objective (mean loss + regularizer
  + proximal term) and g = (mean_{i∈S} ‖∇ℓ_i(θ̂)‖²)^½ is the RMS of the per-example *loss* gradient norms —
  "typical": the size of one example's pull, which the influence of one example is measured against. Both over
  every example (S all n, ``gradient_source="pass"``), in one streamed pass with the registered layers hooked
  (:func:`influkit.factored.fit.objective_gradient`: a layer's batch gradient is one product of its recorded inputs
  and true-label output-gradients, an example's squared norm a sum of Gram products, no per-example gradient row;
  the registered layers owning the other parameters hooked too; a decoder tied to the word embeddings from both
  layers' hooks, :meth:`influkit.layers.Embedding.tied_example_norms`). A trained parameter in no such layer, or
  shared otherwise, adds its batch gradient from the pass's own backward, so ∇L stays
  exact; its per-example squared norms, whose rows over every example would cost more than the rest of the pass,
  come from the seeded sample of :func:`light_sample` (n) examples (``"pass+sample"``, ``sample`` = s): g² = the
  hooked parameters' (1/n) Σ_i ‖∇ℓ_i‖² + the mean over the sample of the others' (unbiased; exact when s = n).
  Where the loss gives no per-example output-gradients to hook: the seeded sample of the light check below, ∇L
  estimated from it with its bound where that settles the verdict (``"sample"``), else drawn on, or one gradient
  pass (``"data"``).
- ``min_eigenvalue`` θ_min, ``max_eigenvalue`` θ_max: extreme Ritz values of H. They bound the spectrum from
  inside, λ_min ≤ θ_min ≤ θ_max ≤ λ_max: a negative θ_min *certifies* negative curvature, a small |θ_min|
  certifies a near-null direction, a positive θ_min does not certify H ≻ 0 (curvature the Krylov space did not
  reach is not seen).

**Eigenvalues only where they decide something.** The verdict needs θ_min only when r ≤ ``GRADIENT_TOL``; off a
stationary point the gradient alone settles it. So a separate Lanczos run (three-term recurrence from a seeded
start, O(p) memory, one Hessian-vector product per step) runs only

- for a stage whose gradient says it may be stationary: m = min(p, ``STEPS``) steps on the exact H
  (``eigenvalue_source="lanczos"``), θ_min deciding minimum / saddle / singular;
- for ``auto``'s damping off a stationary point (``spectrum="largest"``: ``solver="auto"`` with neither a damping
  nor :class:`~influkit.auto.Training`), when no fitted factored curvature gives θ_max for free:
  ``LARGEST_STEPS`` steps on the Hessian of a seeded sample of min(n, ``SAMPLE``) examples
  (``eigenvalue_source="lanczos-sample"``, ``eigenvalue_sample`` examples: an estimate of H's θ_max, whose extreme
  eigenvalues converge first, at ``LARGEST_STEPS``·min(n, SAMPLE)/n of a full product each);
- always with ``spectrum="all"`` (the full check, whatever r).

Otherwise the eigenvalues are not measured (``None``, ``eigenvalue_source="none"``, no product), and a
:class:`~influkit.chain.Chain`'s query fills them in from its solve's own Krylov iterations (:meth:`Position.solved`):
MINRES and CG build a Lanczos tridiagonal of the system they solve, whose extreme Ritz values, less the damping λ,
are those of the solved matrix (H, or the Gauss-Newton G: ``eigenvalue_matrix``) after as many steps as the solve
took (:func:`influkit.krylov.extreme_ritz_values`); ``direct`` gives the exact ones when it fell back to an
eigendecomposition, ``arnoldi`` its fitted Ritz pairs. ``products`` counts the check's own Hessian-vector products.

**A check sized to its stage's fit** (``light=True``: a :class:`~influkit.chain.Chain` asks it for a stage whose
solve fits a factored curvature — ``kfac``/``ekfac`` as the approximate inverse or the preconditioner —, whose fit
is one or two data passes and no Hessian-vector product, where the full check's m products, about three passes
each, and its gradient pass would cost many times that fit):

- the factored fit runs first (``factored()``, fitted with ``gradient=True``: :func:`influkit.factored.fit_curvature`)
  and its statistics pass measures what the check needs of the data (``gradient_source="fit"``): it runs a forward
  and a backward per batch anyway and records each hooked layer's inputs a_t and output-gradients g_t; with the true
  labels' output-gradients (the pass's own on the empirical Fisher; one more backward through the same graph, no
  forward, on the sampled or exact one) a layer's batch gradient is Σ_{i,t} g_t ā_tᵀ and an example's squared norm
  ‖Σ_t g_t ā_tᵀ‖²_F = Σ_{t,t'} (ā_t·ā_t')(g_t·g_t') (:meth:`influkit.layers.Layer.example_norms`); the parameters
  with diagonal blocks take their per-example rows. So ∇L = (1/n) Σ_i ∇ℓ_i + ∇(R + extra) and
  g = ((1/n) Σ_i ‖∇ℓ_i‖²)^½ are exact over every example (``sample`` = n, ``gradient_bound`` 0), and ``seconds``
  counts what measuring them added to the pass (and any Lanczos steps), not the factored fit, which is the solve's;
  a parameter no hook reaches (in no registered layer) adds its batch gradient from the pass's true-label backward, its
  per-example norms from the sample as in the hooked pass above (``"fit+sample"``) — no gradient pass of its own;
- when the fit's pass does not give them — it covers a Hessian sample (``hessian_samples`` < n), or the fitted
  curvature was kept from a fit without them — the sample is s = min(n, max(``LIGHT_SAMPLE_MIN``, min(``SAMPLE``,
  ⌈n/``LIGHT_SAMPLE_SHARE``⌉))) examples; when it does not settle the verdict (below), it is drawn
  on (the same seeded order) to the size s' that would settle it were ‖∇L‖ its unbiased estimate
  ρ = (‖ĝ‖² − SE²)^½, s' = 1.2·Z²σ²/((ρ − GRADIENT_TOL·g)² + Z²σ²/n), provided s' ≤ n/``LIGHT_GROW_SHARE`` (a quarter
  of the data, cheaper than the exact pass); ``sample`` says how many were used. ∇L is estimated by the sample's
  mean gradient ĝ (+ ∇(R + extra), which needs no data). Drawn without replacement, ĝ − ∇L has mean 0 and
  E‖ĝ − ∇L‖² = SE² = (1 − s/n)·σ²/s, σ² = Σ_{i∈S}‖∇ℓ_i − ĝ‖²/(s − 1) (estimated on the sample). By the central
  limit theorem over the s examples, ‖ĝ − ∇L‖ ≤ ``BOUND_Z``·SE with probability about 95 % whatever the gradients'
  covariance (the rank-one case, |N(0, SE²)|, has the heaviest tail; Chebyshev without the CLT gives ≥ 75 %).
  ``gradient_bound`` b = ``BOUND_Z``·SE/g is that half-width on r; when r − b > ``GRADIENT_TOL`` the stage is
  non-stationary from the sample alone (``gradient_source="sample"``); otherwise the exact gradient pass decides
  (``"data"``, b = 0), as in the full check;
- a non-stationary stage's verdict does not depend on the eigenvalues, which then come from the fitted factored
  curvature C ≈ G, the matrix its solve uses (C's extreme eigenvalues, ``eigenvalue_source="ekfac"`` or ``"kfac"``,
  no Hessian-vector product); a stationary one gets the m Lanczos steps on the exact H, since its verdict
  rests on θ_min (at a minimum ``auto`` solves H, preconditioned by the factored fit the check ran).

**From the solve** (:func:`from_solve`: a :class:`~influkit.chain.Chain` stage whose solve the user named with its
damping — one that multiplies by H or G over every example: ``minres``, ``cg_spd``, ``cg``, ``lissa``, ``neumann``, and
``direct``'s dense H or ``arnoldi``'s Lanczos at the fit —, no factored fit): nothing of the check depends on the
answer, and the solve's first product passes over every example anyway, its gradient of the objective a by-product (:class:`~influkit.curvature.HessianOperator`'s
``objective_gradient``: the cached graph's ∇L, the streamed batches' ``vjp(grad)`` primals, on G one more backward
per batch through the kept forward graph). So the check waits for that product (the chain's first query, or the
first time ``positions`` is read, whichever comes first; read before any product, the full check runs then): ∇L is
exact over every example, and g is estimated from the per-example gradients of the seeded sample of
:func:`light_sample` (n) examples, one backward each — g² by their mean squared norm, with the upper bound
g_hi² = m + ``BOUND_Z``·SE, SE² = (1 − s/n)·var(‖∇ℓ_i‖²)/s (≈95 % by the central limit theorem). When
‖∇L‖/g_hi > ``GRADIENT_TOL`` the stage is non-stationary (``gradient_source="solve"``, ``gradient_bound`` r − ‖∇L‖/g_hi,
no data pass and no Hessian-vector product of the check's own); otherwise the full check decides, θ_min included. Its
eigenvalues then come from the solve's iterations, as above.

**From the kept graphs** (``assess(..., gauss_newton=G)``: ``auto``'s damping needs θ_max, no factored fit): off a
minimum ``auto`` solves on G, and where G's operator keeps its batch graphs in memory (a head on a frozen encoder,
whose every product would otherwise run the encoder again) the check builds them now — the solve's forward, moved
from the query to the fit — and takes ∇L from them (one backward per batch through the kept graph, no forward),
g from the sample as above (``gradient_source="graph"``); θ_max still comes from the sampled Hessian's Lanczos steps.
When the bound leaves the verdict open, or G streams its products, the check runs as below, and the graphs' seconds
count as its own.

Verdict, with ε = √(machine epsilon of H's dtype) (1.5e-8 in float64, 3.5e-4 in float32: a float32
Hessian-vector product carries a relative error well above float32's epsilon) and s = max(|θ_min|, |θ_max|):

| verdict            | when                                                     |
|--------------------|----------------------------------------------------------|
| ``non-stationary`` | r > ``GRADIENT_TOL`` (1e-3)                              |
| ``saddle``         | r ≤ ``GRADIENT_TOL`` and θ_min < −ε·s                    |
| ``singular``       | r ≤ ``GRADIENT_TOL`` and |θ_min| ≤ ε·s (or H = 0)        |
| ``minimum``        | r ≤ ``GRADIENT_TOL`` and θ_min > ε·s                     |

Cost of the check: one hooked pass over the data (or a light check's share of the factored fit's, or, from the
solve, a sample's per-example gradients) and the
Hessian-vector products above (none off a stationary point unless ``auto``'s damping needs θ_max and no factored fit
gives it). A sample's per-example gradients, where they are taken, run in the chunks they fit in the memory budget
(:mod:`influkit.memory`: rows included, so the plain gradient pass holds no more than the per-example one); a :class:`~influkit.chain.Chain` without ``memory=`` runs a light check's passes and products in
batches of at most ``memory.DEFAULT_WORKING`` (``least=1``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace

import torch

from .curvature import HessianOperator, gradient, penalty_gradient
from .errors import InputError, StationarityWarning, warn
from .factored.fisher import FactoredCurvatureError
from .factored.fit import objective_gradient
from .gradients import chunk_for, per_example_grad_rows
from .memory import DEFAULT_EXAMPLES
from .operators import Operator
from .params import ParamSpace, point
from .progress import bar
from .scoring import release_freed_memory
from .stage import Stage

GRADIENT_TOL = 1e-3  # r above it: not a stationary point
SAMPLE = 64  # examples whose per-example gradient norms give the typical norm g
STEPS = 20  # Lanczos steps (Hessian-vector products) for θ_min, θ_max where the verdict needs θ_min
LARGEST_STEPS = 8  # Lanczos steps on a sample's Hessian for θ_max alone (auto's damping off a stationary point)
SPECTRA = ("all", "verdict", "largest")  # what assess measures of the eigenvalues (module docstring)
LIGHT_SAMPLE_SHARE = 16  # a light check's sample: about n/16 examples ...
LIGHT_SAMPLE_MIN = 8  # ... at least 8 (and at most SAMPLE)
BOUND_Z = 2.0  # ‖ĝ − ∇L‖ ≤ BOUND_Z·SE with probability ≈ 95 % (module docstring)
LIGHT_GROW_SHARE = 4  # an unsettled light sample is drawn up to the size that settles it when that is ≤ n/4
VERDICTS = ("minimum", "saddle", "non-stationary", "singular")


@dataclass(frozen=True)
class Position:
    """Where one stage stands (module docstring): r, θ_min, θ_max, the verdict, and what it cost."""

    gradient_norm: float  # r = ‖∇L‖ / g
    min_eigenvalue: float | None  # θ_min ≥ λ_min (None: not measured, the gradient settled the verdict)
    max_eigenvalue: float | None  # θ_max ≤ λ_max (None: not measured)
    verdict: str
    objective_gradient: float  # ‖∇L‖
    typical_gradient: float  # g, RMS per-example loss-gradient norm over the sample
    sample: int  # |S|
    lanczos_steps: int  # the Krylov steps the eigenvalues rest on (0: a fitted curvature's, or none)
    eigenvalue_tol: float  # ε
    seconds: float  # the check's own seconds
    gradient_bound: float = 0.0  # b: r's half-width at ≈95 % (0: ∇L and g from the whole data, exact)
    # "pass" / "fit": ∇L and g from every example in the check's hooked pass / the factored fit's data pass ("+sample":
    # g's share of the parameters no hook reaches from ``sample`` examples); "data": ∇L from a gradient pass, g from
    # the sample; "sample": both estimated on the sample (light check); "solve" / "graph": ∇L exact from the solve's
    # first product / from the Gauss-Newton graphs auto's solve reuses, g from the sample (b: how far below r its
    # lower bound lies)
    gradient_source: str = "data"
    # "lanczos" on the exact H; "lanczos-sample" on the Hessian of ``eigenvalue_sample`` examples; the fitted factored
    # curvature ("ekfac", "kfac"); "none" (not measured); or the solver whose own iterations gave them (``solved``)
    eigenvalue_source: str = "lanczos"
    eigenvalue_matrix: str = "hessian"  # the matrix they are eigenvalues of: "hessian", or "gauss-newton" (a solve on G)
    eigenvalue_sample: int = 0  # examples of the sampled Hessian ("lanczos-sample"); 0: the stage's own
    products: int = 0  # Hessian-vector products the check ran (on ``eigenvalue_sample`` examples where sampled)

    @property
    def at_minimum(self) -> bool:
        return self.verdict == "minimum"

    def summary(self) -> dict:
        """JSON-friendly, for ``diagnostics["stages"][k]`` (plus ``gradient_tol``, the threshold on r)."""
        return asdict(self) | {"gradient_tol": GRADIENT_TOL}

    @classmethod
    def from_summary(cls, summary: dict) -> "Position":
        """The position :meth:`summary` wrote."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in summary.items() if k in known})

    def solved(self, solver: str, matrix: str, eigenvalues: Sequence | None) -> "Position":
        """This position with the eigenvalues it did not measure taken from a solve's own iterations: ``eigenvalues``
        = (θ_min, θ_max, steps) of the solved ``matrix`` (:attr:`influkit.solvers.Solution.eigenvalues`); unchanged
        where the check measured them or the solve gave none."""
        if self.eigenvalue_source != "none" or not eigenvalues:
            return self
        low, high, steps = eigenvalues
        return replace(self, min_eigenvalue=low, max_eigenvalue=high, lanczos_steps=int(steps),
                       eigenvalue_source=solver, eigenvalue_matrix=matrix)

    def describe(self) -> str:
        """One line: the verdict with the numbers it rests on."""
        bound = f" ± {self.gradient_bound:.2g} (from {self.sample} examples)" if self.gradient_source == "sample" else ""
        typical = (f" (its share from the parameters no layer hook reaches estimated on {self.sample} examples)"
                   if self.gradient_source.endswith("+sample") else
                   f" (∇L from {_FROM[self.gradient_source]}, the typical norm from {self.sample} examples: "
                   f"r ≥ {self.gradient_norm - self.gradient_bound:.2g} at ≈95 %)" if self.gradient_source in _FROM
                   else "")
        return (f"{self.verdict}: ‖∇L‖ = {self.gradient_norm:.2g}{bound} × the typical per-example gradient norm"
                f"{typical} (stationary below {GRADIENT_TOL:g}), {self.spectrum()}")

    def spectrum(self) -> str:
        """What the eigenvalues are and where they came from, in words."""
        source, low, high = self.eigenvalue_source, _number(self.min_eigenvalue), _number(self.max_eigenvalue)
        if source == "none":
            return "eigenvalues not measured (the gradient settles the verdict)"
        of = "Gauss-Newton" if self.eigenvalue_matrix == "gauss-newton" else "Hessian"
        if source == "lanczos":
            return f"Hessian eigenvalues within [{low}, {high}] ({self.lanczos_steps} Lanczos steps)"
        if source == "lanczos-sample":
            return (f"the Hessian of {self.eigenvalue_sample} examples has eigenvalues within [{low}, {high}] "
                    f"({self.lanczos_steps} Lanczos steps)")
        if source in ("ekfac", "kfac"):
            return f"{source.upper()} eigenvalues within [{low}, {high}] (its fit)"
        return f"{of} eigenvalues within [{low}, {high}] (Ritz values of the {source} solve, {self.lanczos_steps} steps)"


_FROM = {"solve": "the solve's first product", "graph": "the Gauss-Newton graphs its solve reuses"}


def _number(value: float | None) -> str:
    return "?" if value is None else f"{value:.3g}"


def eigenvalue_tol(dtype: torch.dtype) -> float:
    """ε = √(machine epsilon of ``dtype``): relative size below which an eigenvalue counts as zero."""
    return math.sqrt(torch.finfo(dtype).eps)


def verdict(gradient_norm: float, min_eigenvalue: float, max_eigenvalue: float, tol: float) -> str:
    """The verdict of the module table for r = ``gradient_norm``, θ_min, θ_max and ε = ``tol``."""
    if not gradient_norm <= GRADIENT_TOL:
        return "non-stationary"
    scale = max(abs(min_eigenvalue), abs(max_eigenvalue))
    if min_eigenvalue < -tol * scale:
        return "saddle"
    if scale == 0 or min_eigenvalue <= tol * scale:
        return "singular"
    return "minimum"


def extreme_eigenvalues(operator: Operator, steps: int = STEPS, *, seed: int = 0, start: torch.Tensor | None = None,
                        progress: bool = False) -> tuple[float, float, int]:
    """(θ_min, θ_max, m): the extreme Ritz values of the symmetric ``operator`` after m ≤ ``steps`` Lanczos steps.

    Plain three-term recurrence (no stored basis: three vectors, updated in place) in the operator's precision, at
    least float32 (a float32 Hessian-vector product carries float32's error anyway; float64 would triple the
    memory); loss of orthogonality only adds copies of converged Ritz values, not spurious
    extremes. Starts from ``start`` (normalized), else a seeded random vector. Stops early on an invariant subspace
    (then the values are exact)."""
    p = operator.dim
    steps = max(1, min(steps, p))
    dtype = torch.promote_types(operator.dtype, torch.float32)
    if start is None:
        start = torch.randn(p, generator=torch.Generator(device="cpu").manual_seed(seed), dtype=torch.float64)
    q = start.reshape(-1).to(device=operator.device, dtype=dtype).clone()
    q /= q.norm()
    previous = torch.zeros_like(q)
    alphas, betas = [], []
    beta = 0.0
    steps_bar = bar(steps, "where the stage stands: Lanczos, Hessian-vector products", progress)
    for _ in range(steps):
        steps_bar.update()
        w = torch.sub(operator.matvec(q.to(operator.dtype)).to(dtype), previous, alpha=beta)  # a new vector
        alpha = float(q @ w)
        w.sub_(q, alpha=alpha)
        alphas.append(alpha)
        beta = float(w.norm())
        if beta <= 1e-12 * max(abs(a) for a in alphas) or len(alphas) == steps:
            break
        betas.append(beta)
        previous, q = q, w.div_(beta)
    steps_bar.close()
    m = len(alphas)
    tri = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if m > 1:
        off = torch.tensor(betas[: m - 1], dtype=torch.float64)
        tri += torch.diag(off, 1) + torch.diag(off, -1)
    theta = torch.linalg.eigvalsh(tri)
    return float(theta[0]), float(theta[-1]), m


def light_sample(n: int) -> int:
    """The sample of a light check: min(n, max(LIGHT_SAMPLE_MIN, min(SAMPLE, ⌈n/LIGHT_SAMPLE_SHARE⌉)))."""
    return min(n, max(LIGHT_SAMPLE_MIN, min(SAMPLE, -(-n // LIGHT_SAMPLE_SHARE))))


def assess(stage: Stage, names: Sequence[str] | None, operator: Operator, *, extra: Callable | None = None,
           seed: int = 0, memory: int | None = None, least: int = DEFAULT_EXAMPLES,
           factored: Callable[[], object] | None = None, spectrum: str = "all", progress: bool = False,
           gauss_newton: HessianOperator | None = None) -> Position:
    """Where ``stage`` stands at its current parameters ``names`` (module docstring).

    operator: H of the objective over ``names`` (e.g. the chain's :class:`~influkit.curvature.HessianOperator`,
    with its ``hessian_samples``); extra: the term the objective adds besides the stage's (Case 2's proximal term);
    memory: the budget in bytes the gradient passes are chunked by (None: the default, :mod:`influkit.memory`, whose
    floor of examples per chunk is ``least``). factored: the light check, sized to a factored fit (module
    docstring) — a callable returning the fitted :class:`~influkit.factored.FactoredCurvature` its solve uses,
    fitted with ``gradient=True`` when it is fitted by the call — whose ``gradient`` gives r from every example
    and whose eigenvalues are those of a non-stationary stage; without its ``gradient`` (kept from an earlier fit,
    or fitted over a subset of the examples), r comes from the sample :func:`light_sample`.
    spectrum: what is measured of the eigenvalues off a stationary point (``SPECTRA``, module docstring): ``"all"``
    θ_min and θ_max whatever r; ``"verdict"`` nothing the verdict does not need; ``"largest"`` θ_max for auto's damping.
    gauss_newton: with ``"largest"`` and no ``factored``, the G operator ``auto`` solves a non-stationary stage on:
    where it keeps its graphs, they give ∇L (module docstring, "From the kept graphs").
    """
    if spectrum not in SPECTRA:
        raise InputError(f"unknown spectrum {spectrum!r}; choose one of {SPECTRA}.")
    start = time.perf_counter()
    names = stage.param_names if names is None else list(names)
    n = len(stage)
    if spectrum == "largest" and factored is None and gauss_newton is not None:
        building = time.perf_counter()
        kept = gauss_newton.kept_gradient()
        building = time.perf_counter() - building - gauss_newton.gradient_seconds  # the graphs: the solve's
        found = None if kept is None else from_solve(stage, names, gauss_newton, seed=seed, source="graph")
        if found is not None:
            examples = min(n, SAMPLE)
            sampled = HessianOperator(stage, names, samples=examples, seed=seed, extra=extra, memory=memory)
            low, high, m = extreme_eigenvalues(sampled, LARGEST_STEPS, seed=seed, progress=progress)
            return replace(found, min_eigenvalue=low, max_eigenvalue=high, lanczos_steps=m,
                           eigenvalue_source="lanczos-sample", eigenvalue_sample=examples, products=m,
                           seconds=time.perf_counter() - start - building)
    curvature, fitting, source = None, 0.0, None  # fitting: seconds of the factored fit that are the solve's, not the check's
    if factored is not None:
        fitting = time.perf_counter()
        curvature = factored()
        fitting = time.perf_counter() - fitting
    measured = None if curvature is None else curvature.gradient
    if measured is not None and measured.examples == n:  # ∇L and g from every example, in the fit's data pass
        fitting -= measured.seconds
        source = "fit"
    elif factored is None and (measured := _gradient_pass(stage, names, extra, memory, progress)) is not None:
        source = "pass"
    if source in ("fit", "pass"):
        absolute, typical, count, bound = measured.norm, measured.typical, n, 0.0
        if measured.unmeasured:  # g's share of the parameters no hook reaches, from a sample's rows
            typical, count = _completed_typical(stage, measured, seed)
            source += "+sample" if count < n else ""
    else:
        absolute, typical, count, bound, source = _gradient_norms(stage, names, extra, seed, memory, least, progress)
    relative = absolute / typical if typical > 0 else (0.0 if absolute == 0 else math.inf)
    release_freed_memory()  # the passes' freed buffers back to the system before the products allocate theirs
    tol = eigenvalue_tol(operator.dtype)
    examples = 0
    if curvature is not None and relative > GRADIENT_TOL:
        low, high, m, where = curvature.smallest(), curvature.largest(), 0, curvature.kind
    elif relative <= GRADIENT_TOL or spectrum == "all":
        (low, high, m), where = extreme_eigenvalues(operator, STEPS, seed=seed, progress=progress), "lanczos"
    elif spectrum == "largest":
        examples = min(n, SAMPLE)
        sampled = HessianOperator(stage, names, samples=examples, seed=seed, extra=extra, memory=memory)
        (low, high, m), where = extreme_eigenvalues(sampled, LARGEST_STEPS, seed=seed, progress=progress), "lanczos-sample"
    else:
        low, high, m, where = None, None, 0, "none"
    return Position(gradient_norm=relative, min_eigenvalue=low, max_eigenvalue=high,
                    verdict=verdict(relative, low, high, tol), objective_gradient=absolute, typical_gradient=typical,
                    sample=count, lanczos_steps=m, eigenvalue_tol=tol,
                    seconds=time.perf_counter() - start - fitting,
                    gradient_bound=bound / typical if typical > 0 and source == "sample" else 0.0,
                    gradient_source=source, eigenvalue_source=where, eigenvalue_sample=examples,
                    products=m if where.startswith("lanczos") else 0)


def from_solve(stage: Stage, names: Sequence[str], operator: Operator, *, seed: int = 0,
               source: str = "solve") -> Position | None:
    """Where a non-stationary ``stage`` stands, measured from its solve (module docstring, "From the solve"): ∇L the
    ``objective_gradient`` its operator recorded in its first product over every example, g from the per-example
    gradients of a seeded sample of :func:`light_sample` (n) examples; None when the operator recorded none (no
    product yet, or over a Hessian sample or another objective) or when r's lower bound ‖∇L‖/g_hi leaves the
    verdict open (then the full check decides, with its θ_min). source: ``gradient_source`` ("graph": the operator's
    kept graphs, :meth:`~influkit.curvature.HessianOperator.kept_gradient`)."""
    recorded = getattr(operator, "objective_gradient", None)
    if (recorded is None or operator.indices is not None or operator.data_weight != 1.0
            or list(operator.names) != list(names)):
        return None
    start = time.perf_counter()
    n = len(stage)
    size = light_sample(n)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:size].sort().values
    squares = _example_squares(stage, order, names)
    absolute, typical, high = float(recorded.double().norm()), float(squares.mean().sqrt()), _typical_high(squares, n)
    if not (high > 0 and absolute / high > GRADIENT_TOL):
        return None
    relative = absolute / typical
    return Position(gradient_norm=relative, min_eigenvalue=None, max_eigenvalue=None, verdict="non-stationary",
                    objective_gradient=absolute, typical_gradient=typical, sample=size, lanczos_steps=0,
                    eigenvalue_tol=eigenvalue_tol(operator.dtype),
                    seconds=time.perf_counter() - start + operator.gradient_seconds,
                    gradient_bound=relative - absolute / high, gradient_source=source, eigenvalue_source="none")


def _gradient_pass(stage: Stage, names, extra, memory, progress: bool):
    """‖∇L‖ and g over every example in one hooked pass (:func:`influkit.factored.fit.objective_gradient`: g over the
    hooked parameters, ``unmeasured`` the others), or None where the loss has no per-example output-gradients to
    hook."""
    try:
        return objective_gradient(stage, names, extra=extra, memory=memory, progress=progress)
    except FactoredCurvatureError:
        return None


def _completed_typical(stage: Stage, measured, seed: int) -> tuple[float, int]:
    """(g, s): g² = the measured parameters' (1/n) Σ_i ‖∇ℓ_i‖² over every example + the mean over a seeded sample of
    s = :func:`light_sample` (n) examples of the squared norms of the ``measured.unmeasured`` parameters' per-example
    gradients (an unbiased estimate of their share; exact when s = n), by :func:`_example_squares`."""
    n = len(stage)
    size = light_sample(n)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:size].sort().values
    squares = _example_squares(stage, order, list(measured.unmeasured))
    return math.sqrt(measured.typical ** 2 + float(squares.mean())), size


def _typical_high(squares: torch.Tensor, n: int) -> float:
    """g_hi = (m + BOUND_Z·SE)^½, m the mean of a sample's s squared norms ‖∇ℓ_i‖², SE² = (1 − s/n)·var(‖∇ℓ_i‖²)/s:
    g's upper bound at ≈95 % over the n examples (g itself when s = n)."""
    s = squares.numel()
    spread = float(squares.var()) if s > 1 else 0.0
    return math.sqrt(float(squares.mean()) + BOUND_Z * math.sqrt(max(1 - s / n, 0.0) * spread / s))


def _example_squares(stage: Stage, order: torch.Tensor, names: Sequence[str]) -> torch.Tensor:
    """(s,) ‖∇ℓ_i‖² over ``names`` of the examples ``order``, one backward per example, one gradient row held at a
    time, never a vmapped batch of them: on a masked-LM BERT stage of 9.6 M parameters, most of them a vocabulary-sized
    decoder tied to the word embeddings, vmap's rows of 8 examples took longer than a gradient pass over all 128
    (24.8 s against 17.6 s, ``benchmarks/results/bench_check_profile``)."""
    params = {nm: t.detach().clone().requires_grad_(True) for nm, t in point(stage.state(), names).items()}
    squares = []
    for i in order.tolist():
        x, y = stage.data.take([i])
        with torch.enable_grad():
            grads = torch.autograd.grad(stage.losses(params, x, y).sum(), list(params.values()), allow_unused=True)
        squares.append(sum(float(g.pow(2).sum(dtype=torch.float64)) for g in grads if g is not None))
    return torch.tensor(squares, dtype=torch.float64)


def _gradient_norms(stage: Stage, names, extra, seed: int, memory, least: int,
                    progress: bool) -> tuple[float, float, int, float, str]:
    """(‖∇L‖, g, the sample's size, the half-width of ‖∇L‖ (0 when exact), its source "data" or "sample") from the
    per-example gradients of a seeded sample and, unless the sample is every example or a light sample settles the
    verdict, one gradient pass over the data (module docstring)."""
    n = len(stage)
    size = light_sample(n)
    order = None if size == n else torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    values = point(stage.state(), names)
    row = 2 * sum(t.numel() * t.element_size() for t in values.values())  # a gradient row and vmap's copy of it
    x, y = stage.data.take(torch.arange(n) if order is None else order[:size].sort().values)
    chunk = chunk_for(stage, x, y, names, None, row, "where the stage stands", memory, least)  # both passes' batch
    penalty = penalty_gradient(stage, names, extra=extra)
    penalty = 0.0 if penalty is None else ParamSpace(penalty).flatten(penalty).double()
    sums = _SampleSums()
    sums.add(stage, x, y, names, chunk, progress)
    estimate, bound, source = sums.mean() + penalty, 0.0, "data"
    if order is not None:
        bound = sums.bound(n)
        grown = _settling_size(sums, float(estimate.norm()), n)
        if grown and grown <= n // LIGHT_GROW_SHARE and grown > size:  # a second draw settles it, at a fraction of a pass
            sums.add(stage, *stage.data.take(order[size:grown].sort().values), names, chunk, progress)
            estimate, bound = sums.mean() + penalty, sums.bound(n)
        typical = sums.typical()
        if typical > 0 and (float(estimate.norm()) - bound) / typical > GRADIENT_TOL:
            source = "sample"
    typical = sums.typical()
    if source == "sample" or order is None:  # the sample settles it, or is every example (∇L exact, no second pass)
        objective = estimate
    else:
        full = gradient(stage, names, extra=extra, batch_size=chunk, progress=progress)
        objective = ParamSpace(full).flatten(full)
    return float(objective.double().norm()), typical, sums.count, bound if source == "sample" else 0.0, source


class _SampleSums:
    """Running sums of a sample's per-example loss gradients: their count, sum and squared norms."""

    def __init__(self):
        self.count, self.summed, self.squares = 0, 0.0, []

    def add(self, stage: Stage, x, y, names, chunk: int, progress: bool) -> None:
        for rows in per_example_grad_rows(stage, x, y, names, chunk_size=chunk, progress=progress):
            self.squares.append(rows.norm(dim=1).double().pow(2))
            self.summed = self.summed + rows.sum(0, dtype=torch.float64)
        self.count += int(x.shape[0])

    def mean(self) -> torch.Tensor:
        return self.summed / self.count

    def typical(self) -> float:
        """g = (mean ‖∇ℓ_i‖²)^½ over the sample."""
        return float(torch.cat(self.squares).mean().sqrt())


    def spread(self) -> float:
        """σ² = Σ‖∇ℓ_i − ĝ‖²/(s − 1) = (Σ‖∇ℓ_i‖² − s‖ĝ‖²)/(s − 1)."""
        s = self.count
        return max(float(torch.cat(self.squares).sum()) - s * float(self.mean().pow(2).sum()), 0.0) / max(s - 1, 1)

    def bound(self, n: int) -> float:
        """BOUND_Z · SE, SE² = (1 − s/n) σ²/s: the half-width of ‖∇L‖ at ≈95 % (module docstring)."""
        s = self.count
        return BOUND_Z * math.sqrt(max(1 - s / n, 0.0) * self.spread() / s)


def _settling_size(sums: _SampleSums, estimate: float, n: int) -> int | None:
    """The sample size s at which the bound would settle non-stationarity if ‖∇L‖ were its unbiased estimate
    (‖ĝ‖² − SE²)^½ (E‖ĝ‖² = ‖∇L‖² + SE²): BOUND_Z² (1 − s/n) σ²/s ≤ (‖∇L‖ − GRADIENT_TOL·g)², times 1.2; None when
    that estimate is itself below the threshold."""
    s = sums.count
    unbiased = math.sqrt(max(estimate ** 2 - max(1 - s / n, 0.0) * sums.spread() / s, 0.0))
    margin = unbiased - GRADIENT_TOL * sums.typical()
    if margin <= 0:
        return None
    z2 = BOUND_Z ** 2 * sums.spread()
    return math.ceil(1.2 * z2 / (margin ** 2 + z2 / n))


def warn_not_at_minimum(positions: Sequence[Position | None], names: Sequence[str], remedy: Sequence[str]) -> None:
    """One :class:`~influkit.errors.StationarityWarning` naming every stage not at a minimum (None: a stage not to
    warn of now), pointing at the first line outside influkit (the user's call). ``remedy[k]``: what ``auto`` did
    about stage k (or how to change it)."""
    lines = [f"stage {k} ({names[k]}) is not at a minimum — {pos.describe()}; {remedy[k]}"
             for k, pos in enumerate(positions) if pos is not None and not pos.at_minimum]
    if lines:
        warn("influence functions assume each stage is at a minimum of its objective (see diagnostics['stages']):"
             "\n  " + "\n  ".join(lines), StationarityWarning)
