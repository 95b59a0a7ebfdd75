"""influkit.apps.datasets: the one digits loader and the pretraining/finetuning task split."""

from __future__ import annotations

import pytest
import torch

from influkit.apps.datasets import load_digits_tensors, two_task_split
from influkit.errors import InputError


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_digits_are_the_1797_real_images_scaled_to_unit_range(dtype):
    x, y = load_digits_tensors(dtype)
    assert x.shape == (1797, 64) and x.dtype == dtype and y.dtype == torch.long
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    assert sorted(y.unique().tolist()) == list(range(10))


def test_split_is_disjoint_relabelled_and_seeded():
    x, y = load_digits_tensors()
    split = two_task_split(x, y, (0, 1), (2, 3, 4), n_pretrain=50, n_finetune=40, n_test=30, seed=3)
    assert [len(t[1]) for t in (split.pretrain, split.finetune, split.test)] == [50, 40, 30]
    assert set(split.pretrain[1].tolist()) <= {0, 1} and set(split.test[1].tolist()) <= {0, 1, 2}
    rows = [tuple(r.tolist()) for part in (split.pretrain, split.finetune, split.test) for r in part[0]]
    assert len(set(rows)) >= len(rows) - 5  # digits has a few duplicate images, never shared indices
    again = two_task_split(x, y, (0, 1), (2, 3, 4), n_pretrain=50, n_finetune=40, n_test=30, seed=3)
    assert torch.equal(split.pretrain[0], again.pretrain[0])


def test_same_task_twice_keeps_pretraining_and_finetuning_apart():
    x, y = load_digits_tensors()
    split = two_task_split(x, y, (0, 1), (0, 1), seed=0)
    pre = {tuple(r.tolist()) for r in split.pretrain[0]}
    fin = {tuple(r.tolist()) for r in split.finetune[0]}
    assert len(pre & fin) <= 2


def test_asking_for_more_examples_than_exist_says_what_to_lower():
    x, y = load_digits_tensors()
    with pytest.raises(InputError, match="lower n_finetune/n_test"):
        two_task_split(x, y, (0,), (1,), n_finetune=150, n_test=150)
