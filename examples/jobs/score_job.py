"""The factory of ``examples/jobs/score_job.toml``: a two-stage digits model, trained deterministically, as a job.

    influkit score examples/jobs/score_job.toml
    torchrun --standalone --nproc_per_node=2 -m influkit score examples/jobs/score_job.toml

Pretraining: a 64→32 tanh embedding with a 4-class head on scikit-learn's digits 0–3 (p = 2,212);
finetuning: a new 6-class head on half of the digits 4–9 with the embedding fixed (Case 1); the other half
is the test set. Every rank calls :func:`build` and must get bit-identical stages: the scores directory's
manifest fingerprints the weights and refuses a resume against others. So training here runs plain
``torch.optim.LBFGS`` on one thread from fixed seeds, without influkit's (possibly sharded) helpers; a real job
loads a checkpoint instead of training.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import influkit as ik

WEIGHT_DECAY = 1e-3


def cross_entropy(outputs, targets):
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


def l2(params):
    return 0.5 * WEIGHT_DECAY * sum((p**2).sum() for p in params.values())


class Classifier(nn.Module):
    """head(embedding(x)); the embedding is the block the two stages share."""

    def __init__(self, classes: int):
        super().__init__()
        self.embedding = nn.Sequential(nn.Linear(64, 32), nn.Tanh())
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        return self.head(self.embedding(x))


def _train(model: nn.Module, params: list[nn.Parameter], x: torch.Tensor, y: torch.Tensor) -> None:
    """Full-batch L-BFGS on mean cross-entropy + (λ/2)‖params‖², on one thread (the same bits in every process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        opt = torch.optim.LBFGS(params, lr=1.0, max_iter=500, tolerance_grad=1e-10, tolerance_change=1e-14,
                                history_size=50, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = cross_entropy(model(x), y).mean() + 0.5 * WEIGHT_DECAY * sum((p**2).sum() for p in params)
            loss.backward()
            return loss

        opt.step(closure)
    finally:
        torch.set_num_threads(threads)


def build(device: torch.device) -> dict:
    """The job: {"stages": [pretraining, finetuning], "links": [Case 1 on "embedding"], "test": (x, y)}."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float64)
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.as_tensor(np.random.default_rng(0).permutation(len(y)))
    x, y = x[order], y[order]
    pre_rows, fin_rows = y < 4, y >= 4
    zx, zy = x[pre_rows], y[pre_rows]
    fx, fy = x[fin_rows], y[fin_rows] - 4
    half = fx.shape[0] // 2

    torch.manual_seed(0)
    pre_model, fin_model = Classifier(4).double(), Classifier(6).double()
    _train(pre_model, list(pre_model.parameters()), zx, zy)
    fin_model.embedding.load_state_dict(pre_model.embedding.state_dict())
    _train(fin_model, list(fin_model.head.parameters()), fx[:half], fy[:half])

    pre_model, fin_model = pre_model.to(device).eval(), fin_model.to(device).eval()
    pre = ik.Stage(pre_model, cross_entropy, (zx.to(device), zy.to(device)), regularizer=l2)
    fin = ik.Stage(fin_model, cross_entropy, (fx[:half].to(device), fy[:half].to(device)), params="head", regularizer=l2)
    return {"stages": [pre, fin], "links": [ik.Link("embedding", case=1)], "test": (fx[half:], fy[half:])}
