"""First-order trajectory attribution: every recorded step's exact optimizer Jacobian, the loss curvature dropped.

Reverse mode through a recorded step (θ_{t+1}, s_{t+1}) = U_t(θ_t, s_t, g_t) with g_t = ∇_θ L_t(θ_t; S̄, w) gives

    (θ̄_t, s̄_t, ḡ_t) = (∂U_t/∂(θ_t, s_t, g_t))ᵀ (θ̄_{t+1}, s̄_{t+1}),   θ̄_t += H_t ḡ_t,   S̄̄ += ∂²L_t/∂S̄∂θ · ḡ_t,

the first the optimizer's own Jacobian — momentum, Adam's moments with the second moment's response to g_t,
coupled and decoupled decay, the recorded clipping's factor and its dependence on ‖g_t‖, the learning rates —
pulled back in closed form (each rule's ``pullback``, :meth:`StageRun.update_vjp`), the second the loss curvature.
First order keeps the first exactly and drops H_t ḡ_t of the data term (the regularizer's and the Case 2 proximal
term's Hessians, data-free, stay exact). The term of example z fed at step t is

    ∂/∂w_z (g_t · ḡ_t) = (1/|B_t|) ∇ℓ(z; θ_t) · ḡ_t,

the directional derivative of its loss along ḡ_t, one forward-mode ``jvp`` over the batch: no double backward and
no per-example gradient — or, for q > 1 directions (per-test scores) where no fixed block takes the mixed term, each
example's gradient (one backward pass each, :data:`EXAMPLE_GRADIENT_BYTES` at most per micro-batch) times the q
directions, which costs the same for any q. A Case 1 stage's fixed block S̄ also takes the mixed term (reverse over
that ``jvp``), so the adjoint crosses every link kind as in :mod:`.metagradient` (:func:`~.boundary.hand_over`): a fixed block (Case 1),
a proximal one (Case 2), plain finetuning (the later stage starts from the earlier one's final weights), LoRA.
Same sign: score = d measure / d w_z; removing z predicts −score.

Where the loss curves over the run, ``correction=k`` adds V diag(g) Vᵀ ḡ_t with (g, V) the k largest eigenpairs of
the stage's data Hessian at the start of each of ``segments`` pieces of the stage (``"dense"``: every eigenpair),
so the dropped term is put back in the directions that contract fastest; ``"ekfac"`` adds C ḡ_t with C the EK-FAC
approximation of the Gauss-Newton matrix fitted there (every direction, approximately). Either is the curvature of
the stage's mean loss, times the step's examples per unit of its loss divisor (:meth:`StageRun.data_scale`: 1 for a
batch mean); a Trainer stage's is fitted on its batches as the collator fed them (:func:`~.trajectory.fed_rows`:
the recorded masks, a masked-LM batch's loss over its predicted tokens), in eval mode. :func:`first_order_check`
reads the record (run length, sharpness against the edge of stability) and says whether first order is enough.

Cost: one forward replay of each checkpoint segment (a training step each: the gradient g_t and the update, no
graph kept) and per step one closed-form pullback of the update and one ``jvp`` of the batch's losses per direction
(or one backward per example); memory: a segment's steps (θ_t, the update's inputs and outputs) and the adjoints.
"""

from __future__ import annotations

import copy
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass

import pandas as pd
import torch
from torch.func import grad, jvp, vmap
from tqdm.auto import tqdm

from ..chain import Measure
from ..errors import InputError
from ..factored import fit_curvature
from ..results import InfluenceResult
from .boundary import describe_at, hand_over, measure_adjoint, reweighted_at
from .optimizers import SGD, Adam, Groups
from .record import Record
from .replay import deviation, start, unit_weights
from .run import StageRun, cropped, replaying
from .stability import edge_of_stability
from .terms import holding
from .top import top_directions
from .trajectory import boundaries, checkpoint_at, fed_rows, moved_frozen

METHOD = "unrolled first-order (optimizer Jacobians, loss curvature dropped)"
EXPOSURE_FIRST_ORDER = 0.2
"""The curvature exposure τ = Σ_t η_t λ_t (:func:`first_order_check`) up to which first order is enough: the top
direction's response is (1 − e^{−τ})/τ of first order's, within 10 % there."""
FACTORED = ("ekfac", "kfac")
EXAMPLE_GRADIENT_BYTES = 2**30
"""The largest micro-batch of per-example gradients (rows × parameters × bytes) :func:`example_terms` forms to score
q > 1 directions by one backward pass per example instead of one ``jvp`` per direction."""
EXPOSURE_PER_SEGMENT = 1.0
"""The exposure per segment that :func:`first_order_check` asks the correction's segments to stay under."""
EXPOSURE_CORRECTABLE = 2.0
"""The exposure above which :func:`first_order_check` sends the run to exact replay: first order is then off by more
than τ/(1 − e^{−τ}) = 2.3× in the top direction and compounds over every direction the correction approximates."""


@dataclass(frozen=True)
class Correction:
    """The curvature put back per segment, at the start of each of ``segments`` pieces: the ``directions`` largest
    eigenpairs of the stage's data Hessian (an int, or "dense" for every one), or its EK-FAC / K-FAC approximation
    over the whole spectrum ("ekfac", "kfac": the sampled-Fisher Gauss-Newton matrix, block-diagonal per layer)."""

    directions: int | str
    segments: int

    def __post_init__(self) -> None:
        if self.directions not in FACTORED + ("dense",) and (isinstance(self.directions, bool) or not isinstance(
                self.directions, int) or self.directions < 1):
            raise InputError(f"correction must be 0 (first order), a number k ≥ 1 of eigenpairs, 'dense', 'ekfac' or "
                             f"'kfac', got {self.directions!r}.")
        if isinstance(self.segments, bool) or not isinstance(self.segments, int) or self.segments < 1:
            raise InputError(f"segments must be a whole number ≥ 1, got {self.segments!r}.")


def first_order(record: Record, test, *, measure: Measure | None = None, per_test: bool = False,
                correction: int | str = 0, segments: int = 1, at=None,
                progress: bool = True) -> list[InfluenceResult]:
    """One :class:`InfluenceResult` per recorded stage: the first-order estimate of d measure / d w_z (module
    docstring).

    ``test``, ``measure``, ``per_test`` and ``at`` as :func:`~.metagradient.metagradients` (same sign; removal =
    −values). correction: 0 (first order alone), k (the k largest eigenpairs of each stage's data Hessian at
    the start of each of ``segments`` pieces put back, by Lanczos: ``pip install 'influkit[unrolled]'``),
    ``"dense"`` (the dense Hessian: models of up to a few thousand trained parameters) or ``"ekfac"`` / ``"kfac"``
    (the factored Gauss-Newton approximation over the whole spectrum, fitted at each piece's start).
    diagnostics: seconds (this
    pass and the recorded training), the replay check, the settings, and per stage the correction's eigenpairs.
    """
    began = time.perf_counter()
    fix = None if correction == 0 else Correction(correction, segments)
    if correction == 0 and (isinstance(segments, bool) or not isinstance(segments, int) or segments < 1):
        raise InputError(f"segments must be a whole number ≥ 1, got {segments!r}.")
    for run in record.runs:
        refuse_uncovered(run, fix)
    record = reweighted_at(record, test, at, progress)
    adjoint, q, outputs = measure_adjoint(record, test, per_test, measure)
    scores, _, error, notes = carry(record, adjoint, q, fix=fix, progress=progress)
    seconds = time.perf_counter() - began
    training = sum(run.seconds for run in record.runs)
    diagnostics = {
        "seconds": {"first-order": seconds, "training (recorded)": training},
        "ratio_to_recorded_training": seconds / training if training > 0 else None,
        "settings": {"measure_outputs": int(outputs), "per_test": per_test, "at": describe_at(at, record),
                     "correction": 0 if fix is None else {"directions": fix.directions, "segments": fix.segments},
                     "steps": [run.steps for run in record.runs]},
        "replay": {"max_error": error, "checked": "every segment's replayed end vs its checkpoint"},
    }
    return [InfluenceResult(values=scores[k] if per_test else scores[k][:, 0], n_train=len(run.stage),
                            method=f"{METHOD}, stage {k}", removal_eps=-1.0,
                            diagnostics=diagnostics | {"stage": k, "correction": notes[k]})
            for k, run in enumerate(record.runs)]


def carry(record: Record, adjoint: dict, q: int, *, fix: Correction | None = None, first: int = 0,
          progress: bool = True) -> tuple[list, dict | None, float, list]:
    """First order through stages len(record) − 1 … ``first``, last to first, from ``adjoint`` ({name: (q, *shape)}
    on the last stage's final values): (per stage the (n_k, q) scores, None below ``first``; the adjoint handed to
    stage first − 1 (None for first = 0); the replay's largest deviation from the checkpoints; per stage the
    correction's notes). Linear in ``adjoint``."""
    scores: list = [None] * len(record)
    notes: list = [None] * len(record)
    error = 0.0
    for k in range(len(record) - 1, first - 1, -1):
        run = record.runs[k]
        theta_bar = {n: adjoint.get(n, _zeros(v, q)) for n, v in run.checkpoints[run.steps][0].items()}
        anchor_bar = {n: adjoint[n].clone() if n in run.frozen and n in adjoint else _zeros(v, q)
                      for n, v in run.anchors.items()}
        with holding(run.stage.model, moved_frozen(run)):
            theta_bar, anchor_bar, scores[k], replayed, notes[k] = _reverse(run, theta_bar, anchor_bar, q, fix,
                                                                           progress)
        error = max(error, replayed)
        adjoint = hand_over(record, k, theta_bar, anchor_bar, q) if k else None
    return scores, adjoint, error, notes


def refuse_uncovered(run: StageRun, fix: Correction | None = None) -> None:
    """Refuse, with the fix, what the first-order pass does not cover."""
    if fix is None or run.weights is None:
        return
    if run.inputs is not None or not bool((run.weights == run.weights[0]).all()):
        raise InputError("the curvature correction is fitted on the stage's data at one weight per example; a Trainer "
                         "stage re-run at other weights, or an uneven at=, has none: pass correction=0 or use "
                         "ik.unrolled.metagradients (exact).")


def _zeros(like: torch.Tensor, q: int) -> torch.Tensor:
    return torch.zeros(q, *like.shape, dtype=like.dtype, device=like.device)


def _reverse(run: StageRun, theta_bar: dict, anchor_bar: dict, q: int, fix: Correction | None, progress: bool):
    """Reverse mode through one stage, curvature dropped: (θ̄_0, S̄̄, scores (n, q), the replay's largest deviation
    from the checkpoints, the correction's notes)."""
    anchors = run.anchors
    first = next(iter(theta_bar.values()))
    scores = torch.zeros(len(run.stage), q, dtype=first.dtype, device=first.device)
    pieces = [] if fix is None else boundaries(run, fix.segments)
    curvature, notes = _Curvature(run, fix, first.dtype), []
    state_bar, error = None, 0.0
    for a, b in tqdm(list(reversed(run.segments())), desc="first-order", disable=not progress, leave=False):
        theta, state = run.checkpoints[a]
        if a == 0:
            theta = start(run, anchors)
        if state_bar is None:
            state_bar = {slot: {n: _zeros(v, q) for n, v in s.items()} for slot, s in state.items()}
        steps = []
        for t in range(a, b):  # forward: each step's gradient (no graph) and its update's closed-form pullback
            idx, x, y = run.batch(t)
            w = unit_weights(run, idx, None, x)
            g = run.gradient(t, theta, anchors, (x, y, w), size=idx.numel())
            with torch.no_grad():
                new_theta, new_state, pullback = run.update_vjp(t, theta, state, g)
            steps.append((t, theta, idx, x, y, w, pullback))
            theta, state = new_theta, new_state
        error = max(error, deviation((theta, state), run.checkpoints[b]))
        for t, theta_t, idx, x, y, w, pullback in reversed(steps):
            with torch.no_grad():
                theta_bar, state_bar, g_bar = pullback(theta_bar, state_bar)
            terms, mixed = example_terms(run, t, theta_t, x, y, w, g_bar, idx.numel())
            scores.index_add_(0, idx.to(scores.device), terms.T.to(scores.dtype))
            for n, v in mixed.items():
                anchor_bar[n] = anchor_bar[n] + v
            piece = next((c for c, d in pieces if c <= t < d), None)
            through, mixed = curvature.apply(t, piece, theta_t, g_bar, x.shape[0], notes)
            for n, v in through.items():
                theta_bar[n] = theta_bar[n] + v
            for n, v in mixed.items():
                anchor_bar[n] = anchor_bar[n] + v
        del steps
    return theta_bar, anchor_bar, scores, error, notes


def example_terms(run: StageRun, t: int, theta: dict, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
                  direction: dict, size: int) -> tuple[torch.Tensor, dict]:
    """((q, |B|) ∂(g_t · ḡ_j)/∂w_z for the batch, {fixed name: (q, *shape) ∂²L_t/∂S̄∂θ · ḡ_j}) for the q directions
    ḡ_j (``direction``: name → (q, *shape)): per micro-batch, the ``jvp`` of its data term along ḡ_j, differentiated
    in the data weights (and, for a Case 1 fixed block, in it) by reverse mode through that ``jvp`` — the losses
    themselves are forward only; without a fixed block, for q > 1 where the micro-batch's per-example gradients fit
    :data:`EXAMPLE_GRADIENT_BYTES`, those gradients (:func:`example_gradients`) times the q directions instead. An
    embedding's padding row is fed at the positions that feed its token as a value of its own (:mod:`.padding`):
    constant in θ, as the step's gradient holds it, and a function of the fixed block for the mixed term."""
    fixed = {n: run.anchors[n] for n in run.frozen}

    def feeding(block: dict):
        if run.padding is None:
            return nullcontext()
        rows = run.padding.values({n: v.detach() for n, v in (run.anchors | theta).items()} | block)
        return run.padding.feeding(rows)

    def column(d: dict) -> tuple[torch.Tensor, dict]:
        terms, mixed = [], {n: torch.zeros_like(v) for n, v in fixed.items()}
        for part, rng, divisor, width in run.micro_batches(t, x.shape[0], size):
            xp, yp = cropped(x[part], y[part], width)

            def directional(block, weights):
                def data_term(th):
                    return run.objective(th, run.anchors | block, xp, yp, weights, size=divisor, penalties=False)
                return jvp(data_term, (theta,), (d,))[1]

            with replaying(rng, run.mode_list()):
                if fixed:
                    def fed(block, weights):
                        with feeding(block):
                            return directional(block, weights)
                    through_w, through_block = grad(fed, argnums=(1, 0))(fixed, w[part])
                    mixed = {n: mixed[n] + through_block[n] for n in mixed}
                else:  # the data term is linear in w: its w-derivative is the losses' jvp over the divisor
                    with run.precision(True), feeding({}):
                        losses = jvp(lambda th: run.stage.losses(th, xp, yp), (theta,), (d,))[1]
                    divisors = divisor if isinstance(divisor, tuple) else \
                        (losses.shape[0] if divisor is None else divisor,)
                    through_w = losses / (math.prod(divisors) * run.accumulate)
            terms.append(through_w)
        return torch.cat(terms), mixed

    q = next(iter(direction.values())).shape[0]
    rows = max(part.stop - part.start for part, *_ in run.micro_batches(t, x.shape[0], size))
    width = sum(v[0].numel() * v.element_size() for v in direction.values())
    if not fixed and q > 1 and rows * width <= EXAMPLE_GRADIENT_BYTES:  # one backward per example, not q jvps
        terms = torch.zeros(q, x.shape[0], dtype=next(iter(direction.values())).dtype, device=x.device)
        for part, gradients in example_gradients(run, t, theta, x, y, size):
            terms[:, part] = sum(direction[n].reshape(q, -1) @ gradients[n].reshape(gradients[n].shape[0], -1).T
                                 .to(direction[n].dtype) for n in direction)
        return terms, {}
    if q == 1:
        terms, mixed = column({n: v[0] for n, v in direction.items()})
        return terms.unsqueeze(0), {n: v.unsqueeze(0) for n, v in mixed.items()}
    try:
        return vmap(column, randomness="same")(direction)
    except RuntimeError:  # an operation of the model without a batching rule: one column at a time
        columns = [column({n: v[j] for n, v in direction.items()}) for j in range(q)]
        return torch.stack([c[0] for c in columns]), {n: torch.stack([c[1][n] for c in columns]) for n in fixed}


def example_gradients(run: StageRun, t: int, theta: dict, x: torch.Tensor, y: torch.Tensor, size: int):
    """[(rows of the batch, {name: (rows, *shape)} ∂g_t/∂w_z)] per micro-batch of step t: each example's loss
    gradient at θ_t over the micro-batch's divisor and the accumulation, from one forward of the micro-batch as
    it was fed (its recorded generator state and modes; an embedding's padding row as :mod:`.padding` feeds it),
    the data term's derivative in its weights as :func:`example_terms` takes it."""
    out = []
    for part, rng, divisor, width in run.micro_batches(t, x.shape[0], size):
        xp, yp = cropped(x[part], y[part], width)
        leaves = {n: v.detach().requires_grad_() for n, v in theta.items()}
        feeding = run.padding.feeding(run.padding.values({n: v.detach() for n, v in (run.anchors | theta).items()})) \
            if run.padding is not None else nullcontext()
        with replaying(rng, run.mode_list()), torch.enable_grad(), run.precision(True), feeding:
            losses = run.stage.losses(leaves, xp, yp)
            count = losses.shape[0]
            try:  # every example's backward at once
                parts = torch.autograd.grad(losses, list(leaves.values()), torch.eye(count, dtype=losses.dtype,
                                            device=losses.device), is_grads_batched=True, retain_graph=True,
                                            allow_unused=True, materialize_grads=True)
            except RuntimeError:  # an operation of the model without a batching rule: one example at a time
                each = [torch.autograd.grad(losses[i], list(leaves.values()), retain_graph=True, allow_unused=True,
                                            materialize_grads=True)
                        for i in range(count)]
                parts = [torch.stack(column) for column in zip(*each)]
        divisors = divisor if isinstance(divisor, tuple) else (count if divisor is None else divisor,)
        scale = 1.0 / (math.prod(divisors) * run.accumulate)
        out.append((part, {n: v.detach() * scale for n, v in zip(leaves, parts)}))
    return out


class _Curvature:
    """What of H_t ḡ_t a first-order pass keeps: the regularizer's and the proximal term's Hessians exactly (and the
    proximal term's mixed ∂/∂S̄), and with a :class:`Correction` the data term's top eigenpairs at each segment's
    start."""

    def __init__(self, run: StageRun, fix: Correction | None, dtype: torch.dtype):
        self.run, self.fix, self.dtype = run, fix, dtype
        self.names = list(run.trained)
        # the data whose curvature is put back: the stage's own examples, or a Trainer's rows as it fed them
        self.fitted = fed_rows(run)[0] if run.inputs is not None and fix is not None else run
        self.penalized = run.alpha > 0 or run.stage.regularizer is not None
        self.piece, self.pairs = None, None

    def penalty(self, t: int, rows: int):
        """θ, S̄ ↦ the step's penalties R(θ) + α‖θ_S − S̄‖², as many times as it has micro-batches, / accumulate."""
        count = len(self.run.micro_batches(t, rows))

        def value(theta, anchors):
            total = self.run.stage.regularization(theta)
            total = 0.0 if total is None else total
            if self.run.alpha:
                total = total + self.run.plan.proximal_term(theta, anchors)
            return total * count / self.run.accumulate
        return value

    def penalty_products(self, t: int, theta: dict, rows: int, d: dict) -> tuple[dict, dict]:
        """(∇²_θ P · d, ∂²P/∂S̄∂θ · d) of the step's penalties P, for d with a leading q (one column at a time)."""
        value = self.penalty(t, rows)

        def directional(th, anchors, e):
            return jvp(lambda x: value(x, anchors), (th,), (e,))[1]

        pulled = grad(directional, argnums=(0, 1))
        try:  # every column at once
            through, mixed = vmap(pulled, in_dims=(None, None, 0))(theta, self.run.anchors, d)
        except RuntimeError:  # a regularizer operation without a batching rule: one column at a time
            columns = [pulled(theta, self.run.anchors, {n: v[j] for n, v in d.items()})
                       for j in range(next(iter(d.values())).shape[0])]
            through = {n: torch.stack([c[0][n] for c in columns]) for n in theta}
            mixed = {n: torch.stack([c[1][n] for c in columns]) for n in self.run.anchors}
        return through, mixed if self.run.alpha else {}

    def eigenpairs(self, piece: int):
        """(g, V) of the stage's data Hessian at step ``piece`` (the segment's start), or its fitted factored
        curvature, kept for the segment's steps."""
        if self.piece != piece and self.fix.directions in FACTORED:
            theta = checkpoint_at(self.run, piece)[0]
            self.pairs = fit_curvature(_data_only(self.fitted).stage, self.names, kind=self.fix.directions,
                                       at=theta, seed=0)
            if self.run.weights is not None:
                self.pairs.scale_data(float(self.run.weights[0]))
            self.piece = piece
            self.last = {"piece_start": piece, "directions": self.fix.directions}
        if self.piece != piece:
            theta = checkpoint_at(self.run, piece)[0]
            p = sum(v.numel() for v in theta.values())
            k = p if self.fix.directions == "dense" else min(int(self.fix.directions), p)
            self.pairs, products = top_directions(_data_only(self.fitted), theta, k, self.dtype, "hessian")
            self.piece = piece
            self.last = {"piece_start": piece, "directions": k, "largest": float(self.pairs[0].max()),
                         "products": products}
        return self.pairs

    def apply(self, t: int, piece: int | None, theta: dict, g_bar: dict, rows: int, notes: list):
        """({name: what θ̄_t gains}, {fixed name: what S̄̄ gains}) for the step's ḡ_t: the penalties' products
        and, in a correction's segment, V diag(g) Vᵀ ḡ_t (the data term's top curvature, its regularizer left to the
        penalties' exact product)."""
        if self.fix is None or piece is None:
            return self.penalty_products(t, theta, rows, g_bar) if self.penalized else ({}, {})
        curvature = self.eigenpairs(piece)
        if not notes or notes[-1]["piece_start"] != piece:
            notes.append(self.last)
        q = next(iter(g_bar.values())).shape[0]
        flat = torch.cat([g_bar[n].reshape(q, -1) for n in self.names], dim=1)
        if self.fix.directions in FACTORED:
            added = torch.empty_like(flat)
            curvature.functions([flat.T], lambda lam: [[lam]], out=[added.T])
        else:
            g, basis = curvature
            added = ((flat @ basis) * g) @ basis.T
        added = added * self.run.data_scale(t)  # the step's data term: its examples per unit of its divisor
        through = dict(zip(self.names, (v.reshape(g_bar[n].shape) for n, v in zip(
            self.names, added.split([g_bar[n][0].numel() for n in self.names], dim=1)))))
        if not self.penalized:
            return through, {}
        penalty, mixed = self.penalty_products(t, theta, rows, g_bar)
        return {n: through[n] + penalty[n] for n in through}, mixed


def _data_only(run: StageRun) -> StageRun:
    """A view of the run whose stage objective is its data term alone (no regularizer, no proximal term): the
    correction's eigenpairs are the loss curvature, the penalties' Hessians being added exactly."""
    view = copy.copy(run)
    view.stage = copy.copy(run.stage)
    view.stage.regularizer = None
    view.alpha = 0.0
    return view


def first_order_check(record: Record, sharpness: pd.DataFrame) -> pd.DataFrame:
    """One row per stage: whether first order is enough for this run, read from the record and its sharpness table
    (:func:`~.stability.sharpness`: λ_t, the largest eigenvalue of H_t — Adam: of P_t⁻¹H_t — at the checkpoints).

    Columns: ``stage``, ``steps``, ``exposure`` τ = Σ_t η_t λ_t / (1 − μ) (λ_t interpolated between the
    checkpoints; μ the momentum, for Adam η_t λ_t of the preconditioned Hessian: its steady heavy-ball rate) — the
    top direction contracts by e^{−τ} over the run, and first order, which drops that contraction, gives it
    τ/(1 − e^{−τ}) times its response —, ``largest_share_of_edge`` (max_t η_t λ_t / edge), ``verdict``
    (``"first order"``: τ ≤ EXPOSURE_FIRST_ORDER; ``"add the correction"`` up to EXPOSURE_CORRECTABLE, with
    ``segments`` pieces of exposure ≤ EXPOSURE_PER_SEGMENT each; ``"exact replay"`` above it, or past the edge of
    stability, where no linearization holds) and ``why``. It bounds the top direction only: the others contract
    less."""
    rows = []
    for k, run in enumerate(record.runs):
        table = sharpness[sharpness["stage"] == k].sort_values("step")
        if table.empty:
            raise InputError(f"the sharpness table has no row of stage {k}; pass ik.unrolled.sharpness(record).")
        steps, values = table["step"].to_numpy(), table["max_eigenvalue"].to_numpy()
        momentum = _momentum(run)
        lam = [float(values[min(range(len(steps)), key=lambda i: abs(steps[i] - t))]) for t in range(run.steps)]
        lrs = [max(r) if isinstance(r, (tuple, list)) else r for r in run.lrs]
        exposure = sum(lr * max(v, 0.0) for lr, v in zip(lrs, lam)) / (1 - momentum)
        share = float(table["lr_times_eigenvalue"].max()) / edge_of_stability(_rule(run))
        if share > 1:
            verdict, count = "exact replay", None
            why = (f"a step past the edge of stability ({share:.2f} of it): the run answers drops far from linearly; "
                   "exact replay, or a lower learning rate")
        elif exposure <= EXPOSURE_FIRST_ORDER:
            verdict, count = "first order", 1
            why = (f"curvature exposure {exposure:.3g} ≤ {EXPOSURE_FIRST_ORDER}: the loss curvature barely moves the "
                   "adjoint")
        elif exposure > EXPOSURE_CORRECTABLE:
            verdict, count = "exact replay", None
            why = (f"curvature exposure {exposure:.3g} > {EXPOSURE_CORRECTABLE}: the loss curvature contracts the "
                   f"adjoint by up to e^-{exposure:.3g} over the run, more than a correction repairs; exact replay")
        else:
            count = math.ceil(exposure / EXPOSURE_PER_SEGMENT)
            verdict = "add the correction"
            why = (f"curvature exposure {exposure:.3g} > {EXPOSURE_FIRST_ORDER}: first order overstates the top "
                   f"direction up to {exposure / -math.expm1(-exposure):.2f}×; correction with segments={count}")
        rows.append({"stage": k, "steps": run.steps, "exposure": exposure, "largest_share_of_edge": share,
                     "verdict": verdict, "segments": count, "why": why})
    return pd.DataFrame(rows)


def _rule(run: StageRun):
    return run.optimizer.rules[0] if isinstance(run.optimizer, Groups) else run.optimizer


def _momentum(run: StageRun) -> float:
    rule = _rule(run)
    if isinstance(rule, Adam):
        return 0.0  # the preconditioned sharpness already is per unit of Adam's steady step η
    return rule.momentum if isinstance(rule, SGD) else 0.0
