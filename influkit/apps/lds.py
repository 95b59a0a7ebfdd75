"""The linear datamodeling score's re-training harness, baselines and plots (the metric: :mod:`influkit.validation.lds`).

:func:`run_lds` re-trains on M random subsets once per seed and stores each (subset, seed) output in its own
safetensors file the moment it is computed, so an interrupted run resumes where it stopped; :class:`ChainOutputs`
gives the test losses of an influkit :class:`~influkit.chain.Chain` re-trained on a subset (by the one
:class:`~influkit.validation.retrain.Retrainer`); :func:`gradient_dot` and :func:`score_methods`
give the scores to compare; :func:`plot_lds` draws one method's LDS.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm.auto import tqdm

from .. import files
from ..chain import Chain
from ..data import as_examples
from ..errors import InfluenceError, InputError, NumericalError
from ..extras import require
from ..gradients import per_example_grads, project_per_example_grads
from ..results import InfluenceResult
from ..solvers import SolveConfig
from ..stage import check_example_shape
from ..training import train_to_stationarity
from ..validation.lds import lds, lds_per_query, lds_table, predicted_outputs, random_subsets
from ..validation.retrain import Retrainer

if TYPE_CHECKING:
    import pandas as pd

SETUP_KIND = "lds-setup"
OUTPUT_KIND = "lds-output"

Retrain = Callable[[torch.Tensor, int], "torch.Tensor | np.ndarray | Sequence[float]"]


def plot_lds(scores, subsets, outputs, *, query: int | None = None, title: str = "", bins: int = 20):
    """A figure: the histogram of per-query LDS, and for one query the scatter of summed scores vs actual output.

    query: the query to scatter (default: the one with the median LDS). The scatter's title carries its Pearson r
    and Spearman ρ (= that query's LDS). Returns the matplotlib Figure.
    """
    plt = require("matplotlib.pyplot", "influkit.apps.lds plots")

    predicted = predicted_outputs(scores, subsets)
    per_query = lds_per_query(scores, subsets, outputs)
    actual = np.asarray(outputs.detach().cpu() if torch.is_tensor(outputs) else outputs, dtype=float).reshape(predicted.shape)
    m = predicted.shape[0]
    valid = per_query[np.isfinite(per_query)]
    if query is None:
        order = np.argsort(np.where(np.isfinite(per_query), per_query, np.inf))[: valid.size]
        query = int(order[valid.size // 2]) if valid.size else 0
    if not 0 <= query < predicted.shape[1]:
        raise InputError(f"query must be in 0..{predicted.shape[1] - 1}, got {query}.")
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.9))
    axes[0].hist(valid, bins=bins, color="tab:blue", alpha=0.8)
    axes[0].axvline(valid.mean(), color="k", ls="--", lw=1)
    axes[0].set_xlabel("per-query LDS (Spearman over subsets)")
    axes[0].set_ylabel("test queries")
    axes[0].set_title(f"{title}\nLDS = {valid.mean():.3f} (M = {m}, {valid.size} queries)".strip(), fontsize=9)
    p, a = predicted[:, query], actual[:, query]
    axes[1].scatter(p, a, s=16, alpha=0.8)
    r = float(np.corrcoef(p, a)[0, 1]) if p.std() > 0 and a.std() > 0 else float("nan")
    axes[1].set_xlabel(r"predicted: $\sum_{i\in S}$ score$_i$")
    axes[1].set_ylabel("test loss after re-training on S")
    axes[1].set_title(f"query {query}: Pearson r = {r:.3f}, Spearman ρ = {per_query[query]:.3f}", fontsize=9)
    fig.tight_layout()
    return fig


def _canonical(value) -> object:
    """A JSON round trip, so stored and requested setups compare equal exactly when their JSON does."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _digest(meta: dict) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class LDSRun:
    """The re-training outputs of an LDS run: subsets, seeds and one output vector per (subset, seed).

    subsets: (M, n) bool; seeds: the re-training seeds; outputs: (M, S, q) float64, NaN where not yet computed;
    seconds: (M, S) re-training times; setup: what the run was started with (compared on resume);
    info: {(subset, seed): what the re-training reported (``retrain.last_info``, e.g. final gradient norms)}.
    """

    subsets: torch.Tensor
    seeds: list[int]
    outputs: torch.Tensor
    seconds: torch.Tensor
    alpha: float
    subset_seed: int
    setup: dict = field(default_factory=dict)
    directory: Path | None = None
    info: dict = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """True when every (subset, seed) output is present."""
        return bool(torch.isfinite(self.outputs).all())

    @property
    def actual(self) -> torch.Tensor:
        """(M, q): the outputs averaged over seeds (the reference the scores are ranked against)."""
        if not self.complete:
            missing = int((~torch.isfinite(self.outputs).all(-1)).sum())
            raise InputError(f"{missing} (subset, seed) re-trainings are missing; run run_lds again to finish them.")
        return self.outputs.mean(1)

    def lds(self, scores) -> float:
        """:func:`lds` of ``scores`` (n, q) against this run's seed-averaged outputs."""
        return lds(scores, self.subsets, self.actual)

    def lds_per_query(self, scores) -> np.ndarray:
        """:func:`lds_per_query` of ``scores`` against this run's seed-averaged outputs."""
        return lds_per_query(scores, self.subsets, self.actual)

    def table(self, methods: Mapping[str, object]) -> "pd.DataFrame":
        """:func:`lds_table` of several methods on this run's subsets, with per-seed columns."""
        self.actual  # noqa: B018  (refuses an unfinished run with a clear message)
        table = lds_table(methods, self.subsets, self.outputs)
        table.attrs.update({"seeds": list(self.seeds), "alpha": self.alpha, "subset_seed": self.subset_seed,
                            "retrain_seconds": float(self.seconds.sum())})
        return table

    def plot(self, scores, *, query: int | None = None, title: str = ""):
        """:func:`plot_lds` of ``scores`` against this run's seed-averaged outputs."""
        return plot_lds(scores, self.subsets, self.actual, query=query, title=title)

    def to_frame(self) -> "pd.DataFrame":
        """Long format: one row per (subset, seed, query) with the output, for CSV export."""
        import pandas as pd

        m, s, q = self.outputs.shape
        j, k, t = np.meshgrid(np.arange(m), np.arange(s), np.arange(q), indexing="ij")
        return pd.DataFrame({
            "subset": j.reshape(-1), "seed": np.asarray(self.seeds)[k.reshape(-1)], "query": t.reshape(-1),
            "output": self.outputs.reshape(-1).numpy(),
        })


def _output_path(directory: Path, j: int, seed: int) -> Path:
    return directory / "outputs" / f"subset{j:05d}_seed{seed}.safetensors"


def run_lds(
    retrain: Retrain,
    n: int,
    directory: str | Path,
    *,
    n_subsets: int = 50,
    alpha: float = 0.5,
    seeds: Sequence[int] = (0, 1),
    subset_seed: int = 0,
    setup: Mapping | None = None,
    progress: bool = True,
) -> LDSRun:
    """Re-train on M random subsets once per seed, storing each output as it finishes; returns the :class:`LDSRun`.

    retrain(subset_indices, seed) -> (q,) test outputs (per-query test losses) of the model re-trained from
    scratch on the stage-1 examples ``subset_indices`` (a sorted 1-D long tensor) with ``seed``. The same seeds are
    used for every subset (paired re-trainings: the initialisations do not differ between subsets).
    n: the number of stage-1 examples; subsets are :func:`random_subsets` (n, n_subsets, alpha, subset_seed).
    directory: where ``setup.safetensors`` (subsets + settings) and ``outputs/subset*_seed*.safetensors`` (one
    per finished re-training) are written. Rerunning with the same settings skips the finished re-trainings (an
    interrupted run resumes); different settings are refused.
    setup: a JSON-able description of what is re-trained (model, data, trainer), stored and compared on resume;
    ``retrain.setup`` (as :class:`ChainOutputs` provides) is included automatically.
    """
    seeds = [int(s) for s in seeds]
    if not seeds or len(set(seeds)) != len(seeds):
        raise InputError(f"seeds must be distinct re-training seeds, at least one, got {seeds}.")
    subsets = random_subsets(n, n_subsets, alpha, subset_seed)
    described = dict(getattr(retrain, "setup", {}) or {}) | dict(setup or {})
    meta = _canonical({"n": int(n), "n_subsets": int(n_subsets), "alpha": float(alpha), "subset_seed": int(subset_seed),
                       "seeds": seeds, "setup": described})
    directory = Path(directory)
    (directory / "outputs").mkdir(parents=True, exist_ok=True)
    setup_path = directory / "setup.safetensors"
    if setup_path.exists():
        tensors, stored = files.read(setup_path, SETUP_KIND)
        if stored != meta or not torch.equal(tensors["subsets"].bool(), subsets):
            changed = sorted(k for k in set(stored) | set(meta) if stored.get(k) != meta.get(k)) or ["subsets"]
            raise InputError(
                f"{directory} holds an LDS run with a different setup ({', '.join(changed)} differ: stored "
                f"{ {k: stored.get(k) for k in changed} }); pass the same settings to resume it, or another directory "
                "to start a new run."
            )
    else:
        files.write(setup_path, SETUP_KIND, {"subsets": subsets.to(torch.uint8)}, meta)
    digest = _digest(meta)
    m = subsets.shape[0]
    results, seconds, infos = _stored_outputs(directory, m, seeds, digest)
    todo = [(j, k) for j in range(m) for k in range(len(seeds)) if (j, k) not in results]
    q = next(iter(results.values())).numel() if results else None
    for j, k in tqdm(todo, desc="LDS re-training", disable=not progress):
        indices = subsets[j].nonzero().reshape(-1)
        start = time.perf_counter()
        out = torch.as_tensor(retrain(indices, seeds[k]), dtype=torch.float64).detach().cpu().reshape(-1)
        took = time.perf_counter() - start
        if not torch.isfinite(out).all():
            raise NumericalError(
                f"retrain returned NaN/Inf for subset {j}, seed {seeds[k]}; make the re-training converge (more "
                "iterations, regularization) — nothing was stored for it, so a rerun retries it."
            )
        if q is not None and out.numel() != q:
            raise InputError(f"retrain returned {out.numel()} outputs for subset {j}, seed {seeds[k]}, but {q} before; "
                             "return one output per test query, always the same queries.")
        q = out.numel()
        extra = _canonical(getattr(retrain, "last_info", None) or {})
        files.write(_output_path(directory, j, seeds[k]), OUTPUT_KIND, {"outputs": out},
                    {"subset": j, "seed": seeds[k], "seconds": took, "setup": digest, "info": extra})
        results[(j, k)] = out
        seconds[j, k] = took
        infos[(j, seeds[k])] = extra
    return _assemble(results, seconds, subsets, meta, directory, infos)


def _assemble(results: dict, seconds: torch.Tensor, subsets: torch.Tensor, meta: dict, directory: Path, infos: dict) -> LDSRun:
    q = next(iter(results.values())).numel() if results else 0
    outputs = torch.full((*seconds.shape, q), float("nan"), dtype=torch.float64)
    for (j, k), out in results.items():
        outputs[j, k] = out
    return LDSRun(subsets, list(meta["seeds"]), outputs, seconds, meta["alpha"], meta["subset_seed"], meta["setup"],
                  directory, infos)


def _stored_outputs(directory: Path, m: int, seeds: list[int], digest: str):
    """({(subset, seed position): outputs}, (M, S) seconds, {(subset, seed): info}) of the finished re-trainings."""
    results: dict[tuple[int, int], torch.Tensor] = {}
    infos: dict[tuple[int, int], dict] = {}
    seconds = torch.zeros(m, len(seeds), dtype=torch.float64)
    for j in range(m):
        for k, seed in enumerate(seeds):
            path = _output_path(directory, j, seed)
            if not path.exists():
                continue
            tensors, info = files.read(path, OUTPUT_KIND)
            if info.get("setup") != digest:
                raise InputError(f"{path} belongs to another LDS run (its setup differs); remove it or use another directory.")
            results[(j, k)] = tensors["outputs"]
            seconds[j, k] = info["seconds"]
            infos[(j, seed)] = info.get("info", {})
    return results, seconds, infos


def load_lds(directory: str | Path) -> LDSRun:
    """The (possibly unfinished) :class:`LDSRun` stored in ``directory`` by :func:`run_lds`, read without re-training."""
    directory = Path(directory)
    tensors, meta = files.read(directory / "setup.safetensors", SETUP_KIND)
    subsets = tensors["subsets"].bool()
    seeds = list(meta["seeds"])
    results, seconds, infos = _stored_outputs(directory, subsets.shape[0], seeds, _digest(meta))
    return _assemble(results, seconds, subsets, meta, directory, infos)


class ChainOutputs:
    """outputs(subset, seed) -> (q,) per-query test losses of a :class:`~influkit.chain.Chain` re-trained on a subset
    of its stage-1 examples by a :class:`~influkit.validation.retrain.Retrainer` (the ``retrain`` of :func:`run_lds`).

    retrainer: default from scratch (``init="scratch"``: the seed selects the initialization and, for non-convex
    models, which optimum is reached), every stage by :func:`~influkit.training.train_to_stationarity`, stage 1
    re-fitted plainly on the subset (``keep_weights=False``). Each call's final gradient norms (one per stage) are
    appended to ``gradient_norms``; ``last_info`` holds the latest ones, which :func:`run_lds` stores beside each
    output; ``setup`` (the chain's fingerprint, the test set, the retrainer) is compared on resume.
    """

    def __init__(self, chain: Chain, x_test, retrainer: Retrainer | None = None):
        self.chain = chain
        last = chain.plans[-1].stage
        (tx, ty), _ = as_examples(x_test, last.data, "x_test")
        check_example_shape(last, tx, "x_test")
        self.x_test = (tx, ty)
        self.retrainer = retrainer or Retrainer(optimizer=train_to_stationarity, init="scratch", keep_weights=False)
        self.gradient_norms: list[list[float]] = []
        self.last_info: dict = {}
        test = hashlib.sha256(tx.detach().cpu().contiguous().numpy().tobytes() + ty.detach().cpu().numpy().tobytes())
        self.setup = {"chain": chain.fingerprint(), "n_test": int(tx.shape[0]), "test": test.hexdigest()[:16]} | \
            self.retrainer.setup

    def __call__(self, subset, seed: int) -> torch.Tensor:
        """(q,) test losses of the last stage after re-training on ``subset`` with ``seed``."""
        stages, norms = self.retrainer(self.chain, subset, seed)
        self.gradient_norms.append(norms)
        self.last_info = {"gradient_norms": norms}
        last = stages[-1]
        tx, ty = self.x_test
        with torch.no_grad():
            return last.losses(last.trained(), tx, ty).detach().double().cpu()


def gradient_dot(chain, x_test, z=None, *, chunk_size: int = 128) -> InfluenceResult:
    """Per-test gradient dot products (TracIn with one checkpoint), in influkit's sign: an (n, q) InfluenceResult.

        score(z, t) = −∇_S ℓ_1(z)ᵀ ∇_S f(t)

    with ∇ℓ_1(z) the gradient of the stage-1 loss of z and ∇f(t) the gradient of the last stage's test loss of t,
    both at the trained weights, over the parameters S they share: for one stage every trained parameter (then
    this equals ``SolveConfig(solver="identity")``); for a chain the stage-1 parameters carried to the last stage
    through every link (the shared block), each Hessian replaced by nothing and the cross terms dropped.
    Positive = harmful, like every influkit score.
    """
    plans = chain.plans
    if len(plans) == 1:
        pairs = [(n, n) for n in plans[0].trained]
    else:
        pairs = []
        for last_name in plans[-1].inherited:
            name = last_name
            for k in range(len(plans) - 1, 0, -1):
                name = plans[k].inherited.get(name)
                if name is None:
                    break
            if name is not None and name in plans[0].trained:
                pairs.append((last_name, name))
        if not pairs:
            raise InputError("no stage-1 parameter reaches the last stage through the links; nothing to dot.")
    last, first = plans[-1].stage, plans[0].stage
    (tx, ty), _ = as_examples(x_test, last.data, "x_test")
    check_example_shape(last, tx, "x_test")
    z = torch.arange(len(first)) if z is None else z
    (zx, zy), ids = as_examples(z, first.data, "z")
    check_example_shape(first, zx, "z")
    start = time.perf_counter()
    test_grads = per_example_grads(last, tx, ty, [a for a, _ in pairs], chunk_size=chunk_size)  # (q, p)
    values = -project_per_example_grads(first, zx, zy, test_grads.T, [b for _, b in pairs], chunk_size=chunk_size)
    return InfluenceResult(
        values=values, n_train=len(first), index=ids, method="gradient dot product",
        diagnostics={"seconds": {"gradients": time.perf_counter() - start},
                     "settings": {"shared": {a: b for a, b in pairs}, "per_test": True, "n_test": int(tx.shape[0])}},
    )


GRADIENT_DOT = "gradient dot"


def score_methods(chain, x_test, methods: Sequence[str], *, progress: bool = False) -> dict[str, object]:
    """{method: per-test InfluenceResult (n, q), or the reason it could not be computed} on the same chain and test set.

    A method is a solver name of :class:`~influkit.solvers.SolveConfig` (``"direct"``, ``"minres"``, ``"ekfac"``,
    ``"identity"``, ...; used for every stage) or ``"gradient dot"`` (:func:`gradient_dot`). A solver that this
    installation does not offer, or that fails on this chain, maps to a string saying why, so a comparison table
    can show it as missing instead of stopping.
    """
    out: dict[str, object] = {}
    for name in methods:
        start = time.perf_counter()
        try:
            if name == GRADIENT_DOT:
                result = gradient_dot(chain, x_test)
            else:
                variant = Chain(chain.stages, chain.links, solve=SolveConfig(solver=name))
                result = variant.query(x_test, per_test=True, progress=progress).scores()
        except (InfluenceError, NotImplementedError) as exc:
            out[name] = f"not available: {exc}"
            continue
        result.diagnostics["seconds"]["total"] = time.perf_counter() - start
        out[name] = result
    return out
