"""The linear datamodeling score (LDS, Park et al. 2023, "TRAK"): do summed scores rank re-trained models?

Draw M random subsets S_1..S_M of the (stage-1, pretraining) set, each holding a fraction α of its n examples;
re-train the model (every stage of a chain, stage 1 on S_j only) from scratch, once per seed; record each test
query's output. For query t the scores predict the output of the model trained on S as the **sum of the scores
of the examples in S**, and

    LDS(t) = Spearman_j( Σ_{i∈S_j} score_i(t),  output_t(S_j) ),     LDS = mean_t LDS(t).

Sign convention. influkit's scores are I(z_i, t) = d(test loss of t)/dε when the stage-1 objective gains ε·ℓ(z_i)
(positive = harmful), and the output is that same **test loss** (larger is worse). Training on S instead of
the full set re-weights example i from 1/n to w_i = 1/|S| (i ∈ S) or 0 (i ∉ S), so to first order

    loss_t(S) ≈ loss_t(full) + Σ_i (w_i − 1/n)·I_i = loss_t(full) − (1/n) Σ_{i∉S} I_i + (1/|S| − 1/n) Σ_{i∈S} I_i
             = const + (1/|S|) Σ_{i∈S} I_i,

and the "removal" form loss_t(full) + Σ_{i∉S} removal_i (removal_i = −I_i/n) equals const + (1/n) Σ_{i∈S} I_i.
With equal-size subsets both are increasing affine maps of Σ_{i∈S} I_i, so the ranks — and the LDS — are the
same, and exact influence gets a **positive** LDS. Scores of the opposite sign convention (positive = helpful,
as TRAK's τ on a margin) must be paired with outputs of that sign (e.g. minus the loss), or the LDS flips sign.

Per-query scores are ``chain.query(x_test, per_test=True).scores().values``, an (n, q) matrix.
The harness :func:`run_lds` stores each (subset, seed) output in its own safetensors file the moment it is
computed, so an interrupted run resumes where it stopped; :class:`ChainRetrain` re-trains an influkit
:class:`~influkit.chain.Chain` on a subset.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy import stats
from tqdm.auto import tqdm

from .. import files
from ..data import as_examples
from ..errors import InputError, NumericalError
from ..gradients import per_example_grads, project_per_example_grads
from ..results import InfluenceResult
from ..stage import Stage, check_example_shape
from ..training import fit_lbfgs, newton_fit
from .chain_loo import stage_objective

SETUP_KIND = "lds-setup"
OUTPUT_KIND = "lds-output"

Retrain = Callable[[torch.Tensor, int], "torch.Tensor | np.ndarray | Sequence[float]"]


# ----------------------------------------------------------------------------------------------- subsets


def random_subsets(n: int, n_subsets: int = 50, alpha: float = 0.5, seed: int = 0) -> torch.Tensor:
    """(M, n) bool masks: M seeded random subsets of n examples, each of exactly round(α·n) examples.

    The same (n, n_subsets, alpha, seed) always gives the same subsets (a CPU ``torch.Generator``).
    """
    if not 0 < alpha < 1:
        raise InputError(f"alpha is the fraction of examples kept in each subset and must be in (0, 1), got {alpha}.")
    if n < 2 or n_subsets < 3:
        raise InputError(f"need n ≥ 2 examples and at least 3 subsets to rank, got n = {n}, n_subsets = {n_subsets}.")
    size = int(round(alpha * n))
    if not 0 < size < n:
        raise InputError(f"alpha = {alpha} keeps {size} of {n} examples; choose alpha so that 0 < α·n < n.")
    gen = torch.Generator().manual_seed(int(seed))
    masks = torch.zeros(n_subsets, n, dtype=torch.bool)
    for j in range(n_subsets):
        masks[j, torch.randperm(n, generator=gen)[:size]] = True
    return masks


# ------------------------------------------------------------------------------------------------ metric


def _scores_matrix(scores, n: int) -> np.ndarray:
    """Scores as an (n, q) float64 array; an InfluenceResult is put in example order 0..n−1."""
    if isinstance(scores, InfluenceResult):
        values = scores.values.detach().cpu().double().numpy()
        index = scores.index.numpy()
        if sorted(index.tolist()) != list(range(n)):
            raise InputError(
                f"the InfluenceResult scores {len(index)} examples but the subsets are over n = {n}; score every "
                "stage-1 example (query.scores() with no z) before measuring the LDS."
            )
        values = values[np.argsort(index)]
    else:
        values = np.asarray(scores.detach().cpu() if torch.is_tensor(scores) else scores, dtype=float)
    if values.ndim == 1:
        values = values[:, None]
    if values.ndim != 2 or values.shape[0] != n:
        raise InputError(
            f"scores must be (n, q) = ({n}, q) — one row per stage-1 example, one column per test query "
            f"(query(..., per_test=True)) — got shape {values.shape}."
        )
    if not np.isfinite(values).all():
        raise InputError("scores hold NaN/Inf; check the solves' diagnostics before measuring the LDS.")
    return values


def _masks(subsets) -> np.ndarray:
    masks = np.asarray(subsets.detach().cpu() if torch.is_tensor(subsets) else subsets)
    if masks.ndim != 2 or masks.dtype != bool:
        raise InputError(f"subsets must be an (M, n) boolean mask (random_subsets), got {masks.dtype} {masks.shape}.")
    if masks.shape[0] < 3:
        raise InputError(f"need at least 3 subsets to rank, got {masks.shape[0]}.")
    return masks


def _outputs(outputs, m: int, q: int, name: str = "outputs") -> np.ndarray:
    out = np.asarray(outputs.detach().cpu() if torch.is_tensor(outputs) else outputs, dtype=float)
    if out.ndim == 1:
        out = out[:, None]
    if out.shape != (m, q):
        raise InputError(f"{name} must be (M, q) = ({m}, {q}): one row per subset, one column per query; got {out.shape}.")
    if not np.isfinite(out).all():
        raise InputError(f"{name} hold NaN/Inf (unfinished or failed re-trainings); finish the run first.")
    return out


def predicted_outputs(scores, subsets) -> np.ndarray:
    """(M, q): Σ_{i∈S_j} score_i(t), the (rank-equivalent) linear prediction of query t's output on subset j."""
    masks = _masks(subsets)
    return masks.astype(float) @ _scores_matrix(scores, masks.shape[1])


def _columnwise_spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman ρ between the matching columns of a and b (NaN where either column is constant)."""
    ra = stats.rankdata(a, axis=0)
    rb = stats.rankdata(b, axis=0)
    ra = ra - ra.mean(0)
    rb = rb - rb.mean(0)
    denom = np.sqrt((ra**2).sum(0) * (rb**2).sum(0))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denom > 0, (ra * rb).sum(0) / np.where(denom > 0, denom, 1.0), np.nan)


def lds_per_query(scores, subsets, outputs) -> np.ndarray:
    """(q,) LDS(t) = Spearman over subsets j of (Σ_{i∈S_j} score_i(t), outputs[j, t]) for each query t.

    scores: (n, q) (or (n,) for one query, or an InfluenceResult); subsets: (M, n) bool; outputs: (M, q), the
    re-trained models' test loss of each query (seed-averaged). A query whose outputs (or predictions) are the
    same on every subset has no ranking: its value is NaN.
    """
    masks = _masks(subsets)
    predicted = predicted_outputs(scores, masks)
    actual = _outputs(outputs, masks.shape[0], predicted.shape[1])
    return _columnwise_spearman(predicted, actual)


def _mean_over_queries(per_query: np.ndarray) -> float:
    valid = np.isfinite(per_query)
    if not valid.any():
        raise InputError("no query has outputs that vary across subsets: the LDS is undefined.")
    if not valid.all():
        warnings.warn(
            f"{int((~valid).sum())} of {per_query.size} queries have constant outputs or predictions across subsets "
            "and are left out of the LDS mean.",
            UserWarning,
            stacklevel=3,
        )
    return float(per_query[valid].mean())


def lds(scores, subsets, outputs) -> float:
    """The linear datamodeling score: the mean over queries of :func:`lds_per_query` (NaN queries left out, warned).

    1 means the summed scores rank the re-trained models' test losses perfectly for every query; 0 means no
    relation; scores of the wrong sign give a negative value (module docstring).
    """
    return _mean_over_queries(lds_per_query(scores, subsets, outputs))


def seed_agreement(outputs) -> float:
    """Mean over queries and seed pairs of Spearman_j(outputs[j, s, t], outputs[j, s', t]), for (M, S, q) outputs.

    How well one re-training seed ranks the subsets the way another does: when it is low, re-training noise
    (not the scores) limits the LDS of single-seed outputs.
    """
    out = np.asarray(outputs.detach().cpu() if torch.is_tensor(outputs) else outputs, dtype=float)
    if out.ndim != 3 or out.shape[1] < 2:
        raise InputError(f"seed_agreement needs (M, S, q) outputs with S ≥ 2 seeds, got shape {out.shape}.")
    values = [
        _columnwise_spearman(out[:, s], out[:, r]) for s in range(out.shape[1]) for r in range(s + 1, out.shape[1])
    ]
    return float(np.nanmean(np.stack(values)))


def lds_table(methods: Mapping[str, object], subsets, outputs) -> pd.DataFrame:
    """One row per method: LDS on the same subsets and outputs, its spread over queries, and per-seed values.

    methods: {name: (n, q) scores or per-test InfluenceResult}; outputs: (M, q), or (M, S, q) per seed, whose
    seed mean is the reference (as TRAK averages models trained on the same subset), with one extra column
    ``LDS seed s`` per seed. Columns: ``LDS``, ``sem`` (std over queries / √q), ``median``, ``queries``.
    ``attrs`` records M, n, α and, with several seeds, :func:`seed_agreement`.
    """
    masks = _masks(subsets)
    out = np.asarray(outputs.detach().cpu() if torch.is_tensor(outputs) else outputs, dtype=float)
    per_seed = out if out.ndim == 3 else None
    actual = out.mean(1) if per_seed is not None else out
    rows = {}
    for name, scores in methods.items():
        per_query = lds_per_query(scores, masks, actual)
        valid = per_query[np.isfinite(per_query)]
        row = {
            "LDS": _mean_over_queries(per_query),
            "sem": float(valid.std(ddof=1) / np.sqrt(valid.size)) if valid.size > 1 else float("nan"),
            "median": float(np.median(valid)),
            "queries": int(valid.size),
        }
        if per_seed is not None:
            for s in range(per_seed.shape[1]):
                row[f"LDS seed {s}"] = float(np.nanmean(lds_per_query(scores, masks, per_seed[:, s])))
        rows[name] = row
    table = pd.DataFrame(rows).T
    table["queries"] = table["queries"].astype(int)
    table.index.name = "method"
    table.attrs.update({"M": int(masks.shape[0]), "n": int(masks.shape[1]), "alpha": float(masks.mean())})
    if per_seed is not None and per_seed.shape[1] >= 2:
        table.attrs["seed_agreement"] = seed_agreement(per_seed)
    return table


def plot_lds(scores, subsets, outputs, *, query: int | None = None, title: str = "", bins: int = 20):
    """A figure: the histogram of per-query LDS, and for one query the scatter of summed scores vs actual output.

    query: the query to scatter (default: the one with the median LDS). The scatter's title carries its Pearson r
    and Spearman ρ (= that query's LDS). Returns the matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    masks = _masks(subsets)
    predicted = predicted_outputs(scores, masks)
    actual = _outputs(outputs, masks.shape[0], predicted.shape[1])
    per_query = _columnwise_spearman(predicted, actual)
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
    axes[0].set_title(f"{title}\nLDS = {valid.mean():.3f} (M = {masks.shape[0]}, {valid.size} queries)".strip(), fontsize=9)
    p, a = predicted[:, query], actual[:, query]
    axes[1].scatter(p, a, s=16, alpha=0.8)
    r = float(np.corrcoef(p, a)[0, 1]) if p.std() > 0 and a.std() > 0 else float("nan")
    axes[1].set_xlabel(r"predicted: $\sum_{i\in S}$ score$_i$")
    axes[1].set_ylabel("test loss after re-training on S")
    axes[1].set_title(f"query {query}: Pearson r = {r:.3f}, Spearman ρ = {per_query[query]:.3f}", fontsize=9)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------- harness


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

    def table(self, methods: Mapping[str, object]) -> pd.DataFrame:
        """:func:`lds_table` of several methods on this run's subsets, with per-seed columns."""
        self.actual  # noqa: B018  (refuses an unfinished run with a clear message)
        table = lds_table(methods, self.subsets, self.outputs)
        table.attrs.update({"seeds": list(self.seeds), "alpha": self.alpha, "subset_seed": self.subset_seed,
                            "retrain_seconds": float(self.seconds.sum())})
        return table

    def plot(self, scores, *, query: int | None = None, title: str = ""):
        """:func:`plot_lds` of ``scores`` against this run's seed-averaged outputs."""
        return plot_lds(scores, self.subsets, self.actual, query=query, title=title)

    def to_frame(self) -> pd.DataFrame:
        """Long format: one row per (subset, seed, query) with the output, for CSV export."""
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
    ``retrain.setup`` (as :class:`ChainRetrain` provides) is included automatically.
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


# ------------------------------------------------------------------------------------ chain re-training


def train_to_stationarity(stage: Stage, *, max_iter: int = 1000, tol: float = 1e-10) -> float:
    """Minimize the stage objective in place — full-batch L-BFGS, then Newton steps — and return ‖∇L‖ at the end.

    The digits experiment's recipe (a dense Newton factor: for stages of up to a few thousand parameters).
    """
    fit_lbfgs(stage, max_iter=max_iter, tol=10 * tol, restarts=0)
    return newton_fit(stage, tol=tol)


def _qualname(fn) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


class ChainRetrain:
    """retrain(subset, seed) -> (q,) per-query test losses of a :class:`~influkit.chain.Chain` re-trained on a subset.

    Every stage is re-trained in order on copies of its model (the chain's own models are not touched): stage 1 on
    the stage-1 examples ``subset`` only, each later stage on its full data. A Case 1 link copies the re-trained
    shared block in and keeps it fixed; a Case 2 link starts the block at the re-trained values and adds
    α‖S − S̄‖² around them — the objectives the chain's scores differentiate (same losses, regularizers, α).

    init: "scratch" re-initializes, under ``torch.manual_seed(seed)``, every module holding parameters the stage
    trains (other than the inherited block) with its ``reset_parameters()`` — so the seed selects the
    initialization and, for non-convex models, which optimum is reached; "warm" starts every stage from the
    chain's current weights (deterministic trainers then ignore the seed); or a callable ``init(model, seed)``.
    train: ``train(stage) -> ‖∇L‖`` minimizing a stage objective in place (default :func:`train_to_stationarity`).
    Each call's final gradient norms (one per stage) are appended to ``gradient_norms``; ``last_info`` holds the
    latest ones, which :func:`run_lds` stores beside each output.
    """

    def __init__(self, chain, x_test, *, train: Callable[[Stage], float] | None = None, init="scratch"):
        if not (init in ("scratch", "warm") or callable(init)):
            raise InputError(f"init must be 'scratch', 'warm' or a callable init(model, seed), got {init!r}.")
        self.chain = chain
        last = chain.plans[-1].stage
        (tx, ty), _ = as_examples(x_test, last.data, "x_test")
        check_example_shape(last, tx, "x_test")
        self.x_test = (tx, ty)
        self.train = train or train_to_stationarity
        self.init = init
        self.gradient_norms: list[list[float]] = []
        self.last_info: dict = {}
        test = hashlib.sha256(tx.detach().cpu().contiguous().numpy().tobytes() + ty.detach().cpu().numpy().tobytes())
        self.setup = {
            "chain": chain.fingerprint(), "n_test": int(tx.shape[0]), "test": test.hexdigest()[:16],
            "init": init if isinstance(init, str) else _qualname(init), "train": _qualname(self.train),
        }

    def __call__(self, subset, seed: int) -> torch.Tensor:
        """(q,) test losses of the last stage after :meth:`retrain` on ``subset`` with ``seed``."""
        last = self.retrain(subset, seed)[-1]
        tx, ty = self.x_test
        with torch.no_grad():
            return last.losses(last.trained(), tx, ty).detach().double().cpu()

    def retrain(self, subset, seed: int) -> list[Stage]:
        """The re-trained stage objectives, in chain order (their models are fresh copies; see the class docstring).

        Stage 1 minimizes (1/|S|) Σ_{i∈S} ℓ_1(z_i) + R_1 over the subset S; a stage behind a Case 2 link minimizes
        F_k + α‖S_k − S̄‖² with S̄ the re-trained previous stage's block.
        """
        subset = torch.as_tensor(subset, dtype=torch.long).reshape(-1)
        previous, norms, stages = None, [], []
        models = copy.deepcopy([stage.model for stage in self.chain.stages])  # modules shared by stages stay shared
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            for k, (plan, model) in enumerate(zip(self.chain.plans, models)):
                if self.init == "scratch":
                    _reset(model, [n for n in plan.trained if n not in plan.inherited])
                elif callable(self.init):
                    self.init(model, int(seed))
                if previous is not None:
                    before, own = dict(previous.named_parameters()), dict(model.named_parameters())
                    with torch.no_grad():
                        for name, earlier in plan.inherited.items():
                            own[name].copy_(before[earlier])
                base = plan.stage.with_(model=model, data=plan.stage.data.take(subset) if k == 0 else None)
                centre = None
                if plan.link is not None and plan.link.case == 2:
                    centre = {n: p.detach().clone() for n, p in model.named_parameters() if n in plan.inherited}
                stages.append(stage_objective(base, plan.trained, centre, plan.link.alpha if centre else 0.0))
                norms.append(float(self.train(stages[-1])))
                previous = model
        self.gradient_norms.append(norms)
        self.last_info = {"gradient_norms": norms}
        return stages


def _reset(model: torch.nn.Module, names: Sequence[str]) -> None:
    """Re-initialize the modules owning ``names`` by their reset_parameters(), restoring every other parameter."""
    fresh = set(names)
    keep = {n: p.detach().clone() for n, p in model.named_parameters() if n not in fresh}
    for prefix, module in model.named_modules():
        own = [f"{prefix}.{p}" if prefix else p for p, _ in module.named_parameters(recurse=False)]
        if not fresh.intersection(own):
            continue
        if not hasattr(module, "reset_parameters"):
            raise InputError(
                f"module {prefix or type(model).__name__!r} ({type(module).__name__}) holds trained parameters but has "
                "no reset_parameters(), so it cannot be re-initialized from scratch; pass init=callable(model, seed) "
                "or init='warm' to ChainRetrain."
            )
        module.reset_parameters()
    named = dict(model.named_parameters())
    with torch.no_grad():
        for n, value in keep.items():
            named[n].copy_(value)


# ------------------------------------------------------------------------------------------- baselines


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
    from ..chain import Chain
    from ..errors import InfluenceError
    from ..solvers import SolveConfig

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


@dataclass
class DigitsLDS:
    """An LDS comparison on the digits multi-stage setting: the run, the methods' scores and the table."""

    run: LDSRun
    scores: dict[str, object]
    table: pd.DataFrame
    chain: object
    x_test: tuple
    info: dict

    def write(self, out: str | Path, name: str, *, plot_method: str | None = None) -> list[Path]:
        """Write ``{name}_table.csv``, ``{name}_outputs.csv`` (long format), ``{name}_subsets.csv`` and
        ``{name}.png`` (the plot of ``plot_method``, default the first method that has scores) to ``out``."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / f"{name}_table.csv", out / f"{name}_outputs.csv", out / f"{name}_subsets.csv", out / f"{name}.png"]
        self.table.to_csv(paths[0])
        self.run.to_frame().to_csv(paths[1], index=False)
        pd.DataFrame(self.run.subsets.numpy().astype(int)).to_csv(paths[2], index_label="subset")
        ready = [k for k, v in self.scores.items() if isinstance(v, InfluenceResult)]
        method = plot_method or ready[0]
        import matplotlib.pyplot as plt

        fig = self.run.plot(self.scores[method], title=f"{name}: {method}")
        fig.savefig(paths[3], dpi=120)
        plt.close(fig)
        return paths


def digits_lds(
    case: int = 1,
    *,
    directory: str | Path,
    alpha: float = 0.01,
    n_pretrain: int = 200,
    n_finetune: int = 200,
    n_test: int = 100,
    channels: tuple[int, int] = (2, 4),
    split_seed: int = 0,
    n_subsets: int = 50,
    subset_fraction: float = 0.5,
    seeds: Sequence[int] = (0, 1),
    init: str = "scratch",
    methods: Sequence[str] = ("direct", "minres", "kfac", "ekfac", "arnoldi", "identity", GRADIENT_DOT),
    device: str = "cpu",
    reuse: DigitsLDS | None = None,
    progress: bool = True,
) -> DigitsLDS:
    """The LDS of several methods on the multi-stage digits setting (a CNN embedding pretrained on digits 0–3 and
    finetuned on 4–9; Case 1 or 2), shrunk so that one re-training of both stages takes seconds.

    The chain is trained to stationarity (float64 L-BFGS then Newton), scored per test digit by each method,
    and re-trained by :class:`ChainRetrain` (``init``) on ``n_subsets`` random subsets of a fraction
    ``subset_fraction`` of the pretraining digits, once per seed, resumably in ``directory`` (:func:`run_lds`).
    reuse: an earlier result of the same setting (e.g. the other ``init``) whose trained chain and scores are
    taken instead of training and scoring again (``methods`` is then ignored).
    """
    from ..apps.digits import DigitsSetup, train_stages  # the digits experiment (apps layer), imported on use
    from ..chain import Chain, Link
    from ..solvers import SolveConfig

    described = {"experiment": "digits", "case": case, "alpha": alpha, "n_pretrain": n_pretrain, "n_finetune": n_finetune,
                 "n_test": n_test, "channels": list(channels), "split_seed": split_seed}
    if reuse is not None:
        if reuse.info["setup"] != described:
            raise InputError(f"reuse holds the digits setting {reuse.info['setup']}, not {described}.")
        chain, x_test, scores = reuse.chain, reuse.x_test, reuse.scores
        train_seconds, score_seconds = reuse.table.attrs["train_seconds"], reuse.table.attrs["score_seconds"]
    else:
        setup = DigitsSetup(case=case, alpha=alpha, n_pretrain=n_pretrain, n_finetune=n_finetune, n_test=n_test,
                            channels=tuple(channels), seed=split_seed, device=device)
        split = setup.split()
        pre, fin = train_stages(setup, split)
        train_seconds = setup.timings.get("train")
        chain = Chain([pre, fin], [Link("embedding", case=case, alpha=alpha)], solve=SolveConfig(solver="direct"))
        x_test = (split.test[0].to(device), split.test[1].to(device))
        start = time.perf_counter()
        scores = score_methods(chain, x_test, methods, progress=False)
        score_seconds = time.perf_counter() - start
    retrain = ChainRetrain(chain, x_test, init=init)
    run = run_lds(retrain, len(chain.stages[0]), directory, n_subsets=n_subsets, alpha=subset_fraction, seeds=seeds,
                  setup=described, progress=progress)
    ready = {k: v for k, v in scores.items() if isinstance(v, InfluenceResult)}
    table = run.table(ready)
    table["score seconds"] = [ready[k].diagnostics["seconds"]["total"] for k in table.index]
    missing = {k: v for k, v in scores.items() if not isinstance(v, InfluenceResult)}
    table.attrs.update({"case": case, "init": init, "missing": missing, "train_seconds": train_seconds,
                        "score_seconds": score_seconds, "dims": chain.dims,
                        "max_retrain_grad_norm": max(max(i.get("gradient_norms", [float("nan")])) for i in run.info.values())})
    info = {"setup": described, "dims": chain.dims, "n_pretrain": len(chain.stages[0]), "n_finetune": len(chain.stages[1])}
    return DigitsLDS(run, scores, table, chain, x_test, info)
