"""Per-token scores: a sequence's score split over its target tokens, tokens summing to the sequence score.

A language model's per-sequence loss is a sum of token terms, ℓ(z) = Σ_t ℓ_t(z) (for a mean over the M_z labelled
tokens, ℓ_t = −log p(token t) / |M_z|, 0 where no loss is taken). A loss *declares* that split
(:func:`declare_token_losses`: ``influkit.hf``'s causal-LM and masked-LM losses do), and every score that is linear
in ∇ℓ(z) splits with it: the score −⟨∇ℓ(z), s⟩ of an influence query becomes one score per token,

    I_t(z, T) = −⟨∇ℓ_t(z), s⟩,      Σ_t I_t(z, T) = I(z, T),

aligned with the token positions of the sequence (for a causal LM, position t carries the prediction of token t).
The scores are derivatives of the scalar functions ℓ_t in the direction s: one forward-mode pass
(``torch.func.jvp``) per direction gives every token of a batch at once — memory one forward with its tangents plus
the (batch, tokens) output, no per-token gradient ever formed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.func import jvp

from .errors import InputError, LossError
from .gradients import chunk_for
from .params import ParamSpace, point
from .progress import steps as progress_steps
from .stage import Stage

TokenLosses = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (outputs, targets) -> (B, L) token terms


def declare_token_losses(loss, token_losses: TokenLosses):
    """Mark ``loss`` (outputs, targets) → (B,) as the row sums of ``token_losses`` (outputs, targets) → (B, L), the
    split per-token scores use. Returns ``loss``."""
    loss.token_losses = token_losses
    return loss


def token_losses_of(loss) -> TokenLosses:
    """The declared per-token split of ``loss``; :class:`~influkit.errors.LossError` naming the fix if none."""
    split = getattr(loss, "token_losses", None)
    if split is None:
        raise LossError(
            f"the loss {getattr(loss, '__qualname__', type(loss).__name__)} declares no per-token split, so its "
            "scores cannot be split over tokens: use a language-model stage (influkit.hf.causal_lm_stage or "
            "masked_lm_stage), or declare one with influkit.per_token.declare_token_losses(loss, token_losses).")
    return split


def token_losses(stage: Stage, params, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, L) the stage loss's token terms at ``params`` (their row sums are :meth:`Stage.losses`)."""
    return token_losses_of(stage.loss)(stage.outputs(params, inputs), targets)


def token_products(stage: Stage, names: Sequence[str], directions: torch.Tensor, inputs: torch.Tensor,
                   targets: torch.Tensor) -> torch.Tensor:
    """(B, L, k) ⟨∇ℓ_t(z_b), s_j⟩ for the batch's tokens and the k columns s_j of ``directions`` (p, k) over ``names``:
    one ``jvp`` of θ ↦ token_losses(θ) per column."""
    values = point(stage.state(), names)
    space = ParamSpace(values)
    directions = directions.reshape(space.dim, -1)
    if directions.shape[0] != space.dim:
        raise InputError(f"the directions have {directions.shape[0]} rows; the parameters {space.dim}.")

    def terms(params):
        return token_losses(stage, params, inputs, targets)

    columns = []
    for j in range(directions.shape[1]):
        tangent = space.unflatten(directions[:, j].to(space.dtype))
        columns.append(jvp(terms, (values,), ({n: tangent[n] for n in values},))[1])
    return torch.stack(columns, dim=-1)


@dataclass
class TokenScores:
    """Per-token scores of training sequences: ``values[i, t]`` (``[i, t, j]`` per test point) is the score carried
    by token t of sequence ``index[i]``; values.sum(1) is the sequence-level score (:attr:`sequence`).

    method: what produced them; ``diagnostics``: seconds, chunk size, the convention."""

    values: torch.Tensor
    index: torch.Tensor
    method: str
    diagnostics: dict = field(default_factory=dict)

    @property
    def per_test(self) -> bool:
        return self.values.dim() == 3

    @property
    def sequence(self) -> torch.Tensor:
        """(n,) or (n, k): the tokens' sums, the sequence-level scores."""
        return self.values.sum(1)

    def __repr__(self) -> str:
        return f"TokenScores({self.method}, values{tuple(self.values.shape)})"


def stage_token_scores(stage: Stage, names: Sequence[str], s: torch.Tensor, rows, *, per_test: bool,
                       chunk_size: int | None, memory: int | None, progress: bool, method: str) -> TokenScores:
    """:class:`TokenScores` −⟨∇ℓ_t(z), s⟩ of ``rows`` (:class:`~influkit.scoring.Rows`) in chunks of
    ``chunk_size`` (None: sized from ``memory`` by one measured forward and backward, an upper bound of a forward
    with tangents, plus the output rows)."""
    token_losses_of(stage.loss)
    s = s.reshape(s.shape[0], -1)
    start = time.perf_counter()
    if chunk_size is None:
        x, y = rows.take(0, min(2, len(rows)))
        with torch.no_grad():
            width = token_losses(stage, stage.trained(), x[:1], y[:1]).shape[1]
        chunk_size = chunk_for(stage, x, y, names, None, width * s.shape[1] * s.element_size(), "token scoring",
                               memory)
    blocks = []
    for c in progress_steps(range(-(-len(rows) // chunk_size)), "token scores", progress):
        x, y = rows.take(c * chunk_size, (c + 1) * chunk_size)
        blocks.append(-token_products(stage, names, s, x, y))
    values = torch.cat(blocks)
    return TokenScores(values if per_test else values[..., 0], rows.ids, method,
                       {"seconds": time.perf_counter() - start, "chunk_size": int(chunk_size),
                        "convention": "values.sum(1) is the sequence score; position t as the loss's token terms"})
