"""The per-layer compression of a gradient index: which block of a stage's trained parameters is projected how.

Every trained parameter belongs to one block, and a block turns an example's gradient over its parameters into
``width`` numbers, linearly, without forming that gradient where it is a sum of token outer products:

- a Kronecker block (a registered layer with Kronecker structure: ``nn.Linear``, convolutions, transformers'
  ``Conv1D``, ``nn.Embedding``): the per-example gradient of its block matrix M (d_out × d_in, output-gradient side
  first; a trained bias is M's last input column, ā = [a; 1]) is Σ_t g_t ā_tᵀ, and the block stores

      C = P_out (Σ_t g_t ā_tᵀ) P_inᵀ = Σ_t (P_out g_t)(P_in ā_t)ᵀ        (k_out × k_in)

  computed from the projected tokens (LoGra's Kronecker-factored projection). An embedding's inputs are one-hot,
  so P_in ā_t is the column P_in[:, x_t];
- a flat block (normalization layers, whose per-example gradients Σ_t g_t ⊙ â_t cost what one contraction costs,
  and every trained parameter no registered layer owns, from per-example gradients): C = P r, r the gradient row.

A direction S over the same parameters (the chain's adjoint s) is compressed the same way, S̃ = P_out S_M P_inᵀ or
P s, and ⟨C, S̃⟩ is the index's estimate of ⟨∇ℓ, s⟩. With ``projection="random"`` each P (k × d) has orthonormal rows spanning a
uniformly random subspace, scaled by √(d/k) (a Gaussian matrix orthonormalized), so E[PᵀP] = I and the estimate is
unbiased (and exact on a side kept whole, k = d); with ``projection="identity"`` every P is the identity and it is exact.
``projection="eigenbasis"`` takes P_out and P_in from a fitted K-FAC/EK-FAC curvature's eigenbases instead: the
k eigenvectors of each side that carry the most gradient second moment (the eigenvalue matrix E of M's block,
E[o, i] = E[(Q_outᵀ ∇M Q_in)²_oi], summed over the other side), an orthogonal projection onto the subspace
where the gradients live (exact when k is the full size); a layer the curvature gave no Kronecker block (and every
flat block) takes random projections, and its ``basis`` in the layout says so.

Whitening (``whiten=True``, with a fitted curvature C and the damping λ of the chain's stage-1 solve): a block
first maps an example's gradient to W ∇ℓ with W = (C + λI)^{-1/2} and a direction s to W⁻¹ s = (C + λI)^{1/2} s,
so that ⟨W ∇ℓ, W⁻¹ s⟩ = ⟨∇ℓ, s⟩ exactly and, for the chain's adjoint s = (C + λI)⁻¹ u, the query side is
W u: both sides have whitened norms and the projection's error, ≈ ‖W∇ℓ‖‖Wu‖/√k, is relative to them instead of
to ‖∇ℓ‖‖(C + λI)⁻¹u‖, which small λ inflates along the directions where the gradients have almost no energy. On a
layer with an EK-FAC/K-FAC block C_M = (Q_out ⊗ Q_in) diag(vec E) (Q_out ⊗ Q_in)ᵀ, W is exact and cheap in the
eigenbasis: the rotated per-token factors Q_outᵀ g_t and Q_inᵀ ā_t give G̃ = Q_outᵀ (Σ_t g_t ā_tᵀ) Q_in, scaled
entrywise by (E + λ)^{-1/2}, then projected, C = P_out (G̃ ⊘ √(E + λ)) P_inᵀ (the scaling is not a Kronecker
product, so a whitened dense block forms G̃, the cost of a per-example gradient); an embedding's input basis is the
standard one, so its scaling stays per token. The direction side is P_out ((Q_outᵀ S_M Q_in) ⊙ √(E + λ)) P_inᵀ.
Parameters with a diagonal block of C (and flat blocks) are whitened by (diag C + λ)^{-1/2}. With whitening,
``projection="eigenbasis"`` keeps, per side, the k eigen-directions of most whitened energy Σ E/(E + λ), and
``projection="eigenpairs"`` (the default) keeps single entries (i, j) of the whitened block: the eigen-pairs of
most whitened energy E_ij/(E_ij + λ) — the second moment of the whitened gradient's entry, what the entry carries
of the score — chosen over all layers at once, so that a layer's share follows its energy.

The dimension rule (:func:`allot`): ``dim`` numbers per example in all, shared equally among the blocks
(b = ⌊dim / #blocks⌋, at least 1); a Kronecker block takes k_in = min(d_in, ⌊√b⌋) and k_out = min(d_out, ⌊b / k_in⌋),
a flat block k = min(n, b). A block never stores more numbers than its own gradient has. With
``projection="eigenpairs"`` the flat blocks take their share b as above; each whitened Kronecker block's candidates
are the k_out × k_in rectangle of its sides of most whitened energy at 4 × ``dim`` (the rule above with
b' = ⌊4 dim / #blocks⌋), and the remaining dim − Σ_flat k numbers go to the candidate pairs of most whitened energy
over all Kronecker blocks (at most all of them): D ≤ dim, equal to it unless the candidates run out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from ..errors import InputError
from ..layers import Layer

PROJECTIONS = ("random", "identity", "eigenbasis", "eigenpairs")


class Block:
    """One block of the index's row: ``width`` numbers compressing the gradient over ``params``."""

    kind = "block"
    params: list[str]

    @property
    def width(self) -> int:
        raise NotImplementedError

    def direction(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """(k, width) compressed directions from {param: (k, *shape)} (the same map as the gradient rows)."""
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def describe(self) -> dict:
        raise NotImplementedError


class KroneckerBlock(Block):
    """A Kronecker-structured layer: C = P_out (Σ_t g_t ā_tᵀ) P_inᵀ (None: the identity on that side), or whitened
    (``whitening`` = (Q_out, Q_in, scale)): C = P_out ((Q_outᵀ Σ_t g_t ā_tᵀ Q_in) ⊙ scale) P_inᵀ, scale = (E + λ)^{-1/2}
    of shape (d_out, d_in) (Q None: the standard basis). Q may keep only some eigenvectors (d × k columns, the
    whitened eigenbasis selection; scale then the kept entries'), which never forms the whole Σ_t g_t ā_tᵀ."""

    kind = "kronecker"

    def __init__(self, layer: Layer, p_out: torch.Tensor | None, p_in: torch.Tensor | None, basis: str = "random",
                 whitening: tuple | None = None):
        self.layer, self.p_out, self.p_in, self.basis = layer, p_out, p_in, basis
        self.q_out, self.q_in, self.scale = whitening or (None, None, None)
        self.pairs: torch.Tensor | None = None  # kept entries of the k_out × k_in block (flat indices; None: all)
        self.params = layer.params
        self.d_out, self.d_in = kronecker_sides(layer)

    @property
    def whitened(self) -> bool:
        return self.scale is not None

    @property
    def k_out(self) -> int:
        if self.p_out is not None:
            return self.p_out.shape[0]
        return self.d_out if self.q_out is None else self.q_out.shape[1]

    @property
    def k_in(self) -> int:
        if self.p_in is not None:
            return self.p_in.shape[0]
        return self.d_in if self.q_in is None else self.q_in.shape[1]

    @property
    def width(self) -> int:
        return self.k_out * self.k_in if self.pairs is None else int(self.pairs.shape[0])

    def _keep(self, flat: torch.Tensor) -> torch.Tensor:
        """(k, width) the kept entries of (k, k_out · k_in) blocks."""
        return flat if self.pairs is None else flat[:, self.pairs.to(flat.device)]

    def compress(self, inp: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """(B, width) of one recorded call (its raw input and output-gradient); unwhitened (or an embedding) never
        forming Σ_t g_t ā_tᵀ, a whitened dense layer forming it in the eigenbasis."""
        layer = self.layer
        a, g = layer.inputs(inp), layer.grads(grad)
        if self.q_out is not None:
            g = g @ self.q_out.to(g.dtype)
        if layer.one_hot:
            g = g * layer.token_mask(a).unsqueeze(-1).to(g.dtype)
            if self.whitened:  # the input basis is the standard one: each token's column of the scaling
                g = g * self.scale.T.to(g.dtype)[a]
            a = torch.nn.functional.one_hot(a, self.d_in).to(g.dtype) if self.p_in is None else self.p_in.T.to(g.dtype)[a]
            if self.p_out is not None:
                g = g @ self.p_out.T.to(g.dtype)
            return self._keep(torch.einsum("bto,bti->boi", g, a).reshape(g.shape[0], -1))
        a = a.to(g.dtype)
        if self.whitened:
            if layer.bias is not None:
                a = torch.cat([a, torch.ones(*a.shape[:-1], 1, dtype=a.dtype, device=a.device)], dim=-1)
            if self.q_in is not None:
                a = a @ self.q_in.to(g.dtype)
            m = torch.einsum("bto,bti->boi", g, a) * self.scale.to(g.dtype)
            return self._keep(self._project(m).reshape(g.shape[0], -1))
        if self.p_in is not None:
            p = self.p_in.to(g.dtype)
            a = a @ p[:, :-1].T + p[:, -1] if layer.bias is not None else a @ p.T
        elif layer.bias is not None:
            a = torch.cat([a, torch.ones(*a.shape[:-1], 1, dtype=a.dtype, device=a.device)], dim=-1)
        if self.p_out is not None:
            g = g @ self.p_out.T.to(g.dtype)
        return torch.einsum("bto,bti->boi", g, a).reshape(g.shape[0], -1)

    def _project(self, m: torch.Tensor) -> torch.Tensor:
        """P_out M P_inᵀ for (k, d_out, d_in) M."""
        if self.p_out is not None:
            m = self.p_out.to(m.dtype) @ m
        if self.p_in is not None:
            m = m @ self.p_in.T.to(m.dtype)
        return m

    def matrix(self, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """(k, d_out, d_in) block matrices S_M of directions given per parameter as (k, *shape)."""
        layer, module = self.layer, self.layer.module
        w = parts[layer.weight]
        k = w.shape[0]
        w = w.reshape(k, *module.weight.shape)
        m = w.transpose(1, 2) if layer.inputs_first else w.reshape(k, self.d_out, -1)
        if layer.bias is not None:
            m = torch.cat([m, parts[layer.bias].reshape(k, self.d_out, 1)], dim=2)
        return m

    def direction(self, parts):
        m = self.matrix(parts)
        if self.whitened:
            if self.q_out is not None:
                m = self.q_out.T.to(m.dtype) @ m
            if self.q_in is not None:
                m = m @ self.q_in.to(m.dtype)
            m = m / self.scale.to(m.dtype)
        return self._keep(self._project(m).reshape(m.shape[0], -1))

    def tensors(self):
        return {k: v for k, v in (("p_out", self.p_out), ("p_in", self.p_in), ("q_out", self.q_out),
                                  ("q_in", self.q_in), ("scale", self.scale), ("pairs", self.pairs)) if v is not None}

    def describe(self):
        return {"kind": self.kind, "layer": self.layer.name, "module": self.layer.kind, "params": self.params,
                "sides": [self.d_out, self.d_in], "k": [self.k_out, self.k_in], "width": self.width, "basis": self.basis,
                "whitened": self.whitened}


class FlatBlock(Block):
    """Parameters compressed from their per-example gradient rows r: C = P r (P None: the identity), or whitened
    (``scale`` = (diag C + λ)^{-1/2}, (n,)): C = P (scale ⊙ r).

    ``layer``: the registered layer whose :meth:`~influkit.layers.Layer.example_gradients` give r (a normalization),
    or None: r comes from per-example gradients (:func:`influkit.gradients.project_per_example_grads`)."""

    kind = "flat"

    def __init__(self, name: str, params: Sequence[str], sizes: Sequence[int], layer: Layer | None,
                 projection: torch.Tensor | None, scale: torch.Tensor | None = None):
        self.name, self.params, self.sizes, self.layer, self.projection = name, list(params), list(sizes), layer, projection
        self.scale = scale

    @property
    def size(self) -> int:
        return sum(self.sizes)

    @property
    def width(self) -> int:
        return self.size if self.projection is None else self.projection.shape[0]

    def compress_rows(self, rows: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            rows = rows * self.scale.to(rows.dtype)
        return rows if self.projection is None else rows @ self.projection.T.to(rows.dtype)

    def compress(self, inp: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """(B, width) of one recorded call of the block's layer."""
        a, g = self.layer.inputs(inp), self.layer.grads(grad)
        return self.compress_rows(torch.cat(self.layer.example_gradients(a.to(g.dtype), g), dim=1))

    def directions_matrix(self, dtype: torch.dtype, device) -> torch.Tensor:
        """(n, width): (P diag(scale))ᵀ, what per-example gradients are multiplied by (P None: the identity)."""
        out = torch.eye(self.size, dtype=dtype, device=device) if self.projection is None else self.projection.T.to(dtype)
        return out if self.scale is None else out * self.scale.to(dtype)[:, None]

    def direction(self, parts):
        k = next(iter(parts.values())).shape[0]
        flat = torch.cat([parts[n].reshape(k, -1) for n in self.params], dim=1)
        if self.scale is not None:
            flat = flat / self.scale.to(flat.dtype)
        return flat if self.projection is None else flat @ self.projection.T.to(flat.dtype)

    def tensors(self):
        return {k: v for k, v in (("projection", self.projection), ("scale", self.scale)) if v is not None}

    def describe(self):
        return {"kind": self.kind, "name": self.name, "params": self.params, "size": self.size, "width": self.width,
                "layer": None if self.layer is None else self.layer.name, "whitened": self.scale is not None}


def kronecker_sides(layer: Layer) -> tuple[int, int]:
    """(d_out, d_in) of a Kronecker layer's block matrix, output-gradient side first (d_in with a bias column)."""
    if layer.one_hot:
        vocab, dim = layer.shape
        return dim, vocab
    out, width = layer.features
    return out, width + (layer.bias is not None)


def allot(sizes: Sequence[tuple[str, tuple[int, ...]]], dim: int) -> list[tuple[int, ...]]:
    """The dimension rule: per block ((kind, sides) with sides (d_out, d_in) or (n,)), its (k_out, k_in) or (k,)
    out of ``dim`` numbers per example shared equally (module docstring)."""
    if dim < 1:
        raise InputError(f"dim (numbers per example in the index) must be ≥ 1, got {dim}.")
    share = max(1, dim // max(len(sizes), 1))
    out = []
    for kind, sides in sizes:
        if kind == "kronecker":
            d_out, d_in = sides
            k_in = min(d_in, max(1, math.isqrt(share)))
            out.append((min(d_out, max(1, share // k_in)), k_in))
        else:
            out.append((min(sides[0], share),))
    return out


def random_projection(rows: int, cols: int, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """(rows, cols), rows ≤ cols: orthonormal rows spanning a uniformly random subspace (of a Gaussian matrix),
    scaled by √(cols/rows), so that E[PᵀP] = I; with rows = cols, P is orthogonal and the projection exact."""
    if rows >= cols:
        return torch.eye(cols, dtype=dtype)
    q, r = torch.linalg.qr(torch.randn(cols, rows, generator=generator, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))  # the Haar-distributed basis (QR's signs fixed)
    return (q.T * math.sqrt(cols / rows)).to(dtype).contiguous()


def eigen_sides(layer: Layer, factored, k_out: int, k_in: int, dtype: torch.dtype):
    """(P_out, P_in) from a fitted factored curvature's block of ``layer``: each side's k eigenvectors of most
    gradient second moment (the eigenvalue matrix summed over the other side), as rows; None where the curvature
    gave the layer no Kronecker block (a diagonal one: its factors did not fit the memory budget)."""
    block = curvature_block(layer, factored)
    if block is None:
        return None
    energy = block.eigenvalues.to(torch.float64)
    rows_basis = block.left if block.left is not None else torch.eye(block.rows, dtype=torch.float64)
    rows_basis, cols_basis = rows_basis.to(torch.float64), block.right.to(torch.float64)
    row_energy, col_energy = energy.sum(1), energy.sum(0)
    # M's rows are the input side when the weight is stored (in, out) (an embedding, transformers' Conv1D)
    if layer.inputs_first:
        in_basis, in_energy, out_basis, out_energy = rows_basis, row_energy, cols_basis, col_energy
    else:
        out_basis, out_energy, in_basis, in_energy = rows_basis, row_energy, cols_basis, col_energy
    p_out = out_basis[:, out_energy.argsort(descending=True)[:k_out]].T
    p_in = in_basis[:, in_energy.argsort(descending=True)[:k_in]].T
    return p_out.to(dtype).contiguous(), p_in.to(dtype).contiguous()


def curvature_block(layer: Layer, factored):
    """The fitted factored curvature's Kronecker block of ``layer`` (None: it gave the layer none)."""
    return next((b for b in getattr(factored, "blocks", []) if getattr(b, "layer", None) == layer.name), None)


def kronecker_whitening(layer: Layer, factored, damping: float, dtype: torch.dtype):
    """(Q_out, Q_in, scale) of ``layer``'s Kronecker block of the curvature C, in M's (out, in) orientation:
    the eigenbases (None: the standard basis) and scale = (E + shift + λ)^{-1/2} (d_out, d_in), eigenvalues at or
    below C's floor (1e-12 × (largest + λ), those the solve treats as zero) clamped to it; None without a block."""
    block = curvature_block(layer, factored)
    if block is None:
        return None
    floor = 1e-12 * max(factored.largest() + damping, 1e-300)
    scale = (block.eigenvalues.to(torch.float64) + (block.shift + damping)).clamp_min(floor).rsqrt()
    left = None if block.left is None else block.left.to(torch.float64)
    right = block.right.to(torch.float64)
    q_out, q_in = (right, left) if layer.inputs_first else (left, right)
    if layer.inputs_first:
        scale = scale.T
    if layer.one_hot and q_in is not None:
        raise InputError(f"layer {layer.name!r}: an embedding's curvature block must keep the standard input basis.")
    cast = lambda t: None if t is None else t.to(dtype).contiguous()  # noqa: E731
    return cast(q_out), cast(q_in), cast(scale)


def diagonal_whitening(factored, damping: float) -> torch.Tensor:
    """(p,) float64 (diag C + λ)^{-1/2} over the curvature's parameters: a diagonal block's values + shift, a
    Kronecker block's diagonal Σ_ij L_ri² E_ij R_cj² + shift (floored as in :func:`kronecker_whitening`)."""
    from ..factored.blocks import KroneckerBlock as CurvatureKronecker

    diag = torch.zeros(factored.dim, 1, dtype=torch.float64)
    for block in factored.blocks:
        if isinstance(block, CurvatureKronecker):
            right = block.right.to(torch.float64) ** 2
            e = block.eigenvalues.to(torch.float64)
            m = e @ right.T if block.left is None else block.left.to(torch.float64) ** 2 @ e @ right.T
            block.scatter((m + block.shift).unsqueeze(0), diag, factored.offsets)
        else:
            diag[block.index.cpu(), 0] = (block.values + block.shift).to(torch.float64).cpu()
    floor = 1e-12 * max(factored.largest() + damping, 1e-300)
    return (diag[:, 0] + damping).clamp_min(floor).rsqrt()


def whitened_eigen_sides(whitening: tuple, layer: Layer, k_out: int, k_in: int, damping: float, dtype: torch.dtype):
    """((Q_out, Q_in, scale), P_out, P_in, energy) keeping, per side of a whitened block, the k eigen-directions of most
    whitened energy Σ (E + shift)/(E + shift + λ) = Σ (1 − λ·scale²) (summed over the other side): the kept columns
    of each Q (the standard basis's where Q is None) and the kept entries of the scale, so that the rotation and the
    selection are one (d × k) product per token. An embedding keeps its vocabulary side whole in the scale (one
    column per token) and selects it with P_in. ``energy``: (k_out, k_in) float64 the kept entries' whitened
    energy 1 − λ·scale²."""
    q_out, q_in, scale = whitening
    energy = (1 - damping * scale.to(torch.float64) ** 2).clamp_min(0)
    d_out, d_in = scale.shape
    keep_out = energy.sum(1).argsort(descending=True)[:k_out]
    keep_in = energy.sum(0).argsort(descending=True)[:k_in]
    kept_energy = energy[keep_out][:, keep_in]
    q_out = (torch.eye(d_out, dtype=dtype) if q_out is None else q_out)[:, keep_out].contiguous()
    if layer.one_hot:
        return ((q_out, None, scale[keep_out].contiguous()), None, torch.eye(d_in, dtype=dtype)[keep_in].contiguous(),
                kept_energy)
    q_in = (torch.eye(d_in, dtype=dtype) if q_in is None else q_in)[:, keep_in].contiguous()
    return (q_out, q_in, scale[keep_out][:, keep_in].contiguous()), None, None, kept_energy
