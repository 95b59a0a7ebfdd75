"""auto's damping off a minimum, λ = DAMPING_RATIO · θ_max · min(1, r/R_REF), against the previous λ = DAMPING_RATIO ·
θ_max and the undamped exact solve, on near-minimum convex models checked by leave-one-out retraining.

torch-influence's leave-one-out setting, widened: scikit-learn's L2 logistic regression (``LogisticRegression(C,
tol=1e-10)``: ½‖w‖² + C Σ log-loss, the intercept unpenalized) on real digits, one pair of classes, 250 training and
50 test digits; the stage states the objective as a mean, (1/n) Σ ℓ + (1/(2nC))(‖w‖² + b²), penalizing the
intercept too, so scikit-learn's solution stands a hair off the stage's minimum (r = ‖∇L‖/typical per-example
gradient > the stationarity tolerance: "non-stationary"). For every pair in ``PAIRS`` and every C in ``CS``, each of
the examples z = 0, 5, 10, … (50) is left out and the model refitted by scikit-learn (same C, tol 1e-10); the actual
change of the summed test log-loss is ranked against the predicted removals (Spearman) of:

- ``defaults``: ``ik.influence(stage, z, test)`` with nothing set (auto: the rule, scaled by r);
- ``previous rule``: auto with λ = DAMPING_RATIO · θ_max given (what auto chose before the min(1, r/R_REF) factor;
  θ_max from the defaults' own stationarity check);
- ``undamped``: ``SolveConfig(solver="direct")``, the exact H⁻¹ of the stated objective.

Run ``python -m studies.damping_rule`` (a minute or two); writes ``studies/results/damping/logistic_loo.{csv,md,png}``
and MANIFEST.json. ``--part mlp``: where the stages of ``studies/validation_check.py``'s Adam MLP (Case 1, Case 2 with
the term) stand and the λ of both rules there (``adam_mlp.md``): the rules differ only on a stage with r < R_REF. The LM fidelity task's side of the evidence is ``lm_fidelity.md`` there (written by hand from the
committed fidelity results; see it for what was and was not re-measured).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402
from torch import nn  # noqa: E402

import influkit as ik  # noqa: E402
from influkit.auto import DAMPING_RATIO, R_REF  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "damping"
PAIRS = ((3, 8), (1, 7), (4, 9), (2, 5))
CS = (0.1, 1.0, 10.0)
N_TRAIN, N_TEST, EVERY = 250, 50, 5


def bce(out, t):
    return nn.functional.binary_cross_entropy_with_logits(out.squeeze(-1), t, reduction="none")


def case(pair: tuple[int, int], c: float) -> dict:
    """One model: scikit-learn's fit, its leave-one-out changes and the three rules' Spearman with them."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression

    data = load_digits()
    keep = (data.target == pair[0]) | (data.target == pair[1])
    x, y = data.data[keep] / 16.0, (data.target[keep] == pair[1]).astype(float)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0)).numpy()
    x, y = x[order], y[order]
    train, test = (x[:N_TRAIN], y[:N_TRAIN]), (x[N_TRAIN:N_TRAIN + N_TEST], y[N_TRAIN:N_TRAIN + N_TEST])

    def fit(a, b):
        return LogisticRegression(C=c, max_iter=10000, tol=1e-10).fit(a, b)

    def test_loss(model) -> float:
        p = np.clip(model.predict_proba(test[0])[:, 1], 1e-300, 1 - 1e-16)
        return float(-(test[1] * np.log(p) + (1 - test[1]) * np.log1p(-p)).sum())

    base = fit(*train)
    n = N_TRAIN
    z = torch.arange(0, n, EVERY)
    actual = np.array([test_loss(fit(*(a[np.arange(n) != int(j)] for a in train))) - test_loss(base) for j in z])
    model = nn.Linear(64, 1).double().eval()
    with torch.no_grad():
        model.weight.copy_(torch.tensor(base.coef_))
        model.bias.copy_(torch.tensor(base.intercept_))
    stage = ik.Stage(model, bce, (torch.tensor(train[0]), torch.tensor(train[1])),
                     regularizer=lambda p: 0.5 / (n * c) * ((p["weight"] ** 2).sum() + (p["bias"] ** 2).sum()))
    tests = (torch.tensor(test[0]), torch.tensor(test[1]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        defaults = ik.influence(stage, z, tests, progress=False)
        where, (solve,) = defaults.diagnostics["stages"][0], defaults.diagnostics["solves"]
        previous_lambda = DAMPING_RATIO * where["max_eigenvalue"]
        previous = ik.influence(stage, z, tests, solve=ik.SolveConfig(damping=previous_lambda), progress=False)
        exact = ik.influence(stage, z, tests, solve=ik.SolveConfig(solver="direct"), progress=False)
    rho = {name: float(spearmanr(res.removal.numpy(), actual)[0])
           for name, res in (("defaults", defaults), ("previous rule", previous), ("undamped", exact))}
    return {"pair": f"{pair[0]} vs {pair[1]}", "C": c, "verdict": where["verdict"], "r": where["gradient_norm"],
            "theta_min": where["min_eigenvalue"], "theta_max": where["max_eigenvalue"],
            "lambda_defaults": solve["damping"], "lambda_previous": previous_lambda,
            "spearman_defaults": rho["defaults"], "spearman_previous": rho["previous rule"],
            "spearman_undamped": rho["undamped"], "loo_refits": len(z)}


def plot(frame: pd.DataFrame, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.2))
    labels = [f"{p}\nC={c:g}\nr={r:.2g}" for p, c, r in zip(frame["pair"], frame["C"], frame["r"])]
    pos = np.arange(len(frame))
    for shift, (col, name, colour) in zip((-0.27, 0, 0.27), (("spearman_previous", "previous: 0.01·θ_max", "#c0392b"),
                                                            ("spearman_defaults", "defaults: × min(1, r/0.03)", "#2471a3"),
                                                            ("spearman_undamped", "undamped exact H⁻¹", "#7d8c8d"))):
        ax.bar(pos + shift, frame[col], width=0.27, color=colour, label=name)
    ax.axhline(0.9, color="black", lw=0.8, ls="--", label="torch-influence's LOO threshold 0.9")
    ax.set_xticks(pos, labels, fontsize=6)
    ax.set_ylim(min(0.5, float(frame[["spearman_previous", "spearman_defaults", "spearman_undamped"]].min().min()) - 0.05), 1)
    ax.set_ylabel(f"Spearman with {int(frame['loo_refits'].iloc[0])} leave-one-out refits")
    ax.set_title("L2 logistic regression on digit pairs (scikit-learn's fit, a hair off the stage's minimum)", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def adam_mlp() -> pd.DataFrame:
    """Each stage of the Adam MLP pipelines (Case 1, Case 2 with α = 0.01) at defaults: r, θ_max, λ of both rules."""
    from studies.validation_check import MLP, AdamPipeline, score

    rows = []
    for variant, case_ in (("case1", 1), ("case2", 2)):
        pipe = AdamPipeline(MLP(), variant)
        pre, fin = pipe.stages()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res, _ = score(pre, fin, pipe.test, case_, MLP().alpha)
        for where, solve in zip(res.diagnostics["stages"], res.diagnostics["solves"]):
            rows.append({"pipeline": variant, "stage": solve["stage"], "verdict": where["verdict"],
                         "r": where["gradient_norm"], "theta_max": where["max_eigenvalue"], "solver": solve["solver"],
                         "lambda_defaults": solve["damping"], "lambda_previous": DAMPING_RATIO * where["max_eigenvalue"]})
    frame = pd.DataFrame(rows)
    frame["ratio"] = frame["lambda_defaults"] / frame["lambda_previous"]
    return frame


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("logistic", "mlp"), default="logistic")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.part == "mlp":
        frame = adam_mlp()
        lines = ["# auto's damping on the Adam MLP of studies/validation_check.py (studies/damping_rule.py --part mlp)", "",
                 "| pipeline | stage | verdict | r | θ_max | solver | λ defaults | λ previous | ratio |",
                 "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['pipeline']} | {r['stage']} | {r['verdict']} | {r['r']:.3g} | {r['theta_max']:.3g} | {r['solver']} "
                  f"| {r['lambda_defaults']:.3g} | {r['lambda_previous']:.3g} | {r['ratio']:.2f} |"
                  for r in frame.to_dict("records")]
        (RESULTS / "adam_mlp.md").write_text("\n".join(lines) + "\n")
        from benchmarks.manifest import record

        record(RESULTS, ["adam_mlp.md"], note="shared machine: 2 cores, several helpers' jobs beside this one")
        print("\n".join(lines))
        return 0
    rows = [case(pair, c) for pair in PAIRS for c in CS]
    frame = pd.DataFrame(rows)
    frame.to_csv(RESULTS / "logistic_loo.csv", index=False)
    plot(frame, RESULTS / "logistic_loo.png")
    lines = ["# auto's damping on near-minimum logistic regressions, against leave-one-out refits (studies/damping_rule.py)",
             "", f"λ_defaults = {DAMPING_RATIO:g}·θ_max·min(1, r/{R_REF:g}); λ_previous = {DAMPING_RATIO:g}·θ_max; undamped: "
             "the exact H⁻¹. Spearman of each rule's predicted removals with the actual change of the summed test "
             f"log-loss over {int(frame['loo_refits'].iloc[0])} leave-one-out refits (scikit-learn, tol 1e-10). "
             "Figure: `logistic_loo.png`.", "",
             "| pair | C | verdict | r | θ_min | θ_max | λ defaults | λ previous | Spearman defaults | Spearman previous | "
             "Spearman undamped |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['pair']} | {r['C']:g} | {r['verdict']} | {r['r']:.2g} | {r['theta_min']:.2g} | "
                     f"{r['theta_max']:.3g} | {r['lambda_defaults']:.2g} | {r['lambda_previous']:.2g} | "
                     f"{r['spearman_defaults']:.3f} | {r['spearman_previous']:.3f} | {r['spearman_undamped']:.3f} |")
    means = frame[["spearman_defaults", "spearman_previous", "spearman_undamped"]].mean()
    lines += ["", f"Mean over the {len(frame)} models: defaults {means['spearman_defaults']:.3f}, previous rule "
              f"{means['spearman_previous']:.3f}, undamped {means['spearman_undamped']:.3f}; models at ≥ 0.9: defaults "
              f"{int((frame['spearman_defaults'] >= 0.9).sum())}, previous {int((frame['spearman_previous'] >= 0.9).sum())}, "
              f"undamped {int((frame['spearman_undamped'] >= 0.9).sum())} of {len(frame)}."]
    (RESULTS / "logistic_loo.md").write_text("\n".join(lines) + "\n")
    from benchmarks.manifest import record

    record(RESULTS, ["logistic_loo.csv", "logistic_loo.md", "logistic_loo.png"],
           note="shared machine: 2 cores, several helpers' jobs beside this one")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
