"""bench_bergson: influkit against EleutherAI's Bergson 2.5.1 (benchmarks/bergson_peer.py), on one CPU, each pair
timed in one process.

(i) MAGIC vs influkit's exact metagradient on one run. A tiny GPT-2 (byte tokens, vocabulary 256, ``--gpt-layers``
× ``--gpt-width``, untied embeddings, dropout 0, eager attention) trained ``--steps`` AdamW steps (lr 3e-3,
β = (0.9, 0.999), ε = 1e-8, weight decay 0.01) on batches of 8 drawn from 96 real vaderSentiment snippets (the
movie-review sentences of at least 32 bytes, their first 32 bytes; two seeded epochs), the same initial weights and
batches for every row. Loss of a step: the next-token cross-entropy averaged over the batch's tokens (each example's
tokens weighted by its w); measure: the next-token loss of 8 held-out snippets. Rows, each the fastest of
``--repeats`` rounds (the ratio: the median over rounds of seconds over the plain ``torch.optim.AdamW`` loop
timed in the same round):

- ``torch.optim``: the plain loop (the unit);
- ``influkit``: the same loop under ``ik.unrolled.Record.watch`` plus ``ik.unrolled.metagradients`` (summed test
  loss; divided by 8 to compare);
- ``bergson``: ``bergson_peer.magic_scores`` — Bergson's Trainer (torchopt AdamW, eps_root 1e-17; checkpoints
  ``sqrt``), its query gradient and its backward.

Agreement: Pearson and the largest difference relative to the largest score; and how far each library's final
weights are from the plain loop's.

(ii) Bergson's gradient index vs influkit's ``GradientIndex`` on a BertForMaskedLM with random weights (``--bert-layers``
× ``--bert-hidden``, vocabulary 30,522; bench_transformer's masked-LM data: ``--sequences`` random-token sequences of
32 tokens, 15 % masked, token-summed loss) and ``--queries`` test sequences: both index the per-example gradients of
the encoder's linear weights (no biases: what Bergson tracks), influkit's with ``IndexConfig(projection="random",
whiten=False)`` (raw gradients under random Kronecker projections, as Bergson's; int8 rows). Per row: build seconds, bytes per example on disk,
build peak RSS, query seconds (influkit: the test gradients, ``Chain.query``, plus ``GradientIndex.scores``, after
the test-independent ``Chain.fit``, timed apart;
Bergson: ``Attributor.trace`` — test gradients and dot products — and again through FAISS ``Flat`` inner product,
its index made on first load), and agreement with influkit's exact contraction scores of the same gradients
(``Query.scores`` under an identity solve: −∇ℓ_z·∇ℓ_q; Bergson's scores are +∇ℓ_z·∇ℓ_q and are negated to compare):
Pearson and Spearman over all (z, q) pairs, and the mean over test points of the top-10 overlap.

    python -m benchmarks.bench_bergson                # the committed run (bench venv)
    python -m benchmarks.bench_bergson --quick        # 2 repeats, 300 sequences

Writes benchmarks/results/bench_bergson/{magic.csv, magic.md, index.csv, index.md, bench_bergson.json,
bench_bergson.png} and MANIFEST.json.
"""

from __future__ import annotations

import argparse
import copy
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
from scipy.stats import pearsonr, spearmanr
from torch import nn

from benchmarks import bergson_peer
from benchmarks.resident import Peak

RESULTS = Path(__file__).resolve().parent / "results" / "bench_bergson"
LENGTH = 32
BATCH = 8
TRAIN, TEST = 96, 8
BIAS_NOTE = ("Why Bergson's run is not torch.optim's, even in float64: torchopt (its differentiable AdamW) computes "
             "the bias corrections 1 − β^t as pow(β, step count) with an int64 count, i.e. in float32 (1 − 0.999 "
             "comes out 1.3e-5 too small), so each update moves by about 6e-6 of itself: 2.0e-8 at lr 3e-3 on "
             "the first step in float64, measured; Adam's normalisation carries that into the later steps.")
ADAMW = {"lr": 3e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


# ------------------------------------------------------------------------------------------------ (i) MAGIC
def snippet_bytes() -> torch.Tensor:
    """(TRAIN + TEST, LENGTH) byte ids: the first LENGTH bytes of the movie-review snippets at least that long."""
    from influkit import hf

    rows = [list(s.text.encode("utf-8")[:LENGTH]) for s in hf.rated_snippets(("movie",))
            if len(s.text.encode("utf-8")) >= LENGTH]
    return torch.tensor(rows[:TRAIN + TEST])


def tiny_gpt2(layers: int, width: int):
    import transformers

    config = transformers.GPT2Config(vocab_size=256, n_positions=LENGTH, n_embd=width, n_layer=layers,
                                     n_head=max(1, width // 32), tie_word_embeddings=False, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.set_attn_implementation("eager")
    return model


class Logits(nn.Module):
    """The causal LM as a module from input ids to logits (what a Stage and the loop call)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, x):
        return self.lm(input_ids=x).logits


def next_token_losses(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B,) each example's next-token cross-entropy averaged over its LENGTH − 1 predictions."""
    return nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), y[:, 1:], reduction="none").mean(1)


def loader_of(x: torch.Tensor, batches: list[list[int]]):
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(x, x), batch_sampler=batches)


def plain_run(gpt, x, batches):
    model = Logits(copy.deepcopy(gpt))
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    with Peak() as run:
        for xb, yb in loader_of(x, batches):
            opt.zero_grad()
            next_token_losses(model(xb), yb).mean().backward()
            opt.step()
    return run, {n: p.detach().clone() for n, p in model.lm.named_parameters()}


def influkit_run(gpt, x, batches, test):
    import influkit as ik

    model = Logits(copy.deepcopy(gpt))
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    loader = loader_of(x, batches)
    record = ik.unrolled.Record()
    with Peak() as run:
        start = time.perf_counter()
        with record.watch(model, opt, loader, next_token_losses):
            for xb, yb in loader:
                opt.zero_grad()
                next_token_losses(model(xb), yb).mean().backward()
                opt.step()
        recorded = time.perf_counter() - start
        scores = ik.unrolled.metagradients(record, (test, test))[0].values
    return run, recorded, scores.detach() / len(test), {n: p.detach().clone() for n, p in model.lm.named_parameters()}


def agree(ours: torch.Tensor, theirs: torch.Tensor, ours_final: dict, theirs_final: dict, plain_final: dict) -> dict:
    """Pearson, Spearman and the largest difference over the largest score of the two score vectors; the largest
    difference of each library's final weights from the plain loop's."""
    a, b = ours.double().numpy(), theirs.double().numpy()
    return {"pearson": float(pearsonr(a, b).statistic), "spearman": float(spearmanr(a, b).statistic),
            "max_abs_diff_over_max_abs": float(np.abs(a - b).max() / np.abs(a).max()),
            "final_weights_max_abs_diff_vs_torch_optim": {
                "influkit": max(float((ours_final[n] - plain_final[n]).abs().max()) for n in plain_final),
                "bergson": max(float((theirs_final[n].to(plain_final[n].dtype) - plain_final[n]).abs().max())
                               for n in plain_final)}}


def bench_magic(args) -> tuple[pd.DataFrame, dict]:
    data = snippet_bytes()
    x, test = data[:TRAIN], data[TRAIN:]
    gen = torch.Generator().manual_seed(0)
    order = torch.cat([torch.randperm(TRAIN, generator=gen) for _ in range(-(-args.steps * BATCH // TRAIN))])
    batches = [order[t * BATCH:(t + 1) * BATCH].tolist() for t in range(args.steps)]
    gpt = tiny_gpt2(args.gpt_layers, args.gpt_width)
    params = sum(p.numel() for p in gpt.parameters())
    print(f"(i) tiny GPT-2: {params:,} parameters, {TRAIN} snippets × {LENGTH} bytes, {args.steps} AdamW steps of "
          f"{BATCH}; {TEST} test snippets")
    rounds = []
    for r in range(args.repeats):
        plain, plain_final = plain_run(gpt, x, batches)
        ours, recorded, ours_scores, ours_final = influkit_run(gpt, x, batches, test)
        theirs = bergson_peer.magic_scores(gpt, [x[b] for b in batches], test, example_ids=[torch.tensor(b) for b in batches],
                                           **ADAMW)
        rounds.append({"plain": plain.seconds, "influkit": ours.seconds, "influkit_record": recorded,
                       "bergson": theirs.seconds["total"], **{f"bergson_{k}": v for k, v in theirs.seconds.items()
                                                               if k != "total"},
                       "plain_rss": plain.peak, "influkit_rss": ours.peak, "bergson_rss": theirs.peak_rss})
        print(f"  round {r + 1}: plain {plain.seconds:.2f} s, influkit {ours.seconds:.2f} s "
              f"(record {recorded:.2f}), bergson {theirs.seconds['total']:.2f} s")
    best = {k: min(rd[k] for rd in rounds) for k in rounds[0]}
    agreement = agree(ours_scores, theirs.scores, ours_final, theirs.final_params, plain_final)
    # the same comparison in float64 (Bergson's eps_root 1e-30: only where v < 1e-28 does it differ from torch.optim)
    wide = copy.deepcopy(gpt).double()
    _, wide_plain = plain_run(wide, x, batches)
    _, _, wide_ours, wide_final = influkit_run(wide, x, batches, test)
    wide_theirs = bergson_peer.magic_scores(wide, [x[b] for b in batches], test,
                                            example_ids=[torch.tensor(b) for b in batches], eps_root=1e-30, **ADAMW)
    agreement_64 = agree(wide_ours, wide_theirs.scores, wide_final, wide_theirs.final_params, wide_plain)
    print(f"  agreement float32: {agreement}\n  agreement float64: {agreement_64}")
    a, b = ours_scores.double().numpy(), theirs.scores.double().numpy()
    def ratio(key):  # the median over rounds of the round's seconds over the same round's plain loop
        return float(np.median([rd[key] / rd["plain"] for rd in rounds]))

    table = pd.DataFrame([
        {"method": "torch.optim AdamW loop", "fastest_s": best["plain"], "median_ratio_to_plain": 1.0,
         "peak_rss_MB": best["plain_rss"] / 1e6, "pearson_vs_influkit": None},
        {"method": "influkit record + metagradient", "fastest_s": best["influkit"],
         "median_ratio_to_plain": ratio("influkit"), "peak_rss_MB": best["influkit_rss"] / 1e6,
         "pearson_vs_influkit": 1.0},
        {"method": "  of which recorded training", "fastest_s": best["influkit_record"],
         "median_ratio_to_plain": ratio("influkit_record"), "peak_rss_MB": None, "pearson_vs_influkit": None},
        {"method": "Bergson MAGIC (train + query + backward)", "fastest_s": best["bergson"],
         "median_ratio_to_plain": ratio("bergson"), "peak_rss_MB": best["bergson_rss"] / 1e6,
         "pearson_vs_influkit": agreement["pearson"]},
        {"method": "  of which Bergson training (checkpoints)", "fastest_s": best["bergson_train"],
         "median_ratio_to_plain": ratio("bergson_train"), "peak_rss_MB": None, "pearson_vs_influkit": None},
        {"method": "  of which Bergson backward", "fastest_s": best["bergson_backward"],
         "median_ratio_to_plain": ratio("bergson_backward"), "peak_rss_MB": None, "pearson_vs_influkit": None},
    ])
    out = {"parameters": params, "steps": args.steps, "batch": BATCH, "train": TRAIN, "test": TEST, "adamw": ADAMW,
           "rounds": rounds, "fastest": best, "agreement": agreement, "agreement_float64": agreement_64,
           "scores": {"influkit": a.tolist(), "bergson": b.tolist()}}
    return table, out


# ------------------------------------------------------------------------------------------------ (ii) index
def bench_index(args) -> tuple[pd.DataFrame, dict]:
    import transformers

    import influkit as ik
    from influkit import hf
    from influkit.index import GradientIndex, IndexConfig

    from benchmarks.bench_transformer import lm_data, lm_model, token_summed_losses, tracked_linears

    config = transformers.BertConfig(hidden_size=args.bert_hidden, num_hidden_layers=args.bert_layers,
                                     num_attention_heads=max(1, args.bert_hidden // 64),
                                     intermediate_size=4 * args.bert_hidden, vocab_size=30522,
                                     max_position_embeddings=512)
    mlm = lm_model("bert", config)
    x, labels = lm_data("bert", args.sequences, LENGTH, 0, config.vocab_size)
    tx, tlabels = lm_data("bert", args.queries, LENGTH, 2, config.vocab_size)
    weights = [f"{m}.weight" for m in tracked_linears(mlm)]
    stage = ik.Stage(hf.HFModel(mlm), token_summed_losses, (x, labels), params=weights)
    n, q = args.sequences, args.queries
    print(f"(ii) BERT: {sum(p.numel() for p in mlm.parameters()):,} parameters, {stage.num_trained:,} indexed "
          f"({len(weights)} linear weights); {n} sequences × {LENGTH}, {q} queries")
    # identity solve: nothing to fit but where the stage stands (Chain.fit's stationarity check, on 8 examples)
    chain = ik.Chain([stage], solve=ik.SolveConfig(solver="identity"), curvature=ik.CurvatureConfig(hessian_samples=8),
                     progress=False)
    with Peak() as fit:
        chain.fit()
    with Peak() as solve:
        query = chain.query((tx, tlabels), per_test=True)
    with Peak() as contraction:
        exact = query.scores().values.double().numpy()  # (n, q) = −∇ℓ_z·∇ℓ_q
    print(f"  chain fit {fit.seconds:.1f} s; exact contraction pass: {contraction.seconds:.1f} s (test gradients "
          f"{solve.seconds:.2f} s)")
    rows = [{"method": "influkit exact contraction", "numbers_per_example": None, "build_s": None,
             "bytes_per_example": None, "build_peak_rss_MB": None, "query_s": solve.seconds + contraction.seconds,
             "query_test_gradients_s": solve.seconds, "pearson": 1.0, "spearman": 1.0, "top10_overlap": 1.0}]

    def agreement(values: np.ndarray) -> dict:
        """values (n, q) as influkit's sign (−∇ℓ_z·∇ℓ_q) against the exact scores."""
        top = [len(set(np.argsort(-values[:, j])[:10]) & set(np.argsort(-exact[:, j])[:10])) / 10 for j in range(q)]
        return {"pearson": float(pearsonr(values.ravel(), exact.ravel()).statistic),
                "spearman": float(spearmanr(values.ravel(), exact.ravel()).statistic), "top10_overlap": float(np.mean(top))}

    work = Path(tempfile.mkdtemp(prefix="bench-bergson-"))
    try:
        for dim in args.influkit_dims:
            with Peak() as build:
                index = GradientIndex.build(stage, work / f"ik{dim}",
                                            IndexConfig(dim=dim, projection="random", whiten=False))
            size = sum(p.stat().st_size for p in (work / f"ik{dim}").glob("shard-*.npy"))
            with Peak() as query_time:
                again = chain.query((tx, tlabels), per_test=True)
                values = index.scores(again, check_data=False).values.double().numpy()
            rows.append({"method": f"influkit GradientIndex dim {dim}", "numbers_per_example": index.width,
                         "build_s": build.seconds, "bytes_per_example": size / n,
                         "build_peak_rss_MB": build.peak / 1e6, "query_s": query_time.seconds,
                         "query_test_gradients_s": None, **agreement(values)})
            print(f"  {rows[-1]['method']}: build {build.seconds:.1f} s, query {query_time.seconds:.3f} s, "
                  f"Spearman {rows[-1]['spearman']:.3f}")
        shutil.rmtree(work, ignore_errors=True)
        corpus = (x[:, 0], bergson_peer.causal_labels(labels))
        queries = (tx[:, 0], bergson_peer.causal_labels(tlabels))
        for p in args.bergson_dims:
            theirs = bergson_peer.index_build_and_query(mlm, corpus, queries, projection_dim=p, workdir=None)
            for kind, scores, seconds in (("dot products", theirs.scores, theirs.seconds["query"]),
                                          ("FAISS Flat IP", theirs.faiss_scores, theirs.seconds["faiss_query"])):
                values = -scores.double().numpy().T
                rows.append({"method": f"Bergson p {p} ({kind})", "numbers_per_example": theirs.numbers_per_example,
                             "build_s": theirs.seconds["build"], "bytes_per_example": theirs.bytes_per_example,
                             "build_peak_rss_MB": theirs.build_peak_rss / 1e6,
                             "query_s": seconds, "query_test_gradients_s": None,
                             "load_s": theirs.seconds["load" if kind == "dot products" else "faiss_load"],
                             **agreement(values)})
                print(f"  {rows[-1]['method']}: build {theirs.seconds['build']:.1f} s, query {seconds:.3f} s, "
                      f"Spearman {rows[-1]['spearman']:.3f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {"parameters": sum(p.numel() for p in mlm.parameters()), "indexed": stage.num_trained,
           "sequences": n, "queries": q, "length": LENGTH, "layers": args.bert_layers, "hidden": args.bert_hidden,
           "chain_fit_s": fit.seconds}
    return pd.DataFrame(rows), out


def markdown(table: pd.DataFrame) -> str:
    """A Markdown table of ``table``, numbers to 4 significant digits, missing cells blank."""
    def cell(v):
        return "" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)


def plot(magic: pd.DataFrame, magic_out: dict, index: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2), gridspec_kw={"width_ratios": [1, 1.1, 1.3]})
    a, b = np.array(magic_out["scores"]["influkit"]), np.array(magic_out["scores"]["bergson"])
    axes[0].scatter(a, b, s=10)
    lim = [min(a.min(), b.min()), max(a.max(), b.max())]
    axes[0].plot(lim, lim, color="grey", lw=0.8)
    axes[0].set_xlabel("influkit exact metagradient / 8")
    axes[0].set_ylabel("Bergson MAGIC")
    axes[0].set_title(f"(i) tiny GPT-2, {magic_out['steps']} AdamW steps: r = {magic_out['agreement']['pearson']:.6f}",
                      fontsize=9)
    main = magic[~magic["method"].str.startswith("  ")]
    axes[1].barh([m.replace(" (", "\n(") for m in main["method"]], main["median_ratio_to_plain"])
    axes[1].set_xlabel("seconds / plain torch.optim loop (median of same-round ratios)")
    axes[1].set_title("(i) cost over the plain run", fontsize=9)
    rows = index[index["build_s"].notna()]
    y = np.arange(len(rows))
    axes[2].barh(y - 0.2, rows["build_s"], 0.4, label="build s")
    axes[2].barh(y + 0.2, rows["query_s"], 0.4, label="query s")
    axes[2].set_yticks(y, [f"{m}  (ρ {s:.2f})" for m, s in zip(rows["method"], rows["spearman"])], fontsize=7)
    axes[2].set_xscale("log")
    axes[2].set_xlabel("seconds (log)")
    exact = index[index["build_s"].isna()]["query_s"]
    if len(exact):
        axes[2].axvline(float(exact.iloc[0]), color="grey", ls="--", lw=0.8, label="exact contraction pass")
    axes[2].set_title("(ii) BERT index: build and query (ρ: Spearman vs exact)", fontsize=9)
    axes[2].legend(fontsize=7, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--gpt-layers", type=int, default=2)
    parser.add_argument("--gpt-width", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bert-layers", type=int, default=2)
    parser.add_argument("--bert-hidden", type=int, default=128)
    parser.add_argument("--sequences", type=int, default=2000)
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("--influkit-dims", type=int, nargs="+", default=[768, 3072])
    parser.add_argument("--bergson-dims", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--quick", action="store_true", help="2 repeats, 300 sequences")
    parser.add_argument("--skip", choices=("magic", "index"), default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.sequences = 2, 300
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    from benchmarks.manifest import record

    load_start = os.getloadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = "_quick" if args.quick else ""
    files, out = [], {"load_start": load_start}
    stamp = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; shared 2-core machine (six helpers), "
             "one torch thread")
    if args.skip != "magic":
        magic, out["magic"] = bench_magic(args)
        magic.to_csv(RESULTS / f"magic{tag}.csv", index=False)
        (RESULTS / f"magic{tag}.md").write_text(
            f"# (i) MAGIC vs influkit's exact metagradient — {stamp}\n\n"
            f"tiny GPT-2 ({out['magic']['parameters']:,} parameters, untied), {TRAIN} vaderSentiment movie snippets "
            f"× {LENGTH} bytes, {args.steps} AdamW steps of {BATCH}, {TEST} test snippets; fastest of "
            f"{args.repeats} rounds; ratio: the median over rounds of the round's seconds over the same round's plain "
            "loop.\n\n"
            + markdown(magic) + "\n\nagreement (float32, the timed runs): "
            + json.dumps(out["magic"]["agreement"]) + "\n\nagreement of the same comparison in float64 (Bergson's "
            "eps_root 1e-30), untimed: " + json.dumps(out["magic"]["agreement_float64"]) + "\n\n" + BIAS_NOTE + "\n")
        files += [f"magic{tag}.csv", f"magic{tag}.md"]
        print(magic.to_string(index=False))
    if args.skip != "index":
        index, out["index"] = bench_index(args)
        index.to_csv(RESULTS / f"index{tag}.csv", index=False)
        (RESULTS / f"index{tag}.md").write_text(
            f"# (ii) Bergson's gradient index vs influkit's GradientIndex — {stamp}\n\n"
            f"BertForMaskedLM, random weights ({out['index']['parameters']:,} parameters; {out['index']['indexed']:,} "
            f"indexed: the encoder's linear weights), {args.sequences} sequences × {LENGTH} tokens, {args.queries} "
            f"queries; influkit's Chain.fit (test-independent, before any query) {out['index']['chain_fit_s']:.1f} s. "
            "Agreement with influkit's exact contraction scores (identity solve) over all pairs; "
            "Bergson's scores negated.\n\n" + markdown(index) + "\n")
        files += [f"index{tag}.csv", f"index{tag}.md"]
        print(index.to_string(index=False))
    previous = RESULTS / f"bench_bergson{tag}.json"
    if args.skip is not None and previous.exists():  # the part not re-run: its files from the previous run
        kept = json.loads(previous.read_text())
        out[args.skip] = kept.get(args.skip)
        if args.skip == "magic":
            magic = pd.read_csv(RESULTS / f"magic{tag}.csv")
        else:
            index = pd.read_csv(RESULTS / f"index{tag}.csv")
    out["load_end"] = os.getloadavg()
    (RESULTS / f"bench_bergson{tag}.json").write_text(json.dumps(out, indent=1, default=float))
    files.append(f"bench_bergson{tag}.json")
    if out.get("magic") and out.get("index"):
        plot(magic, out["magic"], index, RESULTS / f"bench_bergson{tag}.png")
        files.append(f"bench_bergson{tag}.png")
    record(RESULTS, files, note="shared 2-core machine (six helpers at once); each comparison timed in one process, "
           "one after the other; bergson 2.5.1 installed --no-deps in the bench venv (scripts/bench-env.sh)")


if __name__ == "__main__":
    main()
