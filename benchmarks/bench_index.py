"""bench_index: "pretrain once, finetune many" — a gradient index of a pretraining corpus against influkit's own
contraction pass, for new finetunes (a Case 1 head, a LoRA adapter) and 100 test examples (issue 40).

Model: ``BertForMaskedLM`` from a config with random weights (cost, not fidelity; float32): ``--layers`` 2,
``--hidden`` 256, vocabulary 30,522 (bench_transformer's small BERT, 9.6 M parameters; ``--hidden 128`` gives
4.4 M; ``--model minilm`` takes all-MiniLM-L6-v2's shape: 6 layers, hidden 384), stage 1 the masked-LM loss
(token-summed cross-entropy, 15 % masked) over random token-id sequences of ``--length`` tokens, its trained
parameters the encoder layers. The chain's stage-1 solve is EK-FAC fitted on ``--fit-samples`` sequences
(λ = 0.1 × mean eigenvalue), fitted once by the first finetune's chain (``fit_s``); the second finetune's chain
takes it over (``Chain.reuse``), so its fit is its own stage's alone. Finetunes (each a new chain on the
same stage 1):

- ``head``: ``BertForSequenceClassification`` sharing the encoder (Case 1), its classifier trained (direct solve);
- ``lora``: the same classifier with peft LoRA adapters (r = 8 on query/value) trained (Case 1 ``hf.lora_link``,
  EK-FAC solve of the adapters);

each with the summed loss of ``--test`` test sequences, and the head also per test point (``--test`` columns).

The corpus: ``--sequences`` distinct sequences, repeated ``--tile`` times (``--sequences`` × ``--tile`` in all, the
indexed corpus). On a 2-core machine one pass of forward + backward over 200,000 sequences takes hours, so the
per-sequence passes are run on the distinct sequences only and scaled by ``--tile`` (labelled "scaled" in the
results): the index build (each ``--variants`` setting: ``random`` is ``IndexConfig(projection="random",
whiten=False)``, ``whitened`` the same whitened with the chain's EK-FAC and λ, ``default`` ``IndexConfig(damping=λ)``,
whatever the default is; the results write each one's settings), the contraction pass (``Query.scores`` on the
distinct sequences) and the peers' passes over the corpus (below). A repeated sequence's row is the distinct one's,
so the full index (every sequence) is assembled from the built rows — a shard per repetition, each with its data's
digest, the index a query sees is the real one on disk — and every query is run against the full corpus and its
full index: the checkpoint and data check over every sequence, s compressed to s̃, one matrix product over every
memory-mapped row. Each phase's peak resident memory (a sampler thread; ``*_peak_rss`` the process's, phases in
order: chain fits, contraction passes, index builds and queries, peers) and its working memory (``*_working_rss``:
that peak over the resident memory at the phase's start), bytes per example on disk. The ratio
"query speed-up" compares a new finetune's query through the index (solves + check + product) with the same
solves + the contraction pass over the full corpus (scaled).

Peers (``--peers``, in the same process after the index queries, on the same models and data;
:mod:`benchmarks.index_peers`): kronfluence's pairwise scores (EK-FAC factors fitted on ``--fit-samples`` of the
sequences; every query a pass over the corpus, scaled), TRAK's featurize (scaled) + finalize over every row + score,
Bergson's index build (scaled) + load of every row + query. Each is timed for a new finetune's query with its stored
state and from nothing, and the index query's speed-up over each is in the last table (``x_*``). They need the bench
venv (``bash scripts/bench-env.sh``); one that does not run is reported with its error.

    python -m benchmarks.bench_index --hidden 128 --sequences 1000 --tile 200 --fit-samples 64 --tag bert-200k
    python -m benchmarks.bench_index --quick                                                       # 100 × 10
    python -m benchmarks.bench_index --quick --peers                                               # no peers
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy.stats import spearmanr

from benchmarks.resident import Peak

RESULTS = Path(__file__).resolve().parent / "results" / "bench_index"
PEERS = ("kronfluence", "trak", "bergson")


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


def assemble(built: Path, full: Path, tile: int) -> None:
    """The index of the corpus repeated ``tile`` times from the index of one copy (one shard): the same projections,
    the manifest's shards one per repetition (their data's digest is the copy's), each shard's files the copy's."""
    manifest = json.loads((built / "manifest.json").read_text())
    (shard,) = manifest["shards"]
    n = shard["stop"] - shard["start"]
    manifest["shards"] = [dict(shard, start=j * n, stop=(j + 1) * n) for j in range(tile)]
    full.mkdir(parents=True)
    for path in built.iterdir():
        if path.name.startswith("shard-000000"):
            for j in range(tile):
                shutil.copy(path, full / path.name.replace("shard-000000", f"shard-{j:06d}"))
        elif path.name != "manifest.json" and path.is_file():
            shutil.copy(path, full / path.name)
    (full / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("bert", "minilm"), default="bert")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--sequences", type=int, default=1000, help="distinct sequences (the passes run on these)")
    parser.add_argument("--tile", type=int, default=1, help="the corpus: the distinct sequences repeated this often")
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--test", type=int, default=100)
    parser.add_argument("--fit-samples", type=int, default=256)
    parser.add_argument("--variants", nargs="+", default=["random", "whitened", "default"],
                        choices=("random", "whitened", "default"))
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS,
                        help="the peers timed beside (none: --peers with no name)")
    parser.add_argument("--kron-batch", type=int, default=16, help="kronfluence's per-device batch")
    parser.add_argument("--trak-dim", type=int, default=1024, help="TRAK's proj_dim")
    parser.add_argument("--trak-batch", type=int, default=50, help="sequences per TRAK featurize call")
    parser.add_argument("--bergson-dim", type=int, default=8, help="Bergson's projection_dim p (p × p per module)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="hidden 128, 100 sequences × 10, 20 test")
    parser.add_argument("--tag", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.sequences, args.tile, args.test, args.fit_samples = 128, 100, 10, 20, 64
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")

    import influkit as ik
    from influkit import hf
    from influkit.index import GradientIndex, IndexConfig

    from benchmarks.bench_transformer import classification_losses, token_summed_losses
    from benchmarks.manifest import record

    load_start = os.getloadavg()
    config, mlm, head, (x, y), test, finetune = models(args)
    n, total = args.sequences, args.sequences * args.tile
    distinct = ik.Stage(hf.HFModel(mlm), token_summed_losses, (x, y), params="bert.encoder")
    pre = ik.Stage(hf.HFModel(mlm), token_summed_losses, (x.repeat(args.tile, *[1] * (x.dim() - 1)), y.repeat(args.tile, *[1] * (y.dim() - 1))),
                   params="bert.encoder")
    head_stage = ik.Stage(hf.HFModel(head), classification_losses, finetune, params="classifier")
    lora = lora_classifier(config, mlm)
    lora_stage = ik.Stage(hf.HFModel(lora), classification_losses, finetune)
    out = {"model": args.model, "layers": args.layers, "hidden": args.hidden, "sequences": total, "distinct": n,
           "tile": args.tile, "length": args.length, "test": args.test,
           "parameters": sum(p.numel() for p in mlm.parameters()), "stage1_trained": pre.num_trained,
           "lora_trained": lora_stage.num_trained, "threads": args.threads, "load_start": load_start}
    say = print
    say(f"bench_index: {args.model}, {out['parameters']:,} parameters ({out['stage1_trained']:,} trained in stage 1), "
        f"{total:,} sequences ({n:,} distinct × {args.tile}) × {args.length} tokens, {args.test} test; load {load_start}")

    # the chains: stage 1's EK-FAC fitted once (on a sample), shared by every finetune's chain
    curvature = [ik.CurvatureConfig(hessian_samples=min(args.fit_samples, n)), ik.CurvatureConfig()]
    chains = {
        "head": ik.Chain([pre, head_stage], [ik.Link("bert.encoder", case=1)], curvature=curvature,
                         solve=[ik.SolveConfig(solver="ekfac"), ik.SolveConfig(solver="direct", damping=1e-3)]),
        "lora": ik.Chain([pre, lora_stage], [hf.lora_link(pre, lora_stage, case=1, shared="bert.encoder")],
                         curvature=curvature, solve=[ik.SolveConfig(solver="ekfac"), ik.SolveConfig(solver="ekfac")]),
    }
    fits = {}
    for name in chains:  # the head's chain fits stage 1; the LoRA finetune's takes it over (Chain.reuse)
        with Peak() as fit:
            if name != "head":
                chains[name].reuse(chains["head"])
            chains[name].fit()
        reused = bool(chains[name].reused)
        damping = 0.1 * chains[name].curvature(0).approximation("ekfac").mean_eigenvalue()
        chains[name] = chains[name].with_solve([ik.SolveConfig(solver="ekfac", damping=damping),
                                                chains[name].solve_configs[1]])
        fits[name] = {"fit_s": fit.seconds, "fit_peak_rss": fit.peak, "fit_working_rss": fit.working, "damping": damping,
                      "stage1_reused": reused}
        say(f"{name} chain fit ({'stage 1 reused from the head chain' if reused else 'stage-1 EK-FAC on ' + str(curvature[0].hessian_samples) + ' sequences'}): "
            f"{fit.seconds:.1f} s")
    out["fits"] = fits
    factored, damping = chains["head"].curvature(0).approximation("ekfac"), fits["head"]["damping"]
    settings = {"random": IndexConfig(projection="random", whiten=False),
                "whitened": IndexConfig(projection="random", whiten=True, damping=damping),
                "default": IndexConfig(damping=damping)}

    work = Path(tempfile.mkdtemp(prefix="bench-index-"))
    rows, builds = [], []
    try:
        queries, timed = {}, {}
        for name, per_test in (("head", False), ("lora", False), ("head", True)):
            label = f"{name}{' per-test' if per_test else ''}"
            with Peak() as solve:
                queries[label] = chains[name].query(test, per_test=per_test)
            with Peak() as contraction:  # the distinct sequences: scaled by the tile below
                exact = queries[label].scores(torch.arange(n))
            timed[label] = {"exact": exact.values.reshape(-1).numpy(), "solve_s": solve.seconds, "pass": contraction}
            say(f"{label}: solve {solve.seconds:.2f} s; contraction pass over {n:,} sequences {contraction.seconds:.1f} s")
        for variant in args.variants:
            config = dataclasses.replace(settings[variant], shard_size=n)
            with Peak() as build:
                GradientIndex.build(distinct, work / f"{variant}-built", config, factored=factored)
            assemble(work / f"{variant}-built", work / variant, args.tile)
            index = GradientIndex.open(work / variant)
            size = sum(p.stat().st_size for p in (work / variant).glob("shard-*"))
            out.setdefault("index_configs", {})[variant] = config.summary()
            builds.append({"variant": variant, "build_s_distinct": build.seconds, "build_s": build.seconds * args.tile,
                           "build_peak_rss": build.peak, "build_working_rss": build.working, "width": index.width,
                           "bytes_per_example_disk": size / total, "rows": index.n_rows,
                           "projection_bytes": (work / variant / "projections.safetensors").stat().st_size})
            say(f"{variant} index: build over {n:,} distinct sequences {build.seconds:.1f} s, D = {index.width}, "
                f"{size / total:.0f} bytes per example on disk, {index.n_rows:,} rows, peak RSS {build.peak / 1e9:.2f} GB")
            for label, query in queries.items():
                with Peak() as via_index:
                    approx = index.scores(query)
                first, t = approx.values[:n].reshape(-1).numpy(), timed[label]
                row = {"variant": variant, "query": label, "solve_s": t["solve_s"],
                       "index_check_s": approx.diagnostics["seconds"]["index_check"],
                       "index_directions_s": approx.diagnostics["seconds"]["index_directions"],
                       "index_product_s": approx.diagnostics["seconds"]["index_product"], "index_s": via_index.seconds,
                       "contraction_s_distinct": t["pass"].seconds,
                       "contraction_s": t["pass"].seconds * args.tile, "index_peak_rss": via_index.peak,
                       "index_working_rss": via_index.working, "contraction_peak_rss": t["pass"].peak,
                       "contraction_working_rss": t["pass"].working, "spearman": float(spearmanr(first, t["exact"]).statistic)}
                row["speedup_scoring"] = row["contraction_s"] / row["index_s"]
                row["speedup_query"] = (row["solve_s"] + row["contraction_s"]) / (row["solve_s"] + row["index_s"])
                rows.append(row)
                say(f"  {label}: index {row['index_s']:.2f} s (check {row['index_check_s']:.2f}, product "
                    f"{row['index_product_s']:.3f}) vs contraction {row['contraction_s']:.0f} s (scaled); solve "
                    f"{row['solve_s']:.1f} s; speed-up {row['speedup_query']:.0f}×; Spearman {row['spearman']:.3f}")
            shutil.rmtree(work / variant)
            shutil.rmtree(work / f"{variant}-built")
        peers = run_peers(args, (mlm, head, lora), (x, y), test, out, say)  # last: influkit's phases measured first
    finally:
        shutil.rmtree(work, ignore_errors=True)

    table, built = pd.DataFrame(rows), pd.DataFrame(builds)
    contraction_s = rows[0]["contraction_s"]
    built["build_over_contraction"] = built["build_s"] / contraction_s
    peer_table = peer_frame(peers, args.tile)
    versus = versus_frame(table, peer_table)
    out |= {"queries": rows, "builds": builds, "peers": peers, "peer_table": peer_table.to_dict("records"),
            "versus": versus.to_dict("records"), "load_end": os.getloadavg()}
    targets = {}
    for b in builds:
        q = {r["query"]: r for r in rows if r["variant"] == b["variant"]}
        targets[b["variant"]] = {
            "new finetune query >= 100x faster than solves + contraction pass (head, lora)":
                min(q["head"]["speedup_query"], q["lora"]["speedup_query"]) >= 100,
            "<= 4 KB per example (disk)": b["bytes_per_example_disk"] <= 4096,
            "build <= 1.3x one contraction pass": b["build_s"] <= 1.3 * contraction_s}
    out["targets"] = targets

    tag = args.tag or ("quick" if args.quick else args.model)
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = [f"# bench_index ({tag}) — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; shared 2-core machine, "
            f"load {load_start} → {out['load_end']}; {args.threads} torch thread(s)",
            f"{args.model}: {out['parameters']:,} parameters, stage 1 trains {out['stage1_trained']:,} (the encoder); "
            f"{total:,} sequences × {args.length} tokens ({n:,} distinct, repeated {args.tile}×); {args.test} test "
            f"sequences; LoRA adapters {out['lora_trained']:,}",
            f"SCALED: the build and the contraction pass ran on the {n:,} distinct sequences and are multiplied by "
            f"{args.tile} (build_s, contraction_s; the measured ones are *_distinct); the queries ran on all {total:,} "
            "rows of the index on disk (checkpoint and data check over every sequence, one matrix product)",
            f"chain fits (stage-1 EK-FAC on {min(args.fit_samples, n)} sequences; test-independent, apart from the "
            "queries): " + ", ".join(f"{k} {v['fit_s']:.1f} s" + (" (stage 1 reused: the new finetune's own fit)"
                                                               if v["stage1_reused"] else "") for k, v in fits.items()),
            "index settings: " + json.dumps(out.get("index_configs", {})),
            "", built.to_string(index=False, float_format=lambda v: f"{v:.4g}"), "",
            table.to_string(index=False, float_format=lambda v: f"{v:.4g}"), "",
            "PEERS (same process, same model and data; kronfluence, TRAK and Bergson take the corpus gradients in the "
            "masked-LM model and each finetune's test gradients through its head or LoRA adapters, with respect to the "
            "encoder's linear layers: benchmarks/index_peers.py). SCALED, as influkit's passes: kronfluence's "
            f"query_s (a pass over the corpus per query) and TRAK's and Bergson's build_s are measured on the {n:,} "
            f"distinct sequences (*_distinct) and multiplied by {args.tile}; TRAK's finalize and queries and Bergson's "
            f"load and queries ran on all {total:,} rows (the distinct rows copied to the repeats). new_finetune_s: "
            "what a new finetune's query costs with the peer's stored state (kronfluence: its factors; TRAK: the "
            "finalized features; Bergson: the loaded index); full_pass_s: from nothing (fit or build + finalize/load + "
            "query). What each computes: kronfluence the EK-FAC-preconditioned single-stage influence of the corpus on the "
            "test loss; TRAK the inner products with its features Φ(ΦᵀΦ)⁻¹; Bergson the plain inner products of "
            "projected gradients (no curvature, no check of checkpoint or data); influkit's index query the two-stage "
            "adjoint (the solves), the checkpoint and data check over every sequence, then the product." + "".join(f"\n{k} did not run: {v['error']}" for k, v in peers.items() if "error" in v),
            "", peer_table.to_string(index=False, float_format=lambda v: f"{v:.4g}") if len(peer_table) else "(none)",
            "", "NEW FINETUNE QUERY, same run: seconds (influkit index: solves + check + product over every row; "
            "contraction: solves + a pass, scaled; peers: new_finetune_s) and how many times the index query each is "
            "(x_*)", "", versus.to_string(index=False, float_format=lambda v: f"{v:.4g}"), "",
            "targets: " + json.dumps(targets)]
    (RESULTS / f"bench_index_{tag}.txt").write_text("\n".join(text) + "\n")
    (RESULTS / f"bench_index_{tag}.json").write_text(json.dumps(out, indent=1, default=float))
    plot(versus, out, RESULTS / f"bench_index_{tag}.png")
    record(RESULTS, [f"bench_index_{tag}.txt", f"bench_index_{tag}.json", f"bench_index_{tag}.png"],
           note="shared 2-core machine (four helpers); timings in one process, one after the other; builds, "
                "contraction passes and kronfluence's pairwise passes scaled from the distinct sequences")
    print("\n".join(text))


def plot(versus: pd.DataFrame, out: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    queries = list(dict.fromkeys(versus["query"]))
    first = versus[versus["variant"] == versus["variant"].iloc[0]].set_index("query")
    bars = [(f"influkit index, {v} (solves + check + product)", versus[versus["variant"] == v].set_index("query")["index_s"])
            for v in dict.fromkeys(versus["variant"])]
    bars.append(("influkit contraction (solves + a pass, scaled)", first["contraction_s"]))
    names = {"kronfluence": "kronfluence pairwise (scaled)", "trak": "TRAK score (stored features)",
             "bergson": "Bergson query (loaded index)"}
    bars += [(names[peer], first[f"{peer}_s"]) for peer in PEERS if f"{peer}_s" in first]
    fig, ax = plt.subplots(figsize=(7.5, 2.2 + 0.22 * len(queries) * len(bars)))
    y = np.arange(len(queries))
    height = 0.8 / len(bars)
    for j, (label, seconds) in enumerate(bars):
        ax.barh(y - 0.4 + (j + 0.5) * height, seconds.reindex(queries).to_numpy(), height, label=label)
    ax.set_yticks(y, queries, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("seconds for a new finetune's query (log)")
    ax.set_title(f"{out['model']}: {out['sequences']:,} sequences × {out['length']}, {out['test']} test; "
                 "one process, shared 2-core CPU", fontsize=8)
    ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_peers(args, finetunes, corpus, test, out: dict, say) -> dict:
    """Each of ``args.peers`` (:mod:`benchmarks.index_peers`) on :class:`CrossStage` of the masked-LM model, the
    head and the LoRA finetune, over the distinct sequences ``corpus``: {peer: its result, or {"error": why}}."""
    if not args.peers:
        return {}
    from benchmarks import index_peers

    mlm, head, lora = finetunes
    x, y = corpus
    cross = index_peers.CrossStage(mlm, head, lora)
    out["cross_stage_max_abs_diff"] = index_peers.check_cross_stage(cross, mlm, head, lora, test[0][:8])
    queries = {"head": ("head", test, False), "lora": ("lora", test, False), "head per-test": ("head", test, True)}
    fit = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:min(args.fit_samples, len(x))]
    runs = {
        "kronfluence": lambda: index_peers.kronfluence_peer(cross, corpus, fit, queries, batch=args.kron_batch),
        "trak": lambda: index_peers.trak_peer(cross, corpus, args.tile, queries, proj_dim=args.trak_dim,
                                              batch=args.trak_batch),
        "bergson": lambda: index_peers.bergson_peer(cross, corpus, args.tile, queries,
                                                    projection_dim=args.bergson_dim),
    }
    peers = {}
    for name in args.peers:
        peers[name] = index_peers.run_peer(name, runs[name], say)
        if "error" not in peers[name]:
            say(f"{name}: " + ", ".join(f"{k} {v:.2f} s" for k, v in peers[name].items() if k.endswith("_s")) + "; "
                + ", ".join(f"{label} {q['query_s']:.2f} s" for label, q in peers[name]["queries"].items())
                + " (on the distinct sequences where scaled)")
    return peers


def peer_frame(peers: dict, tile: int) -> pd.DataFrame:
    """One row per peer and query: its stored state's cost (SCALED where it passes over the corpus), its query, and
    what a new finetune costs it with that state (new_finetune_s) and from nothing (full_pass_s)."""
    rows = []
    for name, r in peers.items():
        if "error" in r:
            continue
        for label, q in r["queries"].items():
            row = {"peer": name, "query": label}
            if name == "kronfluence":  # no stored gradients: each query passes over the corpus
                row |= {"fit_s": r["fit_s"], "build_s_distinct": np.nan, "build_s": np.nan, "finalize_or_load_s": np.nan,
                        "query_s_distinct": q["query_s"], "query_s": q["query_s"] * tile, "bytes_per_example": 0.0}
                row["full_pass_s"] = r["fit_s"] + row["query_s"]
            else:
                ready = r["finalize_s"] if name == "trak" else r["load_s"]
                row |= {"fit_s": np.nan, "build_s_distinct": r["build_s"], "build_s": r["build_s"] * tile,
                        "finalize_or_load_s": ready, "query_s_distinct": np.nan, "query_s": q["query_s"],
                        "bytes_per_example": float(r["bytes_per_example"])}
                row["full_pass_s"] = row["build_s"] + ready + q["query_s"]
            row |= {"new_finetune_s": row["query_s"],
                    "build_or_fit_working_rss": r.get("build_working_rss", r.get("fit_working_rss")),
                    "query_peak_rss": q["peak_rss"], "query_working_rss": q["working_rss"], "finite": q["finite"]}
            rows.append(row)
    return pd.DataFrame(rows)


def versus_frame(table: pd.DataFrame, peer_table: pd.DataFrame) -> pd.DataFrame:
    """Per index variant and query: the seconds of a new finetune's query through the index, through the
    contraction pass and through each peer, and each over the index's (x_*: how many times slower)."""
    frame = pd.DataFrame({"variant": table["variant"], "query": table["query"],
                          "index_s": table["solve_s"] + table["index_s"], "of_which_solves_s": table["solve_s"],
                          "contraction_s": table["solve_s"] + table["contraction_s"]})
    frame["x_contraction"] = frame["contraction_s"] / frame["index_s"]
    for peer in PEERS:
        if len(peer_table) and peer in set(peer_table["peer"]):
            seconds = peer_table[peer_table["peer"] == peer].set_index("query")["new_finetune_s"]
            frame[f"{peer}_s"] = frame["query"].map(seconds)
            frame[f"x_{peer}"] = frame[f"{peer}_s"] / frame["index_s"]
    return frame


if __name__ == "__main__":
    main()
