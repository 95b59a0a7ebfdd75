"""influkit.apps.datasets: the one digits loader and the pretraining/finetuning task split."""

from __future__ import annotations

import gzip

import numpy as np
import pytest
import torch

from conftest import need

from influkit.apps.datasets import load_digits_tensors, load_fashion_mnist, read_idx, two_task_split
from influkit.errors import InputError


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_digits_are_the_1797_real_images_scaled_to_unit_range(dtype):
    need("sklearn")
    x, y = load_digits_tensors(dtype)
    assert x.shape == (1797, 64) and x.dtype == dtype and y.dtype == torch.long
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    assert sorted(y.unique().tolist()) == list(range(10))


def test_split_is_disjoint_relabelled_and_seeded():
    need("sklearn")
    x, y = load_digits_tensors()
    split = two_task_split(x, y, (0, 1), (2, 3, 4), n_pretrain=50, n_finetune=40, n_test=30, seed=3)
    assert [len(t[1]) for t in (split.pretrain, split.finetune, split.test)] == [50, 40, 30]
    assert set(split.pretrain[1].tolist()) <= {0, 1} and set(split.test[1].tolist()) <= {0, 1, 2}
    rows = [tuple(r.tolist()) for part in (split.pretrain, split.finetune, split.test) for r in part[0]]
    assert len(set(rows)) >= len(rows) - 5  # digits has a few duplicate images, never shared indices
    again = two_task_split(x, y, (0, 1), (2, 3, 4), n_pretrain=50, n_finetune=40, n_test=30, seed=3)
    assert torch.equal(split.pretrain[0], again.pretrain[0])


def test_same_task_twice_keeps_pretraining_and_finetuning_apart():
    need("sklearn")
    x, y = load_digits_tensors()
    split = two_task_split(x, y, (0, 1), (0, 1), seed=0)
    pre = {tuple(r.tolist()) for r in split.pretrain[0]}
    fin = {tuple(r.tolist()) for r in split.finetune[0]}
    assert len(pre & fin) <= 2


def test_asking_for_more_examples_than_exist_says_what_to_lower():
    need("sklearn")
    x, y = load_digits_tensors()
    with pytest.raises(InputError, match="lower n_finetune/n_test"):
        two_task_split(x, y, (0,), (1,), n_finetune=150, n_test=150)


def _write_idx(path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as handle:
        handle.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_loader_reads_idx_files(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(7, 28, 28))
    labels = rng.integers(0, 10, size=7)
    for prefix in ("train", "t10k"):
        _write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", images)
        _write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", labels)
    x, y = load_fashion_mnist("test", root=tmp_path, dtype=torch.float64)
    assert x.shape == (7, 1, 28, 28) and x.dtype == torch.float64
    assert torch.equal(x[:, 0] * 255, torch.tensor(images, dtype=torch.float64))
    assert y.tolist() == labels.tolist()
    assert read_idx(tmp_path / "train-labels-idx1-ubyte.gz").shape == (7,)


def test_fashion_mnist_loader_rejects_bad_files(tmp_path):
    with gzip.open(tmp_path / "bad.gz", "wb") as handle:
        handle.write(bytes([0, 0, 0x08, 1]) + (5).to_bytes(4, "big") + b"\x01\x02")
    with pytest.raises(InputError, match="header says"):
        read_idx(tmp_path / "bad.gz")
    with pytest.raises(InputError, match="split must be"):
        load_fashion_mnist("valid", root=tmp_path)
