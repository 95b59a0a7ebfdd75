"""Krylov and fixed-point iterations on A x = c for symmetric A given as a function, batched over columns of c.

The kernels of :mod:`influkit.solvers`: :func:`cg` (conjugate gradients, optionally preconditioned), :func:`minres`
(Paige & Saunders, indefinite A), :func:`richardson` (LiSSA's deterministic form) and :func:`largest_eigenvalue`
(its step). Each takes ``apply`` (v ↦ A v on (p, k) blocks), the target c, a tolerance on the relative residual,
an iteration cap and a progress bar, and knows nothing of Hessians, damping or diagnostics.
"""

from __future__ import annotations

import math

import torch

from .errors import NumericalError


def cg(apply, target, tol, max_iter, bar, require_positive: bool, preconditioner=None, stats: dict | None = None):
    """Batched (preconditioned) conjugate gradients on A x = c, A symmetric positive definite, a column each.

    With ``require_positive`` it stops at a direction of non-positive curvature pᵀAp ≤ 0 (A is then not positive
    definite) and sets ``stats["negative_curvature"]``. stats also receives ``lanczos``, each column's Lanczos
    tridiagonal T_k of A (of M⁻¹A when preconditioned) from CG's own coefficients α_j = rᵀz/pᵀAp, β_j = r'ᵀz'/rᵀz:
    T_jj = 1/α_j + β_(j−1)/α_(j−1), T_(j,j+1) = √β_j/α_j (Saad, *Iterative Methods*, §6.7.3), in the layout of
    :func:`minres`'s."""
    precondition = preconditioner or (lambda r: r)
    x = torch.zeros_like(target)
    r = target.clone()
    z = precondition(r)
    p = z.clone()
    rz = (r * z).sum(0)
    bnorm = target.norm(dim=0).clamp_min(torch.finfo(target.dtype).tiny)
    zeros = torch.zeros_like(rz)
    diagonal, offdiagonal, steps = [], [], torch.zeros_like(rz, dtype=torch.long)
    last_alpha, last_beta = torch.ones_like(rz), zeros.clone()  # α_(j−1), β_(j−1) (β_0 = 0)
    iterations = 0
    for iterations in range(1, max_iter + 1):
        active = r.norm(dim=0) / bnorm > tol
        if not active.any():
            iterations -= 1
            break
        ap = apply(p)
        curvature = (p * ap).sum(0)
        if require_positive and (curvature[active] <= 0).any():
            if stats is not None:
                stats["negative_curvature"] = True
            break
        alpha = torch.where(active, rz / torch.where(active, curvature, torch.ones_like(curvature)), torch.zeros_like(rz))
        x = x + alpha * p
        r = r - alpha * ap
        z = precondition(r)
        rz_new = (r * z).sum(0)
        beta = torch.where(active, rz_new / rz.clamp_min(torch.finfo(rz.dtype).tiny), torch.zeros_like(rz))
        if stats is not None:
            safe = torch.where(active, alpha, torch.ones_like(alpha))
            diagonal.append(torch.where(active, 1 / safe + last_beta / last_alpha, zeros))
            offdiagonal.append(torch.where(active, beta.clamp_min(0).sqrt() / safe, zeros))
            steps += active.long()
            last_alpha, last_beta = torch.where(active, safe, last_alpha), torch.where(active, beta, last_beta)
        p = z + beta * p
        rz = torch.where(active, rz_new, rz)
        bar.update(1)
    if stats is not None:
        stats["lanczos"] = (torch.stack(diagonal, 1) if diagonal else zeros[:, None],
                            torch.stack(offdiagonal, 1) if offdiagonal else zeros[:, None], steps)
    return x, iterations


def minres(apply, target, tol, max_iter, bar, preconditioner=None, eps: float | None = None, stats: dict | None = None):
    """Batched MINRES (Paige & Saunders 1975) on A x = c for symmetric, possibly indefinite A.

    Lanczos builds a basis v_j of the Krylov space; a running QR of the tridiagonal matrix by Givens rotations
    (cs, sn) gives the iterate minimizing ‖A x − c‖ over the space, and phibar is that residual norm, so the
    stopping test costs nothing. With a preconditioner (M⁻¹, symmetric positive definite) the Lanczos process
    runs in the M⁻¹ inner product (v_j = M⁻¹-scaled) and x minimizes ‖A x − c‖_{M⁻¹}; phibar is then that
    norm, so the true residual c − A x is carried alongside (A w_j from the same products, no extra HVP) and
    the stopping test uses it.

    eps: given (the unit roundoff of the operator's products), the residual is carried as above even without
    a preconditioner, a column stops once its residual is below ``floor`` = eps·(‖A‖‖x‖/‖c‖ + 1) (‖A‖
    estimated from the products; measured on float32 matrices, the true residual stalls at 0.3-0.5 of it, so
    iterating further cannot be certified), and the call returns
    (x, iterations, largest floor); otherwise (x, iterations).

    stats: a dict that receives ``norm``, the largest ‖Av‖/‖v‖ seen (a lower bound of ‖A‖), and ``lanczos``, the
    Lanczos tridiagonal of each column (:func:`smallest_ritz_value` reads A's inertia off it).
    """
    tiny = torch.finfo(target.dtype).tiny
    track = preconditioner is not None or eps is not None
    zeros = torch.zeros(target.shape[1], dtype=target.dtype, device=target.device)
    bnorm = target.norm(dim=0)
    x = torch.zeros_like(target)
    r1 = target.clone()
    r2 = target.clone()
    if preconditioner is not None:
        y = preconditioner(target)
        inner = (target * y).sum(0)
        if (inner < 0).any() or not torch.isfinite(inner).all():
            raise NumericalError("the preconditioner is not positive definite (bᵀM⁻¹b < 0); add damping to it.")
        beta1 = inner.sqrt()
    else:
        y = target.clone()
        beta1 = bnorm.clone()
    beta, oldb = beta1.clone(), zeros.clone()
    dbar, epsln, cs, sn = zeros.clone(), zeros.clone(), -torch.ones_like(zeros), zeros.clone()
    phibar = beta1.clone()
    w = torch.zeros_like(target)
    w2 = torch.zeros_like(target)
    if track:
        ax, aw, aw2 = torch.zeros_like(target), torch.zeros_like(target), torch.zeros_like(target)
    anorm = zeros.clone()
    floor = zeros.clone()
    active = beta1 > 0
    diagonal, offdiagonal, steps = [], [], torch.zeros_like(beta1, dtype=torch.long)
    iterations = 0
    for iterations in range(1, max_iter + 1):
        if track:
            relres = (target - ax).norm(dim=0) / bnorm.clamp_min(tiny)
            if eps is not None:
                floor = eps * (anorm * x.norm(dim=0) / bnorm.clamp_min(tiny) + 1)
            active = active & (relres > tol) & (relres > floor)
        else:
            active = active & (phibar > tol * beta1)
        if not active.any():
            iterations -= 1
            break
        # normalize converged columns too: their (unused) Lanczos vectors would otherwise grow until they overflow
        safe_beta = torch.where(beta > tiny, beta, torch.ones_like(beta))
        v = y / safe_beta
        av = apply(v)
        anorm = torch.maximum(anorm, av.norm(dim=0) / v.norm(dim=0).clamp_min(tiny))
        y = av
        if iterations >= 2:
            y = y - (beta / torch.where(oldb > tiny, oldb, torch.ones_like(oldb))) * r1
        alfa = (v * y).sum(0)
        y = y - (alfa / safe_beta) * r2
        r1, r2 = r2, y
        if preconditioner is not None:
            y = preconditioner(r2)
            oldb, beta = beta, (r2 * y).sum(0).clamp_min(0).sqrt()
        else:
            oldb, beta = beta, y.norm(dim=0)
        if stats is not None:
            diagonal.append(alfa)
            offdiagonal.append(beta)
            steps += active.long()
        oldeps = epsln
        delta = cs * dbar + sn * alfa
        gbar = sn * dbar - cs * alfa
        epsln = sn * beta
        dbar = -cs * beta
        gamma = torch.sqrt(gbar**2 + beta**2).clamp_min(tiny)
        cs, sn = gbar / gamma, beta / gamma
        phi = cs * phibar
        phibar = torch.where(active, sn * phibar, phibar)
        w1, w2 = w2, w
        w = (v - oldeps * w1 - delta * w2) / gamma
        x = torch.where(active, x + phi * w, x)
        if track:
            aw1, aw2 = aw2, aw
            aw = (av - oldeps * aw1 - delta * aw2) / gamma
            ax = torch.where(active, ax + phi * aw, ax)
        bar.update(1)
    if stats is not None:
        stats["norm"] = float(anorm.max())
        stats["lanczos"] = (torch.stack(diagonal, 1) if diagonal else zeros[:, None],
                            torch.stack(offdiagonal, 1) if offdiagonal else zeros[:, None], steps)
    if eps is not None:
        return x, iterations, float(floor.max())
    return x, iterations


def negative_ritz_values(lanczos) -> int:
    """The most negative eigenvalues of MINRES's Lanczos tridiagonal T_k (``stats["lanczos"]``) over the columns,
    counted by Sylvester's law of inertia: the negative pivots d_1 = α_1, d_i = α_i − β_i² / d_(i−1) of T = LDLᵀ
    (O(k)). Its eigenvalues are Ritz values of A (of M⁻¹A when preconditioned, whose inertia is A's): one negative
    certifies that A is indefinite."""
    diagonal, offdiagonal, steps = lanczos
    most = 0
    for alfa, beta, k in zip(diagonal.tolist(), offdiagonal.tolist(), steps.tolist()):
        pivot, negative = 0.0, 0
        for i in range(k):
            pivot = alfa[i] - (beta[i - 1] ** 2 / pivot if i and pivot != 0.0 else 0.0)
            negative += pivot < 0
        most = max(most, negative)
    return most


def extreme_ritz_values(lanczos) -> tuple[float, float, int] | None:
    """(θ_min, θ_max, k): the extreme Ritz values of A over the columns' Lanczos tridiagonals T (``stats["lanczos"]``
    of :func:`minres` or :func:`cg`, unpreconditioned) — each column's eigenvalues of its T_k lie within A's spectrum,
    so the smallest and largest over the columns do too — and k, the most steps a column took; None when no column
    took a step."""
    diagonal, offdiagonal, steps = lanczos
    low, high, most = math.inf, -math.inf, 0
    for alfa, beta, k in zip(diagonal.double(), offdiagonal.double(), steps.tolist()):
        if k == 0:
            continue
        tri = torch.diag(alfa[:k].cpu())
        if k > 1:
            off = beta[: k - 1].cpu()
            tri += torch.diag(off, 1) + torch.diag(off, -1)
        theta = torch.linalg.eigvalsh(tri)
        low, high, most = min(low, float(theta[0])), max(high, float(theta[-1])), max(most, k)
    return (low, high, most) if most else None


def largest_eigenvalue(apply, like: torch.Tensor, steps: int = 30) -> float:
    """|λ_max| of the operator by power iteration from a seeded random start."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    v = torch.randn(like.shape[0], 1, generator=gen, dtype=like.dtype).to(like.device)
    v = v / v.norm()
    value = 0.0
    for _ in range(steps):
        av = apply(v)
        value = float(av.norm())
        if value == 0.0:
            break
        v = av / value
    return value


def richardson(apply, target, scale, tol, max_iter, bar):
    """LiSSA (Agarwal et al.) in its deterministic form: x ← x + (c − A x)/scale, i.e. x = Σ_j (I − A/s)^j c / s."""
    x = target / scale
    bnorm = target.norm(dim=0).clamp_min(torch.finfo(target.dtype).tiny)
    iterations = 0
    for iterations in range(1, max_iter + 1):
        residual = target - apply(x)
        if ((residual.norm(dim=0) / bnorm) <= tol).all():
            break
        x = x + residual / scale
        bar.update(1)
    return x, iterations
