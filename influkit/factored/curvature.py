"""K-FAC, EK-FAC and diagonal approximations of a stage's curvature, as :class:`~influkit.operators.Operator` s.

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
eigenvalue-correction pass — in the order the kind's registered class (:class:`Diagonal`, :class:`KFAC`,
:class:`EKFAC`, :mod:`.approximations`) gives; :func:`fit_curvature` is the one-call form.

``matvec`` applies C, ``solve(rhs, damping)`` applies (C + λI)⁻¹ blockwise in the eigenbases (exactly, no
iteration); ``inverse(λ)`` is that inverse as an Operator, the approximate inverse of ``solver="ekfac"``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
from torch.func import grad
from ..progress import steps as progress_steps

from .. import distributed
from ..curvature import penalty_gradient
from ..errors import FileFormatError, InputError, warn
from ..layers import Layer, Recorder, plan
from ..memory import DEFAULT_WORKING, PROBE_EXAMPLES, fit_count, probe_bytes
from ..memory import given as memory_given
from ..memory import resolve as memory_budget
from ..operators import count_products
from ..params import ParamSpace, point
from ..stage import Stage
from ..vectorize import vmap_or_loop
from .approximations import APPROXIMATIONS, Approximation, register, space_of
from .fisher import FISHER, PseudoGradients
from .layers import plan_layers

KINDS = ("kfac", "ekfac", "diagonal")
CACHE_BYTES = 2**30  # at most this much of the first pass is kept for EK-FAC's correction (else a second pass)
# a batch also holds output-sized tensors the saved-tensor probe does not see: the outputs, their pseudo-gradients
# and the loss's log-probabilities for the sampled labels' scale (vocabulary-sized for a language model)
OUTPUT_COPIES = 4
DIAGONAL_SLICE = 2**20  # FactoredCurvature.functions: entries of a diagonal block taken at a time


@dataclass
class KroneckerBlock:
    """One layer's block, C_M = (L ⊗ R) diag(vec E) (L ⊗ R)ᵀ + shift·I on the row-major vec of M (rows × cols).

    left: rows × rows eigenvectors (None: the standard basis, an embedding's diagonal input factor);
    right: cols × cols eigenvectors; eigenvalues: rows × cols (K-FAC: outer product of the factors' eigenvalues;
    EK-FAC: the corrected ones); shift: the regularizer's curvature on this block. inputs_first: M = [W; bᵀ]
    (weight stored (in, out), the bias its last row), else M = [W | b] (the bias its last column).
    """

    layer: str
    kind: str
    weight: str
    bias: str | None
    rows: int
    cols: int
    left: torch.Tensor | None
    right: torch.Tensor
    eigenvalues: torch.Tensor
    shift: float = 0.0
    inputs_first: bool = False

    def gather(self, vecs: torch.Tensor, offsets: dict[str, int]) -> torch.Tensor:
        """(k, rows, cols) block matrices from (p, k) flat vectors."""
        k = vecs.shape[1]
        w0 = offsets[self.weight]
        if self.bias is None:
            return vecs[w0 : w0 + self.rows * self.cols].T.reshape(k, self.rows, self.cols)
        b0 = offsets[self.bias]
        if self.inputs_first:
            m = vecs[w0 : w0 + (self.rows - 1) * self.cols].T.reshape(k, self.rows - 1, self.cols)
            return torch.cat([m, vecs[b0 : b0 + self.cols].T.reshape(k, 1, self.cols)], dim=1)
        width = self.cols - 1
        m = vecs[w0 : w0 + self.rows * width].T.reshape(k, self.rows, width)
        return torch.cat([m, vecs[b0 : b0 + self.rows].T.reshape(k, self.rows, 1)], dim=2)

    def scatter(self, m: torch.Tensor, out: torch.Tensor, offsets: dict[str, int]) -> None:
        """Write (k, rows, cols) block matrices into the (p, k) flat vectors ``out``."""
        k = m.shape[0]

        def put(start: int, part: torch.Tensor) -> None:  # (k, a, b) into out[start : start + a·b] in one copy
            out[start : start + part.shape[1] * part.shape[2]].view(part.shape[1], part.shape[2], k).copy_(
                part.permute(1, 2, 0))

        if self.bias is None:
            put(offsets[self.weight], m)
        elif self.inputs_first:
            put(offsets[self.weight], m[:, :-1])
            put(offsets[self.bias], m[:, -1:])
        else:
            put(offsets[self.weight], m[:, :, :-1])
            put(offsets[self.bias], m[:, :, -1:])

    def apply(self, m: torch.Tensor, fn) -> torch.Tensor:
        """L (fn(E + shift) ∘ (Lᵀ M R)) Rᵀ for (k, rows, cols) M, in M's dtype (the bases are stored like the
        parameters: a float32 model's are widened here, one layer at a time)."""
        rotated = self.rotate_in(m)
        return self.rotate_out(rotated * fn(self.eigenvalues.to(m.dtype) + self.shift))

    def rotate_in(self, m: torch.Tensor) -> torch.Tensor:
        """Lᵀ M R for (k, rows, cols) M, in M's dtype."""
        rotated = m @ self.right.to(m.dtype)
        return rotated if self.left is None else self.left.to(m.dtype).T @ rotated

    def rotate_factors(self, u: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(1, rows, cols) Lᵀ (Uᵀ V) R = (U L)ᵀ (V R) for the block's gradient given as token factors U (T × rows),
        V (T × cols) (:mod:`.tokens`), in ``dtype``."""
        return ((u.to(dtype) @ self.left.to(dtype)).T @ (v.to(dtype) @ self.right.to(dtype))).unsqueeze(0)

    def project(self, m: torch.Tensor) -> torch.Tensor:
        """(L∘L)ᵀ M (R∘R) for (k, rows, cols) M: the diagonal of Qᵀ diag(vec M) Q in the eigenbasis Q = L ⊗ R."""
        projected = m @ (self.right.to(m.dtype) ** 2)
        return projected if self.left is None else (self.left.to(m.dtype) ** 2).T @ projected

    def rotate_out(self, rotated: torch.Tensor) -> torch.Tensor:
        """L X Rᵀ for (k, rows, cols) X in the eigenbasis, in X's dtype."""
        if self.left is not None:
            rotated = self.left.to(rotated.dtype) @ rotated
        return rotated @ self.right.to(rotated.dtype).T

    def divide_(self, rotated: torch.Tensor, damping: float, floor: float) -> torch.Tensor:
        """X ⊘ (E + shift + λ) in place for X in the eigenbasis, entries whose E + shift + λ ≤ ``floor`` set to 0:
        (C + λI)⁻¹ there. One division instead of forming the reciprocals (each p-sized pass counts at 10⁸)."""
        shifted = self.eigenvalues.to(rotated.dtype) + (self.shift + damping)
        rotated.div_(shifted)
        if float(shifted.min()) <= floor:
            rotated.masked_fill_(shifted <= floor, 0.0)
        return rotated

    def dense(self) -> torch.Tensor:
        """The (rows·cols)² block in row-major vec(M) order."""
        right = self.right.to(torch.float64)
        left = self.left.to(torch.float64) if self.left is not None else torch.eye(self.rows, dtype=torch.float64, device=right.device)
        basis = torch.kron(left, right)
        return basis @ torch.diag((self.eigenvalues.to(torch.float64) + self.shift).reshape(-1)) @ basis.T

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"right": self.right, "eigenvalues": self.eigenvalues}
        if self.left is not None:
            out["left"] = self.left
        return out


@dataclass
class DiagonalBlock:
    """Parameters with a diagonal block: C = diag(values + shift) on the flat positions ``index``."""

    names: list[str]
    index: torch.Tensor
    values: torch.Tensor
    shift: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"index": self.index, "values": self.values, "shift": self.shift}


class FactoredCurvature:
    """A fitted factored curvature C (K-FAC, EK-FAC or diagonal) over a stage's trained parameters, as an Operator.

    ``dim``/``dtype``/``device`` are the parameters' (vectors are worked on in their own precision, at least float32);
    ``matvec`` applies C, ``solve(rhs, damping)`` applies (C + λI)⁻¹, ``inverse(damping)`` is the latter as an
    Operator, ``dense()`` the explicit matrix (small models). ``info`` holds the diagnostics: kind, fisher, layers,
    the parameters with a diagonal block and why, examples, passes, seconds; ``gradient`` the objective's gradient
    its data pass measured (:class:`ObjectiveGradient`, when fitted with ``gradient=True``), else None.
    """

    def __init__(self, space: ParamSpace, kind: str, blocks: list, info: dict, gradient: "ObjectiveGradient | None" = None):
        self.space, self.kind, self.blocks, self.info = space, kind, blocks, info
        self.gradient = gradient  # what the fit's data pass measured of ∇L (fit_curvature(gradient=True)), else None
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, size in zip(space.names, space.sizes):
            self.offsets[name] = offset
            offset += size
        self.products = 0

    def __repr__(self) -> str:
        layers = sum(isinstance(b, KroneckerBlock) for b in self.blocks)
        return f"FactoredCurvature({self.kind}, p={self.dim}, {layers} Kronecker blocks, fisher={self.info.get('fisher')})"

    @property
    def dim(self) -> int:
        return self.space.dim

    @property
    def dtype(self) -> torch.dtype:
        return self.space.dtype

    @property
    def device(self) -> torch.device:
        return self.space.device

    def _apply(self, vec: torch.Tensor, fn, kronecker=None) -> torch.Tensor:
        """fn(C)·vec blockwise: a diagonal block's values through ``fn``, a Kronecker block through
        ``kronecker(block, vecs)`` → (k, rows, cols) (default ``block.apply(M, fn)`` of its gathered M)."""
        if vec.shape[0] != self.dim:
            raise InputError(f"vector has {vec.shape[0]} rows, the curvature is {self.dim}×{self.dim}.")
        single = vec.dim() == 1
        # in the vectors' precision, at least float32 (a float32 model's solve as kronfluence's: its 24 BERT-base MLP
        # blocks are ~440 GFLOP, 2x faster than in float64); float64 vectors (Krylov preconditioning) in float64
        vecs = vec.reshape(self.dim, -1).to(torch.promote_types(vec.dtype, torch.float32))
        out = torch.zeros_like(vecs)
        for block in self.blocks:
            if isinstance(block, KroneckerBlock):
                m = block.apply(block.gather(vecs, self.offsets), fn) if kronecker is None else kronecker(block, vecs)
                block.scatter(m, out, self.offsets)
            else:
                out[block.index] = (vecs[block.index] * fn(block.values + block.shift)[:, None]).to(out.dtype)
        out = out.to(vec.dtype)
        return out.reshape(-1) if single else out

    def matvec(self, vec: torch.Tensor) -> torch.Tensor:
        """C·vec for vec of shape (p,) or (p, k)."""
        self.products += count_products(vec)
        return self._apply(vec, lambda e: e)

    __call__ = matvec

    def scale_data(self, weight: float) -> None:
        """C ← weight·C_data + C_R: the curvature of the objective whose examples all carry ``weight`` (the
        eigenvalues and diagonal values scaled, the regularizer's shift kept)."""
        for block in self.blocks:
            if isinstance(block, KroneckerBlock):
                block.eigenvalues = block.eigenvalues * weight
            else:
                block.values = block.values * weight

    def function(self, vec: torch.Tensor, fn) -> torch.Tensor:
        """f(C)·vec for an elementwise function f of C's eigenvalues (``fn`` maps a tensor of them), in each
        block's eigenbasis; vec (p,) or (p, k). fn = identity gives matvec."""
        return self._apply(vec, fn)

    def functions(self, inputs: Sequence[torch.Tensor], fn, out: Sequence[torch.Tensor],
                  diagonal: torch.Tensor | None = None) -> None:
        """out_i ← Σ_j f_ij(C)·inputs_j for elementwise functions f_ij of C's eigenvalues: ``fn(e)`` returns the
        matrix [[f_ij(e)]] (nested lists of tensors shaped like e), evaluated once per block. Several linear maps of
        several vectors in one pass: each block's inputs are rotated into its eigenbasis, combined there and rotated
        back once. inputs, out: (p,) or (p, k) tensors; ``out`` may be the inputs themselves (a block's inputs are
        read before its outputs are written), so a map can overwrite its inputs with no p-sized temporary; diagonal
        blocks are taken :data:`DIAGONAL_SLICE` entries at a time, so the functions' temporaries stay small.
        diagonal: a (p,) vector D; then ``fn(e, d)`` also takes d = diag(Qᵀ diag(D) Q) in each block's eigenbasis Q
        (Kronecker: (L∘L)ᵀ D_M (R∘R) of the block matrix D_M; a diagonal block: D itself), the projection of the
        diagonal matrix onto the matrices diagonal in Q."""
        ins = [x if x.dim() == 2 else x.unsqueeze(1) for x in inputs]
        outs = [o if o.dim() == 2 else o.unsqueeze(1) for o in out]
        if any(t.shape[0] != self.dim for t in ins + outs):
            raise InputError(f"vectors must have {self.dim} rows, the curvature's dimension.")
        work = torch.promote_types(ins[0].dtype, torch.float32)  # as _apply: the vectors' precision, at least float32
        for block in self.blocks:
            if isinstance(block, KroneckerBlock):
                rotated = [block.rotate_in(block.gather(x, self.offsets).to(work)) for x in ins]
                values = block.eigenvalues.to(work) + block.shift
                coefficients = fn(values) if diagonal is None else fn(values, block.project(
                    block.gather(diagonal.reshape(-1, 1), self.offsets).to(work))[0])
                for target, row in zip(outs, coefficients):
                    r = sum(f * m for f, m in zip(row, rotated))
                    block.scatter(block.rotate_out(r).to(target.dtype), target, self.offsets)
                continue
            for s in range(0, block.index.numel(), DIAGONAL_SLICE):
                index = block.index[s : s + DIAGONAL_SLICE]
                parts = [x[index] for x in ins]
                values = block.values[s : s + DIAGONAL_SLICE] + block.shift[s : s + DIAGONAL_SLICE]
                coefficients = fn(values) if diagonal is None else fn(values, diagonal[index].to(values.dtype))
                for target, row in zip(outs, coefficients):
                    target[index] = sum(f[:, None] * x for f, x in zip(row, parts)).to(target.dtype)

    def solve(self, rhs: torch.Tensor, damping: float = 0.0, factors: dict | None = None) -> torch.Tensor:
        """(C + λI)⁻¹ rhs blockwise in the eigenbases; eigenvalues e + λ ≤ 1e-12·max are treated as zero.

        factors: {layer: (U, V)}, the blocks of a one-column rhs given as their token factors Uᵀ V (rhs holds 0
        there; :class:`~influkit.factored.tokens.TokenGradient`), rotated from the factors."""
        floor = 1e-12 * max(self.largest() + damping, 1e-300)
        factors = factors or {}
        if factors and rhs.reshape(self.dim, -1).shape[1] != 1:
            raise InputError("token factors describe one right-hand side; solve a (p, k) rhs without them.")

        def kronecker(block, vecs):  # a block given as token factors is rotated from them, its zeros never read
            rotated = block.rotate_factors(*factors[block.layer], vecs.dtype) if block.layer in factors else \
                block.rotate_in(block.gather(vecs, self.offsets))
            return block.rotate_out(block.divide_(rotated, damping, floor))

        def inverse(e):
            shifted = e + damping
            return torch.where(shifted > floor, 1.0 / shifted.clamp_min(floor), torch.zeros_like(shifted))

        return self._apply(rhs, inverse, kronecker)

    def inverse(self, damping: float = 0.0) -> "InverseOperator":
        """(C + λI)⁻¹ as an Operator."""
        return InverseOperator(self, damping)

    def largest(self) -> float:
        """The largest eigenvalue of C."""
        tops = [float(b.eigenvalues.max()) + b.shift if isinstance(b, KroneckerBlock) else float((b.values + b.shift).max())
                for b in self.blocks]
        return max(tops) if tops else 0.0

    def smallest(self) -> float:
        """The smallest eigenvalue of C."""
        lows = [float(b.eigenvalues.min()) + b.shift if isinstance(b, KroneckerBlock) else float((b.values + b.shift).min())
                for b in self.blocks]
        return min(lows) if lows else 0.0

    def mean_eigenvalue(self) -> float:
        """trace(C)/p: the scale kronfluence's heuristic damping (0.1 × this) uses."""
        total = sum(float((b.eigenvalues + b.shift).sum()) if isinstance(b, KroneckerBlock) else float((b.values + b.shift).sum())
                    for b in self.blocks)
        return total / max(self.dim, 1)

    def dense(self) -> torch.Tensor:
        """The explicit p×p matrix (float64): each block placed at its parameters' positions."""
        p = self.dim
        out = torch.zeros(p, p, dtype=torch.float64, device=self.device)
        for block in self.blocks:
            if isinstance(block, KroneckerBlock):
                idx = self._block_index(block)
                out[idx[:, None], idx[None, :]] = block.dense()
            else:
                out[block.index, block.index] = block.values + block.shift
        return out

    def _block_index(self, block: KroneckerBlock) -> torch.Tensor:
        """Flat positions of vec(M) in row-major order."""
        eye = torch.arange(self.dim, device=self.device, dtype=torch.float64)
        return block.gather(eye[:, None], self.offsets).reshape(-1).round().long()

    # ---- persistence (tensors + JSON meta; see influkit.files)
    def state(self, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, JSON meta) that :meth:`from_state` turns back into this curvature, bit for bit."""
        tensors: dict[str, torch.Tensor] = {}
        blocks = []
        for i, block in enumerate(self.blocks):
            for key, t in block.tensors().items():
                tensors[f"{prefix}block{i}.{key}"] = t
            if isinstance(block, KroneckerBlock):
                blocks.append({"type": "kronecker", "layer": block.layer, "kind": block.kind, "weight": block.weight,
                               "bias": block.bias, "rows": block.rows, "cols": block.cols,
                               "shift": block.shift.hex(), "left": block.left is not None,
                               "inputs_first": block.inputs_first})
            else:
                blocks.append({"type": "diagonal", "names": block.names})
        meta = {"kind": self.kind, "names": self.space.names, "shapes": [list(s) for s in self.space.shapes],
                "blocks": blocks, "info": self.info}
        return tensors, meta

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], meta: dict, space: ParamSpace, prefix: str = "") -> "FactoredCurvature":
        """The curvature saved by :meth:`state`, for parameters ``space`` (checked to match)."""
        if meta["names"] != space.names or [list(s) for s in space.shapes] != meta["shapes"]:
            raise FileFormatError("the saved factored curvature was fitted for other parameters (names or shapes differ).")
        device = space.device
        blocks = []
        for i, b in enumerate(meta["blocks"]):
            # a fresh (aligned) copy: BLAS kernels may round differently on the file buffer's offsets
            get = lambda key: tensors[f"{prefix}block{i}.{key}"].to(device).clone()  # noqa: E731
            if b["type"] == "kronecker":
                blocks.append(KroneckerBlock(b["layer"], b["kind"], b["weight"], b["bias"], b["rows"], b["cols"],
                                             get("left") if b["left"] else None, get("right"), get("eigenvalues"),
                                             float.fromhex(b["shift"]), b["inputs_first"]))
            else:
                blocks.append(DiagonalBlock(b["names"], get("index"), get("values"), get("shift")))
        return cls(space, meta["kind"], blocks, meta["info"])


class InverseOperator:
    """(C + λI)⁻¹ of a :class:`FactoredCurvature` as an Operator (each product is one blockwise solve)."""

    def __init__(self, curvature: FactoredCurvature, damping: float):
        self.curvature, self.damping = curvature, float(damping)
        self.products = 0

    @property
    def dim(self) -> int:
        return self.curvature.dim

    @property
    def dtype(self) -> torch.dtype:
        return self.curvature.dtype

    @property
    def device(self) -> torch.device:
        return self.curvature.device

    def matvec(self, vec: torch.Tensor) -> torch.Tensor:
        self.products += count_products(vec)
        return self.curvature.solve(vec, self.damping)

    __call__ = matvec

    def dense(self) -> torch.Tensor:
        eye = torch.eye(self.dim, dtype=torch.float64, device=self.device)
        return self.curvature.solve(eye, self.damping)


def regularizer_diagonal(stage: Stage, names: Sequence[str], extra=None, at=None, seed: int = 0) -> torch.Tensor | None:
    """(p,) float64 diag(∇²(R + extra)) by one Rademacher probe v ⊙ (∇²(R + extra)) v, or None without R and extra.

    Exact for separable R (L2, the proximal term); an unbiased estimate otherwise.
    """
    if stage.regularizer is None and extra is None:
        return None
    space = ParamSpace(point(stage.state(), names, at))
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in point(stage.state(), names, at).items()}
    with torch.enable_grad():
        value = 0.0
        reg = stage.regularization(leaves)
        if reg is not None:
            value = value + reg
        if extra is not None:
            value = value + extra(leaves)
        if not torch.is_tensor(value) or not value.requires_grad:
            return torch.zeros(space.dim, dtype=torch.float64, device=space.device)
        grads = torch.autograd.grad(value, list(leaves.values()), create_graph=True, allow_unused=True)
        gen = torch.Generator(device="cpu").manual_seed(seed + 7919)
        probes = [(torch.randint(0, 2, t.shape, generator=gen) * 2 - 1).to(t.dtype).to(t.device) for t in leaves.values()]
        dot = sum((g * v).sum() for g, v in zip(grads, probes) if g is not None and g.requires_grad)
        if not torch.is_tensor(dot):
            return torch.zeros(space.dim, dtype=torch.float64, device=space.device)
        hv = torch.autograd.grad(dot, list(leaves.values()), allow_unused=True)
    parts = [(torch.zeros_like(v) if h is None else h * v).reshape(-1) for h, v in zip(hv, probes)]
    return torch.cat(parts).to(torch.float64)


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


def _forward_pass(stage, layers, leaves, x, y, pseudo_factory, truth=None):
    """One hooked forward and the backward passes of the pseudo output-gradients: ({layer: (a, g)}, U, dead layers,
    the true-label backward). truth: the true-label output-gradients' maker (:class:`.fisher.PseudoGradients` on the
    empirical Fisher), back-propagated once more through the same graph when the pseudo-gradients are not them:
    then the last item is ({layer: g (B, T, out)}, its U (B, ...), its seconds), else None."""
    with Recorder(layers, x.shape[0]) as rec, torch.enable_grad():
        outputs = stage.outputs(leaves, x)
    pseudo = pseudo_factory(outputs, y)
    u = pseudo(outputs, y)
    dead = rec.misfits()
    live = [layer for layer in layers if layer.name not in dead]
    handles = [(layer, inp, out) for layer in live for inp, out in rec.calls[layer.name]]
    per_call = [[] for _ in handles]
    if handles:
        for j in range(u.shape[0]):
            grads = torch.autograd.grad(outputs, [h[2] for h in handles], grad_outputs=u[j],
                                        retain_graph=j < u.shape[0] - 1 or truth is not None, allow_unused=True)
            for c, ((layer, _, out), g) in enumerate(zip(handles, grads)):
                per_call[c].append(layer.grads(torch.zeros_like(out) if g is None else g))
    true_grads = None
    if truth is not None:
        start = time.perf_counter()
        true_u = truth(outputs, y)[0]
        grads = torch.autograd.grad(outputs, [h[2] for h in handles], grad_outputs=true_u,
                                    allow_unused=True) if handles else ()
        true_calls = [[layer.grads(torch.zeros_like(out) if g is None else g)] for (layer, _, out), g in zip(handles, grads)]
        true_grads = (_pool(live, handles, true_calls, 1), true_u, time.perf_counter() - start)
    return _pool(live, handles, per_call, 0), u, dead, true_grads


def _pool(live, handles, per_call, true: int) -> dict:
    """{layer: (a, g)} (``true`` 0: g (k, B, T, out), every pseudo-gradient column) or {layer: g (B, T, out)} (1: the
    one true-label column); a layer called several times in one forward has its tokens pooled."""
    data = {}
    for layer in live:
        a_parts, g_parts = [], []
        for c, (owner, inp, _) in enumerate(handles):
            if owner is layer:
                a_parts.append(layer.inputs(inp))
                g_parts.append(per_call[c][0] if true else torch.stack(per_call[c]))
        a = a_parts[0] if len(a_parts) == 1 else torch.cat(a_parts, dim=1)
        g = g_parts[0] if len(g_parts) == 1 else torch.cat(g_parts, dim=2 - true)
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


@dataclass(frozen=True)
class ObjectiveGradient:
    """What a factored fit's data pass measured of the objective's gradient at the fitted point, with the true labels
    (:func:`fit_curvature` with ``gradient=True``): ``norm`` ‖∇L‖ = ‖(1/n) Σ_i ∇ℓ_i + ∇(R + extra)‖ and ``typical``
    g = ((1/n) Σ_i ‖∇ℓ_i‖²)^½ over the n = ``examples`` examples the fit averages over (every one, no sample), and
    ``seconds``, what forming them added to the pass: from each hooked layer's recorded inputs a and output-gradients
    g, the batch's gradient (one product over all its tokens) and the per-example squared norms
    (:meth:`influkit.layers.Layer.example_norms`: for a dense layer Σ_{t,t'} (ā_t·ā_t')(g_t·g_t'), no per-example
    rows), the diagonal-block parameters' per-example gradients (hooked too where one registered layer owns them
    alone — a LayerNorm, a bias without its weight —, else by per-example backward passes), and, when the
    pseudo-gradients are not the true-label ones (``fisher`` "sampled" or "exact"), one more backward of the true-label
    output-gradients through the pass's graph (no forward)."""

    norm: float
    typical: float
    examples: int
    seconds: float


class _GradientSums:
    """Running sums of the true-label per-example loss gradients: Σ_i ∇ℓ_i per parameter (float64), Σ_i ‖∇ℓ_i‖²."""

    def __init__(self):
        self.total: dict[str, torch.Tensor] = {}
        self.squares = 0.0
        self.seconds = 0.0

    def add(self, names, rows) -> None:
        """Add one batch: ``rows`` (B, numel) per parameter of ``names``, the examples' gradients of it."""
        for name, part in zip(names, rows):
            self._sum(name, part.sum(0, dtype=torch.float64))
            self.squares += float(part.pow(2).sum(dtype=torch.float64))

    def add_layer(self, layer: Layer, a: torch.Tensor, g: torch.Tensor) -> None:
        """Add one batch of a hooked layer from its inputs a and true-label output-gradients g: the batch's gradient
        Σ_i ∇ℓ_i is the per-example gradient of all its tokens as one example (one product, no per-example rows),
        Σ_i ‖∇ℓ_i‖² is :meth:`~influkit.layers.Layer.example_norms`'."""
        merged = layer.example_gradients(a.reshape(1, -1, *a.shape[2:]), g.reshape(1, -1, *g.shape[2:]))
        for name, part in zip(layer.params, merged):
            self._sum(name, part[0].to(torch.float64))
        self.squares += float(layer.example_norms(a, g).sum())

    def _sum(self, name: str, summed: torch.Tensor) -> None:
        self.total[name] = self.total[name] + summed if name in self.total else summed


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
    :mod:`influkit.stationarity` needs of the data; else ``curvature.gradient`` is None.
    """
    if kind not in KINDS:
        raise InputError(f"unknown factored curvature {kind!r}; choose one of {KINDS}.")
    if fisher not in FISHER:
        raise InputError(f"unknown fisher {fisher!r}; choose one of {FISHER}.")
    approximation = APPROXIMATIONS[kind]
    if basis is not None and (kind != "ekfac" or basis.kind != "ekfac"):
        raise InputError(f"a kept eigenbasis (basis=) re-estimates EK-FAC eigenvalues: kind and the basis must be "
                         f"'ekfac', got kind={kind!r} and a {basis.kind!r} basis.")
    fit = FactorFit(stage, names, kind=kind, fisher=fisher, indices=indices, extra=extra, at=at, seed=seed,
                    batch_size=batch_size, cache_bytes=cache_bytes, memory=memory, max_factor_bytes=max_factor_bytes,
                    progress=progress, kronecker=approximation.kronecker, basis=basis, gradient=gradient)
    if basis is not None:
        return fit.assemble(fit.kept_eigenbasis(), fit.eigenvalues_in_kept_basis())
    return approximation.passes(fit)


class FactorFit:
    """The state one factored fit carries through its passes: the parameters and the layers that get Kronecker
    factors (``tracked``; the rest get diagonal blocks, ``diag_names``), this rank's examples, the sizes chosen
    from the memory budget, each layer's running sums (:class:`_Accumulator`) and the diagonal-block squares.

    The passes — :meth:`statistics_pass` (covariances or squares, one streamed pass), :meth:`eigendecomposition`,
    :meth:`correction_pass` (EK-FAC's eigenvalues in that basis) — and :meth:`assemble` (the blocks) are run in
    order by each registered approximation's ``passes``. Arguments: those of :func:`fit_curvature`, and
    ``kronecker``: whether the approximation has Kronecker factors (else no layer is too wide for them); ``basis``:
    a fitted EK-FAC curvature whose eigenbases are kept (then no covariance is accumulated: its Kronecker layers get
    Λ from :meth:`eigenvalues_in_kept_basis`, its other layers diagonal blocks); ``gradient``: the statistics pass
    also sums the true-label per-example gradients (:class:`ObjectiveGradient`).
    """

    def __init__(self, stage: Stage, names, *, kind, fisher, indices, extra, at, seed, batch_size, cache_bytes, memory,
                 max_factor_bytes, progress, kronecker=True, basis=None, gradient=False):
        self.start = time.perf_counter()
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
        if basis is not None:
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
                             for layer in self.tracked}
        self.diag_names: list[str] = [nm for nm in self.names if nm in self.reasons]
        # the sums; each layer's eigenbases replace its covariances, so they add at most one layer's
        fixed = sum(t.numel() * t.element_size() for acc in self.accumulators.values() for t in (acc.inputs, acc.grads, acc.squares))
        self.sizing = {"phase": "factor fitting", "budget": budget, "fixed_bytes": fixed, "diagonal_layers": sorted(self.wide)}
        self.statistics_bytes = 0  # per example, the layer statistics one batch keeps (set by the probe)
        self.sums = _GradientSums() if gradient else None  # the true-label gradients, summed in the first pass
        self.truth: PseudoGradients | None = None  # their output-gradients, when the pseudo-gradients are not them
        self.measured = self._measured_layers() if gradient and fisher != "empirical" else []
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
        self.progress = progress and distributed.rank() == 0
        self.diag_total: torch.Tensor | None = None  # Σ squared per-example gradients of the diagonal-block parameters
        self.cache: list | None = None  # the first pass's (a, g) per batch, for EK-FAC's correction
        self.dead: dict[str, str] = {}
        self.pseudo: PseudoGradients | None = None
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
            data, _, _, true = _forward_pass(stage, list(self.tracked) + self.measured, self.leaves, px, py,
                                             lambda outputs, targets: partial(pseudo, index=probe), truth)
            tracked = {layer.name for layer in self.tracked}
            kept = [t for name, pair in data.items() if name in tracked for t in pair]  # what the cache keeps
            self.statistics_bytes = sum(t.numel() * t.element_size() for t in kept) // max(len(probe), 1)
            measured = [t for name, pair in data.items() if name not in tracked for t in pair]
            return kept + measured + ([] if true is None else list(true[0].values()))

        rows = 2 * sum(params[nm].numel() * params[nm].element_size() for nm in self.diag_names)
        output_bytes = OUTPUT_COPIES * outputs.numel() * outputs.element_size() // max(len(probe), 1)
        return probe_bytes(run, stage.model, len(probe)) + rows + output_bytes

    def _drop(self, name: str, why: str) -> None:
        """Layer ``name`` cannot be factored (found on the first batch): its parameters get a diagonal block."""
        layer = next(item for item in self.tracked if item.name == name)
        self.tracked.remove(layer)
        self.accumulators.pop(name)
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
        """The registered layers that own diagonal-block parameters alone (a LayerNorm, a bias without its weight,
        each parameter in one layer): hooked in the first pass too, so that their true-label per-example gradients
        come from their recorded inputs and output-gradients, not from per-example backward passes (the diagonal
        block's own squares, of the pseudo-gradients, are formed as before)."""
        layers, _ = plan(self.stage.model, self.diag_names)
        owners: dict[str, int] = {}
        for layer in layers:
            for name in layer.params:
                owners[name] = owners.get(name, 0) + 1
        return [layer for layer in layers if all(owners[name] == 1 for name in layer.params)]

    def _true_labels(self, outputs, targets):
        """The true-label output-gradients' maker (the empirical Fisher's), made once from the first batch."""
        if self.truth is None:
            self.truth = PseudoGradients(self.stage.loss, "empirical", outputs, targets)
        return self.truth(outputs, targets)

    def stream(self, label: str, consume, *, diagonal: bool, keep: bool = False, sums: "_GradientSums | None" = None) -> None:
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
            hooked = list(self.tracked) + (self.measured if sums is not None else [])
            data, u, dead, true = _forward_pass(self.stage, hooked, self.leaves, x, y, labelled, truth)
            for name, why in dead.items():  # found on the first batch: these layers fall back to diagonal blocks
                if any(layer.name == name for layer in self.measured):  # its gradients by per-example passes
                    self.measured = [layer for layer in self.measured if layer.name != name]
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
                true_g, true_u, seconds = ({name: g[0] for name, (_, g) in data.items()}, u[0], 0.0) if empirical else true
                for layer in self.tracked + self.measured:
                    sums.add_layer(layer, data[layer.name][0], true_g[layer.name])
                hooked_names = {name for layer in self.measured for name in layer.params}
                rest = [nm for nm in self.diag_names if nm not in hooked_names]
                if rest:
                    rows = first if first is not None else _diagonal_rows(self.stage, rest, self.params, x, true_u.detach())
                    sums.add(rest, rows.split([self.params[nm].numel() for nm in rest], dim=1))
                sums.seconds += time.perf_counter() - start_sums + seconds
            if diagonal and self.diag_names:
                part = _diagonal_squares(self.stage, self.diag_names, self.params, x, u.detach(),
                                         first if empirical else None)
                self.diag_total = part if self.diag_total is None else self.diag_total + part
            if keep and self.cache is not None:
                factored = {layer.name for layer in self.tracked} - self.wide
                data = {name: pair for name, pair in data.items() if name in factored}
                cached += sum(t.numel() * t.element_size() for pair in data.values() for t in pair)
                self.cache = self.cache + [data] if cached <= self.cache_bytes else None

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

    def _objective_gradient(self, sums: _GradientSums) -> ObjectiveGradient:
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
                                 examples=self.n, seconds=sums.seconds + time.perf_counter() - start)

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
            idx = _layer_index(layer, offsets, space.device)
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


def _layer_index(layer: Layer, offsets: dict[str, int], device) -> torch.Tensor:
    """(rows, cols) flat positions of the layer's block matrix M."""
    rows, cols = layer.shape
    w0 = offsets[layer.weight]
    if layer.bias is None:
        return torch.arange(w0, w0 + rows * cols, device=device).reshape(rows, cols)
    b0 = offsets[layer.bias]
    if layer.inputs_first:
        weight = torch.arange(w0, w0 + (rows - 1) * cols, device=device).reshape(rows - 1, cols)
        return torch.cat([weight, torch.arange(b0, b0 + cols, device=device)[None, :]], dim=0)
    weight = torch.arange(w0, w0 + rows * (cols - 1), device=device).reshape(rows, cols - 1)
    return torch.cat([weight, torch.arange(b0, b0 + rows, device=device)[:, None]], dim=1)


class _Factored(Approximation):
    """A :class:`FactoredCurvature` fitted from the stage's layers by :func:`fit_curvature`: the registered class
    of each kind says which passes of a :class:`FactorFit` it runs (``passes``)."""

    kronecker: ClassVar[bool] = True  # False: no Kronecker factors (no layer is too wide for them)
    depends_on = ("fisher", "seed")
    measures_gradient = True

    @classmethod
    def fit(cls, operator, config, *, memory=None, progress=False, gradient=False):
        return fit_curvature(operator.stage, operator.names, kind=cls.name, fisher=config.fisher,
                             indices=operator.indices, extra=operator.extra, at=getattr(operator, "at", None),
                             seed=config.seed, memory=memory, gradient=gradient, progress=progress)

    @classmethod
    def from_state(cls, tensors, meta, operator, prefix=""):
        return FactoredCurvature.from_state(tensors, meta, space_of(operator), prefix)

    @classmethod
    def passes(cls, fit: FactorFit) -> FactoredCurvature:
        raise NotImplementedError


@register("diagonal")
class Diagonal(_Factored):
    """diag(GGN) = (1/n) Σ_{i,j} (∇_θ ℓ_ij)²: one pass of squared per-example gradients, every parameter its block."""

    kronecker = False

    @classmethod
    def passes(cls, fit):
        fit.statistics_pass(squares=True)
        return fit.assemble({}, {})


@register("kfac")
class KFAC(_Factored):
    """C_M = G ⊗ A: one covariance pass, their eigendecompositions, eigenvalues the products of the factors'."""

    @classmethod
    def passes(cls, fit):
        fit.statistics_pass(squares=False)
        eigen = fit.eigendecomposition()
        return fit.assemble(eigen, fit.kfac_values(eigen))


@register("ekfac")
class EKFAC(_Factored):
    """K-FAC's eigenbases with the eigenvalues corrected to the per-example gradients' second moments in them."""

    @classmethod
    def passes(cls, fit):
        fit.statistics_pass(squares=False, keep=True)
        eigen = fit.eigendecomposition()
        return fit.assemble(eigen, fit.correction_pass(eigen))
