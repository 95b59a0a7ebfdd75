"""Benchmark: per-example gradients of the unsupervised loss and hypergradients of the unlabeled weights.

Part 1 — per-example gradients of N unlabeled examples (pseudo-label loss) for an MLP
(256→512→128→10, a last layer of 1,290 parameters like WRN-28-2's 128×10+10) and a small CNN (digits 8×8: conv 16 → conv 32 → linear 10):
  closed form (last linear layer: features and δ_i = ∂ℓ_i/∂logits from one forward and one backward pass),
  vmap over the last layer and over all layers (``influkit.gradients.per_example_grads``), and the serial
  autograd loop over the last layer (``per_example_grads_serial``).
Part 2 — the hypergradient of one batch (|D'| = 64, |U'| = 256, |V'| = 64) for the MLP, by the paper's
last-layer exact inverse (features cached, explicit Hessian) and the baselines of its Table A1 over all
parameters: identity (Luketina et al.) and Neumann series with K = 20 terms (Lorraine et al.), plus
last-layer identity / Neumann.
Seconds are the best of a few repeats; peak memory is the high-water mark of CPU tensor allocations
recorded by the torch profiler (profile_memory=True) during one call. Ratios are measured in the same run.

Run: ``python -m benchmarks.bench_ssl`` (about a minute; ``--threads`` sets torch CPU threads).
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import influkit as ik
from benchmarks.common import RESULTS, cross_entropy as ce, timed
from benchmarks.manifest import saved_output
from influkit.gradients import per_example_grads, per_example_grads_serial
from influkit.ssl import PseudoLabel, hypergradient, last_layer_grads




def peak_memory_mb(fn) -> float:
    """Returns the peak of live CPU tensor memory (MB) allocated during ``fn()``, from the profiler's memory events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    live = peak = 0
    for event in events:
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak / 2**20


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 128), nn.ReLU(), nn.Linear(128, 10))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Flatten(),
        )
        self.fc = nn.Linear(32 * 64, 10)

    def forward(self, x):
        return self.fc(self.body(x))


def bench_per_example(n: int) -> pd.DataFrame:
    """Returns one row per (model, method): seconds, peak MB and speed-up of the closed form over the method."""
    torch.manual_seed(0)
    models = {
        "MLP 256-512-128-10": (mlp(), "4", torch.randn(n, 256)),
        "CNN conv16-conv32-fc10 (8x8)": (SmallCNN(), "fc", torch.rand(n, 64)),
    }
    rows = []
    loss = PseudoLabel()
    for label, (model, head, x) in models.items():
        model.eval()
        inputs, targets = loss.prepare(model, x)
        stage = ik.Stage(model, loss.on_outputs, (inputs, targets))
        last = stage.select(head)
        methods = {
            "closed form (last layer)": lambda: last_layer_grads(model, head, loss.on_outputs, inputs, targets),
            "vmap (last layer)": lambda: per_example_grads(stage, inputs, targets, last, chunk_size=n),
            "vmap (all layers)": lambda: per_example_grads(stage, inputs, targets, chunk_size=128),
            "serial loop (last layer)": lambda: per_example_grads_serial(stage, inputs, targets, last),
        }
        reference = methods["closed form (last layer)"]()
        assert torch.allclose(reference, methods["vmap (last layer)"](), atol=1e-5)
        for name, fn in methods.items():
            seconds, _ = timed(fn, repeat=1 if "serial" in name else 3)
            rows.append(dict(part="per-example grads", model=label, method=name, n=n, seconds=seconds,
                             peak_mb=peak_memory_mb(fn)))
    out = pd.DataFrame(rows)
    fast = out[out.method == "closed form (last layer)"].set_index("model").seconds
    out["closed_form_speedup"] = out.seconds.values / fast.loc[out.model].values
    return out


def bench_hypergradient(batch_u: int) -> pd.DataFrame:
    """Returns one row per hypergradient method: seconds, peak MB, parameters covered, ratio to last-layer exact."""
    torch.manual_seed(0)
    model = mlp().eval()
    gen = torch.Generator().manual_seed(1)
    labeled = (torch.randn(64, 256, generator=gen), torch.randint(0, 10, (64,), generator=gen))
    val = (torch.randn(64, 256, generator=gen), torch.randint(0, 10, (64,), generator=gen))
    unlabeled = torch.randn(batch_u, 256, generator=gen)
    weights = torch.ones(batch_u)
    args = (model, ce, PseudoLabel(), labeled, unlabeled, val, weights)
    methods = {
        "last layer, exact inverse (ours)": dict(params="4", solve=ik.SolveConfig(solver="direct", damping=1e-3)),
        "last layer, identity": dict(params="4", solve=ik.SolveConfig(solver="identity")),
        "last layer, Neumann K=20": dict(params="4", solve=ik.SolveConfig(solver="neumann", max_iter=20)),
        "all layers, identity (Luketina)": dict(solve=ik.SolveConfig(solver="identity")),
        "all layers, Neumann K=20 (Lorraine)": dict(solve=ik.SolveConfig(solver="neumann", max_iter=20)),
    }
    n_all = sum(p.numel() for p in model.parameters())
    n_last = sum(p.numel() for p in model[4].parameters())
    rows = []
    for name, kw in methods.items():
        seconds, result = timed(lambda: hypergradient(*args, **kw), repeat=2)
        rows.append(dict(part="hypergradient", method=name, batch_u=batch_u,
                         params=n_last if "last" in name else n_all, seconds=seconds,
                         peak_mb=peak_memory_mb(lambda: hypergradient(*args, **kw)),
                         hessian_products=result.diagnostics["solves"][0]["products"]))
    out = pd.DataFrame(rows)
    out["ratio_to_ours"] = out.seconds / out.seconds.iloc[0]
    out["memory_ratio_to_ours"] = out.peak_mb / out.peak_mb.iloc[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--n", type=int, default=256, help="unlabeled examples per batch")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pd.set_option("display.width", 200)
    with saved_output(RESULTS / "bench_ssl", "bench_ssl.txt"):
        grads = bench_per_example(args.n)
        print(grads.drop(columns="part").to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        print()
        hyper = bench_hypergradient(args.n)
        print(hyper.drop(columns="part").to_string(index=False, float_format=lambda v: f"{v:.4g}"))


if __name__ == "__main__":
    main()
