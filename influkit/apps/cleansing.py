"""Acting on influence: remove harmful pretraining examples, and find mislabelled training examples.

``cleansing_table``: remove the k pretraining examples with the largest multi-stage score (the most harmful:
largest positive I(z, T); k given as a count or a fraction), retrain both stages, and compare test accuracy
and loss with removing k random ones and removing nothing, over several seeds (the multi-stage paper's §4.2).

``mislabel_detection``: flip a fraction of training labels, rank the examples by self-influence
(−I(z, z)/n: how much removing z would raise its own loss), and report the fraction of flipped labels found
after checking the top 5/10/20/30% — against random order and the training loss — and the test accuracy
after fixing the ones found.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from ..chain import Chain
from ..errors import InputError
from ..influence import self_influence
from ..multistage import score
from ..solvers import SolveConfig
from ..stage import Stage
from ..training import fit_lbfgs, newton_refine
from ..validation.retrain import kept
from .datasets import load_digits_tensors
from .digits import DigitsSetup, accuracy, train_stages
from .objectives import cross_entropy, l2


def _retrained_metrics(chain: Chain, retrainer, exclude, test) -> tuple[float, float]:
    fin = retrainer(chain, kept(len(chain.stages[0]), exclude))[0][-1]
    with torch.no_grad():
        loss = float(fin.losses(fin.trained(), *test).mean())
    return accuracy(fin, test), loss


def cleansing_table(
    setup: DigitsSetup,
    *,
    fraction: float = 0.1,
    removals: int | None = None,
    seeds: int = 5,
    solver: str = "direct",
    progress: bool = True,
) -> pd.DataFrame:
    """Test accuracy and mean test loss (mean ± std over seeds) after removing nothing, the k most harmful
    pretraining examples (largest score), or k random ones; retraining starts from the original weights.

    k = ``removals`` if given, else ``fraction`` of the pretraining set. ``solver`` is the inverse-Hessian
    solver of the scores (``influkit.score``'s, for both stages).
    """
    rows = []
    for seed in tqdm(range(seeds), desc="cleansing seeds", disable=not progress):
        run = replace(setup, seed=seed, timings={})
        split = run.split()
        m = len(split.pretrain[1])
        k = removals if removals is not None else int(round(fraction * m))
        if not 0 < k < m:
            raise InputError(f"cannot remove {k} of {m} pretraining examples; choose --removals (or --fraction) "
                             f"so that 0 < k < {m}.")
        size = f"{fraction:.0%}" if removals is None else str(k)
        pre, fin = train_stages(run, split)
        test = tuple(t.to(run.device) for t in split.test)
        chain = Chain([pre, fin], [run.link()])
        retrainer = run.retrainer()  # one Hessian factorization per seed, shared by its three retrainings
        res = score(pre, fin, torch.arange(len(pre)), test, shared="embedding", case=run.case, alpha=run.alpha,
                    solve=SolveConfig(solver=solver), progress=False)
        harmful = torch.argsort(res.values, descending=True)[:k]
        rng = np.random.default_rng(seed)
        random = torch.as_tensor(rng.choice(len(pre), k, replace=False))
        for name, exclude in (("none", None), (f"top {size} harmful", harmful), (f"random {size}", random)):
            acc, loss = _retrained_metrics(chain, retrainer, exclude, test)
            rows.append({"removed": name, "seed": seed, "test_accuracy": acc, "test_loss": loss})
    frame = pd.DataFrame(rows)
    return frame.groupby("removed", sort=False)[["test_accuracy", "test_loss"]].agg(["mean", "std"])


def mislabel_detection(
    *,
    flip_fraction: float = 0.1,
    checks=(0.05, 0.1, 0.2, 0.3),
    n_train: int = 1000,
    weight_decay: float = 1e-2,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> tuple[pd.DataFrame, dict[str, float]]:
    """Fraction of flipped labels found after checking the top x% by self-influence, training loss, random.

    Model: L2-regularized multinomial logistic regression on real digits, trained to its optimum. Returns
    the table (rows: ranking, columns: fraction checked) and test accuracies clean / noisy / after fixing
    the flipped labels found in the top ``checks[-1]`` by self-influence.
    """
    x, y = load_digits_tensors(dtype)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(x.shape[0], generator=gen)
    train, test = perm[:n_train], perm[n_train:]
    clean = y[train].clone()
    noisy = clean.clone()
    flipped = torch.randperm(n_train, generator=gen)[: int(flip_fraction * n_train)]
    noisy[flipped] = (clean[flipped] + torch.randint(1, 10, (len(flipped),), generator=gen)) % 10
    is_flipped = torch.zeros(n_train, dtype=torch.bool)
    is_flipped[flipped] = True

    def fit(labels) -> Stage:
        torch.manual_seed(seed)
        stage = Stage(nn.Linear(64, 10).to(dtype), cross_entropy, (x[train], labels), regularizer=l2(weight_decay))
        fit_lbfgs(stage, max_iter=1000)
        newton_refine(stage, steps=2)
        return stage

    stage = fit(noisy)
    suspicious = self_influence(stage, solve=SolveConfig(solver="direct"), progress=False).suspicious(n_train)
    with torch.no_grad():
        losses = stage.losses(stage.trained(), x[train], noisy)
    rankings = {
        "self-influence": torch.tensor(suspicious["example"].tolist()),
        "training loss": torch.argsort(losses, descending=True),
        "random": torch.randperm(n_train, generator=gen),
    }
    table = pd.DataFrame(
        {
            name: {f"{c:.0%} checked": float(is_flipped[order[: int(c * n_train)]].sum()) / len(flipped) for c in checks}
            for name, order in rankings.items()
        }
    ).T
    fixed = noisy.clone()
    found = rankings["self-influence"][: int(checks[-1] * n_train)]
    fixed[found] = clean[found]  # a human checks the flagged examples and restores their true labels
    accuracies = {
        "clean labels": accuracy(fit(clean), (x[test], y[test])),
        f"{flip_fraction:.0%} flipped": accuracy(stage, (x[test], y[test])),
        f"after fixing top {checks[-1]:.0%} by self-influence": accuracy(fit(fixed), (x[test], y[test])),
    }
    return table, accuracies
