"""Ensembles: influence averaged over K independently trained chains (as TRAK averages over models).

The scores of a non-convex model depend on which optimum training reached; re-training from scratch (another
seed) may reach another. Averaging over K chains trained from different initializations on the same data,

    Ī(z, T) = (1/K) Σ_k I_k(z, T),

estimates the expected influence over that randomness, which is what from-scratch re-training measures.
Each member is a :class:`~influkit.chain.Chain` over the same stage-1 examples (same order); the sign and
``removal`` conventions are those of every influkit score (positive = up-weighting z raises the test loss).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from .chain import Chain, Measure
from .errors import InputError
from .results import InfluenceResult


class Ensemble:
    """K chains scored on the same test set and stage-1 examples; :meth:`scores` returns the mean of their scores.

    chains: the members, each a fitted or unfitted :class:`~influkit.chain.Chain` whose first stage holds the same
    number of examples (the same examples, in the same order: the ensemble cannot check that they are equal).
    """

    def __init__(self, chains: Sequence[Chain]):
        chains = list(chains)
        if not chains:
            raise InputError("an Ensemble needs at least one chain; pass [chain] for K = 1.")
        bad = [type(c).__name__ for c in chains if not isinstance(c, Chain)]
        if bad:
            raise InputError(f"every ensemble member must be an influkit Chain, got {bad}.")
        sizes = [len(c.stages[0]) for c in chains]
        if len(set(sizes)) != 1:
            raise InputError(
                f"the chains' first stages hold different numbers of examples {sizes}; every member must be trained "
                "on the same stage-1 examples (in the same order) for their scores to be averaged."
            )
        self.chains = chains

    def __len__(self) -> int:
        return len(self.chains)

    def __repr__(self) -> str:
        return f"Ensemble(K={len(self)}, n={len(self.chains[0].stages[0])}, method={self.chains[0].method!r})"

    def fit(self) -> "Ensemble":
        """Fit every member (:meth:`Chain.fit`); returns self."""
        for chain in self.chains:
            chain.fit()
        return self

    def scores(self, z=None, x_test=None, *, measure: Measure | None = None, per_test: bool = False,
               chunk_size: int | None = None, progress: bool = True) -> InfluenceResult:
        """Ī(z, T) = (1/K) Σ_k I_k(z, T): each member's ``query(x_test, measure=measure).scores(z)``, averaged.

        z: stage-1 examples, indices or (inputs, targets) (default None: every one); x_test (required): the test
        set, as :meth:`influkit.Chain.query` takes it; measure: what is attributed (None: the last stage's loss).
        per_test: (len(z), len(x_test)) values instead of the sum over the test set. The diagnostics hold each
        member's diagnostics (``members``) and the total seconds. chunk_size: as :meth:`influkit.Chain.query` and
        its ``scores`` (None: sized from the memory budget), so an ensemble of one is its chain exactly.
        progress: a bar over the members, and each member's own bars (``False``: nothing printed).
        """
        if x_test is None:
            raise InputError("x_test is required: the test examples, (inputs, targets) or indices into the last "
                             "stage's data.")
        start = time.perf_counter()
        results = [
            chain.query(x_test, measure=measure, per_test=per_test, chunk_size=chunk_size, progress=progress)
            .scores(z, chunk_size=chunk_size, progress=progress)
            for chain in tqdm(self.chains, desc="ensemble members", disable=not progress)
        ]
        return average(results, seconds=time.perf_counter() - start)


def average(results: Sequence[InfluenceResult], *, seconds: float | None = None) -> InfluenceResult:
    """The mean of K influence results over the same examples and test set (their values averaged entrywise).

    The results must score the same example ids in the same order with values of the same shape.
    """
    results = list(results)
    if not results:
        raise InputError("nothing to average: pass at least one InfluenceResult.")
    first = results[0]
    for k, result in enumerate(results[1:], start=1):
        if result.values.shape != first.values.shape:
            raise InputError(
                f"member {k} scores have shape {tuple(result.values.shape)}, member 0 {tuple(first.values.shape)}; "
                "score the same examples against the same test set with every member."
            )
        if result.n_train != first.n_train or (
            first.index is not None and result.index is not None and not torch.equal(result.index, first.index)
        ):
            raise InputError(f"member {k} scores other examples than member 0 (n_train or example ids differ).")
    values = torch.stack([r.values for r in results]).mean(0)
    diagnostics = {"members": [r.diagnostics for r in results], "K": len(results)}
    if seconds is not None:
        diagnostics["seconds"] = {"total": seconds}
    return InfluenceResult(values=values, n_train=first.n_train, index=first.index,
                           method=f"ensemble of {len(results)}: {first.method}", diagnostics=diagnostics,
                           removal_eps=first.removal_eps)
