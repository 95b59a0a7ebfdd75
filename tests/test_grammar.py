"""The scoring entry points speak one grammar: the object carrying the training first, then the training examples,
then the test set, the rest keyword-only; ``measure=`` wherever a test set is taken; ``progress=True``;
``curvature=`` a CurvatureConfig or its matrix's name."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import influkit as ik
from influkit.index import GradientIndex
from influkit.turnover import influence as turnover_influence

ENTRY_POINTS = {  # callable: (its positional parameters in order, whether it takes a test set)
    "influence": (ik.influence, ["stage", "z", "x_test"], True),
    "self_influence": (ik.self_influence, ["stage", "z"], False),
    "score": (ik.score, ["pretrain", "finetune", "z", "x_test"], True),
    "Chain.query": (ik.Chain.query, ["self", "x_test"], True),
    "Query.scores": (ik.Query.scores, ["self", "z"], False),
    "Ensemble.scores": (ik.Ensemble.scores, ["self", "z", "x_test"], True),
    "GradientIndex.scores": (GradientIndex.scores, ["self", "query"], False),
    "GradientIndex.top": (GradientIndex.top, ["self", "query", "k"], False),
    "turnover.influence": (turnover_influence, ["model", "z", "x_test"], True),
}


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_point_signature(name):
    fn, positional, takes_test_set = ENTRY_POINTS[name]
    parameters = inspect.signature(fn).parameters.values()
    assert [p.name for p in parameters if p.kind == p.POSITIONAL_OR_KEYWORD] == positional
    keyword = {p.name: p for p in parameters if p.kind == p.KEYWORD_ONLY}
    if takes_test_set:
        assert "measure" in keyword
    if name in ("Chain.query", "Query.scores"):  # None: the chain's own, Chain(progress=True)
        assert keyword["progress"].default is None
        assert inspect.signature(ik.Chain).parameters["progress"].default is True
    else:
        assert keyword["progress"].default is True


def _stage():
    torch.manual_seed(0)
    x, y = torch.randn(40, 3, dtype=torch.float64), torch.randint(0, 2, (40,))
    model = nn.Linear(3, 2).double()
    loss = lambda out, t: nn.functional.cross_entropy(out, t, reduction="none")  # noqa: E731
    stage = ik.Stage(model, loss, (x, y), regularizer=lambda p: 1e-1 * sum((w ** 2).sum() for w in p.values()))
    ik.training.train_to_stationarity(stage)
    return stage, (x[:6], y[:6])


def test_curvature_by_name_is_its_config():
    stage, test = _stage()
    named = ik.influence(stage, None, test, curvature="gauss-newton", progress=False)
    config = ik.influence(stage, None, test, curvature=ik.CurvatureConfig("gauss-newton"), progress=False)
    hessian = ik.influence(stage, None, test, progress=False)
    torch.testing.assert_close(named.values, config.values, rtol=0, atol=0)
    assert named.diagnostics["settings"]["curvature"][0]["matrix"] == "gauss-newton"
    assert hessian.diagnostics["settings"]["curvature"][0]["matrix"] == "hessian"
    chain = ik.Chain([stage], curvature=["gauss-newton"])
    assert chain.curvature_configs == [ik.CurvatureConfig("gauss-newton")]
    with pytest.raises(ik.InfluenceError, match="unknown matrix"):
        ik.Chain([stage], curvature="ekfak")
