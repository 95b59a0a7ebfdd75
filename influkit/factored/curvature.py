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
float32 (a float64 model: float64; a float32 model: float32, as kronfluence does — half the accumulator memory,
3.1 → 1.5 GB on BERT-base); eigendecompositions are float64, and the eigenbases and eigenvalues are then stored in the parameters' dtype (a float32 model's in
float32: half the memory; widened layer by layer when applied), each layer's covariances freed once decomposed;
EK-FAC's Λ comes from the same pass's inputs and gradients, kept while they fit ``cache_bytes`` (else from a
second pass with the same sampled labels).

Under ``torch.distributed`` each rank streams its contiguous shard of the examples (:func:`influkit.distributed.shard`)
and the sums (covariances, token counts, squares; EK-FAC's corrections after the eigenbasis of the all-reduced
covariances) are all-reduced, so every rank holds the same factors, equal to one process's up to summation
order; sampled labels depend on (seed, example index) only (:mod:`.fisher`).

``matvec`` applies C, ``solve(rhs, damping)`` applies (C + λI)⁻¹ blockwise in the eigenbases (exactly, no
iteration); ``inverse(λ)`` is that inverse as an Operator, the approximate inverse of ``solver="ekfac"``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch.func import grad
from tqdm.auto import tqdm

from .. import distributed
from ..errors import FileFormatError, InputError, warn
from ..memory import DEFAULT_WORKING, PROBE_EXAMPLES, fit_count, probe_bytes
from ..memory import given as memory_given
from ..memory import resolve as memory_budget
from ..operators import count_products
from ..params import ParamSpace, point
from ..stage import Stage
from ..vectorize import vmap_or_loop
from .fisher import FISHER, PseudoGradients
from .layers import Layer, Recorder, check_calls, example_squares, layer_grads, layer_inputs, plan_layers, token_mask

KINDS = ("kfac", "ekfac", "diagonal")
CACHE_BYTES = 2**30  # at most this much of the first pass is kept for EK-FAC's correction (else a second pass)
# a batch also holds output-sized tensors the saved-tensor probe does not see: the outputs, their pseudo-gradients
# and the loss's log-probabilities for the sampled labels' scale (vocabulary-sized for a language model)
OUTPUT_COPIES = 4


@dataclass
class KroneckerBlock:
    """One layer's block, C_M = (L ⊗ R) diag(vec E) (L ⊗ R)ᵀ + shift·I on the row-major vec of M (rows × cols).

    left: rows × rows eigenvectors (None: the standard basis, an embedding's diagonal input factor);
    right: cols × cols eigenvectors; eigenvalues: rows × cols (K-FAC: outer product of the factors' eigenvalues;
    EK-FAC: the corrected ones); shift: the regularizer's curvature on this block.
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

    def gather(self, vecs: torch.Tensor, offsets: dict[str, int]) -> torch.Tensor:
        """(k, rows, cols) block matrices from (p, k) flat vectors."""
        k = vecs.shape[1]
        w0 = offsets[self.weight]
        if self.kind == "embedding":
            return vecs[w0 : w0 + self.rows * self.cols].T.reshape(k, self.rows, self.cols)
        width = self.cols - (self.bias is not None)
        m = vecs[w0 : w0 + self.rows * width].T.reshape(k, self.rows, width)
        if self.bias is not None:
            b0 = offsets[self.bias]
            m = torch.cat([m, vecs[b0 : b0 + self.rows].T.reshape(k, self.rows, 1)], dim=2)
        return m

    def scatter(self, m: torch.Tensor, out: torch.Tensor, offsets: dict[str, int]) -> None:
        """Write (k, rows, cols) block matrices into the (p, k) flat vectors ``out``."""
        k = m.shape[0]
        w0 = offsets[self.weight]
        if self.kind == "embedding" or self.bias is None:
            out[w0 : w0 + self.rows * self.cols] = m.reshape(k, -1).T
            return
        width = self.cols - 1
        out[w0 : w0 + self.rows * width] = m[:, :, :width].reshape(k, -1).T
        b0 = offsets[self.bias]
        out[b0 : b0 + self.rows] = m[:, :, width].T

    def apply(self, m: torch.Tensor, fn) -> torch.Tensor:
        """L (fn(E + shift) ∘ (Lᵀ M R)) Rᵀ for (k, rows, cols) M, in M's dtype (the bases are stored like the
        parameters: a float32 model's are widened here, one layer at a time)."""
        right = self.right.to(m.dtype)
        left = None if self.left is None else self.left.to(m.dtype)
        rotated = m @ right
        if left is not None:
            rotated = left.T @ rotated
        rotated = rotated * fn(self.eigenvalues.to(m.dtype) + self.shift)
        if left is not None:
            rotated = left @ rotated
        return rotated @ right.T

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
    the parameters with a diagonal block and why, examples, passes, seconds.
    """

    def __init__(self, space: ParamSpace, kind: str, blocks: list, info: dict):
        self.space, self.kind, self.blocks, self.info = space, kind, blocks, info
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

    def _apply(self, vec: torch.Tensor, fn) -> torch.Tensor:
        if vec.shape[0] != self.dim:
            raise InputError(f"vector has {vec.shape[0]} rows, the curvature is {self.dim}×{self.dim}.")
        single = vec.dim() == 1
        # in the vectors' precision, at least float32 (a float32 model's solve as kronfluence's: its 24 BERT-base MLP
        # blocks are ~440 GFLOP, 2x faster than in float64); float64 vectors (Krylov preconditioning) in float64
        vecs = vec.reshape(self.dim, -1).to(torch.promote_types(vec.dtype, torch.float32))
        out = torch.zeros_like(vecs)
        for block in self.blocks:
            if isinstance(block, KroneckerBlock):
                block.scatter(block.apply(block.gather(vecs, self.offsets), fn), out, self.offsets)
            else:
                out[block.index] = (vecs[block.index] * fn(block.values + block.shift)[:, None]).to(out.dtype)
        out = out.to(vec.dtype)
        return out.reshape(-1) if single else out

    def matvec(self, vec: torch.Tensor) -> torch.Tensor:
        """C·vec for vec of shape (p,) or (p, k)."""
        self.products += count_products(vec)
        return self._apply(vec, lambda e: e)

    __call__ = matvec

    def solve(self, rhs: torch.Tensor, damping: float = 0.0) -> torch.Tensor:
        """(C + λI)⁻¹ rhs blockwise in the eigenbases; eigenvalues e + λ ≤ 1e-12·max are treated as zero."""
        floor = 1e-12 * max(self.largest() + damping, 1e-300)

        def inverse(e):
            shifted = e + damping
            return torch.where(shifted > floor, 1.0 / shifted.clamp_min(floor), torch.zeros_like(shifted))

        return self._apply(rhs, inverse)

    def inverse(self, damping: float = 0.0) -> "InverseOperator":
        """(C + λI)⁻¹ as an Operator."""
        return InverseOperator(self, damping)

    def largest(self) -> float:
        """The largest eigenvalue of C."""
        tops = [float((b.eigenvalues + b.shift).max()) if isinstance(b, KroneckerBlock) else float((b.values + b.shift).max())
                for b in self.blocks]
        return max(tops) if tops else 0.0

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
                               "shift": block.shift.hex(), "left": block.left is not None})
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
                                             float.fromhex(b["shift"])))
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
        in_dim, out_dim = (0, 0) if diagonal else _factor_dims(layer)  # a diagonal block keeps only the squares
        self.inputs = torch.zeros(in_dim, dtype=dtype, device=device) if layer.kind == "embedding" \
            else torch.zeros(in_dim, in_dim, dtype=dtype, device=device)
        self.grads = torch.zeros(out_dim, out_dim, dtype=dtype, device=device)
        self.squares = torch.zeros(layer.rows, layer.cols, dtype=dtype, device=device)
        self.tokens = 0

    def release_covariances(self) -> None:
        """Drop the covariance sums once their eigendecomposition is taken (an embedding's token counts stay)."""
        if self.layer.kind != "embedding":
            self.inputs = self.inputs.new_zeros(0, 0)
        self.grads = self.grads.new_zeros(0, 0)

    def covariances(self, a: torch.Tensor, g: torch.Tensor) -> None:
        """Add one batch: Σ ā āᵀ (blockwise for the homogeneous coordinate, never materializing ā) and Σ g gᵀ."""
        if self.layer.kind == "embedding":
            keep = token_mask(self.layer, a)
            self.inputs.index_add_(0, a[keep], torch.ones(int(keep.sum()), dtype=self.inputs.dtype, device=a.device))
            self.tokens += int(keep.sum())
            g = g * keep[None, :, :, None].to(g.dtype)
        else:
            flat = a.reshape(-1, a.shape[-1])
            width = flat.shape[1]
            self.inputs[:width, :width] += (flat.T @ flat).to(self.inputs.dtype)
            if self.layer.bias is not None:
                total = flat.sum(0).to(self.inputs.dtype)
                self.inputs[:width, width] += total
                self.inputs[width, :width] += total
                self.inputs[width, width] += flat.shape[0]
            self.tokens += flat.shape[0]
        flat_g = g.reshape(-1, g.shape[-1])
        self.grads += (flat_g.T @ flat_g).to(self.grads.dtype)


def _factor_dims(layer: Layer) -> tuple[int, int]:
    """(input factor size, output-gradient factor size) of a layer (an embedding's input factor is a diagonal)."""
    return (layer.rows, layer.cols) if layer.kind == "embedding" else (layer.cols, layer.rows)


def factor_bytes(layer: Layer) -> int:
    """Bytes of a layer's float64 factors and their eigenvectors: 2 · 8 · (in² + out²) (embedding: in, not in²)."""
    a, g = _factor_dims(layer)
    return 16 * ((a if layer.kind == "embedding" else a * a) + g * g)


def _forward_pass(stage, layers, leaves, x, y, pseudo_factory):
    """One hooked forward and the backward passes of the pseudo output-gradients: ({layer: (a, g)}, U, dead layers)."""
    with Recorder(layers) as rec, torch.enable_grad():
        outputs = stage.outputs(leaves, x)
    pseudo = pseudo_factory(outputs, y)
    u = pseudo(outputs, y)
    batch = x.shape[0]
    dead = {layer.name: why for layer in layers if (why := check_calls(layer, rec.calls[layer.name], batch))}
    live = [layer for layer in layers if layer.name not in dead]
    handles = [(layer, inp, out) for layer in live for inp, out in rec.calls[layer.name]]
    per_call = [[] for _ in handles]
    if handles:
        for j in range(u.shape[0]):
            grads = torch.autograd.grad(outputs, [h[2] for h in handles], grad_outputs=u[j],
                                        retain_graph=j < u.shape[0] - 1, allow_unused=True)
            for c, ((layer, _, out), g) in enumerate(zip(handles, grads)):
                per_call[c].append(layer_grads(layer, g, out))
    data: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in live:
        a_parts, g_parts = [], []
        for c, (owner, inp, _) in enumerate(handles):
            if owner is layer:
                a_parts.append(layer_inputs(layer, inp))
                g_parts.append(torch.stack(per_call[c]))
        if len(a_parts) == 1:
            data[layer.name] = (a_parts[0], g_parts[0])
        else:  # several calls in one forward: their tokens are pooled
            data[layer.name] = (torch.cat(a_parts, dim=1), torch.cat(g_parts, dim=2))
    return data, u, dead


def _diagonal_squares(stage: Stage, names, params, x, u) -> torch.Tensor:
    """(p_names,) Σ_{i,j} (∂⟨f(x_i), u_ij⟩/∂θ)² over the parameters ``names`` (per-example gradients by vmap)."""
    sub = {n: params[n] for n in names}
    space = ParamSpace(sub)

    def dot(p, xi, ui):
        return (stage.outputs(p, xi.unsqueeze(0)) * ui.unsqueeze(0)).sum()

    total = torch.zeros(space.dim, dtype=torch.float64, device=space.device)
    per = grad(dot)
    for j in range(u.shape[0]):
        rows = space.flatten(vmap_or_loop(per, (None, 0, 0), stage, sub, x, u[j]), batched=True)
        total += (rows.to(torch.float64) ** 2).sum(1)
    return total


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
    progress: bool = False,
) -> FactoredCurvature:
    """The factored curvature C of ``stage``'s objective over ``names`` (default: its trained parameters).

    kind: "kfac", "ekfac" or "diagonal" (module docstring). fisher: "sampled" (default), "empirical" or "exact"
    (:mod:`influkit.factored.fisher`). indices: the examples the objective averages over (default: all; the
    Hessian's ``hessian_samples`` subset). extra: an additional term of the objective (the Case 2 proximal term),
    whose curvature is added like R's. seed: of the sampled labels (the same labels in both EK-FAC passes).
    memory: the budget in bytes (default: :func:`influkit.memory.resolve`, the enclosing scope's or a share of what
    is free); the statistics are streamed per module, so memory does not grow with the number of examples:
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
    Gauss-Newton comes from the same hooks (Σ_i (Σ_t g_it a_itᵀ)², :func:`.layers.example_squares`), memory
    O(rows · cols). ``info["memory"]`` records the sizes chosen.
    """
    if kind not in KINDS:
        raise InputError(f"unknown factored curvature {kind!r}; choose one of {KINDS}.")
    if fisher not in FISHER:
        raise InputError(f"unknown fisher {fisher!r}; choose one of {FISHER}.")
    start = time.perf_counter()
    names = list(stage.param_names if names is None else names)
    params = point(stage.state(), names, at)
    space = ParamSpace(params)
    layers, reasons = plan_layers(stage.model, names)
    n = len(stage) if indices is None else len(indices)
    local = distributed.shard(torch.arange(len(stage)) if indices is None else torch.as_tensor(indices).reshape(-1))
    budget = memory_budget(memory, space.device)
    limit = budget // 8 if max_factor_bytes is None else max_factor_bytes
    wide = {layer.name for layer in layers if kind != "diagonal" and factor_bytes(layer) > limit}
    for layer in layers:
        if layer.name in wide:
            warn(
                f"layer {layer.name} ({layer.rows}×{layer.cols}) would need {factor_bytes(layer) / 2**30:.2f} GiB of "
                f"Kronecker factors, more than max_factor_bytes = {limit / 2**30:.2f} GiB (1/8 of the memory budget); it "
                "gets a diagonal Gauss-Newton block instead (raise memory= or max_factor_bytes= to factor it).")
    leaves = {nm: t.detach().requires_grad_(True) for nm, t in params.items()}
    pseudo_holder: dict[str, PseudoGradients] = {}

    def pseudo_factory(outputs, targets):
        if "p" not in pseudo_holder:
            pseudo_holder["p"] = PseudoGradients(stage.loss, fisher, outputs, targets, seed=seed)
        return pseudo_holder["p"]

    tracked = list(layers)  # layers whose hooks give a and g (also used for the diagonal kind's squares)
    accumulate = torch.promote_types(space.dtype, torch.float32)  # float64 models: float64; float32 (bf16) models: float32
    accumulators = {layer.name: _Accumulator(layer, space.device, layer.name in wide, accumulate) for layer in tracked}
    diag_names: list[str] = [nm for nm in names if nm in reasons]
    # the sums; each layer's eigenbases replace its covariances, so they add at most one layer's
    fixed = sum(t.numel() * t.element_size() for acc in accumulators.values() for t in (acc.inputs, acc.grads, acc.squares))
    sizing = {"phase": "factor fitting", "budget": budget, "fixed_bytes": fixed, "diagonal_layers": sorted(wide)}
    if batch_size is None:
        probe = torch.as_tensor(local[:PROBE_EXAMPLES]) if len(local) else torch.arange(min(PROBE_EXAMPLES, len(stage)))
        px, py = next(iter(stage.batches(probe, len(probe))))
        probe_outputs = stage.outputs(params, px).detach()
        probe_pseudo = PseudoGradients(stage.loss, fisher, probe_outputs, py, seed=seed)
        row_bytes = 2 * sum(params[nm].numel() * params[nm].element_size() for nm in diag_names)
        output_bytes = OUTPUT_COPIES * probe_outputs.numel() * probe_outputs.element_size() // max(len(probe), 1)
        statistics_bytes = {}

        def run(_):
            data, _, _ = _forward_pass(stage, list(layers), leaves, px, py,
                                       lambda outputs, targets: partial(probe_pseudo, index=probe))
            kept = [t for pair in data.values() for t in pair]
            statistics_bytes["per"] = sum(t.numel() * t.element_size() for t in kept) // max(len(probe), 1)
            return kept

        per = probe_bytes(run, stage.model, len(probe)) + row_bytes + output_bytes
        share = (budget - fixed) // 2 if cache_bytes is None else budget - fixed
        batch_size = fit_count(share + fixed, per, "factor fitting", fixed=fixed, most=min(stage.data.batch_size, 1024),
                               default=not memory_given(memory))
        sizing["bytes_per_example"] = per
    if cache_bytes is None:
        cache_bytes = min(max(0, (budget - fixed) // 2), CACHE_BYTES if memory_given(memory) else DEFAULT_WORKING)
        if "bytes_per_example" in sizing and statistics_bytes["per"] * len(local) > cache_bytes:
            cache_bytes = 0  # the first pass would not fit: a second pass, without filling memory first
    sizing |= {"batch": int(batch_size), "cache_bytes": int(cache_bytes)}
    diag_total: torch.Tensor | None = None
    seconds: dict[str, float] = {}
    passes = 1

    cache: list | None = [] if kind == "ekfac" and cache_bytes > 0 else None
    cached_bytes = 0
    batches = -(-len(local) // batch_size)
    progress = progress and distributed.rank() == 0
    dead_seen: dict[str, str] = {}

    def drop(name: str, why: str) -> None:
        nonlocal diag_names
        layer = next(item for item in tracked if item.name == name)
        tracked.remove(layer)
        accumulators.pop(name)
        dead_seen[name] = why
        for pname in (layer.weight, layer.bias):
            if pname is not None:
                reasons[pname] = why
        diag_names = [nm for nm in names if nm in reasons]

    def run_pass(label: str, consume, want_diagonal: bool, keep: bool = False):
        nonlocal diag_total, cache, cached_bytes
        pseudo_holder.pop("p", None)  # same seed: the same labels in every pass
        for start in tqdm(range(0, len(local), batch_size), total=batches, desc=label, disable=not progress, leave=False):
            index = local[start : start + batch_size]
            x, y = next(iter(stage.batches(index, batch_size)))
            labelled = lambda outputs, targets: partial(pseudo_factory(outputs, targets), index=index)  # noqa: E731
            data, u, dead = _forward_pass(stage, list(tracked), leaves, x, y, labelled)
            for name, why in dead.items():  # found on the first batch: these layers fall back to diagonal blocks
                if diag_total is not None:
                    raise InputError(f"layer {name} stopped being usable after the first batch ({why}).")
                drop(name, why)
            for layer in tracked:
                consume(layer, *data[layer.name])
            if want_diagonal and diag_names:
                part = _diagonal_squares(stage, diag_names, params, x, u.detach())
                diag_total = part if diag_total is None else diag_total + part
            if keep and cache is not None:
                data = {name: pair for name, pair in data.items() if name not in wide}
                cached_bytes += sum(t.numel() * t.element_size() for pair in data.values() for t in pair)
                cache = cache + [data] if cached_bytes <= cache_bytes else None

    t0 = time.perf_counter()
    if kind == "diagonal":
        run_pass("diagonal Fisher", lambda layer, a, g: accumulators[layer.name].squares.add_(example_squares(layer, a, g)), True)
    else:
        def statistics(layer, a, g):
            acc = accumulators[layer.name]
            acc.squares.add_(example_squares(layer, a, g)) if layer.name in wide else acc.covariances(a, g)

        run_pass("K-FAC covariances", statistics, True, keep=True)
    pseudo = pseudo_holder.get("p")
    detail = pseudo.describe() if pseudo is not None else None
    if distributed.active():  # every rank's sums over its shard, added up; same layers on every rank first
        shared = distributed.gather_objects((len(local) > 0, sorted(dead_seen.items()), detail))
        everywhere = dict(item for _, dead, _ in shared for item in dead)
        if any(busy and dict(dead) != everywhere for busy, dead, _ in shared):
            raise InputError(f"the layers usable for Kronecker factors differ between ranks' data ({everywhere}).")
        for name, why in everywhere.items():
            if name not in dead_seen:
                drop(name, why)
        detail = next((d for _, _, d in shared if d is not None), None)
        _all_reduce_sums(accumulators, tracked, squares=kind == "diagonal", wide=wide)
        if diag_names:
            if diag_total is None:
                diag_total = torch.zeros(sum(params[nm].numel() for nm in diag_names), dtype=torch.float64, device=space.device)
            distributed.all_reduce_(diag_total)
    seconds["covariances" if kind != "diagonal" else "squares"] = time.perf_counter() - t0

    eigen: dict[str, tuple] = {}
    if kind != "diagonal":
        t0 = time.perf_counter()
        for layer in tracked:
            if layer.name in wide:
                continue
            acc = accumulators[layer.name]
            g_cov = acc.grads.to(torch.float64) / n
            g_evals, g_evecs = torch.linalg.eigh(0.5 * (g_cov + g_cov.T))
            if layer.kind == "embedding":
                a_evals, a_evecs = acc.inputs.to(torch.float64) / max(acc.tokens, 1), None
            else:
                a_cov = acc.inputs.to(torch.float64) / max(acc.tokens, 1)
                a_evals, a_evecs = torch.linalg.eigh(0.5 * (a_cov + a_cov.T))
            keep = space.dtype  # stored like the parameters (float32 model: half the bytes of float64)
            eigen[layer.name] = (a_evals.clamp_min(0), None if a_evecs is None else a_evecs.to(keep).contiguous(),
                                 g_evals.clamp_min(0), g_evecs.to(keep).contiguous())
            acc.release_covariances()  # peak: the covariances or the bases, not both
        seconds["eigendecomposition"] = time.perf_counter() - t0
    if kind == "ekfac":
        t0 = time.perf_counter()

        def correct(layer, a, g):
            if layer.name in wide:
                return
            a_evals, a_evecs, g_evals, g_evecs = eigen[layer.name]
            if layer.kind == "embedding":
                accumulators[layer.name].squares.add_(example_squares(layer, a, g, right=g_evecs))
            else:
                accumulators[layer.name].squares.add_(example_squares(layer, a, g, left=g_evecs, right=a_evecs))

        if cache is not None:  # the first pass's inputs and output-gradients fit in memory: no second data pass
            for data in cache:
                for layer in tracked:
                    if layer.name not in wide:
                        correct(layer, *data[layer.name])
            cache = None
        else:
            run_pass("EK-FAC eigenvalue correction", correct, False)
            passes += 1
        for layer in tracked:
            if layer.name not in wide:
                distributed.all_reduce_(accumulators[layer.name].squares)
        seconds["eigenvalue_correction"] = time.perf_counter() - t0

    reg = regularizer_diagonal(stage, names, extra, at, seed)
    offsets, offset = {}, 0
    for nm, size in zip(space.names, space.sizes):
        offsets[nm] = offset
        offset += size
    blocks: list = []
    layer_info = []
    for layer in tracked:
        acc = accumulators[layer.name]
        idx = _layer_index(layer, offsets, space.device)
        shift = float(reg[idx].mean()) if reg is not None else 0.0
        if kind == "diagonal" or layer.name in wide:
            pos = idx.reshape(-1)
            blocks.append(DiagonalBlock([layer.weight] + ([layer.bias] if layer.bias else []), pos,
                                        (acc.squares.to(torch.float64) / n).reshape(-1), reg[pos] if reg is not None else torch.zeros_like(pos, dtype=torch.float64)))
            acc.squares = None
        else:
            a_evals, a_evecs, g_evals, g_evecs = eigen[layer.name]
            if layer.kind == "embedding":
                left, right = None, g_evecs
                values = acc.squares.div_(n) if kind == "ekfac" else a_evals[:, None] * g_evals[None, :]
            else:
                left, right = g_evecs, a_evecs
                values = acc.squares.div_(n) if kind == "ekfac" else g_evals[:, None] * a_evals[None, :]
            values = values.to(space.dtype)
            acc.squares = None
            blocks.append(KroneckerBlock(layer.name, layer.kind, layer.weight, layer.bias, layer.rows, layer.cols,
                                         left, right, values, shift))
        layer_info.append(layer.describe() | {"tokens_per_example": acc.tokens / max(n, 1)})
    if diag_names:
        pos = torch.cat([torch.arange(offsets[nm], offsets[nm] + params[nm].numel(), device=space.device) for nm in diag_names])
        values = diag_total / n if diag_total is not None else torch.zeros(pos.shape[0], dtype=torch.float64, device=space.device)
        blocks.append(DiagonalBlock(diag_names, pos, values, reg[pos] if reg is not None else torch.zeros_like(values)))
    seconds["total"] = time.perf_counter() - start
    info = {
        "kind": kind,
        "fisher": fisher,
        "fisher_detail": detail if detail is not None else fisher,
        "layers": layer_info,
        "diagonal": {nm: reasons[nm] for nm in diag_names},
        "examples": n,
        "passes": passes,
        "seed": seed,
        "seconds": seconds,
        "memory": sizing,
    }
    return FactoredCurvature(space, kind, blocks, info)


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
    w0 = offsets[layer.weight]
    if layer.kind == "embedding" or layer.bias is None:
        return torch.arange(w0, w0 + layer.rows * layer.cols, device=device).reshape(layer.rows, layer.cols)
    width = layer.cols - 1
    weight = torch.arange(w0, w0 + layer.rows * width, device=device).reshape(layer.rows, width)
    b0 = offsets[layer.bias]
    return torch.cat([weight, torch.arange(b0, b0 + layer.rows, device=device)[:, None]], dim=1)
