"""The closed form of one piece of approximate unrolling: the transposed heavy-ball recursion per eigen-coordinate,
applied through a dense Hessian's or a factored curvature's eigenbasis.

A piece [a, b) is linearized as heavy-ball descent with one curvature K; per eigen-coordinate (eigenvalue λ) step t
is b' = μb + c_t(λδ + f), δ' = ρ_t δ − η_t b' (gain c_t, decay ρ_t), and its transpose with γ = β − η_t α is
u += c_t γ, α ← ρ_t α + c_t λ γ, β ← μ γ, from the adjoints (α, β) of (δ, b) at the piece's end. Under Adam the
recursion runs in the coordinates scaled by the frozen preconditioner P (:class:`~.adam_piece.AdamPiece`); the
derivation is on the documentation's approximate-unrolling page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.func import hessian

from .replay import unit_weights
from .run import StageRun
from .steps import Steps

if TYPE_CHECKING:
    from .adam_piece import AdamPiece


@dataclass(frozen=True)
class Edge:
    """What a piece met of the edge of stability: its largest η_t c_t λ, how many eigen-coordinates were past the edge
    (unrolled as gradient flow, :func:`piece`) and how many there were."""

    largest_lr_times_eigenvalue: float = 0.0
    coordinates_past_the_edge: int = 0
    coordinates: int = 0

    @classmethod
    def of(cls, lam: torch.Tensor, steps: Steps) -> Edge:
        largest = max(lr * c for lr, c in zip(steps.lrs, steps.factors()))
        return cls(float(lam.max()) * largest, int((lam > steps.edge()).sum()), lam.numel())

    def __add__(self, other: Edge) -> Edge:
        return Edge(max(self.largest_lr_times_eigenvalue, other.largest_lr_times_eigenvalue),
                    self.coordinates_past_the_edge + other.coordinates_past_the_edge,
                    self.coordinates + other.coordinates)

    def summary(self) -> dict:
        return {"largest_lr_times_eigenvalue": self.largest_lr_times_eigenvalue,
                "coordinates_past_the_edge": self.coordinates_past_the_edge, "coordinates": self.coordinates}


def piece(lam: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, steps: Steps):
    """(α, β) at the piece's start and the forcing's adjoint u, elementwise per eigen-coordinate (eigenvalue ``lam``)
    from the adjoints (α, β) of (δθ, δb) at its end (module docstring).

    A coordinate past the edge of stability (η_t c_t λ > 2(1 + μ) at some step, where one step's linear map has
    spectral radius > 1) is unrolled as gradient flow with the effective learning rate η_t c_t / (1 − μ) and the
    momentum buffer slaved to it (b = (λδ + f)/(1 − μ)): with τ = Σ_t η_t c_t/(1 − μ), the decay's rate
    λ' = λ + Σ_t (1 − ρ_t)/τ and A = exp(−λ'τ), u = −(1 − A)/λ' · α + c A/(1 − μ) · β, α ← A α + c λA/(1 − μ) · β,
    β ← 0 (c: the last step's gain). The discrete map there grows as |1 − ηλ|^K while the run it linearizes did not
    diverge (its sharpness adapts, Cohen et al. 2021); the flow keeps such a direction's share at its minimum's 1/λ."""
    rho, gains, momentum = steps.decays(), steps.factors(), steps.momentum
    unstable = lam > steps.edge()
    stable_lam = torch.where(unstable, torch.zeros_like(lam), lam)  # no overflow in the coordinates replaced below
    a0, b0 = alpha, beta
    forcing = torch.zeros_like(alpha)
    for lr, r, c in zip(reversed(steps.lrs), reversed(rho), reversed(gains)):
        gamma = beta - lr * alpha
        forcing = forcing + c * gamma
        alpha, beta = r * alpha + (c * stable_lam) * gamma, momentum * gamma
    if not bool(unstable.any()):
        return alpha, beta, forcing
    slaved = gains[-1] / (1 - momentum)
    time_ = sum(lr * c for lr, c in zip(steps.lrs, gains)) / (1 - momentum)
    rate = lam + sum(1 - r for r in rho) / time_
    decayed = torch.exp(-rate * time_)
    safe = torch.where(unstable, rate, torch.ones_like(rate))
    forcing = torch.where(unstable, -(1 - decayed) / safe * a0 + decayed * slaved * b0, forcing)
    alpha = torch.where(unstable, decayed * a0 + lam * decayed * slaved * b0, alpha)
    beta = torch.where(unstable, torch.zeros_like(beta), beta)
    return alpha, beta, forcing


def maps(lam: torch.Tensor, d: torch.Tensor | None, steps: Steps) -> list[list[torch.Tensor]]:
    """[[f_ij]]: the piece's map from the end adjoints j = (α, β) to i = (u, α_start, β_start), per coordinate with
    eigenvalue ``lam`` and learning-rate scale d (None: 1) — in the scaled coordinates φ = δ/√d, b̃ = √d b the
    coordinate is the plain recursion with eigenvalue dλ (:func:`piece`), so with (ũ, α̃, β̃) its maps from the unit
    inputs: f = [[d ũ_α, ũ_β], [α̃_α, α̃_β / d], [d β̃_α, β̃_β]]."""
    one, zero = torch.ones_like(lam), torch.zeros_like(lam)
    scaled = lam if d is None else d * lam
    alpha_v, beta_v, u_v = piece(scaled, one, zero, steps)
    if d is not None:
        u_v, beta_v = d * u_v, d * beta_v
    if not steps.momentum:
        return [[u_v], [alpha_v], [beta_v]]
    alpha_w, beta_w, u_w = piece(scaled, zero, one, steps)
    return [[u_v, u_w], [alpha_v, alpha_w if d is None else alpha_w / d], [beta_v, beta_w]]


def dense_piece(run: StageRun, theta_end: dict, v: torch.Tensor, w: torch.Tensor, steps: Steps, decay: float,
                adam: AdamPiece | None = None, scale: float = 1.0):
    """(u, v', w', Edge) of one piece with the dense Hessian of the stage objective at θ_ℓ (its data term times
    ``scale``), eigendecomposed; under Adam (``adam``) that of K = P^{1/2}(H + coupled decay)P^{1/2}, with the
    adjoints moved into and out of the scaled coordinates (:class:`~.adam_piece.AdamPiece`)."""
    names = list(run.trained)
    every = torch.arange(len(run.stage))
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
        alpha, beta, forcing = piece(lam + decay, v @ eigvecs, w @ eigvecs, steps)
        return forcing @ eigvecs.T, alpha @ eigvecs.T, beta @ eigvecs.T, Edge.of(lam + decay, steps)
    root = adam.P.to(h.dtype).sqrt()
    if adam.coupled is not None:
        h = h + torch.diag(adam.coupled.to(h.dtype))
    lam, eigvecs = torch.linalg.eigh(root[:, None] * h * root[None, :])
    alpha, beta, forcing = piece(lam, (v * root) @ eigvecs, (w / root) @ eigvecs, steps)
    return (forcing @ eigvecs.T) * root, (alpha @ eigvecs.T) / root, (beta @ eigvecs.T) * root, Edge.of(lam, steps)


def factored_piece(fitted, v: torch.Tensor, w: torch.Tensor, steps: Steps, decay: float,
                   directions: tuple[torch.Tensor, torch.Tensor] | None = None,
                   preconditioner: torch.Tensor | None = None) -> tuple[torch.Tensor, Edge]:
    """(u, Edge) of one piece with the factored curvature C fitted at θ_ℓ, and (v, w) moved to the piece's start
    **in place**: each output is Σ_j f_j(C)·input_j with f_j the piece's coefficient functions of one eigenvalue
    (:func:`maps` on unit inputs), all applied in one pass over C's blocks (:meth:`FactoredCurvature.functions`).
    Under Adam (``preconditioner`` P, the diagonal of :class:`~.adam_piece.AdamPiece`) the map is split by its order
    in the curvature: F(0) and F'(0) with the diagonal P itself (F(0) elementwise, F'(0) through products with C, on
    the eigenvalues :func:`first_order` keeps), the rest in C's eigenbasis with P projected onto it
    (d = q_iᵀ P q_i). ``directions`` (g, V): the top eigenpairs put in exactly, the factored map on their
    complement. Adds u, and under Adam three more (q, p) outputs and two products with C."""
    carried = steps.momentum > 0  # with momentum the buffer's adjoint w is carried (else it stays 0)
    top = directions is not None
    edges: list[Edge] = []
    low, slopes = ((), None) if preconditioner is None else \
        low_orders(fitted, v, w if carried else None, preconditioner, decay, directions, steps)

    def remainder(f, lam, d):  # f(λ, d) − f(0, d) − λ' f_λ(0, d), f_ij = d^{a_ij} φ_ij(dλ) (a = ORDERS)
        zero = maps(torch.zeros_like(lam), d, steps)
        lam = first_order(lam, d, steps, slopes[0][0])
        return [[f - f0 - lam * d ** (a + 1) * s for f, f0, s, a in zip(row, row0, slope, orders)]
                for row, row0, slope, orders in zip(f, zero, slopes, ORDERS)]

    def coefficients(lam, d=None):  # [[f_ij]]: outputs i = (u, v', w'), inputs j = (v, w)
        edges.append(Edge.of(lam + decay if d is None else d * (lam + decay), steps))
        f = maps(lam + decay, d, steps)
        return f if d is None else remainder(f, lam + decay, d)

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
        edges.append(Edge.of(g + decay if d_top is None else d_top * (g + decay), steps))
        f = maps(g + decay, d_top, steps)
        if d_top is not None:
            f = remainder(f, g + decay, d_top)
        top_in = (v_top, w_top) if carried else (v_top,)
        for x, row in zip((u, v, w), f):
            x += sum(c * t for c, t in zip(row, top_in)) @ basis.T
    for x, part in zip((u, v, w), low):
        x += part
    return u, sum(edges, Edge())


def first_order(lam: torch.Tensor, d: torch.Tensor, steps: Steps, slope: float) -> torch.Tensor:
    """λ where an Adam piece's map of the eigen-coordinate is still close to linear in its curvature, else 0: the
    eigenvalues whose first order the piece takes with the diagonal P (:func:`factored_piece`). Close: the map
    u ← v past its first order, |f(λ, d) − f(0, d) − λ d² φ'(0)|, is at most half that first order |λ d² φ'(0)|
    (``slope`` φ'(0)). Past it the first order outgrows the map (a long piece saturates at the minimum's response)
    and its remainder, in the projected P, would cancel it only where P_Q = P, so there it stays in the remainder."""
    first = lam * d * d * slope
    rest = maps(lam, d, steps)[0][0] - maps(torch.zeros_like(lam), d, steps)[0][0] - first
    return torch.where(rest.abs() <= 0.5 * first.abs(), lam, torch.zeros_like(lam))


ORDERS = ((1, 0), (0, -1), (1, 0))
"""a_ij of f_ij(λ, d) = d^{a_ij} φ_ij(dλ), the piece's maps (:func:`maps`) from the inputs j = (α, β) to the outputs
i = (u, α_start, β_start): u and β_start carry P^{1/2} on the left, α P^{1/2} on the right, so the first order
λ d^{a_ij + 1} φ'_ij(0) is P^{[i ≠ α]} C P^{[j = α]} φ'_ij(0) in θ's coordinates."""


def low_orders(fitted, v: torch.Tensor, w: torch.Tensor | None, P: torch.Tensor, decay: float, directions,
               steps: Steps) -> tuple[list, list]:
    """([u, α, β parts], slopes): the zeroth and first order in the curvature of one Adam piece's map, applied to
    (v, w) with the diagonal P itself — F(0) elementwise (f_ij(0, P)), and the first order λ d^{a_ij + 1} φ'_ij(0)
    as P^{[i ∈ (u, β)]} K P^{[j = α]} (K the piece's curvature: C plus the coupled decay, the top directions' exact
    eigenvalues in their span) — and the slopes φ'_ij(0) (one number each) for :func:`factored_piece`'s remainder."""
    lam = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():
        unit = maps(lam, None, steps)
        slopes = [[float(torch.autograd.grad(f.sum(), lam, retain_graph=True, allow_unused=True)[0] or 0.0)
                   if f.requires_grad else 0.0 for f in row] for row in unit]
    inputs = (v, w) if w is not None else (v,)
    zero = maps(torch.zeros_like(P), P, steps)
    parts = [sum(f * x for f, x in zip(row, inputs)) for row in zero]

    def kept(e, d):  # K's eigenvalues where the first order is kept, else 0
        return [[first_order(e + decay, d, steps, slopes[0][0])]]

    def curvature(x: torch.Tensor) -> torch.Tensor:  # K' x for x (q, p): K's eigenvalues past first_order's bound 0
        out = torch.empty_like(x)
        if directions is None:
            fitted.functions([x.T], kept, out=[out.T], diagonal=P)
        else:
            g, basis = directions
            inside = x @ basis
            fitted.functions([(x - inside @ basis.T).T], kept, out=[out.T], diagonal=P)
            out -= (out @ basis) @ basis.T
            out += (inside * first_order(g + decay, (basis ** 2).T @ P, steps, slopes[0][0])) @ basis.T
        return out

    products = [curvature(P * v)] + ([curvature(w)] if w is not None else [])
    for i, (part, row) in enumerate(zip(parts, slopes)):
        for slope, product in zip(row, products):
            if slope:
                part += slope * (P * product if ORDERS[i][0] == 1 else product)
    return parts, slopes
