"""The summed gradient of a batch, with each Kronecker-factored layer's block kept as its token factors.

A layer's block matrix M (:mod:`influkit.layers.dense`: M = [W | b], or [W; bᵀ] for a weight stored (in, out)) has
the summed gradient ∇_M Σ_i ℓ_i = Σ_t u_t v_tᵀ = Uᵀ V over the T tokens of every example and call (U: T × rows,
V: T × cols; for ``nn.Linear`` u_t = g_t the output-gradient and v_t = ā_t = [a_t; 1] the input). An EK-FAC / K-FAC
solve rotates it into the eigenbasis, Lᵀ (Uᵀ V) R = (U L)ᵀ (V R): T·(rows² + cols² + rows·cols) multiply-adds from
the factors, against rows·cols·(T + rows + cols) for forming the gradient (the weight-gradient product of the
backward pass) and rotating it. :func:`token_gradient` keeps the factors of the blocks where they are cheaper (T
below about the block's dimensions: BERT-base's blocks against 4 test sequences of 128 tokens) and forms the others
from the same factors, so autograd takes no block's weight gradient after the first chunk (the check below); every
other parameter's gradient comes from autograd as in :func:`influkit.gradients.total_grad`.

Memory: a chunk holds its activations and every layer's output-gradients at once (measured on the first chunk, as
the contraction does); the kept factors total T·(rows + cols) per block, under twice the block's entries (the rule
implies T < rows·cols·(rows + cols)/(rows² + cols²) and (rows + cols)² ≤ 2(rows² + cols²)).

Recorded inputs and output-gradients give a block's gradient only when its parameters are used inside the module's
``forward`` (as in :mod:`influkit.contraction`): the first chunk's autograd gradient of every parameter is taken too
and compared with the factors on random rank-one directions (⟨Uᵀ V, x yᵀ⟩ = (U x)ᵀ (V y), cheap); on a mismatch
:func:`token_gradient` returns None and the caller takes the plain gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .. import memory as budgets
from ..layers import Dense, Layer, Recorder
from ..memory import PROBE_EXAMPLES, Probe
from ..params import ParamSpace, point
from ..stage import Stage, check_finite
from .blocks import KroneckerBlock
from .operator import FactoredCurvature
from .layers import plan_layers

# relative gap the rank-one check allows, as the contraction's check: float64, float32, and half types otherwise
CHECK_TOL = {torch.float64: 1e-8, torch.float32: 1e-3}
HALF_TOL = 5e-2


@dataclass
class TokenGradient:
    """Σ_i ∇ℓ_i over a ParamSpace: ``flat`` (p,) with the entries of the blocks in ``factors`` left 0, and
    ``factors[layer] = (U, V)`` with that block's gradient Uᵀ V (U: T × rows, V: T × cols)."""

    flat: torch.Tensor
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def dense(self, curvature: FactoredCurvature) -> torch.Tensor:
        """The (p,) gradient with the factored blocks formed (Uᵀ V written at their entries)."""
        out = self.flat.clone().reshape(-1, 1)
        for block in curvature.blocks:
            if isinstance(block, KroneckerBlock) and block.layer in self.factors:
                u, v = self.factors[block.layer]
                block.scatter((u.T @ v).unsqueeze(0), out, curvature.offsets)
        return out.reshape(-1)


def factors_cheaper(block: KroneckerBlock, tokens: int) -> bool:
    """Whether rotating T = ``tokens`` factor rows costs less than forming the block and rotating it:
    T·(rows² + cols²) < rows·cols·(rows + cols) (the product U L · (V R)ᵀ costs what forming Uᵀ V does)."""
    rows, cols = block.rows, block.cols
    return block.left is not None and tokens * (rows * rows + cols * cols) < rows * cols * (rows + cols)


def _token_factors(layer: Layer, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, V) of one recorded call: the block's gradient Uᵀ V = Σ_t over the call's tokens."""
    a, g = layer.inputs(a), layer.grads(g)
    a = a.reshape(-1, a.shape[-1])
    if layer.bias is not None:
        a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype, device=a.device)], dim=1)
    g = g.reshape(-1, g.shape[-1]).to(a.dtype)
    return (a, g) if layer.inputs_first else (g, a)


def token_gradient(stage: Stage, inputs: torch.Tensor, targets: torch.Tensor, names: Sequence[str],
                   curvature: FactoredCurvature, *, chunk_size: int | None = None,
                   memory: int | None = None) -> TokenGradient | None:
    """Σ_i ∇ℓ(x_i, y_i) over ``names`` (the curvature's parameter space) as a :class:`TokenGradient` (no factors when
    no block is cheaper as factors), or None when ``names`` are not the curvature's, no Kronecker block is a dense
    layer's, or the first chunk's check fails (a parameter used outside its module's forward).

    Chunks of ``chunk_size`` examples, or as many as the budget ``memory`` holds (measured on the first
    ``PROBE_EXAMPLES``, whose autograd gradient is the check's reference)."""
    names = list(names)
    space = ParamSpace(point(stage.state(), names))
    if space.names != curvature.space.names:
        return None
    blocks = {b.layer: b for b in curvature.blocks if isinstance(b, KroneckerBlock)}
    layers = [layer for layer in plan_layers(stage.model, names)[0]
              if isinstance(layer, Dense) and layer.name in blocks
              and (layer.weight, layer.bias) == (blocks[layer.name].weight, blocks[layer.name].bias)]
    if not layers:
        return None
    check_finite(inputs, "inputs")
    covered = {n for layer in layers for n in layer.params}
    others = [n for n in names if n not in covered]
    offsets = curvature.offsets
    flat = space.zeros().reshape(-1, 1)
    pieces: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {layer.name: [] for layer in layers}
    keep: dict[str, bool] = {}
    held = [0]  # bytes of the output-gradients and factors one chunk holds at once (the probe's)

    def run(x, y, check: bool) -> bool:
        leaves = {n: t.detach().requires_grad_(True) for n, t in point(stage.state(), names).items()}
        with Recorder(layers, x.shape[0]) as recorder, torch.enable_grad():
            losses = stage.losses(leaves, x, y)
        if any(recorder.calls[name] for name in recorder.misfits()):  # not batch-first: no per-token factors
            return False
        calls = [(layer, a, out) for layer in layers for a, out in recorder.calls[layer.name]]
        wanted = others if not check else names
        grads = torch.autograd.grad(losses.sum(), [out for _, _, out in calls] + [leaves[n] for n in wanted],
                                    allow_unused=True)
        found = dict(zip(wanted, grads[len(calls):]))
        for n in others:
            if found[n] is not None:
                start = offsets[n]
                flat[start : start + found[n].numel(), 0] += found[n].reshape(-1).to(flat.dtype)
        now: dict[str, list] = {layer.name: [] for layer in layers}
        for (layer, a, _), g in zip(calls, grads[: len(calls)]):
            if g is not None:
                now[layer.name].append(_token_factors(layer, a.to(flat.dtype), g.to(flat.dtype)))
        held[0] = max(held[0], sum(t.numel() * t.element_size() for pair in sum(now.values(), []) for t in pair))
        if check:
            auto = {n: (torch.zeros_like(leaves[n]) if found[n] is None else found[n]).to(flat.dtype) for n in covered}
            if not _agrees(now, blocks, auto, layers):
                return False
        for layer in layers:
            if not now[layer.name]:
                continue
            u, v = (_stacked([f[i] for f in now[layer.name]]) for i in (0, 1))
            if keep.get(layer.name) is None:  # decided on the first chunk: tokens per example × all examples
                keep[layer.name] = factors_cheaper(blocks[layer.name], -(-u.shape[0] * inputs.shape[0] // x.shape[0]))
            if keep[layer.name]:
                pieces[layer.name].append((u, v))
            else:
                block = blocks[layer.name]
                m = block.gather(flat, offsets) + (u.T @ v).unsqueeze(0)
                block.scatter(m, flat, offsets)
        return True

    head = min(PROBE_EXAMPLES, inputs.shape[0])
    with Probe(stage.model, head) as probe:
        agreed = run(inputs[:head], targets[:head], check=True)
    per = probe.per_example - (-held[0] // head)
    if not agreed:
        return None
    if chunk_size is None:
        chunk_size = min(512, budgets.fit_count(budgets.resolve(memory, inputs.device), per, "the test gradient",
                                                most=max(inputs.shape[0], 1), default=not budgets.given(memory)))
    for start in range(head, inputs.shape[0], chunk_size):
        run(inputs[start : start + chunk_size], targets[start : start + chunk_size], check=False)
    factors = {name: (_stacked([u for u, _ in parts]), _stacked([v for _, v in parts]))
               for name, parts in pieces.items() if parts and keep.get(name)}
    return TokenGradient(flat.reshape(-1), factors)


def _stacked(rows: list[torch.Tensor]) -> torch.Tensor:
    """The row blocks stacked (one block as it is, no copy)."""
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def _agrees(now: dict, blocks: dict, auto: dict[str, torch.Tensor], layers: list[Layer]) -> bool:
    """Whether each layer's factors match its block of the autograd gradients ``auto`` (by parameter name) on a
    random rank-one direction x yᵀ: ⟨Uᵀ V, x yᵀ⟩ = (U x)ᵀ (V y) against xᵀ M y."""
    for layer in layers:
        block = blocks[layer.name]
        parts = [auto[n] for n in layer.params]
        m = block.gather(torch.cat([t.reshape(-1) for t in parts])[:, None],
                         {n: sum(t.numel() for t in parts[:i]) for i, n in enumerate(layer.params)})[0]
        gen = torch.Generator(device=m.device).manual_seed(0)
        x = torch.randn(block.rows, generator=gen, dtype=m.dtype, device=m.device)
        y = torch.randn(block.cols, generator=gen, dtype=m.dtype, device=m.device)
        expected = x @ m @ y
        got = sum(((u @ x) * (v @ y)).sum() for u, v in now[layer.name]) if now[layer.name] else m.new_zeros(())
        scale = (x.abs() @ m.abs() @ y.abs()) + sum(((u @ x).abs() * (v @ y).abs()).sum() for u, v in now[layer.name])
        if abs(float(got - expected)) > CHECK_TOL.get(m.dtype, HALF_TOL) * float(scale) + torch.finfo(m.dtype).tiny:
            return False
    return True
