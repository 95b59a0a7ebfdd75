"""bench_scale: exact influence at about the cost of approximate influence, on a real CNN (issue 11).

Fashion-MNIST, a CNN pretrained on classes 0-4 (5,000 images at 14×14: Conv(1→16, 3) ReLU MaxPool,
Conv(16→32, 3) ReLU MaxPool, Linear(128→256) ReLU = the "embedding", head Linear(256→5); p = 39,109), trained
with Adam in float32 to a real, non-stationary, partly indefinite point. Job: the influence of every one of the
5,000 training images on the summed loss of 20 test images, damping λ (``--damping``, default 0.1) on the
mean-loss Hessian: I(z) = −∇ℓ(z)ᵀ (H + λI)⁻¹ ∇f(T). One table, every method end to end (fit, solve, score) in
float32 through ``ik.Chain``/``ik.SolveConfig``, against a float64 reference (the same job solved by plain MINRES
in float64 to a relative residual ≤ 1e-9 on a float64 copy of the model; kept in the temp directory keyed by
model, queries and λ, and reused by a later run on the identical model — the log says so), and kronfluence
1.0.1's EK-FAC on the same model, data, damping and sampled labels in the same run (``pip install
kronfluence==1.0.1``; its scores are −ours). Then ``ik.score`` Case 1 and Case 2 (finetuning on classes 5-9, the
embedding shared, ``solver="auto"``) on all 5,000 pretraining images.

At λ = 0.1 this model's H + λI is indefinite with a continuum of eigenvalues through 0 (H's smallest Ritz value
−0.42): the float64 reference does not converge in hundreds of iterations and the damped influence is ill-posed
(``results/bench_scale/bench_scale_damping0.1_diagnostics.txt``); the committed table is ``--damping 1.0``, where H + λI ≻ 0.
``--curvature gauss-newton`` runs the same table at the issue's λ = 0.1 on the generalized Gauss-Newton matrix
G (every solve, the reference — float64 CG — and the residuals): G + λI ≻ 0, so the exact damped influence is
well posed there, and G is the matrix EK-FAC (ours and kronfluence's) approximates.

Columns: seconds (wall clock, one torch thread), HVPs (Hessian-vector products, Lanczos and residual checks
included), residual ‖(H + λI)x − b‖/‖b‖ of each x measured with the float64 reference operator, and vs the
reference scores: relative error ‖I − I_ref‖/‖I_ref‖, Pearson, Spearman, and the overlap of the 50 most harmful
(largest I) images.

Data: Debian's ``dataset-fashion-mnist`` (``apt-get install -y dataset-fashion-mnist``; ``dpkg -L
dataset-fashion-mnist`` lists its IDX files under /usr/share/datasets/fashion-mnist), or a directory with
the four ``*-idx?-ubyte.gz`` files in ``$FASHION_MNIST``. Nothing is downloaded.

Run: ``python -m benchmarks.bench_scale --damping 1.0`` and ``--curvature gauss-newton`` (about 12 min each on 2
busy cores) or ``--quick`` (no Lanczos spectrum, no Case 2). kronfluence lives in the peers' environment
(``bash scripts/bench-env.sh``, then ``.bench-venv/bin/python -m benchmarks.bench_scale``), or by hand:
``python3 -m venv /work/kron-venv && /work/kron-venv/bin/pip install torch==2.13.0 && /work/kron-venv/bin/pip
install kronfluence==1.0.1 torchvision==0.28.0 pandas scipy scikit-learn safetensors tqdm h5py matplotlib &&
/work/kron-venv/bin/pip install --no-deps -e .`` then ``/work/kron-venv/bin/python -m benchmarks.bench_scale
--damping 1.0``; without kronfluence its row is skipped. (PyPI's torchvision 0.28.0 does not import beside the
CPU torch 2.13.0 file — ``operator torchvision::nms does not exist`` — but kronfluence 1.0.1 never imports it.)
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gzip
import hashlib
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy import stats
from torch import nn
from torch.utils.data import TensorDataset

import influkit as ik
from benchmarks.common import Tee
from influkit.curvature import HessianOperator

FASHION_DIRS = [os.environ.get("FASHION_MNIST", ""), "/usr/share/datasets/fashion-mnist"]
INSTALL_NOTE = (
    "Fashion-MNIST is not installed. On Debian/Ubuntu: `sudo apt-get install -y dataset-fashion-mnist` "
    "(`dpkg -L dataset-fashion-mnist` lists its IDX files), or point $FASHION_MNIST at a directory holding "
    "train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz."
)
DAMPING = 0.1
CURVATURE = "hessian"  # --curvature gauss-newton: every solve (and the reference) on the Gauss-Newton matrix
TOP = 50


# ------------------------------------------------------------------------------------------------ output
def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    return (f"{datetime.datetime.now():%Y-%m-%d %H:%M} | {cpu} | {os.cpu_count()} cores, load {load} | python "
            f"{platform.python_version()} | torch {torch.__version__} | torch threads {torch.get_num_threads()}")


# ------------------------------------------------------------------------------------------------ data, model
def fashion_dir() -> Path | None:
    for d in FASHION_DIRS:
        if d and (Path(d) / "train-images-idx3-ubyte.gz").exists():
            return Path(d)
    return None


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (LeCun's format: magic, dims as big-endian int32, then uint8 data)."""
    with gzip.open(path) as handle:
        raw = handle.read()
    ndim = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_split(root: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    prefix = "train" if split == "train" else "t10k"
    x = torch.tensor(read_idx(root / f"{prefix}-images-idx3-ubyte.gz"), dtype=torch.float32) / 255.0
    y = torch.tensor(read_idx(root / f"{prefix}-labels-idx1-ubyte.gz"), dtype=torch.long)
    return x, y


def pick(x, y, classes, per_class: int, seed: int, size: int = 14):
    """``per_class`` seeded images of each class, shuffled, 2×2-average-pooled to 14×14, labels re-indexed from 0."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for c in classes:
        idx = (y == c).nonzero().reshape(-1)
        rows.append(idx[torch.randperm(len(idx), generator=gen)[:per_class]])
    rows = torch.cat(rows)
    rows = rows[torch.randperm(len(rows), generator=gen)]
    images = x[rows][:, None]
    if size == 14:
        images = nn.functional.avg_pool2d(images, 2)
    return images.contiguous(), y[rows] - min(classes)


class Net(nn.Module):
    """embedding: Conv(1→16,3) ReLU MaxPool Conv(16→32,3) ReLU MaxPool Flatten Linear(128→256) ReLU; head: Linear(256→5)."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.embedding = nn.Sequential(
            nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(128, 256), nn.ReLU(),
        )
        self.head = nn.Linear(256, classes)

    def forward(self, x):
        return self.head(self.embedding(x))


def cross_entropy(outputs, targets):
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


def train(model, x, y, epochs: int, params=None, penalty=None, seed: int = 0, lr: float = 1e-3):
    """Adam on the mean cross-entropy (+ penalty), batches of 128, seeded; returns the model in eval mode."""
    torch.manual_seed(seed)
    opt = torch.optim.Adam(params if params is not None else model.parameters(), lr)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(x))
        for s in range(0, len(x), 128):
            b = order[s : s + 128]
            opt.zero_grad()
            loss = cross_entropy(model(x[b]), y[b]).mean()
            if penalty is not None:
                loss = loss + penalty()
            loss.backward()
            opt.step()
    return model.eval()


# ------------------------------------------------------------------------------------------------ metrics
def compare(values: torch.Tensor, ref: torch.Tensor) -> dict:
    v, r = values.detach().double().reshape(-1).cpu(), ref.detach().double().reshape(-1).cpu()
    top_v, top_r = set(v.argsort(descending=True)[:TOP].tolist()), set(r.argsort(descending=True)[:TOP].tolist())
    return {
        "rel. error": float((v - r).norm() / r.norm()),
        "Pearson": float(np.corrcoef(v.numpy(), r.numpy())[0, 1]),
        "Spearman": float(stats.spearmanr(v.numpy(), r.numpy())[0]),
        f"top-{TOP}": len(top_v & top_r) / TOP,
    }


class Reference:
    """The float64 copy of a stage, for the reference solve and for measuring every method's residual."""

    def __init__(self, stage: ik.Stage, test, log):
        model64 = copy.deepcopy(stage.model).double().eval()
        x, y = stage.data.take(torch.arange(len(stage)))
        self.stage = ik.Stage(model64, stage.loss, (x.double(), y), batch_size=len(stage))
        self.test = (test[0].double(), test[1])
        self.operator = HessianOperator(self.stage, curvature=CURVATURE)
        start = time.perf_counter()
        self.b = self.rhs()
        key = hashlib.sha256(b"".join(t.detach().double().numpy().tobytes() for t in model64.state_dict().values())
                             + self.b.numpy().tobytes() + repr((DAMPING, CURVATURE)).encode()).hexdigest()[:16]
        cache = Path(tempfile.gettempdir()) / f"influkit_bench_scale_reference_{key}.pt"
        if cache.exists():  # the same model (seeded training), data and queries as an earlier run of this script
            saved = torch.load(cache)
            self.s, self.values, sol = saved["s"], saved["values"], saved["solve"]
            log(f"reference: loaded from {cache} (computed by an earlier run on the identical model and queries: "
                f"{sol['iterations']} iterations, {sol['seconds']:.0f} s); relative residual re-measured here "
                f"{self.residual(self.s):.1e}")
            return
        method = "minres" if CURVATURE == "hessian" else "cg_spd"  # G + λI ≻ 0: conjugate gradients
        config = ik.SolveConfig(solver=method, damping=DAMPING, tol=1e-9, max_iter=3000)
        self.chain = ik.Chain([self.stage], solve=config, curvature=ik.CurvatureConfig(matrix=CURVATURE))
        query = self.chain.query(self.test, progress=True)  # progress bars on stderr
        self.s = query.s
        self.values = query.scores().values
        sol = query.solves[0]
        log(f"reference: float64 {method} on {CURVATURE}, {sol['iterations']} iterations, relative "
            f"residual {sol['residual']:.1e} (converged {sol['converged']}), {time.perf_counter() - start:.0f} s")
        if not sol["converged"]:
            raise RuntimeError("the float64 reference solve did not converge; raise max_iter.")
        torch.save({"s": self.s, "values": self.values, "solve": sol}, cache)

    def rhs(self) -> torch.Tensor:
        from influkit.gradients import total_grad

        return total_grad(self.stage, *self.test)

    def residual(self, s: torch.Tensor) -> float:
        x = s.detach().double().reshape(-1)
        r = self.operator.matvec(x) + DAMPING * x - self.b
        return float(r.norm() / self.b.norm())


# ------------------------------------------------------------------------------------------------ methods
def run_influkit(name: str, stage: ik.Stage, test, config: ik.SolveConfig, ref: Reference):
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ik.ConvergenceWarning)
        chain = ik.Chain([stage], solve=config, curvature=ik.CurvatureConfig(matrix=CURVATURE))
        query = chain.query(test)
        result = query.scores()
    seconds = time.perf_counter() - start
    sol = query.solves[0]
    fit_seconds = sum(a.info["seconds"]["total"] for a in chain.curvature(0).approximations.values()
                      if isinstance(a.info.get("seconds"), dict))
    row = {"method": name, "seconds": seconds, "HVPs": chain.operator(0).products,
           "residual": ref.residual(query.s), **compare(result.values, ref.values),
           "detail": f"{sol['iterations']} it, fit {fit_seconds:.1f}s, solve {sol['seconds']:.1f}s, "
                     f"scores {result.diagnostics['seconds']['example_gradients']:.1f}s"}
    return row, result.values


def sampled_labels(stage: ik.Stage) -> torch.Tensor:
    """The labels ŷ_i ~ softmax(f(x_i)) influkit's ``fisher="sampled"`` draws for example i (seed 0, the default):
    u_i = softmax(f_i) − onehot(ŷ_i), so ŷ_i = argmin u_i. Given to kronfluence so both fit the same Fisher sample."""
    from influkit.factored.fisher import PseudoGradients

    x, y = stage.data.take(torch.arange(len(stage)))
    with torch.no_grad():
        outputs = stage.model(x).double()
    u = PseudoGradients(stage.loss, "sampled", outputs, y, seed=0)(outputs, y, index=torch.arange(len(stage)))
    return u[0].argmin(-1)


def run_kronfluence(model, train_data, test_data, log):
    """kronfluence 1.0.1 EK-FAC (float32 covariances, float64 eigh, eigenvalue correction from per-example
    gradients, Λ and the gradient covariance per example: the mean-loss Fisher), absolute damping λ, the 20 query
    gradients aggregated into one: scores = ∇f(T)ᵀ (C + λI)⁻¹ ∇ℓ(z) = −I(z). Set the same way as influkit's
    ``solver="ekfac"`` (``fisher="sampled"``, seed 0): train_data holds (x, y, ŷ) with ŷ influkit's sampled labels
    (:func:`sampled_labels`), which kronfluence's task uses for its sampled-Fisher passes (covariances and
    eigenvalue correction) instead of drawing its own, so both fit the same Fisher sample and any difference in
    the scores is the implementation's."""
    try:
        import kronfluence
        from kronfluence.analyzer import Analyzer, prepare_model
        from kronfluence.arguments import FactorArguments, ScoreArguments
        from kronfluence.task import Task
    except ImportError:
        log("kronfluence is not installed here (pip install kronfluence==1.0.1 in a separate venv): row skipped.")
        return None, None

    class Classification(Task):
        def compute_train_loss(self, batch, model, sample=False):
            inputs, labels, sampled = batch
            return nn.functional.cross_entropy(model(inputs), sampled if sample else labels, reduction="sum")

        def compute_measurement(self, batch, model):
            inputs, labels = batch
            return nn.functional.cross_entropy(model(inputs), labels, reduction="sum")

    peer = copy.deepcopy(model).eval()
    task = Classification()
    start = time.perf_counter()
    peer = prepare_model(peer, task)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        analyzer = Analyzer("bench_scale", model=peer, task=task, cpu=True, disable_tqdm=True, output_dir=tmp)
        analyzer.fit_all_factors("ekfac", dataset=train_data, per_device_batch_size=1000,
                                 factor_args=FactorArguments(strategy="ekfac"), overwrite_output_dir=True)
        fit = time.perf_counter() - start
        analyzer.compute_pairwise_scores(
            "scores", "ekfac", query_dataset=test_data, train_dataset=train_data, per_device_query_batch_size=20,
            per_device_train_batch_size=1000, score_args=ScoreArguments(damping_factor=DAMPING,
                                                                        aggregate_query_gradients=True),
            overwrite_output_dir=True)
        scores = analyzer.load_pairwise_scores("scores")["all_modules"]
    seconds = time.perf_counter() - start
    values = -scores.reshape(-1).double()
    return {"seconds": seconds, "fit": fit, "version": kronfluence.__version__}, values


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> None:
    global DAMPING, CURVATURE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="no Lanczos spectrum, no Case 2")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--damping", type=float, default=0.1,
                        help="λ on both stages (default 0.1; see the README: at 0.1 H + λI of this model is indefinite)")
    parser.add_argument("--curvature", default="hessian", choices=("hessian", "gauss-newton"),
                        help="the matrix every solve (and the reference) inverts: the Hessian or the Gauss-Newton matrix")
    args = parser.parse_args(argv)
    DAMPING, CURVATURE = args.damping, args.curvature
    torch.set_num_threads(1)
    log = Tee()
    log("# bench_scale: exact influence at the cost of approximate influence (Fashion-MNIST CNN)")
    log(f"# {machine()}")
    log(f"# command: python {' '.join(sys.argv)}")
    root = fashion_dir()
    if root is None:
        log(INSTALL_NOTE)
        return
    x, y = load_split(root, "train")
    xt, yt = load_split(root, "test")
    pre_x, pre_y = pick(x, y, range(5), 1000, seed=0)
    fin_x, fin_y = pick(x, y, range(5, 10), 1000, seed=1)
    test_pre = pick(xt, yt, range(5), 4, seed=2)
    test_fin = pick(xt, yt, range(5, 10), 4, seed=3)

    torch.manual_seed(0)
    start = time.perf_counter()
    model = train(Net(), pre_x, pre_y, args.epochs)
    with torch.no_grad():
        accuracy = float((model(pre_x).argmax(1) == pre_y).float().mean())
    stage = ik.Stage(model, cross_entropy, (pre_x, pre_y), batch_size=len(pre_x))
    log(f"pretraining: {len(pre_x)} images of classes 0-4 at 14x14, p = {stage.num_trained:,}, Adam {args.epochs} "
        f"epochs ({time.perf_counter() - start:.0f} s), train accuracy {accuracy:.3f}; 20 test queries; λ = {DAMPING}")
    log("(stage batch = n: Hessian-vector products through one cached gradient graph)")

    ref = Reference(stage, test_pre, log)
    if not args.quick:
        from influkit.factored import lanczos

        theta, _, _ = lanczos(HessianOperator(stage, curvature=CURVATURE), 60, iterations=60)
        theta = theta.sort().values
        log(f"{CURVATURE}: extreme Ritz values (60 Lanczos steps on the float32 H): smallest "
            f"{', '.join(f'{float(t):.3g}' for t in theta[:3])}; largest {', '.join(f'{float(t):.3g}' for t in theta[-3:])}")

    solve = dict(damping=DAMPING)  # every solve on CurvatureConfig(matrix=CURVATURE), arnoldi with its default rank 50
    configs = [
        ("identity", ik.SolveConfig(solver="identity", **solve)),
        ("kfac (approximate inverse)", ik.SolveConfig(solver="kfac", **solve)),
        ("ekfac (approximate inverse)", ik.SolveConfig(solver="ekfac", **solve)),
        ("arnoldi rank 50", ik.SolveConfig(solver="arnoldi", **solve)),
        ("minres", ik.SolveConfig(solver="minres", **solve)),
        ("minres + ekfac", ik.SolveConfig(solver="minres", preconditioner="ekfac", **solve)),
        *([("cg_spd", ik.SolveConfig(solver="cg_spd", **solve)),
           ("cg_spd + ekfac", ik.SolveConfig(solver="cg_spd", preconditioner="ekfac", **solve))]
          if CURVATURE == "gauss-newton" else []),
        (f"cg on H² (λ² = {DAMPING**2:g}, cap 50 it)", ik.SolveConfig(solver="cg", damping=DAMPING**2, max_iter=50)),
        ("lissa (cap 100 it)", ik.SolveConfig(solver="lissa", max_iter=100, **solve)),
    ]
    rows, values = [], {}
    for name, config in configs:
        row, vals = run_influkit(name, stage, test_pre, config, ref)
        rows.append(row)
        values[name] = vals
        log(f"  {name}: {row['seconds']:.1f} s, {row['HVPs']} HVPs, rel. error {row['rel. error']:.2e} ({row['detail']})")
    peer, peer_values = run_kronfluence(model, TensorDataset(pre_x, pre_y, sampled_labels(stage)),
                                       TensorDataset(*test_pre), log)
    if peer is not None:
        rows.append({"method": f"kronfluence {peer['version']} ekfac", "seconds": peer["seconds"], "HVPs": 0,
                     "residual": float("nan"), **compare(peer_values, ref.values),
                     "detail": f"factors {peer['fit']:.1f}s, scores {peer['seconds'] - peer['fit']:.1f}s"})
    table = pd.DataFrame(rows)
    log("")
    log(f"## single stage: 5,000 pretraining images × 20 test queries (summed), λ = {DAMPING:g}, float32, vs float64 reference")
    log(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))

    # targets
    log("")
    log("## targets")
    by = {r["method"]: r for r in rows}
    plain, pre = by["minres"], by["minres + ekfac"]
    if peer is not None:
        agreement = float(np.corrcoef(values["ekfac (approximate inverse)"].double().numpy(), peer_values.numpy())[0, 1])
        ours = by["ekfac (approximate inverse)"]["seconds"]
        log(f"- influkit EK-FAC vs kronfluence EK-FAC scores: Pearson {agreement:.4f} (target ≥ 0.99: "
            f"{'met' if agreement >= 0.99 else 'MISSED'}); time {ours:.1f} s vs {peer['seconds']:.1f} s "
            f"(target ≤: {'met' if ours <= peer['seconds'] else 'MISSED'})")
        log(f"- EK-FAC-preconditioned MINRES: rel. error {pre['rel. error']:.1e} (target ≤ 1e-3: "
            f"{'met' if pre['rel. error'] <= 1e-3 else 'MISSED'}), {pre['seconds']:.1f} s = "
            f"{pre['seconds'] / peer['seconds']:.2f}× kronfluence (target ≤ 3×: "
            f"{'met' if pre['seconds'] <= 3 * peer['seconds'] else 'MISSED'})")
    log(f"- HVPs: preconditioned {pre['HVPs']} vs plain MINRES {plain['HVPs']} (rel. error {plain['rel. error']:.1e}): "
        f"{pre['HVPs'] / max(plain['HVPs'], 1):.2f}× (target ≤ 0.2: {'met' if pre['HVPs'] <= 0.2 * plain['HVPs'] else 'MISSED'})")

    # multi-stage
    log("")
    log(f"## ik.score on all 5,000 pretraining images, 20 finetuning test queries (classes 5-9), λ = {DAMPING:g} both stages")
    cases = [1] if args.quick else [1, 2]
    score_rows = []
    for case in cases:
        fin_model = Net()
        fin_model.embedding.load_state_dict(model.embedding.state_dict())
        if case == 1:
            train(fin_model, fin_x, fin_y, args.epochs, params=fin_model.head.parameters(), seed=1)
            fin = ik.Stage(fin_model, cross_entropy, (fin_x, fin_y), params="head", batch_size=len(fin_x))
        else:
            centre = {n: p.detach().clone() for n, p in fin_model.embedding.named_parameters()}
            penalty = lambda m=fin_model: 0.01 * sum(((p - centre[n]) ** 2).sum() for n, p in m.embedding.named_parameters())  # noqa: E731
            train(fin_model, fin_x, fin_y, max(args.epochs // 2, 1), penalty=penalty, seed=1)
            fin = ik.Stage(fin_model, cross_entropy, (fin_x, fin_y), batch_size=len(fin_x))
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            chain = ik.Chain([stage, fin], [ik.Link("embedding", case=case, alpha=0.01)],
                             solve=ik.SolveConfig(solver="auto", damping=DAMPING),
                             curvature=ik.CurvatureConfig(matrix=CURVATURE))  # = ik.score(...)
            result = chain.query(test_fin).scores(torch.arange(len(stage)))
        seconds = time.perf_counter() - start
        solves = result.diagnostics["solves"]
        score_rows.append({
            "case": case, "seconds": seconds,
            **{f"stage {s['stage']}": f"{s['solver']}{' + ' + s['preconditioner'].split(' ')[0] if s['preconditioner'] else ''}, "
                                      f"{s['iterations']} it, {s['products']} HVPs, residual {s['residual']:.1e}, {s['seconds']:.1f}s"
               for s in solves},
            "scores s": result.diagnostics["seconds"].get("example_gradients", float("nan")),
        })
        log(f"  case {case}: {seconds:.1f} s; " + "; ".join(f"{k}: {v}" for k, v in score_rows[-1].items() if k.startswith("stage")))
    log(pd.DataFrame(score_rows).to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    case1 = score_rows[0]["seconds"]
    log(f"- ik.score Case 1 on all 5,000 pretraining images: {case1:.1f} s (target ≤ 15 s: {'met' if case1 <= 15 else 'MISSED'})")
    path = log.save(("bench_scale_quick" if args.quick else "bench_scale") + ("" if DAMPING == 0.1 else f"_damping{DAMPING:g}")
                    + ("" if CURVATURE == "hessian" else "_gauss-newton"))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
