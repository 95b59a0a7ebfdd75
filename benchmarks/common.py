"""Shared helpers of the influkit benchmarks: data, models, training, reference quantities, timing, output.

Every benchmark runs single-threaded (``setup()`` calls ``torch.set_num_threads(1)``) so that timings are
comparable on a shared 2-core machine; the number of threads is printed in the header of every run.
"""

from __future__ import annotations

import datetime
import importlib.util
import io
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn

import influkit as ik
from influkit.apps.datasets import load_digits_tensors
from influkit.apps.models import digits_classifier
from influkit.apps.objectives import cross_entropy, l2  # noqa: F401  (the one loss and regularizer; benchmarks import them from here)
from influkit.curvature import HessianOperator, gradient
from influkit.gradients import per_example_grads_serial
from influkit.training import fit_lbfgs, gradient_norm, newton_refine
from benchmarks.manifest import machine, record
from influkit.validation.reference import explicit_hessian  # the one explicit-Hessian truth (tests use it too)

RESULTS = Path(__file__).resolve().parent / "results"
EXPERIMENTS = Path(__file__).resolve().parent.parent / "studies"


# --------------------------------------------------------------------------------------------- environment
def setup(threads: int = 1) -> None:
    """Fix the number of torch CPU threads (intra- and inter-op) for the whole run."""
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # already set once in this process
        pass


def machine_info() -> str:
    """One line: date, CPU model, core count, python/torch versions and the torch thread count."""
    return (
        f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} | {machine()} | "
        f"python {platform.python_version()} | torch {torch.__version__} | torch threads {torch.get_num_threads()}"
    )


class Tee:
    """Print to stdout and keep a copy, written to ``benchmarks/results/<bench>/<name>.txt`` by :meth:`save`, which
    also records the run in that folder's MANIFEST.json (``benchmarks.manifest.record``)."""

    def __init__(self):
        self.buffer = io.StringIO()

    def __call__(self, *args) -> None:
        text = " ".join(str(a) for a in args)
        print(text, flush=True)
        self.buffer.write(text + "\n")

    def table(self, frame: pd.DataFrame, floatfmt: str = "{:.3g}") -> None:
        self(frame.to_string(index=False, float_format=lambda v: floatfmt.format(v)))

    def save(self, name: str, bench: str | None = None) -> Path:
        """Write ``results/<bench>/<name>.txt`` and record it; ``bench`` defaults to the running script's module name
        (``python -m benchmarks.bench_core`` → ``bench_core``)."""
        folder = RESULTS / (bench or Path(sys.modules["__main__"].__file__).stem)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.txt"
        path.write_text(self.buffer.getvalue())
        record(folder, [path.name])
        return path


def timed(fn: Callable, repeat: int = 1, warmup: int = 0):
    """(best wall-clock seconds over ``repeat`` calls after ``warmup`` untimed calls, the last result)."""
    result = None
    for _ in range(warmup):
        result = fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def study(name: str):
    """The study module ``studies/<name>.py``, executed from its file (studies/ is not a package) and
    registered as ``sys.modules[name]`` (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------- data, models
def digits(dtype: torch.dtype = torch.float64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 real scikit-learn digits, pixels scaled to [0, 1], in a seeded random order."""
    x, y = load_digits_tensors(dtype)
    order = torch.as_tensor(np.random.default_rng(seed).permutation(len(y)))
    return x[order], y[order]


def logreg(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    """Multinomial logistic regression on 8×8 digits: 64·10 + 10 = 650 parameters."""
    torch.manual_seed(seed)
    return nn.Linear(64, 10).to(dtype)


def tanh_mlp(seed: int = 0, dtype: torch.dtype = torch.float64, hidden: int = 32) -> nn.Module:
    """The 64→hidden→10 tanh MLP (hidden=32: 2,410 parameters)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10)).to(dtype)


def digits_cnn(channels: tuple[int, int] = (4, 8), seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    """The repo's digits CNN (``influkit.apps.models.digits_classifier``, 10 classes) on flat 64-pixel digits:
    channels (4, 8): 666 parameters, (16, 32): 6,090, (32, 64): 21,386."""
    torch.manual_seed(seed)
    return digits_classifier(10, channels).to(dtype)


def mnist_cnn(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The multi-stage paper's MNIST CNN (Table A): CONV 32 5×5 tanh, MAX-POOL 2×2, CONV 64 5×5 tanh,
    MAX-POOL 2×2, FC 10, on 1×28×28 inputs (28→24→12→8→4, so FC 1024→10; 62,346 parameters)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 32, 5), nn.Tanh(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5), nn.Tanh(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 10),
    ).to(dtype)


# --------------------------------------------------------------------------------------------- recipes
def adam(stage: ik.Stage, steps: int, lr: float) -> None:
    """``steps`` full-batch Adam steps on the stage objective (``stage.objective``), in place: a model trained
    the way people train one, short of a minimum (``influkit.training.train_adam`` takes seeded mini-batches)."""
    live = dict(stage.model.named_parameters())
    params = {n: live[n] for n in stage.param_names}
    opt = torch.optim.Adam(params.values(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        stage.objective(params).backward()
        opt.step()


def bert_mlm_classifier_chain(config, sentences: dict, labelled: dict, *, steps: int, lr: float, regularizer,
                              mask_token_id: int = 4, special_token_ids=(0, 1, 2, 3, 4), seed: int = 0) -> ik.Chain:
    """The Case 1 chain masked LM → classifier (``shared="bert"``) of ``influkit.hf``, both stages Adam-trained.

    A float32 ``BertForMaskedLM(config)`` (after ``torch.manual_seed(0)``) is pretrained on ``sentences``
    (masked with ``seed``) by ``steps`` Adam steps; its encoder is copied into a ``BertForSequenceClassification``
    whose pooler and classifier are trained the same way on ``labelled`` (a batch with ``labels``).
    """
    from transformers import BertForMaskedLM, BertForSequenceClassification

    from influkit import hf

    torch.manual_seed(0)
    pre_model = BertForMaskedLM(config).float().eval()
    pre = hf.masked_lm_stage(pre_model, sentences, mask_token_id=mask_token_id, special_token_ids=special_token_ids,
                             seed=seed, regularizer=regularizer)
    adam(pre, steps, lr)
    fin_model = BertForSequenceClassification(config).float().eval()
    fin_model.bert.load_state_dict(pre_model.bert.state_dict(), strict=False)  # the pretrained encoder
    fin = hf.classification_stage(fin_model, labelled, params=["bert.pooler", "classifier"], regularizer=regularizer)
    adam(fin, steps, lr)
    return ik.Chain([pre, fin], [ik.Link("bert", case=1)])


# --------------------------------------------------------------------------------------------- problems
PROBLEMS = {
    # name: (model factory, L2 weight). The MLP's small L2 makes the optimum isolated (H ≻ 0) yet ill-conditioned.
    "logreg": (logreg, 1e-2),
    "mlp": (tanh_mlp, 1e-4),
}


def newton_polish(stage: ik.Stage, steps: int = 4, target: float = 1e-12) -> float:
    """Newton steps θ ← θ − H⁻¹∇L with the dense Hessian (HessianOperator.dense) and an LU solve, until
    ‖∇L‖ ≤ target; returns ‖∇L‖. Same as influkit's newton_refine, but with LU instead of eigh (faster)."""
    named = dict(stage.model.named_parameters())
    norm = gradient_norm(stage)
    for _ in range(steps):
        if norm <= target:
            break
        op = HessianOperator(stage)
        g = op.space.flatten(gradient(stage, stage.param_names))
        step = torch.linalg.solve(op.dense(), g)
        with torch.no_grad():
            for name, delta in op.space.unflatten(step).items():
                named[name].sub_(delta)
        norm = gradient_norm(stage)
    return norm


def trained_stage(name: str, n_train: int = 1000, n_test: int = 100, hidden: int = 32, log=print):
    """(stage, test batch, ‖∇L‖) for problem ``name`` on the first ``n_train`` digits, trained to convergence.

    logreg: fit_lbfgs + newton_refine (convex; Newton from the L-BFGS point reaches machine precision).
    mlp: fit_lbfgs (L-BFGS with restarts) from a seeded init, then Newton steps on the dense Hessian, which the
    small L2 makes positive definite at the optimum; ‖∇L‖ is checked and reported.
    """
    factory, weight = PROBLEMS[name]
    x, y = digits()
    train, test = (x[:n_train], y[:n_train]), (x[n_train : n_train + n_test], y[n_train : n_train + n_test])
    model = (factory(hidden=hidden) if name == "mlp" else factory()).eval()
    stage = ik.Stage(model, cross_entropy, train, regularizer=l2(weight), batch_size=n_train)
    start = time.perf_counter()
    if name == "logreg":
        fit_lbfgs(stage, max_iter=500, tol=1e-10)
        norm = newton_refine(stage, steps=3)
    else:
        fit_lbfgs(stage, max_iter=1500, tol=1e-7, restarts=1)
        norm = newton_polish(stage, steps=5)
    log(
        f"[{name}] p={stage.num_trained}, n_train={n_train}, n_test={n_test}, L2={weight:g}: trained in "
        f"{time.perf_counter() - start:.1f}s, ‖∇L‖ = {norm:.1e}"
    )
    if norm > 1e-8:
        raise RuntimeError(f"{name}: not at an optimum (‖∇L‖ = {norm:.1e}); influence would be meaningless.")
    return stage, test, norm


def reference_removal(stage: ik.Stage, test) -> tuple[torch.Tensor, torch.Tensor]:
    """(removal effects (n,), dense H): Δ_i = ∇f(T)ᵀ H⁻¹ ∇ℓ(z_i) / n from the explicit Hessian, serial gradients
    and a float64 LU solve — the explicit-Hessian ground truth every method is compared against."""
    h = explicit_hessian(stage)
    x, y = stage.data.take(torch.arange(len(stage)))
    g_train = per_example_grads_serial(stage, x, y)
    g_test = per_example_grads_serial(stage, *test).sum(0)
    return g_train @ torch.linalg.solve(h, g_test) / len(stage), h


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """‖a − ref‖ / ‖ref‖ (float64)."""
    a, ref = a.detach().double().reshape(-1), ref.detach().double().reshape(-1)
    return float((a - ref).norm() / ref.norm())


def grad_norm(stage: ik.Stage) -> float:
    return gradient_norm(stage)


def banner(log, title: str, argv: list[str] | None = None) -> None:
    log(f"# {title}")
    log(f"# {machine_info()}")
    log(f"# command: python {' '.join(argv if argv is not None else sys.argv)}")
