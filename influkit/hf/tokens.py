"""Query-token scores: a completion query split into one test row per completion token, whose scores sum to the
query's.

A query's measure is the mean negative log-likelihood of its completion, f(x) = (1/|M_x|) Σ_{t∈M_x} ℓ_t(x) (M_x: its
labelled positions; for a causal LM, position t is the prediction of token t, t ≥ 1). Every score is linear in
∇f(x), so the score of a training sequence on the query splits over the completion tokens:

    I(z, x) = Σ_{t∈M_x} I(z, x_t) / |M_x|,

x_t the query with only token t labelled (whose loss is ℓ_t(x)). :func:`token_queries` builds those rows; any
per-test scoring — ``Chain.query(rows, per_test=True)``, the unrolled metagradients with ``per_test=True``, a
gradient index's per-test scores — scores them, and :meth:`TokenQueries.split` weights the columns by 1/|M_x| and
lays them out per query and token position, aligned with the query's ``input_ids``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..errors import InputError
from .batches import pack
from .masking import IGNORE


@dataclass(frozen=True)
class TokenQueries:
    """The test rows of :func:`token_queries`: ``test`` packed (inputs, targets), one row per labelled token;
    row r is query ``query[r]`` with only position ``position[r]`` labelled, weighted ``weight[r]`` = 1/|M_x|."""

    test: tuple[torch.Tensor, torch.Tensor]
    query: torch.Tensor
    position: torch.Tensor
    weight: torch.Tensor
    n_queries: int
    length: int

    def split(self, values: torch.Tensor) -> torch.Tensor:
        """(..., n_queries, L) from per-test ``values`` (..., R) of the R rows: column r weighted by 1/|M_x| at
        (query[r], position[r]), zero at unlabelled positions; summing the last axis gives each query's score."""
        if values.shape[-1] != self.query.numel():
            raise InputError(f"values have {values.shape[-1]} columns; the token queries have {self.query.numel()} "
                             "rows: score them with per_test=True.")
        out = values.new_zeros(*values.shape[:-1], self.n_queries, self.length)
        out[..., self.query, self.position] = values * self.weight.to(values.dtype)
        return out


def token_queries(batch, *, causal: bool = True) -> TokenQueries:
    """One test row per labelled token of each query of ``batch`` (a dict with ``input_ids``, ``attention_mask``,
    ``labels`` −100 off the completion — :func:`~influkit.hf.completion_batch` — or packed (inputs, targets)).

    causal: position 0 is never predicted (a causal LM's labels are shifted), so it is left out; False for a
    masked LM, whose every labelled position is predicted."""
    inputs, targets = pack(batch) if isinstance(batch, Mapping) else batch
    if targets.dim() != 2 or targets.shape != inputs[:, 0].shape:
        raise InputError(f"token queries need (batch, length) labels aligned with input_ids, got {tuple(targets.shape)}.")
    labelled = targets != IGNORE
    if causal:
        labelled[:, 0] = False
    query, position = labelled.nonzero(as_tuple=True)
    empty = sorted(set(range(targets.shape[0])) - set(query.tolist()))
    if empty:
        raise InputError(f"queries {empty[:5]} have no labelled token to split; give each query a completion "
                         "(labels ≠ −100 on its tokens).")
    rows = torch.full((query.numel(), targets.shape[1]), IGNORE, dtype=targets.dtype)
    rows[torch.arange(query.numel()), position] = targets[query, position]
    weight = 1.0 / labelled.sum(1).to(torch.float64)[query]
    return TokenQueries((inputs[query], rows), query, position, weight, targets.shape[0], targets.shape[1])
