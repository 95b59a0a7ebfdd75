"""bench_index: "pretrain once, finetune many" — a gradient index of a pretraining corpus against influkit's own
contraction pass, for new finetunes (a Case 1 head, a LoRA adapter) and 100 test examples (issue 40).

Model: ``BertForMaskedLM`` from a config with random weights (cost, not fidelity; float32): ``--layers`` 2,
``--hidden`` 256, vocabulary 30,522 (bench_transformer's small BERT, 9.6 M parameters; ``--model minilm`` takes
all-MiniLM-L6-v2's shape: 6 layers, hidden 384), stage 1 the masked-LM loss (token-summed cross-entropy, 15 %
masked) over ``--sequences`` random token-id sequences of ``--length`` tokens, its trained parameters the encoder
layers. The chain's stage-1 solve is EK-FAC fitted on ``--fit-samples`` sequences (λ = 0.1 × mean eigenvalue),
common to every query and timed once (``fit_s``). Finetunes (each a new chain on the same stage 1):

- ``head``: ``BertForSequenceClassification`` sharing the encoder (Case 1), its classifier trained (direct solve);
- ``lora``: the same classifier with peft LoRA adapters (r = 8 on query/value) trained (Case 1 ``hf.lora_link``,
  EK-FAC solve of the adapters);

each with the summed loss of ``--test`` test sequences, and the head also per test point (``--test`` columns).
Timed in the same run: the index build (every sequence, default settings: dim 1000, float32), bytes per example on
disk, each phase's peak resident memory (a sampler thread); per query the solves (``Chain.query``, common to both
paths), the index's scores (checkpoint and data check, s compressed to s̃, one matrix product) and the contraction pass
(``Query.scores``, every sequence), and the top-10 re-scored exactly (``GradientIndex.top``). The ratio "query
speed-up" compares a new finetune's query through the index (solves + check + product) with the same solves +
the contraction pass. Also the Spearman correlation of the index scores with the contraction scores (random
weights: a check of the compression, not the fidelity study, which is studies/fidelity_index.py).

Rates are per sequence; the extrapolation to ``--extrapolate`` sequences multiplies them (labelled as such).

    python -m benchmarks.bench_index --sequences 400 --fit-samples 64 --tag bert   # the committed run
    python -m benchmarks.bench_index --quick                              # 100 sequences
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy.stats import spearmanr

RESULTS = Path(__file__).resolve().parent / "results" / "bench_index"


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    """Context manager: the peak resident memory while it is open (a thread reading RSS every 10 ms)."""

    def __enter__(self):
        self.start = self.peak = rss_now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self.t0 = time.perf_counter()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_now())
            self._stop.wait(0.01)

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_now())


def models(args):
    import transformers

    from benchmarks.bench_transformer import classifier_model, lm_data, lm_model

    if args.model == "minilm":
        args.layers, args.hidden = 6, 384
    config = transformers.BertConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                     num_attention_heads=max(1, args.hidden // 64), intermediate_size=4 * args.hidden,
                                     vocab_size=30522, max_position_embeddings=512, num_labels=2)
    mlm = lm_model("bert", config)
    head = classifier_model("bert", config, mlm)
    x, y = lm_data("bert", args.sequences, args.length, 0, config.vocab_size)
    tx, _ = lm_data("bert", args.test, args.length, 2, config.vocab_size)
    fx, _ = lm_data("bert", 64, args.length, 3, config.vocab_size)
    return config, mlm, head, (x, y), (tx, torch.arange(args.test) % 2), (fx, torch.arange(64) % 2)


def lora_classifier(config, mlm):
    from peft import LoraConfig, get_peft_model

    from benchmarks.bench_transformer import classifier_model

    torch.manual_seed(2)
    model = classifier_model("bert", config, mlm)
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"], lora_dropout=0.0,
                                            modules_to_save=["classifier"]))
    with torch.no_grad():  # LoRA's B starts at 0: give it values, as after finetuning
        gen = torch.Generator().manual_seed(4)
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return peft.eval()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("bert", "minilm"), default="bert")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--sequences", type=int, default=1000)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--test", type=int, default=100)
    parser.add_argument("--fit-samples", type=int, default=256)
    parser.add_argument("--dim", type=int, default=None, help="numbers per example (default: IndexConfig's)")
    parser.add_argument("--extrapolate", type=int, default=200_000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="100 sequences, 20 test")
    parser.add_argument("--tag", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.sequences, args.test, args.fit_samples = 100, 20, 64
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")

    import influkit as ik
    from influkit import hf
    from influkit.index import GradientIndex, IndexConfig

    from benchmarks.bench_transformer import classification_losses, token_summed_losses
    from benchmarks.manifest import record

    load_start = os.getloadavg()
    config, mlm, head, corpus, test, finetune = models(args)
    pre = ik.Stage(hf.HFModel(mlm), token_summed_losses, corpus, params="bert.encoder")
    head_stage = ik.Stage(hf.HFModel(head), classification_losses, finetune, params="classifier")
    lora = lora_classifier(config, mlm)
    lora_stage = ik.Stage(hf.HFModel(lora), classification_losses, finetune)
    out = {"model": args.model, "layers": args.layers, "hidden": args.hidden, "sequences": args.sequences,
           "length": args.length, "test": args.test, "parameters": sum(p.numel() for p in mlm.parameters()),
           "stage1_trained": pre.num_trained, "lora_trained": lora_stage.num_trained, "threads": args.threads,
           "load_start": load_start}
    say = print
    say(f"bench_index: {args.model}, {out['parameters']:,} parameters ({out['stage1_trained']:,} trained in stage 1), "
        f"{args.sequences} × {args.length} tokens, {args.test} test; load {load_start}")

    # the chains: stage 1's EK-FAC fitted once (on a sample), shared by every finetune's chain
    curvature = [ik.CurvatureConfig(hessian_samples=min(args.fit_samples, args.sequences)), ik.CurvatureConfig()]
    chains = {
        "head": ik.Chain([pre, head_stage], [ik.Link("bert.encoder", case=1)], curvature=curvature,
                         solve=[ik.SolveConfig(solver="ekfac"), ik.SolveConfig(solver="direct", damping=1e-3)]),
        "lora": ik.Chain([pre, lora_stage], [hf.lora_link(pre, lora_stage, case=1, shared="bert.encoder")],
                         curvature=curvature, solve=[ik.SolveConfig(solver="ekfac"), ik.SolveConfig(solver="ekfac")]),
    }
    fits = {}
    for name in chains:  # each chain fits its own stage 1 (a chain's fit is its own); timed apart from the queries
        with Peak() as fit:
            chains[name].fit()
        damping = 0.1 * chains[name].curvature(0).approximation("ekfac").mean_eigenvalue()
        chains[name] = chains[name].with_solve([ik.SolveConfig(solver="ekfac", damping=damping),
                                                chains[name].solve_configs[1]])
        fits[name] = {"fit_s": fit.seconds, "fit_peak_rss": fit.peak, "damping": damping}
        say(f"{name} chain fit (stage-1 EK-FAC on {curvature[0].hessian_samples} sequences): {fit.seconds:.1f} s")
    out["fits"] = fits

    work = Path(tempfile.mkdtemp(prefix="bench-index-"))
    try:
        with Peak() as build:
            index = GradientIndex.build(pre, work / "index", IndexConfig() if args.dim is None else IndexConfig(dim=args.dim))
        size = sum(p.stat().st_size for p in (work / "index").glob("shard-*.npy"))
        out |= {"build_s": build.seconds, "build_peak_rss": build.peak, "build_rss_start": build.start,
                "width": index.width, "bytes_per_example_rows": index.bytes_per_example,
                "bytes_per_example_disk": size / args.sequences,
                "projection_bytes": (work / "index" / "projections.safetensors").stat().st_size}
        say(f"index build: {build.seconds:.1f} s ({args.sequences / build.seconds:.2f} sequences/s), D = {index.width}, "
            f"{size / args.sequences:.0f} bytes per example on disk, peak RSS {build.peak / 1e9:.2f} GB")

        rows = []
        for name, chain, per_test in (("head", chains["head"], False), ("lora", chains["lora"], False),
                                      ("head", chains["head"], True)):
            label = f"{name}{' per-test' if per_test else ''}"
            with Peak() as solve:
                query = chain.query(test, per_test=per_test)
            with Peak() as via_index:
                approx = index.scores(query)
            with Peak() as contraction:
                exact = query.scores()
            best = None
            if not per_test:
                with Peak() as top:
                    best = index.top(query, 10)
            a, e = approx.values.reshape(-1).numpy(), exact.values.reshape(-1).numpy()
            row = {"query": label, "solve_s": solve.seconds, "index_check_s": approx.diagnostics["seconds"]["index_check"],
                   "index_directions_s": approx.diagnostics["seconds"]["index_directions"],
                   "index_product_s": approx.diagnostics["seconds"]["index_product"], "index_s": via_index.seconds,
                   "index_checkpoint_s": approx.diagnostics["seconds"]["index_checkpoint"],
                   "index_data_s": approx.diagnostics["seconds"]["index_data"],
                   "contraction_s": contraction.seconds, "top10_rescored_s": top.seconds if best else None,
                   "index_peak_rss": via_index.peak, "contraction_peak_rss": contraction.peak,
                   "spearman": float(spearmanr(a, e).statistic),
                   "top10_exact_overlap": None if best is None else len(
                       set(best.index.tolist()) & set(exact.total.argsort(descending=True)[:10].tolist())) / 10}
            row["speedup_scoring"] = row["contraction_s"] / row["index_s"]
            row["speedup_query"] = (row["solve_s"] + row["contraction_s"]) / (row["solve_s"] + row["index_s"])
            rows.append(row)
            say(f"{label}: solve {row['solve_s']:.2f} s; index {row['index_s']:.3f} s (check {row['index_check_s']:.3f}, "
                f"product {row['index_product_s']:.4f}); contraction pass {row['contraction_s']:.1f} s; top-10 re-scored "
                f"{row['top10_rescored_s']} s; Spearman {row['spearman']:.3f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    n, big = args.sequences, args.extrapolate
    table = pd.DataFrame(rows)
    per_seq = {"build_s_per_sequence": out["build_s"] / n,
               "contraction_s_per_sequence": float(table["contraction_s"].iloc[0]) / n,
               "index_product_s_per_sequence": float(table["index_product_s"].iloc[0]) / n,
               "index_data_check_s_per_sequence": float(table["index_data_s"].iloc[0]) / n}
    head_row = rows[0]
    extrapolated = {  # linear in the number of sequences: measured per-sequence rates × big (labelled)
        "sequences": big,
        "build_s": per_seq["build_s_per_sequence"] * big,
        "contraction_s": per_seq["contraction_s_per_sequence"] * big,
        # the checkpoint's hash and s compressed to s̃ do not grow with the corpus; the data check and product do
        "index_s": head_row["index_checkpoint_s"] + head_row.get("index_directions_s", 0.0)
        + (per_seq["index_product_s_per_sequence"] + per_seq["index_data_check_s_per_sequence"]) * big,
        "index_product_only_s": per_seq["index_product_s_per_sequence"] * big,
        "solve_s": head_row["solve_s"],
        "disk_bytes": out["bytes_per_example_disk"] * big,
    }
    extrapolated["speedup_query"] = (extrapolated["solve_s"] + extrapolated["contraction_s"]) / (
        extrapolated["solve_s"] + extrapolated["index_s"])
    extrapolated["speedup_query_unchecked"] = (extrapolated["solve_s"] + extrapolated["contraction_s"]) / (
        extrapolated["solve_s"] + extrapolated["index_product_only_s"])
    out |= {"queries": rows, "rates": per_seq, "extrapolated": extrapolated, "load_end": os.getloadavg()}
    targets = {
        "query >= 100x faster than the contraction pass (measured, head summed)": head_row["speedup_query"] >= 100,
        "<= 4 KB per example (disk)": out["bytes_per_example_disk"] <= 4096,
        "build <= 1.3x one contraction pass (measured)": out["build_s"] <= 1.3 * head_row["contraction_s"],
        f"query >= 100x at {big:,} (extrapolated)": extrapolated["speedup_query"] >= 100,
    }
    out["targets"] = targets

    tag = args.tag or ("quick" if args.quick else args.model)
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = [f"# bench_index ({tag}) — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; shared 2-core machine, "
            f"load {load_start} → {out['load_end']}; {args.threads} torch thread(s)",
            f"{args.model}: {out['parameters']:,} parameters, stage 1 trains {out['stage1_trained']:,} (the encoder); "
            f"{n} sequences × {args.length} tokens; {args.test} test sequences; LoRA adapters {out['lora_trained']:,}",
            f"chain fits (stage-1 EK-FAC on {min(args.fit_samples, n)} sequences; test-independent, apart from the "
            "queries): " + ", ".join(f"{k} {v['fit_s']:.1f} s" for k, v in fits.items()),
            f"index build: {out['build_s']:.1f} s, D = {out['width']}, {out['bytes_per_example_disk']:.0f} bytes/example on "
            f"disk (+ {out['projection_bytes']:,} bytes of projections once), peak RSS {out['build_peak_rss'] / 1e9:.2f} GB",
            "", table.to_string(index=False, float_format=lambda v: f"{v:.4g}"), "",
            "per-sequence rates (measured): " + json.dumps({k: float(f"{v:.4g}") for k, v in per_seq.items()}),
            f"EXTRAPOLATED to {big:,} sequences (measured rates × {big:,}; not run): "
            + json.dumps({k: float(f"{v:.4g}") for k, v in extrapolated.items()}),
            "targets: " + json.dumps(targets)]
    (RESULTS / f"bench_index_{tag}.txt").write_text("\n".join(text) + "\n")
    (RESULTS / f"bench_index_{tag}.json").write_text(json.dumps(out, indent=1, default=float))
    plot(table, out, RESULTS / f"bench_index_{tag}.png")
    record(RESULTS, [f"bench_index_{tag}.txt", f"bench_index_{tag}.json", f"bench_index_{tag}.png"],
           note="shared 2-core machine (seven helpers); timings in one process, one after the other")
    print("\n".join(text))


def plot(table: pd.DataFrame, out: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels = list(table["query"])
    y = np.arange(len(labels))
    ax.barh(y - 0.2, table["solve_s"] + table["contraction_s"], 0.4, label="solves + contraction pass")
    ax.barh(y + 0.2, table["solve_s"] + table["index_s"], 0.4, label="solves + index (check + product)")
    ax.set_yticks(y, labels)
    ax.set_xscale("log")
    ax.set_xlabel("seconds (log)")
    ax.set_title(f"{out['model']}: {out['sequences']} sequences × {out['length']}; build {out['build_s']:.0f} s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
