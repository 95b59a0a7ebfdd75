"""The multi-stage paper's digits experiment as reusable steps: train both stages, score, validate by LOO or LDS.

Pretraining learns the CNN embedding W and a head U on some digit classes; finetuning learns a new head Θ on
the other classes (Case 1: W fixed; Case 2: W finetuned with the proximal term α‖W − W̄‖²). Both stages are
trained to a stationary point (full-batch L-BFGS in float64, L2-regularized) so that the influence function's
first-order conditions hold, which is what makes its predictions match leave-out retraining.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..chain import Chain, Link
from ..errors import InputError
from ..extras import require
from ..multistage import score
from ..results import InfluenceResult
from ..solvers import SolveConfig
from ..stage import Stage
from ..training import HessianFactor, fit_lbfgs, gradient_norm, newton_fit, train_to_stationarity
from ..links import StagePlan
from ..validation import Retrainer, leave_out_retrain, loo_corr
from .datasets import TwoTaskSplit, load_digits_tensors, two_task_split
from .demo_defaults import DEMO_SETTINGS
from .lds import GRADIENT_DOT, ChainOutputs, LDSRun, run_lds, score_methods
from .models import digits_classifier
from .objectives import cross_entropy, l2


@dataclass
class DigitsSetup:
    """Settings of the digits two-stage experiment (defaults: the paper's §4.1 adapted to 8×8 digits)."""

    case: int = 1
    alpha: float = 0.01
    pretrain_classes: tuple[int, ...] = (0, 1, 2, 3)
    finetune_classes: tuple[int, ...] = (4, 5, 6, 7, 8, 9)
    n_pretrain: int | None = None
    n_finetune: int | None = None
    n_test: int = 300
    channels: tuple[int, int] = (4, 8)
    weight_decay: float = 1e-2
    max_iter: int = 1000
    lbfgs_tol: float = 1e-9
    tol: float = 1e-10
    seed: int = 0
    device: str = "cpu"
    dtype: torch.dtype = torch.float64
    warmup: int = 0
    """L-BFGS iterations that start each leave-out retraining before its Newton steps (0: Newton only). They
    carry a large removal's retraining out of the region where the leave-out Hessian is indefinite, which
    otherwise costs a dense refactorization per removal; the end point is the same ‖∇‖ ≤ ``tol`` optimum."""
    timings: dict = field(default_factory=dict)
    factors: dict = field(default_factory=dict, repr=False, compare=False)
    """Hessian factors of both stage objectives near their optima by stage index, from training; ``retrainer()``
    hands them to the leave-out retraining as its Newton preconditioners instead of factorizing the same Hessians again."""

    @classmethod
    def demo(cls, full: bool = False, **overrides) -> "DigitsSetup":
        """The settings of ``influkit demo``: ``full=True`` is the paper-size run (all 720 pretraining digits 0–3,
        channels (4, 8), both stages and every leave-out run to ‖∇‖ ≤ 1e-10); the default is a smaller problem
        that finishes in about a minute on two busy CPU cores (240 pretraining digits, ‖∇‖ ≤ 1e-8: still a
        stationary point for the first-order conditions the influence function uses; each leave-out run starts
        with 100 L-BFGS iterations before its Newton steps — the same optimum, measured to agree with Newton
        alone to 1e-8 relative on the demo's 20 removals, without one dense refactorization per large removal).
        ``overrides`` (e.g. ``case``, ``n_pretrain``) replace individual settings; ``None`` values are ignored.
        """
        settings = {} if full else dict(DEMO_SETTINGS)
        settings.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**settings)

    def split(self) -> TwoTaskSplit:
        x, y = load_digits_tensors(self.dtype)
        return two_task_split(
            x, y, self.pretrain_classes, self.finetune_classes,
            n_pretrain=self.n_pretrain, n_finetune=self.n_finetune, n_test=self.n_test, seed=self.seed,
        )

    def link(self) -> Link:
        """The link of the finetuning stage: the embedding, Case 1 (fixed) or Case 2 (finetuned, proximal α)."""
        return Link("embedding", case=self.case, alpha=self.alpha)

    def retrainer(self) -> Retrainer:
        """Leave-out re-training from the original weights to the exact leave-out optimum (Newton, ‖∇‖ ≤ ``tol``),
        the pretraining objective re-fitted as the mean over the kept examples."""
        return Retrainer(optimizer="newton", tol=self.tol, max_steps=100, warmup=self.warmup, keep_weights=False,
                         factors=dict(self.factors))  # a preconditioner only: every run still goes to ‖∇‖ ≤ tol





def train_stages(setup: DigitsSetup, split: TwoTaskSplit) -> tuple[Stage, Stage]:
    """Pretrain W, U on the pretraining classes, then finetune (Case 1: Θ; Case 2: W and Θ), to stationarity."""
    start = time.perf_counter()
    setup.factors = {}  # a new dict: copies made with dataclasses.replace keep their own
    torch.manual_seed(setup.seed)
    device = torch.device(setup.device)
    to = lambda pair: (pair[0].to(device), pair[1].to(device))  # noqa: E731
    pre_model = digits_classifier(len(setup.pretrain_classes), setup.channels).to(device, setup.dtype)
    pre = Stage(pre_model, cross_entropy, to(split.pretrain), regularizer=l2(setup.weight_decay), batch_size=2048)
    fit_lbfgs(pre, max_iter=setup.max_iter, tol=setup.lbfgs_tol, restarts=0)
    setup.factors[0] = HessianFactor(pre)
    newton_fit(pre, factor=setup.factors[0], tol=setup.tol)
    fin_model = digits_classifier(len(setup.finetune_classes), setup.channels).to(device, setup.dtype)
    fin_model.embedding.load_state_dict(pre_model.embedding.state_dict())
    params = "head" if setup.case == 1 else None
    fin = Stage(fin_model, cross_entropy, to(split.finetune), params=params, regularizer=l2(setup.weight_decay), batch_size=2048)
    # the objective the link defines (Case 2 adds α‖W − W̄‖²); the returned stage stays F, as score() expects
    objective = StagePlan(fin, setup.link(), StagePlan(pre)).objective(fin, pre.state())
    fit_lbfgs(objective, max_iter=setup.max_iter, tol=setup.lbfgs_tol, restarts=0)
    setup.factors[1] = HessianFactor(objective)
    newton_fit(objective, factor=setup.factors[1], tol=setup.tol)
    setup.timings["train"] = time.perf_counter() - start
    return pre, fin


def accuracy(stage: Stage, data) -> float:
    """Fraction of ``data`` = (inputs, targets) the stage's model classifies correctly."""
    with torch.no_grad():
        return float((stage.model(data[0]).argmax(1) == data[1]).double().mean())


def choose_removals(result: InfluenceResult, n: int, seed: int = 0) -> list[int]:
    """Half the examples with the largest |score|, half drawn at random from the rest (DESIGN §5)."""
    order = torch.argsort(result.total.abs(), descending=True)
    top = order[: n // 2].tolist()
    rest = order[n // 2 :].numpy()
    rng = np.random.default_rng(seed)
    return top + rng.choice(rest, n - len(top), replace=False).tolist()


@dataclass
class ValidationRun:
    """Everything one validated experiment produced."""

    setup: DigitsSetup
    split: TwoTaskSplit
    pretrain: Stage
    finetune: Stage
    scores: InfluenceResult
    identity: InfluenceResult
    loo: pd.DataFrame
    summary: pd.DataFrame


def validate_digits(
    setup: DigitsSetup,
    *,
    n_removals: int = 40,
    solver: str = "direct",
    damping: tuple[float, float] = (0.0, 0.0),
    log=None,
    progress: bool = True,
    report: Callable[[str, float], None] | None = None,
) -> ValidationRun:
    """Train both stages, score every pretraining example, and compare with leave-out retraining.

    The same removals are scored by the identity-Hessian ablation. ``summary`` holds Pearson, Spearman,
    sign agreement and top-10% overlap of both against the actual changes, with timings.
    report: called as ``report(phase, seconds)`` when each phase ends ("train", "score" — both scorings —,
    "validate"), e.g. to print progress as it happens.
    """
    report = report or (lambda phase, seconds: None)
    split = setup.split()
    pre, fin = train_stages(setup, split)
    report("train", setup.timings["train"])
    test = (split.test[0].to(setup.device), split.test[1].to(setup.device))
    start = time.perf_counter()
    kw = dict(shared="embedding", case=setup.case, alpha=setup.alpha, progress=progress)
    configs = [SolveConfig(solver=solver, damping=d) for d in damping]
    scores = score(pre, fin, torch.arange(len(pre)), test, solve=configs, **kw)
    setup.timings["score"] = time.perf_counter() - start
    identity = score(pre, fin, torch.arange(len(pre)), test, solve=SolveConfig(solver="identity"), **kw)
    report("score", time.perf_counter() - start)
    removals = choose_removals(scores, n_removals, setup.seed)
    start = time.perf_counter()
    chain = Chain([pre, fin], [setup.link()])
    loo = leave_out_retrain(chain, removals, test, setup.retrainer(), predicted=scores, log=log, progress=progress)
    setup.timings["loo"] = time.perf_counter() - start
    report("validate", setup.timings["loo"])
    ident_removal = identity.removal.cpu().double()
    loo["identity"] = [float(ident_removal[i]) for i in removals]
    loo["score"] = [float(scores.values[i]) for i in removals]
    rows = {
        "multi-stage influence": loo_corr(loo["predicted"], loo["actual"]),
        "identity-Hessian ablation": loo_corr(loo["identity"], loo["actual"]),
    }
    summary = pd.DataFrame(rows).T
    summary["case"] = setup.case
    summary.attrs.update(
        {
            "pretrain_grad_norm": gradient_norm(pre),
            "finetune_test_accuracy": accuracy(fin, test),
            "timings": dict(setup.timings),
            "solves": scores.diagnostics["solves"],  # one per stage: 0 pretraining, 1 finetuning
        }
    )
    return ValidationRun(setup, split, pre, fin, scores, identity, loo, summary)


def write_validation(run: ValidationRun, out: Path, name: str) -> None:
    """Write a :class:`ValidationRun` to ``out``: ``{name}_loo.csv``, ``_scores.csv``, ``_summary.csv``, the scatter of
    predicted vs actual changes (and of the identity ablation), the gallery of the most harmful / helpful digits
    and ``_attrs.json``."""
    plt = require("matplotlib.pyplot", "influkit.apps.digits plots")

    from . import plotting

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    run.loo.to_csv(out / f"{name}_loo.csv", index=False)
    run.scores.to_frame().to_csv(out / f"{name}_scores.csv", index=False)
    run.summary.to_csv(out / f"{name}_summary.csv")
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 4.2))
    plotting.scatter_with_r(run.loo["predicted"], run.loo["actual"], ax=axes[0],
                            title=f"Case {run.setup.case}: multi-stage influence (digits)")
    plotting.scatter_with_r(run.loo["identity"], run.loo["actual"], ax=axes[1], own_scale=True,
                            title="identity-Hessian ablation (own x-scale)")
    plotting.caption(fig, "Right: the identity-Hessian predictions live on another scale than the actual changes, so "
                          "that panel has its own x-axis (no y = x line); compare correlations, not values.")
    plotting.save(fig, out / f"{name}_scatter.png")
    frame = run.scores.to_frame()
    harmful = frame.nlargest(8, "score")
    helpful = frame.nsmallest(8, "score")
    picks = list(harmful["example"]) + list(helpful["example"])
    images = run.split.pretrain[0][picks].cpu().numpy()
    labels = [run.setup.pretrain_classes[int(c)] for c in run.split.pretrain[1][picks]]
    captions = [f"#{i} ({lab})\n{s:+.2f}" for i, lab, s in zip(picks, labels, list(harmful["score"]) + list(helpful["score"]))]
    plotting.save(
        plotting.image_gallery(images, captions, title="top row: most harmful pretraining digits · bottom: most helpful"),
        out / f"{name}_gallery.png",
    )
    (out / f"{name}_attrs.json").write_text(json.dumps(run.summary.attrs, indent=1, default=str))
    shown = report_page(run, out / f"{name}_report.html")
    shown.save(out / f"{name}_result.safetensors")  # `influkit report` renders the page again from this file


def report_page(run: ValidationRun, path: Path) -> InfluenceResult:
    """Write the HTML report of a :class:`ValidationRun` (:mod:`influkit.report`): pretraining digits as thumbnails,
    the test digits as queries, the leave-out validation scatter. Returns the scores with what the page shows
    attached (:func:`influkit.report.attach`), which render the same page again once saved."""
    from ..report import attach, write_report

    images, classes = run.split.pretrain
    test_images, test_classes = run.split.test
    side = int(round(images[0].numel() ** 0.5))
    shown = attach(
        run.scores,
        examples=images.reshape(len(images), side, side),
        labels=[f"digit {run.setup.pretrain_classes[int(c)]}" for c in classes],
        queries=test_images.reshape(len(test_images), side, side),
        query_labels=[f"digit {run.setup.finetune_classes[int(c)]}" for c in test_classes],
        validation=run.loo,
        title=f"Case {run.setup.case} multi-stage influence on digits: pretraining digits "
              f"{', '.join(map(str, run.setup.pretrain_classes))} → finetuned {', '.join(map(str, run.setup.finetune_classes))}",
    )
    write_report(shown, path)
    return shown


# ------------------------------------------------------------------------------ the LDS of the digits setting


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
        plt = require("matplotlib.pyplot", "influkit.apps.digits plots")

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
    and re-trained (:class:`~influkit.validation.retrain.Retrainer`, ``init``) on ``n_subsets`` random subsets of a fraction
    ``subset_fraction`` of the pretraining digits, once per seed, resumably in ``directory`` (:func:`run_lds`).
    reuse: an earlier result of the same setting (e.g. the other ``init``) whose trained chain and scores are
    taken instead of training and scoring again (``methods`` is then ignored).
    """
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
        chain = Chain([pre, fin], [setup.link()], solve=SolveConfig(solver="direct"))
        x_test = (split.test[0].to(device), split.test[1].to(device))
        start = time.perf_counter()
        scores = score_methods(chain, x_test, methods, progress=False)
        score_seconds = time.perf_counter() - start
    retrain = ChainOutputs(chain, x_test, Retrainer(optimizer=train_to_stationarity, init=init, keep_weights=False))
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
