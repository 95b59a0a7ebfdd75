"""benchmarks/dvemb_peer.py calls dattri's DVEmb correctly: on a plain-SGD record with a small learning rate (where
DVEmb's second-order terms vanish) its scores are the exact metagradient d loss_t / d w_z of the recorded run, in
influkit's sign and scale, and their difference shrinks with the learning rate (it is DVEmb's approximation of the
Hessian terms, O(η)). Skipped where dattri is not installed (it lives in the bench venv:
scripts/bench-env.sh)."""
import importlib.util

import pytest
import torch

import influkit as ik

pytestmark = pytest.mark.skipif(importlib.util.find_spec("dattri") is None,
                                reason="dattri not installed (bash scripts/bench-env.sh)")


def relative_error(lr: float) -> float:
    from benchmarks.dvemb_peer import dvemb_scores

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, (40,), generator=gen)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).double().eval()
    loss = lambda out, target: torch.nn.functional.cross_entropy(out, target, reduction="none")  # noqa: E731
    stage = ik.Stage(model, loss, (x, y))
    record = ik.unrolled.Record()
    record.train(stage, ik.unrolled.SGD(lr=lr), steps=20, batch_size=8, checkpoint_every=5)
    test = (torch.randn(3, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, (3,), generator=gen))

    scores = dvemb_scores(record, test)
    exact = -ik.unrolled.metagradients(record, test, per_test=True, progress=False)[0].removal
    assert scores.shape == exact.shape == (40, 3)
    return float(torch.linalg.norm(scores - exact) / torch.linalg.norm(exact))


def test_dvemb_is_the_metagradient_of_a_small_step_sgd_run():
    coarse, fine = relative_error(1e-3), relative_error(1e-4)
    assert coarse < 5e-3
    assert fine < 0.2 * coarse
