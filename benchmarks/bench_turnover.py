"""Benchmark: turn-over dropout influence (forward passes only) vs Koh & Liang with CG, and mask memory.

Part 1 — time to score every training example against one test example on the same MLP
(64→256→TurnOverDropout(0.5)→10, trained with turn-over dropout on digits):
  turn-over: 2·N example-forward passes, no autograd;
  Koh & Liang: ``influkit.influence(Stage(model, loss, data), ..., solver="cg")`` over all parameters
  (CG on H² + λI with Hessian-vector products, then N per-example gradients).
Part 2 — memory of the masks as the number of training examples N grows (d = 256 units):
  stored masks (an N×d bool tensor), volatile masks (nothing persists), hash-based masks (K×d codebook),
  and the time to produce the masks of one batch of 64 examples.

Run: ``python -m benchmarks.bench_turnover`` (about a minute; ``--threads`` sets torch CPU threads).
"""

from __future__ import annotations

import argparse
import warnings

import numpy as np
import pandas as pd
import torch
from torch import nn

import influkit as ik
from benchmarks.common import RESULTS, cross_entropy as ce, timed
from benchmarks.manifest import saved_output
from influkit.apps.datasets import load_digits_tensors
from influkit.errors import ConvergenceWarning
from influkit.turnover import HashedMasks, TurnOverDropout, VolatileMasks, influence, train_turnover




def bench_influence(sizes: list[int]) -> pd.DataFrame:
    """Returns one row per training-set size N: seconds of turn-over and CG Koh & Liang, and their ratio."""
    x, y = load_digits_tensors(torch.float32)
    order = torch.as_tensor(np.random.default_rng(0).permutation(len(x)))
    x, y = x[order], y[order]
    test = (x[-1:], y[-1:])
    rows = []
    for n in sizes:
        data = (x[:n], y[:n])
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), TurnOverDropout(0.5), nn.Linear(256, 10))
        train_turnover(model, ce, data, epochs=10, progress=False)
        t_turn, _ = timed(lambda: influence(model, torch.arange(n), test, measure=ce, n_train=n, batch_size=2048,
                                            progress=False), repeat=3)
        stage = ik.Stage(model, ce, data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            t_kl, kl = timed(
                lambda: ik.influence(stage, torch.arange(n), test,
                                     solve=ik.SolveConfig(solver="cg", damping=1e-2, tol=1e-3, max_iter=100))
            )
        solve = kl.diagnostics["solves"][0]
        rows.append(
            {
                "N": n,
                "params": stage.num_trained,
                "turnover_s": t_turn,
                "koh_liang_cg_s": t_kl,
                "cg_iterations": solve.get("iterations"),
                "cg_residual": solve.get("residual"),
                "speedup": t_kl / t_turn,
            }
        )
    return pd.DataFrame(rows)


def bench_memory(sizes: list[int], d: int = 256, batch: int = 64, codebook: int = 1024) -> pd.DataFrame:
    """Returns one row per N: bytes held by stored / volatile / hashed masks, and ms to produce one batch."""
    volatile, hashed = VolatileMasks(seed=0), HashedMasks(seed=0, codebook_size=codebook, n_hashes=3)
    rows = []
    for n in sizes:
        ids = torch.randint(n, (batch,), generator=torch.Generator().manual_seed(n))
        stored = torch.empty(n, d, dtype=torch.bool).bernoulli_(0.5)  # what storing every mask costs
        t_stored, _ = timed(lambda: stored[ids], repeat=20)
        t_volatile, _ = timed(lambda: volatile.keep(ids, 0, d, 0.5), repeat=20)
        hashed.keep(ids, 0, d, 0.5)  # builds the codebook once
        t_hashed, _ = timed(lambda: hashed.keep(ids, 0, d, 0.5), repeat=20)
        rows.append(
            {
                "N": n,
                "stored_bytes": stored.numel() * stored.element_size(),
                "volatile_bytes": volatile.state_bytes(),
                "hashed_bytes": hashed.state_bytes(),
                "stored/hashed": stored.numel() * stored.element_size() / hashed.state_bytes(),
                "stored_ms": 1e3 * t_stored,
                "volatile_ms": 1e3 * t_volatile,
                "hashed_ms": 1e3 * t_hashed,
            }
        )
        del stored
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description="turn-over dropout benchmark")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pd.set_option("display.width", 160)
    with saved_output(RESULTS / "bench_turnover", "bench_turnover.txt"):
        print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)\n")
        print("influence of every training example on one test example (seconds; speedup = Koh&Liang / turn-over)")
        print(bench_influence([500, 1000, 1797]).to_string(index=False, float_format="%.4g"))
        print("\nmask memory (bytes held between batches) and time per batch of 64 masks (ms), d = 256")
        print(bench_memory([1_000, 10_000, 100_000, 1_000_000]).to_string(index=False, float_format="%.4g"))


if __name__ == "__main__":
    main()
