"""Scoring against many directions forms a layer's per-example gradient rows once where its cost rule says so
(influkit.layers.Layer.forms_rows): rows and per-direction contraction give the same float64 scores as
per-example gradients for Linear, Conv2d, Embedding, LayerNorm and RMSNorm, also with the rows formed a few
examples at a time; the rule takes rows for many directions and the contraction for one; and the memory plan sets
aside what the rows need, or, with no room for one row, none is formed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from influkit.contraction import ROWS_SHARE, Contractor
from influkit.memory import SAFETY
from influkit.gradients import per_example_grads_serial as per_example_grads
from influkit.layers import Embedding, LayerNorm, Linear
from test_layers import conv2d_stage, tokens_stage

K = 100  # directions, as the fidelity benchmark's per-test scoring of 100 test points
STAGES = {"conv2d": (conv2d_stage, {"a", "b", "out"}),  # Conv2d, Conv2d without bias, Linear
          "tokens": (tokens_stage, {"emb", "ln", "lin", "rms", "ln2", "out"})}  # Embedding, LayerNorm, Linear, RMSNorm


@pytest.mark.parametrize("model", list(STAGES))
def test_rows_and_contraction_give_the_per_example_gradient_scores(model):
    make, layers = STAGES[model]
    stage = make()
    x, y = stage.data.take(torch.arange(len(stage)))
    directions = torch.randn(stage.num_trained, K, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    expected = per_example_grads(stage, x, y) @ directions
    assert expected.std(0).min() > 1e-3  # examples differ: the comparison can fail
    tol = dict(rtol=1e-10, atol=1e-10 * float(expected.abs().max()))

    rows = Contractor(stage, memory=2**30)
    contracted = Contractor(stage, memory=1)  # no room for a single row: every layer contracted per direction
    by_rows, by_contraction = rows(x, y, directions), contracted(x, y, directions)
    assert set(rows.describe()["formed_rows"]) == layers and rows.plan.fallback == []
    assert contracted.describe()["formed_rows"] == [] and contracted.rows_bytes == 0
    torch.testing.assert_close(by_rows, expected, **tol)
    torch.testing.assert_close(by_contraction, expected, **tol)
    torch.testing.assert_close(by_rows, by_contraction, **tol)

    # room for two rows of the largest layer: its rows are formed two examples at a time, the same scores
    largest = max(layer.size for layer in rows.plan.modules) * directions.element_size()
    sliced = Contractor(stage, memory=int(2 * largest / ROWS_SHARE) + 1)
    assert sliced.rows_bytes // largest == 2
    torch.testing.assert_close(sliced(x, y, directions), expected, **tol)
    assert set(sliced.describe()["formed_rows"]) == layers


def test_rule_forms_rows_for_many_directions_and_contracts_for_few():
    tokens = {"a": 16, "b": 16, "out": 1, "emb": 5, "ln": 5, "lin": 5, "rms": 5, "ln2": 1}  # per example, per call
    for make in (conv2d_stage, tokens_stage):
        for layer in Contractor(make()).plan.modules:
            assert layer.forms_rows(tokens[layer.name], K), layer
            assert not layer.forms_rows(tokens[layer.name], 1), layer  # one direction: contracting costs less
    # rows that cost more than K contractions: a vocabulary far larger than the tokens per example, and a square
    # layer seeing one token per example (rows and contraction are then the same product; rows cost memory)
    vocabulary = Embedding("e", nn.Embedding(1000, 8), "e.weight", None)
    assert not vocabulary.forms_rows(5, K) and vocabulary.forms_rows(1000, K)
    square = Linear("l", nn.Linear(512, 512), "l.weight", "l.bias")
    assert not square.forms_rows(1, K) and square.forms_rows(8, K)
    norm = LayerNorm("n", nn.LayerNorm(8), "n.weight", "n.bias")
    assert norm.forms_rows(5, 2) and not norm.forms_rows(5, 1)  # its rows cost what one contraction costs


def test_rows_are_set_aside_in_the_budget_or_not_formed():
    """The scorer's plan reserves what the probe's rows need (a chunk's worth of the largest layer's rows, no more);
    a budget with no room for one row beside one example's contraction forms none, with the same scores."""
    stage = conv2d_stage()
    x, y = stage.data.take(torch.arange(len(stage)))
    directions = torch.randn(stage.num_trained, K, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    roomy = Contractor(stage, memory=2**30)
    per_example = roomy.probe(x[:2], y[:2], directions)
    largest = max(roomy.formed.values())
    assert largest == max(layer.size for layer in roomy.plan.modules) * 8
    assert roomy.reserve(2**30, per_example, most=9) == 9 * largest

    budget = int(SAFETY * per_example) + largest - 1
    tight = Contractor(stage, memory=budget)
    tight.probe(x[:2], y[:2], directions)
    assert tight.formed and tight.reserve(budget, per_example, most=9) == 0
    expected = per_example_grads(stage, x, y) @ directions
    torch.testing.assert_close(tight(x, y, directions), expected, rtol=1e-10, atol=1e-10 * float(expected.abs().max()))
    assert tight.describe()["formed_rows"] == []
