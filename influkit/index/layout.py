"""The layout of an index row: the blocks of a stage's trained parameters in order, and the two maps through them —
a batch of examples to its (B, D) compressed gradient rows, and a direction s over the parameters to its (D, k)
compressed columns, so that row · column estimates ⟨∇ℓ(z), s⟩ (exactly with identity projections).

The rows come from one forward with hooks on the registered layers (:mod:`influkit.layers`) and one backward of
the summed loss to the layers' outputs, as contraction scoring does (:mod:`influkit.contraction`): per example,
per layer, the recorded inputs a_t and output-gradients g_t (examples do not mix in eval mode). Parameters outside
registered layers (or in layers whose calls are not batch-first) take per-example gradients (``torch.func.vmap``)
multiplied by their projection.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InputError
from ..gradients import project_per_example_grads
from ..layers import Recorder
from ..layers import plan as registered_layers
from ..params import ParamSpace, point
from ..stage import Stage, check_finite
from .projections import (PROJECTIONS, Block, FlatBlock, KroneckerBlock, allot, diagonal_whitening, eigen_sides,
                          kronecker_sides, kronecker_whitening, random_projection, whitened_eigen_sides)

FALLBACK = "per-example gradients"
CANDIDATES = 4  # projection="eigenpairs": each Kronecker block's candidate rectangle, in shares of the dimension rule


class Layout:
    """The blocks of one stage's trained ``names``; ``width`` = D numbers per example."""

    def __init__(self, stage: Stage, names: Sequence[str], blocks: list[Block]):
        self.stage, self.names, self.blocks = stage, list(names), blocks
        self.space = ParamSpace(point(stage.state(), self.names))

    @property
    def width(self) -> int:
        return sum(b.width for b in self.blocks)

    @classmethod
    def plan(cls, stage: Stage, names: Sequence[str], *, projection: str, dim: int, seed: int,
             dtype: torch.dtype, factored=None, whiten: bool = False, damping: float | None = None) -> "Layout":
        """The blocks of ``names`` with their projections (:mod:`.projections`: the dimension rule, the kinds),
        whitened by (C + λI)^{-1/2} of the fitted curvature ``factored`` with λ = ``damping`` if ``whiten``."""
        if projection not in PROJECTIONS:
            raise InputError(f"unknown projection={projection!r}; choose one of {PROJECTIONS}.")
        if projection == "eigenpairs" and not whiten:
            raise InputError("projection='eigenpairs' (the default) selects eigen-pairs by whitened energy: it needs "
                             "whiten=True; unwhitened, choose projection='eigenbasis' or 'random'.")
        if (projection in ("eigenbasis", "eigenpairs") or whiten) and factored is None:
            raise InputError(f"{'whiten=True' if whiten else f'projection={projection}'} (the default) needs the stage's "
                             "fitted factored curvature: pass factored=chain.curvature(0).approximation('ekfac') (or "
                             "ik.factored.fit_curvature(stage, kind='ekfac')) to GradientIndex.build; or "
                             "IndexConfig(projection='random', whiten=False) for an index without a curvature.")
        names = list(names)
        if whiten and damping is None:
            raise InputError("whiten=True (the default) needs IndexConfig(damping=λ), the damping of the chain's stage-1 "
                             "solve (query.solves[0]['damping']); or IndexConfig(projection='random', whiten=False) for an "
                             "index without a curvature.")
        if whiten:
            missing = [n for n in names if n not in factored.offsets]
            if missing:
                raise InputError(f"the curvature passed as factored= is not over the indexed parameters (it lacks "
                                 f"{missing[:3]}); fit it on this stage's trained parameters.")
            diagonal = diagonal_whitening(factored, damping)

            def diagonal_parts(params):
                return {n: diagonal[factored.offsets[n] : factored.offsets[n] + stage.state()[n].numel()].reshape(
                    1, *stage.state()[n].shape).to(dtype) for n in params}

        layers, _ = registered_layers(stage.model, names)
        layers = _batch_first(stage, layers)
        covered = {n for layer in layers for n in layer.params}
        rest = [n for n in names if n not in covered]
        state = stage.state()
        shapes = []
        for layer in layers:
            shapes.append(("kronecker", kronecker_sides(layer)) if _kronecker(layer) else ("flat", (layer.size,)))
        if rest:
            shapes.append(("flat", (sum(state[n].numel() for n in rest),)))
        ks = allot(shapes, dim) if projection != "identity" else [None] * len(shapes)
        if projection == "eigenpairs":  # candidate rectangles of CANDIDATES × the share, the pairs chosen below
            candidates = allot(shapes, CANDIDATES * dim)
            budget = dim - sum(k[0] for k, (kind, _) in zip(ks, shapes) if kind == "flat")
            energies = []
        generator = torch.Generator().manual_seed(seed)
        blocks: list[Block] = []
        for i, layer in enumerate(layers):
            if shapes[i][0] == "kronecker":
                whitening = None
                if whiten:
                    whitening = kronecker_whitening(layer, factored, damping, dtype)
                    if whitening is None:  # the curvature gave the layer a diagonal block
                        plain = KroneckerBlock(layer, None, None)
                        whitening = (None, None, plain.matrix(diagonal_parts(layer.params))[0].contiguous())
                p_out = p_in = None
                if projection in ("eigenbasis", "eigenpairs") and whiten:
                    sizes = candidates[i] if projection == "eigenpairs" else ks[i]
                    kept, p_out, p_in, energy = whitened_eigen_sides(whitening, layer, *sizes, damping, dtype)
                    blocks.append(KroneckerBlock(layer, p_out, p_in, basis=projection, whitening=kept))
                    if projection == "eigenpairs":
                        energies.append((blocks[-1], energy.reshape(-1)))
                    continue
                if projection == "eigenbasis":
                    sides = eigen_sides(layer, factored, *ks[i], dtype)
                    if sides is not None:
                        blocks.append(KroneckerBlock(layer, *sides, basis="eigenbasis"))
                        continue
                if projection != "identity":
                    p_out = random_projection(ks[i][0], shapes[i][1][0], generator, dtype)
                    p_in = random_projection(ks[i][1], shapes[i][1][1], generator, dtype)
                blocks.append(KroneckerBlock(layer, p_out, p_in, basis=projection if projection == "identity" else "random",
                                             whitening=whitening))
            else:
                p = None if ks[i] is None else random_projection(ks[i][0], layer.size, generator, dtype)
                scale = _flat_scale(diagonal_parts(layer.params), layer.params) if whiten else None
                blocks.append(FlatBlock(layer.name, layer.params, [state[n].numel() for n in layer.params], layer, p, scale))
        if rest:
            p = None if ks[-1] is None else random_projection(ks[-1][0], shapes[-1][1][0], generator, dtype)
            scale = _flat_scale(diagonal_parts(rest), rest) if whiten else None
            blocks.append(FlatBlock(FALLBACK, rest, [state[n].numel() for n in rest], None, p, scale))
        if projection == "eigenpairs":
            _choose_pairs(energies, budget)
        return cls(stage, names, blocks)

    def describe(self) -> list[dict]:
        return [b.describe() for b in self.blocks]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"block{i}.{k}": t for i, b in enumerate(self.blocks) for k, t in b.tensors().items()}

    def rows(self, inputs: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B, D) compressed per-example gradients of the batch, in ``dtype``."""
        check_finite(inputs, "inputs")
        stage, batch = self.stage, inputs.shape[0]
        hooked = [b for b in self.blocks if getattr(b, "layer", None) is not None]
        covered = [n for b in hooked for n in b.params]
        leaves = {n: t.detach().requires_grad_(True) for n, t in point(stage.state(), covered).items()}
        parts: dict[int, torch.Tensor] = {}
        if hooked:
            with Recorder([b.layer for b in hooked], batch) as recorder, torch.enable_grad():
                losses = stage.losses(leaves, inputs, targets)
            bad = {name: why for name, why in recorder.misfits().items() if recorder.calls[name]}
            if bad:
                raise InputError(f"layer {next(iter(bad))!r} was {next(iter(bad.values()))} on this batch though not "
                                 "on the probe batch the index was planned on; give batches of one shape.")
            calls = [(b, a, y) for b in hooked for a, y in recorder.calls[b.layer.name]]
            grads = torch.autograd.grad(losses.sum(), [c[2] for c in calls], allow_unused=True)
            for (block, a, y), g in zip(calls, grads):
                if g is None:
                    continue
                term = block.compress(a, g.to(dtype))
                key = id(block)
                parts[key] = parts[key] + term if key in parts else term
        out = []
        for block in self.blocks:
            if isinstance(block, FlatBlock) and block.layer is None:
                directions = block.directions_matrix(dtype, inputs.device)
                out.append(project_per_example_grads(stage, inputs, targets, directions.to(self.space.dtype),
                                                     block.params, chunk_size=max(batch, 1)).to(dtype))
            else:
                out.append(parts.get(id(block), torch.zeros(batch, block.width, dtype=dtype, device=inputs.device)))
        return torch.cat(out, dim=1)

    def directions(self, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(D, k) compressed columns of directions s (p,) or (p, k) over the stage's trained parameters, in ``dtype``."""
        s = s.reshape(s.shape[0], -1)
        if s.shape[0] != self.space.dim:
            raise InputError(f"the direction has {s.shape[0]} entries; the index's parameters have {self.space.dim}.")
        parts = self.space.unflatten(s.to(dtype))
        return torch.cat([b.direction({n: parts[n] for n in b.params}) for b in self.blocks], dim=1).T.contiguous()


def _choose_pairs(energies: list, budget: int) -> None:
    """Give each whitened Kronecker block the pairs of its candidate rectangle that are among the ``budget`` of most
    whitened energy E/(E + λ) over all blocks' candidates (ties: the earlier block, the earlier pair)."""
    if not energies:
        return
    every = torch.cat([e for _, e in energies])
    chosen = torch.zeros(every.shape[0], dtype=torch.bool)
    chosen[torch.sort(every, descending=True, stable=True).indices[: max(budget, 0)]] = True
    start = 0
    for block, energy in energies:
        block.pairs = torch.nonzero(chosen[start : start + energy.shape[0]]).reshape(-1)
        start += energy.shape[0]


def _flat_scale(parts: dict, params: Sequence[str]) -> torch.Tensor:
    """(n,) the flat block's whitening scale, its parameters' entries in order."""
    return torch.cat([parts[n].reshape(-1) for n in params])


def _kronecker(layer) -> bool:
    return layer.kronecker and layer.weight is not None


def _batch_first(stage: Stage, layers: list) -> list:
    """The layers whose calls on a probe batch of two examples are batch-first (the others: per-example gradients)."""
    if not layers or len(stage) == 0:
        return layers
    x, y = stage.data.take(torch.arange(min(2, len(stage))))
    leaves = {n: t.detach().requires_grad_(True) for n, t in point(stage.state(), [n for lay in layers for n in lay.params]).items()}
    with Recorder(layers, x.shape[0]) as recorder, torch.enable_grad():
        stage.losses(leaves, x, y)
    misfits = recorder.misfits()
    return [layer for layer in layers if layer.name not in misfits]
