"""The fitted factored curvature C (K-FAC, EK-FAC or diagonal) as an Operator, its inverse, and its files.

:class:`FactoredCurvature` holds the blocks (:mod:`.blocks`) over a stage's trained parameters: ``matvec`` applies
C, ``solve(rhs, damping)`` applies (C + λI)⁻¹ blockwise in the eigenbases (exactly, no iteration), ``inverse(λ)`` is
that inverse as an Operator (:class:`InverseOperator`, the approximate inverse of ``solver="ekfac"``), and
``state``/``from_state`` write and read it (tensors + JSON meta, :mod:`influkit.files`) bit for bit. It is fitted by
:func:`influkit.factored.fit_curvature` (:mod:`.fit`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import FileFormatError, InputError
from ..operators import count_products
from ..params import ParamSpace
from .blocks import DiagonalBlock, KroneckerBlock
from .gradient import ObjectiveGradient

DIAGONAL_SLICE = 2**20  # FactoredCurvature.functions: entries of a diagonal block taken at a time


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
