"""Benchmark behind ``solver="auto"`` on a stage at a minimum with p > ``auto.PRECONDITION_MIN``: is CG faster
preconditioned by the EK-FAC that the light stationarity check fits anyway (the default) than without it?

The stage: a vocabulary head on frozen features of real text. Next-word prediction on the vaderSentiment 3.3.2
snippets (tweets, NYT editorials, Amazon and movie reviews; ``influkit.elmo.corpora``): a vocabulary of the
``--vocab`` − 1 most frequent words and one unknown-word class, each example the two previous words' frozen
features (a seeded Gaussian embedding, ``--dim`` per word, concatenated) and the next word as the label; the trained
model is one ``nn.Linear(2·dim, vocab)`` under softmax cross-entropy and an L2 weight ``--l2`` (convex: one
minimum, and there H equals the Gauss-Newton matrix). Defaults: 512 features, 2,048 words, p = 1,050,624. Trained
in float64 by full-batch L-BFGS (``influkit.training.fit_lbfgs``) to ‖∇L‖ ≤ 1e-8 (``newton_refine`` forms the dense
Hessian, out of reach at this p; the stationarity check's r is ~1e-8 without it).

Three ways of fitting and solving the same query (the summed test loss of ``--test`` held-out positions), each
from a fresh ``ik.Chain`` in this one process, back to back:

- ``new default``: ``solver="auto"``: the light check (the EK-FAC fit, whose data pass measures ∇L, and 20
  Lanczos steps on H), then CG on H preconditioned by that EK-FAC;
- ``old default``: the same light check, then CG without a preconditioner, as ``auto`` chose before
  (``auto.decide`` wrapped to drop the preconditioner at a minimum): the EK-FAC is fitted and thrown away;
- ``named cg_spd``: ``SolveConfig(solver="cg_spd")``: the full check (per-example gradients of 64, a gradient pass,
  20 Lanczos steps), no EK-FAC fitted, unpreconditioned CG.

Reported per row: fit seconds (with the check's own share), solve seconds (the best of ``--repeat`` queries on the
fitted chain), CG iterations, seconds per iteration, the relative residual, the total (fit + solve), and
‖s − s_old‖/‖s_old‖; then one Hessian-vector product's and one preconditioner application's
seconds (each the best of 3). Writes ``results/bench_auto_minimum/bench_auto_minimum[_quick].txt`` and a bar
chart ``.png`` (``_n<N>`` with ``--n``).

Run: ``OMP_NUM_THREADS=1 nice -n 5 python -m benchmarks.bench_auto_minimum`` (n = 4,096 training examples, ~6
min), ``--n 2048`` (~3 min) or ``--quick`` (n = 1,024, ~1.5 min). Single-threaded.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import time
from dataclasses import replace

import pandas as pd
import torch
from torch import nn

import influkit as ik
from benchmarks.common import RESULTS, Tee, banner, rel_err, setup
from benchmarks.manifest import record
from influkit import auto, solvers
from influkit.elmo import corpora
from influkit.training import fit_lbfgs

OUT = RESULTS / "bench_auto_minimum"


def next_word_head(n: int, n_test: int, vocab: int, dim: int, l2: float, seed: int = 0):
    """(stage, test examples): the vocabulary head of the module docstring on ``n`` seeded next-word positions."""
    sentences = [corpora.tokenize(text) for text in corpora.vader_corpus(corpora.VADER_SETS)]
    counts = collections.Counter(word for sentence in sentences for word in sentence)
    index = {word: i for i, (word, _) in enumerate(counts.most_common(vocab - 1))}
    unknown = vocab - 1
    ids = [[index.get(word, unknown) for word in sentence] for sentence in sentences]
    triples = torch.tensor([(s[j - 2], s[j - 1], s[j]) for s in ids for j in range(2, len(s))])
    gen = torch.Generator().manual_seed(seed)
    triples = triples[torch.randperm(len(triples), generator=gen)[: n + n_test]]
    embedding = torch.randn(vocab, dim, generator=gen, dtype=torch.float64) / dim**0.5  # frozen features
    x, y = torch.cat([embedding[triples[:, 0]], embedding[triples[:, 1]]], 1), triples[:, 2]
    model = nn.Linear(2 * dim, vocab).double().eval()
    nn.init.zeros_(model.weight), nn.init.zeros_(model.bias)
    loss = lambda out, t: nn.functional.cross_entropy(out, t, reduction="none")  # noqa: E731
    stage = ik.Stage(model, loss, (x[:n], y[:n]), regularizer=lambda p: 0.5 * l2 * sum((v**2).sum() for v in p.values()))
    return stage, (x[n:], y[n:])


@contextlib.contextmanager
def decided_as_before():
    """``auto`` as it decided before: at a minimum CG without a preconditioner (the check's EK-FAC unused)."""
    decide = solvers.decide

    def before(position, p, **context):
        choice = decide(position, p, **context)
        if position is not None and position.verdict == "minimum" and context["asked"].preconditioner is None:
            choice = replace(choice, preconditioner=None, reason=choice.reason.split(", preconditioned")[0])
        return choice

    solvers.decide = before
    try:
        yield
    finally:
        solvers.decide = decide


def fit_and_solve(stage, test, solve: ik.SolveConfig, repeat: int) -> tuple[dict, ik.Chain, torch.Tensor]:
    """(the row, the fitted chain, s) of one fresh chain: fit, then the query ``repeat`` times (its solve seconds: the
    best of them; the machine is shared)."""
    chain = ik.Chain([stage], solve=solve, progress=False)
    start = time.perf_counter()
    chain.fit()
    fit = time.perf_counter() - start
    queries = [chain.query(test) for _ in range(repeat)]
    (s,) = queries[0].solves
    seconds = min(query.solves[0]["seconds"] for query in queries)
    row = {"fit_s": fit, "check_s": chain.positions[0].seconds, "solve_s": seconds, "iterations": s["iterations"],
           "per_iteration_s": seconds / s["iterations"], "residual": s["residual"], "total_s": fit + seconds,
           "preconditioner": s["preconditioner"] or "none"}
    return row, chain, queries[0].s


def best_of(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def plot(frame: pd.DataFrame, title: str, path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    rows = frame["setting"].tolist()
    ax.barh(rows, frame["fit_s"], label="fit (check + factored fit)", color="#9ab")
    ax.barh(rows, frame["solve_s"], left=frame["fit_s"], label="CG solve", color="#358")
    for i, (total, iters) in enumerate(zip(frame["total_s"], frame["iterations"])):
        ax.text(total, i, f" {iters} it.", va="center", fontsize=8)
    ax.set_xlabel("seconds (one process, one CPU thread)")
    ax.set_xlim(0, 1.15 * frame["total_s"].max())
    ax.set_title(title, fontsize=9)
    ax.invert_yaxis()
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="n = 1,024 training examples")
    parser.add_argument("--n", type=int, default=None, help="training examples (default 4,096; --quick 1,024)")
    parser.add_argument("--test", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=256, help="features per context word (the head has 2·dim inputs)")
    parser.add_argument("--l2", type=float, default=1e-3)
    parser.add_argument("--repeat", type=int, default=2, help="queries per chain; the solve's best seconds")
    args = parser.parse_args(argv)
    n = args.n or (1024 if args.quick else 4096)
    setup(1)
    log = Tee()
    banner(log, "auto at a minimum with p > PRECONDITION_MIN: CG with and without the check's EK-FAC")
    stage, test = next_word_head(n, args.test, args.vocab, args.dim, args.l2)
    p = sum(t.numel() for t in stage.model.parameters())
    start = time.perf_counter()
    gradient = fit_lbfgs(stage, max_iter=500, tol=1e-8, restarts=2)
    log(f"# stage: next-word head on frozen features of the vaderSentiment snippets: n = {n}, {args.test} test "
        f"positions, vocab {args.vocab}, {2 * args.dim} features, L2 {args.l2:g}, p = {p} "
        f"(PRECONDITION_MIN = {auto.PRECONDITION_MIN:.0e}); L-BFGS {time.perf_counter() - start:.1f} s to "
        f"‖∇L‖ = {gradient:.2g}")
    rows = {}
    with decided_as_before():
        rows["old default"], _, s_old = fit_and_solve(stage, test, ik.SolveConfig(), args.repeat)
    rows["new default"], chain, s_new = fit_and_solve(stage, test, ik.SolveConfig(), args.repeat)
    log(f"# where it stands: {chain.positions[0].describe()}")
    rows["named cg_spd"], _, s_named = fit_and_solve(stage, test, ik.SolveConfig(solver="cg_spd"), args.repeat)
    for name, s in (("new default", s_new), ("old default", s_old), ("named cg_spd", s_named)):
        rows[name]["vs_old"] = rel_err(s, s_old)
    frame = pd.DataFrame([{"setting": name} | row for name, row in rows.items()])
    log(frame.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    ekfac = chain.curvature(0).approximations["ekfac"]
    shift = 1e-3 * ekfac.mean_eigenvalue()
    vector = torch.randn(p, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    hvp = best_of(lambda: chain.operator(0).matvec(vector))
    apply = best_of(lambda: ekfac.solve(vector, shift))
    log(f"# one Hessian-vector product {hvp:.3g} s, one EK-FAC preconditioner application {apply:.3g} s "
        f"(ratio {apply / hvp:.2f}; the HVP grows with n, the application does not)")
    old, mine = rows["old default"], rows["new default"]
    log(f"# new vs old default: iterations {mine['iterations']} vs {old['iterations']} "
        f"({mine['iterations'] / old['iterations']:.2f}×), solve {mine['solve_s']:.1f} s vs {old['solve_s']:.1f} s "
        f"({mine['solve_s'] / old['solve_s']:.2f}×), total {mine['total_s']:.1f} s vs {old['total_s']:.1f} s "
        f"({mine['total_s'] / old['total_s']:.2f}×)")
    log("# the machine was shared with other jobs (load in MANIFEST.json): ratios within this run, not absolute times")
    name = "bench_auto_minimum" + ("_quick" if args.quick else "") + (f"_n{n}" if args.n else "")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.txt").write_text(log.buffer.getvalue())
    plot(frame, f"vocabulary head at a minimum, p = {p:,}, n = {n:,}", OUT / f"{name}.png")
    record(OUT, [f"{name}.txt", f"{name}.png"], note="shared machine: other helpers' jobs ran beside it")


if __name__ == "__main__":
    main()
