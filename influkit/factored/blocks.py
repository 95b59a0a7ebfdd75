"""The blocks of a factored curvature: one layer's Kronecker block and the diagonal block, on flat vectors.

A layer with block matrix M (rows × cols, :mod:`influkit.layers`) gets C_M = (L ⊗ R) diag(vec E) (L ⊗ R)ᵀ + shift·I
(:class:`KroneckerBlock`: K-FAC's and EK-FAC's eigenbases and eigenvalues); every other parameter a diagonal
(:class:`DiagonalBlock`). :func:`layer_index` gives the flat positions of a layer's M in the parameter vector.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers import Layer


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


def layer_index(layer: Layer, offsets: dict[str, int], device) -> torch.Tensor:
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
