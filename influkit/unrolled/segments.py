"""Approximate unrolling (SOURCE, Bae, Lin, Lorraine & Grosse 2024) across stages: the driver.

Each stage's recorded steps are cut into ``segments`` contiguous pieces; inside piece ℓ the run is linearized as
heavy-ball descent on the stage's full-data objective with one curvature K_ℓ taken at the piece's last parameters
θ_ℓ and the recorded learning rates, so the piece's reverse map (v, w) → (v', w', u_ℓ) has a closed form per
eigen-coordinate (:mod:`.pieces`; Adam / AdamW with the second moment frozen at the piece's end, :mod:`.adam_piece`).
Then score_z = Σ_ℓ (1/n) ∇ℓ(z; θ_ℓ)·u_ℓ (same sign as :mod:`.metagradient`: score = d measure / d w_z, removal
predicts −score), the shared block's adjoint += C_ℓᵀ u_ℓ with C_ℓ = ∂∇_θL/∂S̄, and the adjoints cross each stage
boundary as in the exact method (:mod:`.boundary`). The derivation, the treatment of the edge of stability, of
factored curvatures, of the top directions, of Trainer and dropout runs and the memory each phase holds are on the
documentation's approximate-unrolling page.

The scores are computed in two passes: the reverse pass over the pieces (every rank the same) gives each piece's θ_ℓ
and u_ℓ and the adjoints handed across the boundary; then the example terms are computed chunk by chunk like
:meth:`influkit.Query.scores` rows (:mod:`.terms`: by contraction within the memory budget, sharded over ranks,
streamed to ``out`` and resumable).
"""

from __future__ import annotations

import numbers
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import distributed
from ..chain import Measure
from ..curvature import CURVATURES, HVP_TRANSIENT
from ..errors import InputError
from ..factored import FactoredCurvature, fit_curvature
from ..fitted import CurvatureConfig
from ..memory import PROBE_EXAMPLES, Held, probe_bytes
from ..memory import given as budget_given
from ..memory import plan as memory_plan
from ..memory import resolve as budget_of
from ..results import InfluenceResult
from ..scoring import release_freed_memory
from .adam_piece import AdamPiece, rules
from .boundary import hand_over, measure_adjoint, reweighted_at
from .optimizers import Adam
from .pieces import Edge, dense_piece, factored_piece
from .steps import Steps
from .record import Record
from .replay import unit_weights
from .run import StageRun
from .terms import Terms, fingerprint, holding
from .top import top_count, top_directions
from .trajectory import boundaries, checkpoint_at, clipped_trajectory, fed_rows, moved_frozen

METHOD = "unrolled approximate (segments, dense Hessian)"
PIECE_CURVATURES = ("hessian", "ekfac", "kfac")
"""The curvature of each piece: the dense Hessian, or a factored approximation of it."""
BASES = ("each", "shared")
DECAY_WARNING = 0.01
"""The relative change of δθ over a segment (``decay_ignored``) above which taking the groups' mean decoupled decay
warns; below it the note is in ``diagnostics["stability"]`` only (transformers' decay / no-decay groups leave ~10⁻⁵)."""


@dataclass(frozen=True)
class Settings:
    """How each stage's pieces are cut and linearized (the arguments of :func:`approximate` of that name)."""

    segments: int
    curvature: str
    basis: str
    config: CurvatureConfig
    memory: int | None
    top: int | str
    top_curvature: str
    progress: bool


@dataclass
class StagePass:
    """One stage's reverse pass through its pieces: θ̄_0, the inherited block's adjoint S̄̄, [(θ_ℓ, u_ℓ (q, p))] in run
    order, the memory plans of its phases, and its ``diagnostics["stability"]`` and ``["top"]``."""

    theta_bar: dict
    anchor_bar: dict
    pieces: list
    plans: list
    stability: dict
    top: dict


def approximate(record: Record, test, *, measure: Measure | None = None, segments: int = 1, per_test: bool = False,
                curvature: str = "hessian", basis: str = "each", config: CurvatureConfig | None = None,
                chunk_size: int | None = None, out: str | Path | None = None, gradients: str = "contraction",
                memory: int | None = None, at=None, top: int | str = "auto", top_curvature: str = "hessian",
                progress: bool = True) -> list[InfluenceResult]:
    """One :class:`InfluenceResult` per stage: the segment-wise closed-form estimate of d measure / d w_z.

    ``test`` and ``measure`` as :func:`influkit.unrolled.metagradients` (an (inputs, targets) test set with
    ``measure`` default the stage's loss, a callable of the final values, or an :class:`~.boundary.Adjoint`), and the
    same sign (score = d measure / d w_z at w = 1, or at the weights ``at``: the record re-run there and each piece
    linearized on that run with the weighted objective's curvature; removing z predicts −score: ``removal``); SGD
    (heavy-ball) and Adam / AdamW stages, with dropout (eval-mode objective) and Trainer stages (their recorded
    batches) — what each stage's pieces approximated in ``diagnostics["linearized"]``; ``segments`` pieces per stage;
    curvature: ``"hessian"`` (dense, exact) or ``"ekfac"``/``"kfac"`` (factored, fitted with ``config``, default
    ``CurvatureConfig()``: the sampled Fisher on every example); basis: ``"each"`` (a fit per piece) or ``"shared"``
    (EK-FAC: one eigenbasis per stage, eigenvalues re-estimated per piece) or one fitted EK-FAC curvature (or None)
    per stage, fitted at that stage's final parameters over its trained parameters, e.g.
    ``chain.curvature(0).approximations["ekfac"]`` of the plain chain on the recorded models: used as its last
    piece's curvature and shared basis, not refitted. The example terms as :meth:`influkit.Query.scores`:
    ``chunk_size`` rows at a time (default: what ``memory`` bytes hold, default budget when None), ``gradients``
    "contraction" or "per-example", split over the ranks under ``torch.distributed``, and with ``out=DIR`` streamed
    to a score store per stage (``DIR/stage-k``), resumable: a re-run skips the chunks already written.
    top: with a factored curvature, the ``top`` largest eigenpairs of each stage's Hessian (``top_curvature``:
    ``"hessian"``, or ``"gauss-newton"`` for its positive semi-definite part) at its final parameters (ARPACK's
    Lanczos, ``scipy.sparse.linalg.eigsh``: ``pip install 'influkit[unrolled]'``; dense when top ≥ p − 1) are put
    into every piece exactly (:mod:`.top`). Memory: top·p more per stage. Default ``"auto"``: TOP_AUTO per stage of
    ≤ TOP_AUTO_PARAMETERS trained parameters, fewer where the budget is short, none with the dense Hessian or where
    scipy is missing (a warning says so): :func:`~.top.top_count`. ``diagnostics["top"]`` says how many each stage
    used, from which matrix, and why. ``memory=`` bounds what the whole call adds (every phase gets ``memory`` minus
    what the call holds then, reported as ``held_bytes``).
    """
    if int(segments) < 1:
        raise InputError(f"segments must be ≥ 1, got {segments!r}.")
    if curvature not in PIECE_CURVATURES:
        raise InputError(f"unknown curvature {curvature!r}; choose one of {PIECE_CURVATURES}.")
    if top != "auto" and (isinstance(top, bool) or not isinstance(top, numbers.Integral) or top < 0
                          or (top and curvature == "hessian")):
        raise InputError(f"top={top!r}: the exact top eigenpairs complete a factored curvature (curvature='ekfac' or "
                         "'kfac', top ≥ 0, or 'auto'); the dense Hessian is exact in every direction already.")
    if top_curvature not in CURVATURES:
        raise InputError(f"unknown top_curvature {top_curvature!r}; choose one of {CURVATURES}.")
    given = None if isinstance(basis, str) else list(basis)
    if given is not None:
        if len(given) != len(record) or not all(b is None or isinstance(b, FactoredCurvature) for b in given):
            raise InputError(f"basis as a list needs one fitted EK-FAC curvature (or None) per recorded stage "
                             f"({len(record)}), e.g. [chain.curvature(0).approximations['ekfac'], None].")
        basis = "shared"
    if basis not in BASES or (basis == "shared" and curvature != "ekfac"):
        raise InputError(f"basis must be one of {BASES} or a list of fitted curvatures, and a shared eigenbasis "
                         f"needs curvature='ekfac'; got basis={basis!r} with curvature={curvature!r}.")
    settings = Settings(int(segments), curvature, basis, CurvatureConfig() if config is None else config, memory, top,
                        top_curvature, progress)
    for run in record.runs:
        rules(run)
    record = reweighted_at(record, test, at, progress)
    linear = [linearized(run) for run in record.runs]
    if out is not None and any(rows is not None for *_, rows in linear):
        raise InputError("out= streams each row's terms, and a Trainer stage's rows are its fed batches, summed into "
                         "examples in memory; leave out= unset for a record with Trainer stages.")
    if given is not None and any(g is not None and rows is not None for g, (*_, rows) in zip(given, linear)):
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
    adjoint, q, outputs = measure_adjoint(record, test, per_test, measure)
    passes: list[StagePass | None] = [None] * len(record)
    existing = [[run.checkpoints for run in record.runs], [b.tensors() for c in given or () if c is not None
                                                           for b in c.blocks]]
    held = Held(before=existing)  # the record's checkpoints and the given curvatures are not this call's
    held.hold(adjoint)
    for k in range(len(record) - 1, -1, -1):
        run, scale, _, _ = linear[k]
        with holding(run.stage.model, moved_frozen(run)), evaluating(run.stage.model):
            passes[k] = done = _stage(run, adjoint, q, settings, held, given[k] if given else None, scale)
        del adjoint
        if k:
            adjoint = hand_over(record, k, done.theta_bar, done.anchor_bar, q)
            held.hold(adjoint)
        held.drop(done.theta_bar, done.anchor_bar)
        done.theta_bar = done.anchor_bar = None
        del done
    directions_s = time.perf_counter() - began
    where = "dense Hessian at each segment's end" if curvature == "hessian" else \
        f"{curvature} ({settings.config.fisher} Fisher, hessian_samples={settings.config.hessian_samples}) " + \
        ("fitted at each segment's end" if basis == "each" else "eigenbasis fitted at the stage's end, eigenvalues at "
         "each segment's end")
    method = METHOD if curvature == "hessian" else f"unrolled approximate (segments, {curvature})"
    results = []
    for k, (run, _, notes, owner) in enumerate(linear):
        t0 = time.perf_counter()
        stage_out = None if out is None else Path(out) / f"stage-{k}"
        terms = Terms(run.stage, run.trained, passes[k].pieces, chunk_size=chunk_size, gradients=gradients,
                      memory=held.left(memory, "the example terms"), out=stage_out)
        terms.scorer.memory["held_bytes"] = held.bytes  # with memory=: its budget is memory − this
        with holding(run.stage.model, moved_frozen(run)), evaluating(run.stage.model):
            values, index, counts = terms.compute(fingerprint=fingerprint(f"{method}|{basis}", k, passes[k].pieces),
                                                  out=stage_out, progress=progress)
        diagnostics = {"seconds": {"approximate (pieces)": directions_s, "example terms": time.perf_counter() - t0},
                       "settings": {"segments": int(segments), "curvature": where, "basis": basis,
                                    "per_test": per_test, "measure_outputs": int(outputs)},
                       "chunks": counts | {"chunk_size": terms.chunk_size, "ranks": distributed.world_size()},
                       "scoring": terms.describe(), "memory": passes[k].plans + [terms.scorer.memory], "stage": k,
                       "top": passes[k].top, "stability": passes[k].stability, "linearized": notes}
        n = len(run.stage)
        if owner is not None:  # a Trainer stage's rows summed into their examples
            n = len(record.runs[k].stage)
            values = torch.zeros(n, *values.shape[1:], dtype=values.dtype, device=values.device).index_add_(
                0, (owner if index is None else owner[torch.as_tensor(index)]).to(values.device), values)
            index = None
        results.append(InfluenceResult(values=values if per_test else values[:, 0], n_train=n, index=index,
                                       method=f"{method}, stage {k}", diagnostics=diagnostics, removal_eps=-1.0))
        held.drop(passes[k].pieces)  # this stage's θ_ℓ and u_ℓ: not needed by the next stage's terms
        passes[k] = terms = None
    return results


def _stage(run: StageRun, adjoint: dict, q: int, settings: Settings, held: Held, fitted_end=None,
           scale: float = 1.0) -> StagePass:
    """Reverse pass of one stage through its pieces; ``adjoint`` (the stage's final adjoint, this call's own dict) is
    consumed.
    fitted_end: an EK-FAC curvature already fitted at the stage's final parameters (its last piece's), reused.
    scale: the factor of the objective's data term (a Trainer stage's examples per predicted token,
    :func:`linearized`); the stored u_ℓ carry it (the example terms and the shared block's adjoint read the data
    term only). ``held`` counts what the pass keeps."""
    names, anchor_names = list(run.trained), list(run.anchors)
    shapes = {n: v.shape for n, v in run.checkpoints[0][0].items()} | {n: v.shape for n, v in run.anchors.items()}
    sizes = {n: shapes[n].numel() for n in shapes}
    reference = run.checkpoints[0][0][names[0]]
    memory = settings.memory

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
    adam = isinstance(rules(run)[0][0], Adam)
    momentum = rules(run)[0][0].betas[0] if adam else run.optimizer.momentum
    decay = 0.0 if adam else run.optimizer.weight_decay
    out, plans, kept = [], [], None
    stability: dict = {"edge": 2 * (1 + momentum)}
    edge = Edge()
    directions = None
    top = {"directions": 0, "why": "the dense Hessian is exact in every direction"}
    if settings.curvature != "hessian":
        k, why = top_count(settings.top, v.shape[1], v.element_size(), held.left(memory, "the top directions"))
        top = {"directions": k, "curvature": settings.top_curvature, "why": why}
        if k:
            began = time.perf_counter()
            directions, products = top_directions(run, checkpoint_at(run, run.steps)[0], k, v.dtype,
                                                  settings.top_curvature, scale)
            top |= {"products": products, "seconds": time.perf_counter() - began}
    held.hold(directions)
    cuts = boundaries(run, settings.segments)
    clipped = adam and any(clip is not None for clip in run.clips)
    trajectory, gains = clipped_trajectory(run, [b for _, b in cuts]) if clipped else ({}, [1.0] * run.steps)
    held.hold(trajectory)  # the replayed ends' θ and optimizer state, each dropped once its piece is done
    for a, b in tqdm(list(reversed(cuts)), desc="segments", disable=not settings.progress, leave=False):
        theta_end, state_end = trajectory.pop(b) if clipped else checkpoint_at(run, b)
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
            if settings.curvature != "hessian" and not linear.coupled_uniform:
                raise InputError("Adam's coupled weight decay differs across parameter groups, and a factored "
                                 "curvature's eigenbasis cannot take a per-coordinate decay; use AdamW (decoupled) "
                                 "or curvature='hessian'.")
            if settings.curvature != "hessian" and linear.coupled is not None:
                decay = float(linear.coupled[0])
        steps = Steps(run.lrs[a:b], momentum) if linear is None else linear.steps
        if settings.curvature == "hessian":
            held.drop(v, w)
            u, v, w, met = dense_piece(run, theta_end, v, w, steps, decay, linear, scale)
            held.hold(v, w)
        else:
            fitted = fitted_end if b == run.steps and fitted_end is not None else \
                _fit(run, settings.curvature, settings.config, theta_end, kept,
                     held.left(memory, "a piece's curvature fit"), scale)
            if fitted is not fitted_end:
                plans.append({"piece": [a, b]} | fitted.info["memory"])
            if settings.basis == "shared":  # the eigenbases stay for the next piece (its fit shares them)
                held.drop([blk.tensors() for blk in kept.blocks] if kept is not None else [])
                held.hold([blk.tensors() for blk in fitted.blocks])
                kept = fitted
            release_freed_memory()
            u, met = factored_piece(fitted, v, w, steps, decay, directions,
                                    None if linear is None else linear.P.to(v.dtype))
            del fitted
        edge = edge + met
        if scale != 1.0:
            u.mul_(scale)
        held.hold(u)
        out.append((theta_end, u))
        if anchor_names:
            plans.append(_anchor_adjoint(run, theta_end, u, anchor_bar,
                                         held.left(memory, "the shared block's adjoint")))
            release_freed_memory()
    if kept is not None:
        held.drop([blk.tensors() for blk in kept.blocks])
    held.drop(directions)
    theta_bar = {m: t.reshape(q, *shapes[m]) for m, t in zip(names, v.split([sizes[m] for m in names], dim=1))}
    held.drop(w)
    return StagePass(theta_bar, anchor_bar, out[::-1], plans, stability | edge.summary(), top)


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


def linearized(run: StageRun) -> tuple[StageRun, float, list[str], torch.Tensor | None]:
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
    if isinstance(rules(run)[0][0], Adam):
        notes.append("Adam: second moment frozen at each segment's end (P = 1/(√v̂ + ε)), heavy-ball form with "
                     "momentum β₁")
    if any(clip is not None for clip in run.clips):
        notes.append("gradient clipping: each step's recorded clipping factor kept as a constant gain")
    optimizer_rules = rules(run)[0]
    if any(clip is not None for clip in run.clips) and any(
            isinstance(r, Adam) and not r.decoupled and r.weight_decay for r in optimizer_rules):
        raise InputError("a stage trained by Adam with coupled weight decay and gradient clipping: its decay term is "
                         "not clipped, so no single gain per step linearizes it; use AdamW (decoupled decay) or "
                         "ik.unrolled.metagradients (exact).")
    if run.inputs is None:
        return run, 1.0, notes, None
    if run.weights is not None or distributed.world_size() > 1:
        raise InputError("the approximate unrolling of a Trainer stage (its collated batches) runs at the recorded "
                         "weights in one process; use ik.unrolled.metagradients (exact) for at= or several ranks.")
    collated, scale, owner = fed_rows(run)
    notes.append(f"Trainer batches: the stage's rows are the {len(owner)} examples as the collator fed them step by "
                 f"step (their recorded masks; an example's score sums its rows'), the data term scaled by {scale:.4g} "
                 "(the recorded batches' mean examples per predicted token)")
    return collated, scale, notes, owner


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
