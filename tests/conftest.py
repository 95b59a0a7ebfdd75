"""Small float64 problems with explicit-Hessian ground truth, shared by the tests."""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import influkit as ik
from influkit.training import fit_lbfgs, newton_refine
from influkit.validation.reference import explicit_hessian  # noqa: F401  (the tests' explicit-Hessian truth)

torch.set_default_dtype(torch.float64)

# what an optional dependency is installed by: tests needing one skip, saying so, where it is missing
INSTALLED_BY = {"sklearn": "influkit[apps]", "matplotlib": "influkit[plot]", "h5py": "influkit[elmo]",
                "scipy": "influkit[dev] (the tests' reference statistics)", "nbformat": "influkit[dev]",
                "nbclient": "influkit[dev]", "datasets": "influkit[dev]"}


def need(module: str):
    """The imported ``module``, or a skip of the calling test (module) naming what installs it."""
    top = module.split(".")[0]
    return pytest.importorskip(module, reason=f"{top} is not installed: pip install '{INSTALLED_BY[top]}'")


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-example cross-entropy, shape (B,): the tests' one loss."""
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


def l2(weight: float):
    """R(θ) = (weight/2)·‖θ‖² over the trained parameters (Hessian weight·I): the tests' one regularizer."""
    return lambda params: 0.5 * weight * sum((p**2).sum() for p in params.values())


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """The tests' models are tiny: intra-op threads only add overhead and contention on a 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def digits(n: int | None = None, seed: int = 0):
    """Real scikit-learn digits, scaled to [0, 1], float64; a seeded subset of n if given (skips without sklearn)."""
    data = need("sklearn.datasets").load_digits()
    x, y = torch.tensor(data.data / 16.0, dtype=torch.float64), torch.tensor(data.target, dtype=torch.long)
    if n is not None:
        idx = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:n]
        x, y = x[idx], y[idx]
    return x, y


def tanh_mlp(d_in: int = 8, hidden: int = 6, d_out: int = 3, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out)).double()


@pytest.fixture
def mlp_stage():
    """A tanh MLP on 40 generated points, 3 classes, light L2: a small indefinite-capable problem."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 8, generator=gen)
    y = torch.randint(0, 3, (40,), generator=gen)
    return ik.Stage(tanh_mlp(), cross_entropy, (x, y), regularizer=l2(1e-3), batch_size=16)


@pytest.fixture(scope="session")
def logreg_digits():
    """L2-regularized multinomial logistic regression on 300 real digits, trained to convergence."""
    x, y = digits()
    train_x, train_y, test_x, test_y = x[:300], y[:300], x[300:400], y[300:400]
    torch.manual_seed(0)
    model = nn.Linear(64, 10).double()
    stage = ik.Stage(model, cross_entropy, (train_x, train_y), regularizer=l2(1e-2))
    fit_lbfgs(stage, max_iter=1000)
    assert newton_refine(stage) < 1e-12
    return stage, (test_x, test_y)


def run_gloo_rank(rank: int, world: int, init_file: str, work, *, timeout_s: float = 60) -> None:
    """One spawned rank: float64, 1 thread, a gloo group from ``init_file`` around ``work()``, then destroyed. A rank
    whose work returned leaves by ``os._exit(0)``: the interpreter's teardown, where gloo's threads can abort the
    process ("terminate called without an active exception", SIGABRT) after the results were written, is skipped.
    A rank whose work raised exits through the exception, as ``torch.multiprocessing`` reports it."""
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        work()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_a_rank_that_may_fail(rank: int, world: int, init_file: str, out: str, work) -> None:
    """One rank of a failing-rank test (:func:`run_gloo_rank`, a 15 s timeout): rank 1 raises InputError, the others
    run ``work()``; each rank writes what it saw (``finished`` or the exception) to out/rank<r>."""
    def record_what_this_rank_saw():
        try:
            if rank == 1:
                raise ik.InputError("rank 1 was given bad data")
            work()
            Path(out, f"rank{rank}").write_text("finished")
        except Exception as exc:
            Path(out, f"rank{rank}").write_text(f"{type(exc).__name__}: {exc}")
            raise

    run_gloo_rank(rank, world, init_file, record_what_this_rank_saw, timeout_s=15)


def assert_a_failing_rank_fails_the_others(worker, tmp_path) -> None:
    """Run ``worker(rank, 2, init_file, out)`` on 2 spawned ranks, rank 1 raising InputError: within 90 s both end,
    and rank 0 (which records what it saw in out/rank0) raised DistributedError naming another rank, not a hang."""
    procs = [mp.get_context("spawn").Process(target=worker, args=(r, 2, str(tmp_path / "init"), str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    start = time.time()
    for p in procs:
        p.join(timeout=90)
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, "a rank hung instead of failing"
    assert time.time() - start < 90
    assert (tmp_path / "rank1").read_text().startswith("InputError")
    seen = (tmp_path / "rank0").read_text()
    assert seen.startswith("DistributedError") and "another rank" in seen, seen
