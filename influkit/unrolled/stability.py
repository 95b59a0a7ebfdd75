"""How far from linear a recorded run is: its sharpness against its learning rate, checkpoint by checkpoint.

An SGD step with heavy-ball momentum μ and learning rate η is linearly stable along a Hessian eigen-direction with
eigenvalue λ exactly when 0 < η(λ + decay) < 2(1 + μ) (the edge of stability; ``decay`` the coupled weight decay;
with Nesterov momentum the edge is 2(1 + μ)/(1 + 2μ)).
Past it, the step's linearization expands that direction, and a run that still trains (its sharpness adapts, Cohen
et al. 2021) answers a change of its data weights far from linearly: the exact metagradient is then right for
infinitesimal changes (it is the run's derivative) but predicts whole-example drops poorly. :func:`sharpness`
measures λ_max of each stage's full-data objective (1/n) Σ ℓ(z; θ_t) + R(θ_t) (+ the Case 2 proximal term) over the
trained parameters at the record's checkpoints by Lanczos (:func:`influkit.stationarity.extreme_eigenvalues`; a
Ritz value, never above λ_max) and puts η_t·λ_max beside the edge. A Trainer stage's objective is that of its
batches as the collator fed them (:func:`~.trajectory.fed_rows`: a masked-LM batch's recorded masks, its summed loss
over its predicted tokens), not its examples' as the dataset gives them.

Adam and AdamW step by η·P⁻¹m̂ with the diagonal preconditioner P = diag(√v̂ + ε) (v̂ = v/(1 − β₂ᵗ), the
bias-corrected second moment). With P frozen — it moves slowly once v has averaged many steps — one step on a
quadratic with Hessian H is heavy-ball descent on the preconditioned Hessian P⁻¹H with learning rate η(1 − β₁) and
momentum β₁ (m is an exponential average, m ← β₁m + (1 − β₁)g; its bias correction 1/(1 − β₁ᵗ) tends to 1), so
an eigen-direction of P⁻¹H with eigenvalue a is stable exactly when η(1 − β₁)·a < 2(1 + β₁): the edge is
η·λ_max(P⁻¹H) = 2(1 + β₁)/(1 − β₁), 38 for β₁ = 0.9 (Cohen et al. 2022, "Adaptive Gradient Methods at the Edge of
Stability", arXiv:2207.14484, §2: "preconditioned sharpness" against 38/η). For Adam rows :func:`sharpness`
reports λ_max(P⁻¹(H + λI)) (λ Adam's coupled decay; AdamW's decoupled decay only contracts, θ ← (1 − ηλ)θ, and is
left out) by Lanczos on the symmetric P^{-1/2}(H + λI)P^{-1/2}, which has the same eigenvalues.

Past the edge is a cause, not the only one: a run below it can still answer drops irregularly (mini-batch noise; on
Fashion-MNIST SGD at lr 0.05 stayed below its edge and was chaotic), so :func:`linearity` checks the answer itself:
a few drop sets replayed at full and at small size, against the scores' prediction, and :func:`diagnose` reads
both tables and names what to change.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..curvature import HessianOperator
from ..errors import InputError
from ..results import InfluenceResult
from ..stationarity import STEPS, extreme_eigenvalues
from .optimizers import SGD, Adam, Groups, Tensors
from .record import Record
from .run import StageRun
from .replay import outputs, unit_weights
from .terms import holding
from .trajectory import fed_rows

# the remedy keeps every step below this share of the edge: a run held just under the edge still carries a whole drop
# beyond its linear response (benchmarks/results/bench_adamw_drops/remedies.md: margins 1 and 0.5 side by side)
MARGIN = 0.5
COLUMNS = ("stage", "step", "lr", "max_eigenvalue", "lr_times_eigenvalue", "edge", "past_edge", "preconditioned",
           "lanczos_steps")


def sharpness(record: Record, *, steps: int = STEPS, memory: int | None = None, first: int = 0,
              samples: int | None = None, seed: int = 0, progress: bool = False) -> pd.DataFrame:
    """One row per checkpoint of every recorded stage (module docstring), and per step t < ``first`` of each stage
    (those states replayed from the stage's start; Adam is sharpest in its first steps, where v̂ rests on few
    batches): ``stage``, ``step`` t, ``lr`` η_t (the learning rate of the step taken from θ_t; the last step's at
    the final checkpoint), ``max_eigenvalue`` — SGD: λ_max(H_t + decay·I), H_t the Hessian of the stage objective at
    θ_t; Adam/AdamW: λ_max(P_t⁻¹(H_t + λI)), the preconditioned sharpness (:func:`preconditioner`) —
    ``lr_times_eigenvalue`` η_t·max_eigenvalue, ``edge`` (:func:`edge_of_stability`: SGD 2(1 + μ), Nesterov
    2(1 + μ)/(1 + 2μ); Adam 2(1 + β₁)/(1 − β₁)), ``past_edge`` (η_t·max_eigenvalue > edge), ``preconditioned``
    (True for Adam rows), ``lanczos_steps``.
    steps: Lanczos steps (Hessian-vector products) per row; memory: their budget (bytes); samples: the Hessian of a
    seeded sample (``seed``) of that many examples (a Trainer stage's fed rows) instead of all of them — an estimate,
    for runs whose full-data products cost too much (a sample's Hessian H_S has the same mean and a spread that grows
    as the sample shrinks, so its λ_max tends to exceed the full data's; where every example's Hessian is positive
    semidefinite, H ⪰ (s/n)·H_S bounds the excess by n/s). The Hessian is the recorded objective's
    (w = 1), the Case 1 fixed block at the previous stage's final values."""
    rows = []
    states = [early_states(run, first) | run.checkpoints for run in record.runs]
    fed = [(run, 1.0) if run.inputs is None else fed_rows(run)[:2] for run in record.runs]
    jobs = [(k, t) for k in range(len(record.runs)) for t in sorted(states[k])]
    for k, t in tqdm(jobs, desc="sharpness", disable=not progress, leave=False):
        run = record.runs[k]
        theta, state = states[k][t]
        rule = stage_rule(run.optimizer)
        adam = isinstance(rule, Adam)
        stage, scale = fed[k][0].stage, fed[k][1]
        with holding(run.stage.model, {n: run.anchors[n] for n in run.frozen}):
            operator = HessianOperator(stage, list(run.trained), at=theta, extra=run.proximal(), memory=memory,
                                       data_weight=scale, seed=seed,
                                       samples=None if samples is None else min(samples, len(stage)))
            if adam:
                decay = 0.0 if rule.decoupled else rule.weight_decay
                operator = Preconditioned(operator, preconditioner(run, t, theta, state), decay)
            _, largest, m = extreme_eigenvalues(operator, steps)
        if not adam:
            largest += rule.weight_decay
        lr = run.lrs[min(t, run.steps - 1)]
        lr = max(lr) if isinstance(lr, tuple) else lr  # parameter groups: the largest group's step
        edge = edge_of_stability(rule)
        rows.append((k, t, lr, largest, lr * largest, edge, lr * largest > edge, adam, m))
    return pd.DataFrame(rows, columns=list(COLUMNS))


def stage_rule(optimizer: SGD | Adam | Groups) -> SGD | Adam:
    """The one update rule of a stage: its optimizer, or a watched ``torch.optim`` optimizer's when all its parameter
    groups share one rule up to the learning rate (and AdamW's decoupled weight decay, which takes no part in the
    sharpness: a Trainer's groups with and without decay); :class:`~influkit.errors.InputError` when they differ in
    more."""
    if not isinstance(optimizer, Groups):
        return optimizer
    first = optimizer.rules[0]
    decoupled = isinstance(first, Adam) and first.decoupled  # AdamW's decay only contracts: no part of its sharpness
    if any(replace(rule, lr=first.lr, **({"weight_decay": first.weight_decay} if decoupled and isinstance(
            rule, Adam) and rule.decoupled else {})) != first for rule in optimizer.rules[1:]):
        raise InputError(
            f"the stage's optimizer has {len(optimizer.rules)} parameter groups that differ in more than their "
            "learning rates (e.g. weight decay on some parameters only), so one sharpness per step is not defined; "
            "use exact replay (ik.unrolled.metagradients), which follows every group's own rule.")
    return first


def edge_of_stability(optimizer: SGD | Adam) -> float:
    """The largest η·λ at which one step is linearly stable (module docstring): SGD 2(1 + μ), or 2(1 + μ)/(1 + 2μ)
    with Nesterov, λ an eigenvalue of H; Adam/AdamW 2(1 + β₁)/(1 − β₁), λ an eigenvalue of P⁻¹H."""
    if isinstance(optimizer, Adam):
        beta1 = optimizer.betas[0]
        return 2 * (1 + beta1) / (1 - beta1)
    mu = optimizer.momentum
    return 2 * (1 + mu) / (1 + 2 * mu) if optimizer.nesterov else 2 * (1 + mu)


def early_states(run: StageRun, first: int) -> dict[int, tuple[Tensors, dict]]:
    """{t: (θ_t, state_t)} for t < min(first, steps), the run's steps replayed from its start (θ_0, state_0)."""
    theta, state = run.checkpoints[0]
    kept = {}
    for t in range(min(int(first), run.steps)):
        kept[t] = (theta, state)
        idx, x, y = run.batch(t)
        theta, state = run.step(t, theta, state, run.anchors, unit_weights(run, idx, None, x), x, y)
    return kept


def preconditioner(run: StageRun, t: int, theta: Tensors, state: dict) -> Tensors:
    """Adam's diagonal preconditioner P_t = √v̂ + ε of the step taken from (θ_t, state_t) (name → tensor over the
    trained parameters): v_{t+1} = β₂v_t + (1 − β₂)d_t² with d_t the recorded batch's gradient at θ_t as the step took
    it (its micro-batches and loss divisors, times its recorded clipping factor, plus λθ_t under coupled decay) — the
    recorded v_{t+1} where step t + 1 has a checkpoint —, v̂ = v_{t+1}/(1 − β₂^{t+1}); at the final checkpoint T, the
    last step's: v̂ = v_T/(1 − β₂^T)."""
    optimizer = stage_rule(run.optimizer)
    beta2, eps = optimizer.betas[1], optimizer.eps
    v = state["v"]
    if t < run.steps and t + 1 in run.checkpoints:  # the step's own v_{t+1}, as recorded
        v, t = run.checkpoints[t + 1][1]["v"], t + 1
    elif t < run.steps:
        idx, x, y = run.batch(t)
        d = run.clipped(t, run.gradient(t, theta, run.anchors, (x, y, unit_weights(run, idx, None, x)),
                                        size=idx.numel()))
        if optimizer.weight_decay and not optimizer.decoupled:
            d = {n: d[n] + optimizer.weight_decay * theta[n] for n in d}
        v, t = {n: beta2 * v[n] + (1 - beta2) * d[n] ** 2 for n in v}, t + 1
    return {n: torch.sqrt(v[n].detach() / (1 - beta2**t)) + eps for n in v}


class Preconditioned:
    """The symmetric operator P^{-1/2}(H + λI)P^{-1/2} (P diagonal, over the same flat parameters as ``hessian``):
    the same eigenvalues as P⁻¹(H + λI)."""

    def __init__(self, hessian, p: Tensors, decay: float = 0.0):
        self.hessian, self.decay = hessian, float(decay)
        self.scale = hessian.space.flatten(p).to(hessian.dtype).rsqrt()

    @property
    def dim(self) -> int:
        return self.hessian.dim

    @property
    def dtype(self) -> torch.dtype:
        return self.hessian.dtype

    @property
    def device(self) -> torch.device:
        return self.hessian.device

    def matvec(self, vec: torch.Tensor) -> torch.Tensor:
        scale = self.scale if vec.dim() == 1 else self.scale[:, None]
        u = scale * vec
        return scale * (self.hessian.matvec(u) + self.decay * u)


def linearity(record: Record, measure, scores: InfluenceResult, *, stage: int = 0, fraction: float = 0.01,
              sets: int = 5, steps=(1.0, 0.1), seed: int = 0) -> pd.DataFrame:
    """Does the recorded run answer drops as ``scores`` (d measure / d w_z of stage ``stage``'s examples, e.g. from
    :func:`~.metagradient.metagradients`) predict? For ``sets`` seeded random sets D of ⌊fraction·n⌋ examples (at
    least 1) and each t in ``steps`` the record is replayed at w = 1 − t·1_D (t = 1: D dropped), and
    Δ_t = (m(w) − m(1)) / t is compared with the prediction p = −Σ_{z∈D} score_z over the measure's q outputs (the
    outputs' sum for one column of scores: a summed measure's).
    One row per (set, t): ``cosine`` cos(Δ_t, p) and ``ratio`` ‖Δ_t‖ / ‖p‖. A run linear in w has both 1 at every t;
    for the exact metagradient both tend to 1 as t → 0, so a cosine or ratio far from 1 at t = 1 says how much of a
    whole drop the derivative misses. Costs sets × len(steps) + 1 replays."""
    n = len(record.runs[stage].stage)
    if scores.values.shape[0] != n or not 0 < fraction < 1:
        raise InputError(f"linearity needs the {n} scores of stage {stage} (got {tuple(scores.values.shape)}) and a "
                         f"fraction in (0, 1) (got {fraction!r}).")
    values = torch.zeros(n, *scores.values.shape[1:], dtype=torch.float64)
    values[scores.index] = scores.values.double()  # rows by example id (a streamed or sharded result's order)
    values = values[:, None] if values.dim() == 1 else values
    q = values.shape[1]  # scores of a summed measure (one column) are compared with the measure's sum

    def measured(weights=None):
        value = outputs(record, measure, weights).double().reshape(-1)
        return value.sum(0, keepdim=True) if q == 1 else value

    base = measured()
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for j in range(sets):
        dropped = torch.randperm(n, generator=gen)[:max(1, int(fraction * n))]
        predicted = -values[dropped].sum(0)
        for t in steps:
            weights = [None] * len(record.runs)
            weights[stage] = torch.ones(n)
            weights[stage][dropped] = 1 - t
            delta = (measured(weights) - base) / t
            cosine = float(delta @ predicted / (delta.norm() * predicted.norm()).clamp_min(1e-300))
            rows.append((j, t, cosine, float(delta.norm() / predicted.norm().clamp_min(1e-300))))
    return pd.DataFrame(rows, columns=["set", "t", "cosine", "ratio"])


def diagnose(sharpness: pd.DataFrame, linearity: pd.DataFrame | None = None, *, margin: float = MARGIN) -> pd.DataFrame:
    """One row per finding about a recorded run: ``stage`` (None: the whole run), ``finding``, ``evidence``,
    ``remedy`` (what to change in the training, with ``torch.optim`` settings or an influkit option) and its numbers
    ``warmup`` (steps of a linear warmup, or None) and ``lr_divisor`` (or None), read from a
    :func:`sharpness` table and optionally a :func:`linearity` table. Empty: nothing found.

    Past the edge: a stage whose η_t·λ_t (λ_t: max_eigenvalue, P_t⁻¹H_t for Adam) exceeds the edge at some step.
    The remedy keeps every measured step below ``margin``·edge (default :data:`MARGIN`, half the edge) if λ_t stayed
    as measured: for Adam, a linear warmup
    lr_t = lr·min(1, (t+1)/W) with W = ⌈max_t (t+1)·lr·λ_t / (margin·edge)⌉ over the rows (lr the stage's largest),
    at most the stage's steps (beyond them, lr divided by W / steps too); for SGD the learning rate divided by
    max_t lr·λ_t / (margin·edge). Adam is sharpest
    in its first steps (v̂ averages few batches), so a table with ``first`` > 0 shows the steps between checkpoints.

    Non-linear drops (with ``linearity``, at least one t = 1 and one t < 1): at the smallest t a median over sets of
    cos(Δ_t, p) above 0.95 and of |log(‖Δ_t‖/‖p‖)| below log 1.05 says the scores are the run's derivative, while at
    t = 1 a median cosine below 0.9 or median |log ratio| above log 2 (ratios off by more than 2× either way) says a
    whole drop moves the run beyond its linear response; the remedy
    is the stage's past-the-edge remedy where one was found, else to score at the drop's midpoint
    (``metagradients(..., at=1 − f/2)``, f the dropped fraction). If the small-t agreement fails too, either the
    scores are not this record's derivative (another record or measure) or the run is so sensitive that t is not
    yet small."""
    rows = []
    for k, table in sharpness.groupby("stage", sort=True):
        past = table[table["past_edge"].astype(bool)]
        if past.empty:
            continue
        edge, peak = float(table["edge"].iloc[0]), float(table["lr"].max())
        eigen = table["lr_times_eigenvalue"] / table["lr"]
        need = (table["step"] + 1) * peak * eigen / (margin * edge)
        worst = float((peak * eigen).max() / (margin * edge))
        kind = "η·λ_max(P⁻¹H)" if bool(table["preconditioned"].iloc[0]) else "η·λ_max(H)"
        steps = int(table["step"].max())
        needed = int(math.ceil(need.max()))
        warmup = min(needed, steps) if bool(table["preconditioned"].iloc[0]) else None
        if warmup is None:
            remedy = f"divide the learning rate by {worst:.3g} (lr ≤ {peak / worst:.3g})"
        else:
            remedy = (f"warm the learning rate up linearly over the first {warmup} steps, lr_t = lr·min(1, (t + 1)/"
                      f"{warmup}) (torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / "
                      f"{warmup})))")
            if needed > steps:
                remedy += (f"; the measured steps ask for {needed} > the stage's {steps} steps, so if the drops "
                           f"still disagree, also divide lr by {needed / steps:.3g}")
        ratio = past["lr_times_eigenvalue"] / past["edge"]
        rows.append((int(k), "past the edge of stability",
                     f"{kind} above the edge {edge:.3g} at steps {list(map(int, past['step']))[:12]} (up to "
                     f"{float(ratio.max()):.3g}× the edge); steps that expand the run's linearization carry a whole "
                     "drop's change beyond the derivative's reach", remedy, warmup,
                     worst if warmup is None else (needed / steps if needed > steps else None)))
    if linearity is not None and (linearity["t"] == 1.0).any() and (linearity["t"] < 1.0).any():
        table = linearity.assign(spread=linearity["ratio"].clip(lower=1e-300).map(math.log).abs())
        medians = table.groupby("t")[["cosine", "ratio", "spread"]].median()
        small, whole = medians.iloc[0], medians.loc[1.0]
        t_small = float(medians.index[0])
        derivative = small["cosine"] > 0.95 and small["spread"] < math.log(1.05)
        nonlinear = whole["cosine"] < 0.9 or whole["spread"] > math.log(2)
        def ratios(t):
            return "[" + ", ".join(f"{v:.3g}" for v in linearity.loc[linearity["t"] == t, "ratio"]) + "]"

        if not derivative:
            rows.append((None, f"not linear even at t = {t_small:g}",
                         f"median cosine {small['cosine']:.3g}, ratios {ratios(t_small)} at t = {t_small:g} (both → 1 "
                         "as t → 0 for the record's own metagradient)",
                         "check the scores with a smaller t (they must come from this record and measure: "
                         "metagradients(record, measure)); a run this sensitive needs the past-the-edge remedy "
                         "first", None, None))
        elif nonlinear:
            found = [r for r in rows if r[1] == "past the edge of stability"]
            remedy = ("; ".join(f"stage {r[0]}: {r[3]}" for r in found) if found else
                      "score at the drop's midpoint: metagradients(record, measure, at=[1 - f/2, ...]) for a "
                      "dropped fraction f")
            rows.append((None, "whole drops are non-linear",
                         f"median cosine {small['cosine']:.3g}, ratios {ratios(t_small)} at t = {t_small:g} (the "
                         f"derivative is right) but median cosine {whole['cosine']:.3g}, ratios {ratios(1.0)} at t = 1",
                         remedy, None, None))
    found = pd.DataFrame(rows, columns=["stage", "finding", "evidence", "remedy", "warmup", "lr_divisor"])
    return found.astype({"stage": "Int64", "warmup": "Int64", "lr_divisor": "Float64"})
