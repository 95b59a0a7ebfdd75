"""Low-rank curvature from Hessian-vector products: the top eigenpairs of H by Lanczos (Schioppa et al. 2022).

Schioppa, Zablotskaia, Vilar & Sokolov, "Scaling Up Influence Functions" (AAAI 2022) run Arnoldi on the Hessian
and keep its k largest eigenvalues; for a symmetric H Arnoldi is the Lanczos recurrence, run here in float64 with
full re-orthogonalization, m ≥ k steps (one HVP each), Ritz pairs of the m×m tridiagonal matrix, and the k
of largest |θ| kept (a trained network's H is often indefinite). :class:`ArnoldiInverse` is their influence
operator, the inverse restricted to the span of the eigenvectors:

    H⁻¹ ≈ V diag(1/(θ + λ)) Vᵀ        (directions outside span V are dropped; θ + λ ≈ 0 dropped too)

and :func:`deflated` turns the same pairs into a spectral preconditioner for MINRES/CG.
"""

from __future__ import annotations

import time

import torch
from ..progress import steps as progress_steps

from ..errors import InputError


def lanczos(operator, rank: int, iterations: int | None = None, *, seed: int = 0, progress: bool = False):
    """(θ (r,), V (p, r), info): the r = min(rank, m) Ritz pairs of largest |θ| after m Lanczos steps, float64.

    iterations: m (default max(2·rank, rank + 20), at most p). info: HVPs, seconds, and each pair's residual
    bound ‖H v − θ v‖ = β_m |s_m| (the last component of its tridiagonal eigenvector).
    """
    if rank <= 0:
        raise InputError(f"rank must be positive, got {rank}.")
    start = time.perf_counter()
    p = operator.dim
    steps = min(iterations or max(2 * rank, rank + 20), p)
    device = operator.device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    basis = torch.zeros(p, steps + 1, dtype=torch.float64, device=device)
    q = torch.randn(p, generator=gen, dtype=torch.float64).to(device)
    basis[:, 0] = q / q.norm()
    alphas, betas = [], []
    products = 0
    for j in progress_steps(range(steps), "Lanczos", progress):
        w = operator.matvec(basis[:, j].to(operator.dtype)).to(torch.float64)
        products += 1
        alpha = float(basis[:, j] @ w)
        w = w - alpha * basis[:, j] - (betas[-1] * basis[:, j - 1] if j > 0 else 0.0)
        for _ in range(2):  # full re-orthogonalization, twice is enough (Parlett)
            w = w - basis[:, : j + 1] @ (basis[:, : j + 1].T @ w)
        beta = float(w.norm())
        alphas.append(alpha)
        betas.append(beta)
        if beta <= 1e-12 * max(abs(a) for a in alphas):  # an invariant subspace: the Ritz pairs are exact
            break
        basis[:, j + 1] = w / beta
    m = len(alphas)
    tri = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if m > 1:
        off = torch.tensor(betas[: m - 1], dtype=torch.float64)
        tri += torch.diag(off, 1) + torch.diag(off, -1)
    theta, s = torch.linalg.eigh(tri)
    order = theta.abs().argsort(descending=True)[: min(rank, m)]
    theta, s = theta[order], s[:, order]
    vectors = basis[:, :m] @ s.to(device)
    bounds = (betas[m - 1] * s[m - 1].abs()).tolist()
    info = {"rank": int(theta.numel()), "iterations": m, "products": products,
            "seconds": time.perf_counter() - start, "residual_bounds": bounds}
    return theta.to(device), vectors, info


class ArnoldiInverse:
    """V diag(1/(θ + λ)) Vᵀ, the low-rank inverse of Schioppa et al. (module docstring): the top eigenpairs (θ, V)
    of H, applied with the damping λ of each solve (the solver's :class:`~influkit.solvers.SolveConfig` holds λ)."""

    def __init__(self, eigenvalues: torch.Tensor, eigenvectors: torch.Tensor, dtype: torch.dtype, info: dict | None = None):
        self.eigenvalues, self.eigenvectors = eigenvalues, eigenvectors
        self._dtype = dtype
        self.info = dict(info or {})

    @property
    def dim(self) -> int:
        return self.eigenvectors.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self.eigenvectors.device

    def _weights(self, damping: float) -> torch.Tensor:
        shifted = self.eigenvalues + damping
        floor = 1e-12 * float(shifted.abs().max()) if shifted.numel() else 0.0
        return torch.where(shifted.abs() > floor, 1.0 / torch.where(shifted.abs() > floor, shifted, torch.ones_like(shifted)),
                           torch.zeros_like(shifted))

    def solve(self, rhs: torch.Tensor, damping: float) -> torch.Tensor:
        """V diag(1/(θ + λ)) Vᵀ rhs for λ = ``damping`` (θ + λ ≈ 0 dropped)."""
        single = rhs.dim() == 1
        r = rhs.reshape(rhs.shape[0], -1).to(torch.float64)
        out = self.eigenvectors @ (self._weights(float(damping))[:, None] * (self.eigenvectors.T @ r))
        out = out.to(rhs.dtype)
        return out.reshape(-1) if single else out

    def dense(self, damping: float) -> torch.Tensor:
        """The explicit p×p matrix V diag(1/(θ + λ)) Vᵀ."""
        return self.eigenvectors @ torch.diag(self._weights(float(damping))) @ self.eigenvectors.T

    def state(self, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict]:
        return ({f"{prefix}eigenvalues": self.eigenvalues, f"{prefix}eigenvectors": self.eigenvectors},
                {"info": self.info})

    @classmethod
    def from_state(cls, tensors: dict, meta: dict, dtype: torch.dtype, device, prefix: str = "") -> "ArnoldiInverse":
        # fresh (aligned) copies: BLAS kernels may round differently on the file buffer's offsets
        return cls(tensors[f"{prefix}eigenvalues"].to(device).clone(), tensors[f"{prefix}eigenvectors"].to(device).clone(),
                   dtype, meta["info"])


def deflated(base, eigenvalues: torch.Tensor, eigenvectors: torch.Tensor, damping: float):
    """The spectral preconditioner M⁻¹ r = V diag(1/|θ + λ|) Vᵀ r + P base(P r), P = I − V Vᵀ.

    base: a callable applying an SPD M₀⁻¹ (or None for the identity). M⁻¹ is SPD, inverts H + λI exactly on
    span V when the pairs are exact, and leaves the rest to M₀; with MINRES the eigenvalues θ + λ become ±1.
    """
    weights = 1.0 / (eigenvalues + damping).abs().clamp_min(1e-12 * float((eigenvalues + damping).abs().max()))

    def apply(r: torch.Tensor) -> torch.Tensor:
        r64 = r.to(torch.float64)
        coeff = eigenvectors.T @ r64
        rest = r64 - eigenvectors @ coeff
        if base is not None:
            rest = base(rest.to(r.dtype)).to(torch.float64)
            rest = rest - eigenvectors @ (eigenvectors.T @ rest)
        return (eigenvectors @ (weights[:, None] * coeff) + rest).to(r.dtype)

    return apply
