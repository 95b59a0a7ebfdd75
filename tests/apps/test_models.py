"""influkit.apps.models: the multi-stage paper's architectures (Table A), adapted to 8×8 digits."""

from __future__ import annotations

import pytest
import torch

from influkit.apps.models import digits_classifier, mnist_classifier


@pytest.mark.parametrize("channels, n_params", [((4, 8), 666), ((16, 32), 6090)])
def test_digits_classifier_shapes_and_sizes(channels, n_params):
    model = digits_classifier(10, channels)
    assert model(torch.rand(5, 64)).shape == (5, 10)
    assert model.embedding(torch.rand(5, 64)).shape == (5, channels[1] * 4)
    assert sum(p.numel() for p in model.parameters()) == n_params


def test_pooling_choice_and_mnist_model():
    assert isinstance(digits_classifier(3, pool="max").embedding[3], torch.nn.MaxPool2d)
    assert isinstance(digits_classifier(3).embedding[3], torch.nn.AvgPool2d)
    assert mnist_classifier(6)(torch.rand(2, 784)).shape == (2, 6)
