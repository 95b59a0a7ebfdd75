"""Why MiniLM's predicted removals are 10⁴–10⁵× what retraining shows: the prediction taken apart, by measurement.

The pipeline and scores of ``studies/validation_check.py --part minilm`` (stage 1: the MLM stage, solved by the EK-FAC
inverse of the empirical Fisher with λ = 0.1 × its mean eigenvalue; the head by the direct solve). For the k most
harmful snippets G (by those scores), with m the corpus size, u the stage-1 right-hand side (the test loss's gradient
on W after the head's implicit response) and s = (C + λI)⁻¹ u the stage-1 solve:

- predicted ΔW = (1/m) (C + λI)⁻¹ Σ_{i∈G} ∇g_i (ε = −1/m removes each member), predicted Δf = uᵀ ΔW (= the table's
  Σ removal: a units check of the scores against the parameter response);
- actual ΔW: the MLM stage re-run on the corpus without G minus the run with everything (seed 0, the trained run's own
  batch order), and uᵀ ΔW_actual: the first-order change of the test loss the actual response implies (its gap to
  the actual Δf is the downstream linearization's error, not stage 1's);
- ‖θ̂ − θ_0‖: how far the whole continued pretraining moved the weights from the checkpoint;
- the exact relative residual of s against the Gauss-Newton matrix G (‖(G + λI)s − u‖/‖u‖) and sᵀGs / sᵀCs: whether
  the EK-FAC inverse is the damped Gauss-Newton solve it stands for, in its units;
- the same group's predicted Δf over a damping sweep λ = λ_study·10^j, at ``1/(ηT)`` and at the identity (s = u), and
  the fraction of the fitted curvature's eigenvalues below λ_study.

Run ``python -m studies.validation_minilm_scale`` (``--quick``: smaller; ``--table-only``: the Markdown from the
JSON already written). Writes ``studies/results/validation/minilm_scale.{json,md}`` and a MANIFEST entry; the noise
floor and the seeds' spread quoted beside them are ``minilm_summary.json``'s (``studies/validation_check.py``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import time
import warnings
from pathlib import Path

import torch

import influkit as ik
from influkit.gradients import per_example_grads

RESULTS = Path(__file__).resolve().parent / "results" / "validation"


def flat(stage: ik.Stage, names) -> torch.Tensor:
    state = stage.state()
    return torch.cat([state[n].detach().reshape(-1).double() for n in names])


def markdown(out: dict, summary: dict | None) -> str:
    """The measurements as a page: what each number says about the −888."""
    r, u, e, t = out["response"], out["units"], out["ekfac_vs_gauss_newton"], out["test_loss"]
    c, pos, eig = out["config"], out["stage1_position"], out["curvature_eigenvalues"]
    harmful = next((row for row in (summary or {}).get("table", []) if row["group"] == "most harmful"), None)
    lines = [
        "# MiniLM: why the study's predicted removals are 10⁴× what retraining shows (studies/validation_minilm_scale.py)",
        "",
        f"Pipeline of `minilm_summary.json` (corpus {c['corpus']} snippets, {c['n_test']} test snippets, masked-LM stage "
        f"{c['pre_epochs']} epoch = {c['optimizer_steps']} AdamW steps at lr {c['pre_lr']:g}, p = {c['p_stage1']:,} "
        f"trained values), scored as the study scores it (EK-FAC inverse of the empirical Fisher, λ = 0.1 × its mean "
        f"eigenvalue = {out['lambda_study']:.3g}). Group: the {c['k']} most harmful snippets.",
        "",
        "| measurement | value | what it says |",
        "|---|---|---|",
        f"| Σ removal over the group (the table's predicted) | {u['predicted_sum_of_removal']:.4g} | |",
        f"| uᵀ ΔW_predicted, ΔW = (1/m)(C + λI)⁻¹ Σ ∇g_i | {u['u_dot_dW_predicted']:.4g} | equal to "
        f"{u['relative_difference']:.0e}: the scores are the parameter response's first-order effect — no 1/m, "
        "sum-vs-mean or sign error between the solve and the scores |",
        f"| ‖ΔW_predicted‖ | {r['dW_predicted_norm']:.4g} | |",
        f"| ‖ΔW_actual‖ (MLM stage re-run without the group, same batch order) | {r['dW_actual_norm']:.3g} | the "
        f"prediction is {r['ratio_predicted_to_actual']:.0f}× the actual parameter response (cosine "
        f"{r['cosine']:.2f}) |",
        f"| ‖θ̂ − θ_checkpoint‖ (the whole continued pretraining) | {r['whole_training_movement_norm']:.3g} | the "
        f"prediction has the removal of {c['k']} snippets move W "
        f"{r['dW_predicted_norm'] / r['whole_training_movement_norm']:.0f}× farther than all of training did |",
        f"| stage 1: r = ‖∇L‖ / typical per-example gradient | {pos['gradient_norm']:.2g} ({pos['verdict']}) | far "
        "from a minimum: the response of a re-optimized minimum is not what 8 steps do |",
        f"| EK-FAC eigenvalues: max, mean, median | {eig['max']:.3g}, {eig['mean']:.3g}, {eig['median']:.2g} | the "
        f"mean-eigenvalue heuristic gives λ = {out['lambda_study'] / eig['max']:.1e} × θ_max |",
        f"| fraction of EK-FAC eigenvalues below λ | {eig['fraction_below_lambda']:.2f} | (C + λI)⁻¹ multiplies "
        f"most directions by 1/λ ≈ {1 / out['lambda_study']:.0f} |",
        f"| ‖(G + λI)s − u‖/‖u‖, G the exact Gauss-Newton matrix | {e['relative_residual']:.3g} | the EK-FAC x is not "
        "the damped Gauss-Newton solve it stands for |",
        f"| sᵀGs / sᵀCs along the solve | {e['ratio_sGs_to_sCs']:.3g} | G has that much more curvature where the "
        "solve went than EK-FAC's empirical Fisher (rank ≤ the corpus' tokens) sees |",
        f"| vᵀGv / vᵀCv along u and along the group's gradient | {e['along_gradients']['u']['ratio']:.2g}, "
        f"{e['along_gradients']['group_gradient']['ratio']:.2g} | on gradient directions C and G agree within a small "
        "factor: no units error in the curvature |",
        f"| actual change of the summed test loss (seed 0) | {t['actual_change']:.3g} | on a baseline of "
        f"{t['baseline_sum']:.3g} |",
        f"| uᵀ ΔW_actual | {t['u_dot_dW_actual']:.3g} | the downstream first-order map given the actual ΔW |",
    ]
    if harmful:
        lines.append(f"| over {harmful['seeds']} seeds (minilm_summary.json) | {harmful['actual']:.3g} ± "
                     f"{harmful['actual_sd']:.2g}, noise floor {harmful['noise_floor']:.3g} | |")
    lines += ["", "Damping sweep of the same EK-FAC inverse (the group's predicted Δf and ‖ΔW‖):", "",
              "| damping | λ | predicted Δf | ‖ΔW_predicted‖ |", "|---|---|---|---|"]
    for row in out["damping_sweep"]:
        lam = "—" if row["lambda"] != row["lambda"] else f"{row['lambda']:.3g}"
        label = row["damping"] + (" (SGD's rule; this run is AdamW)" if row["damping"] == "1/(ηT)" else "")
        lines.append(f"| {label} | {lam} | {row['predicted']:.4g} | {row['dW_norm']:.3g} |")
    lines += ["", "Verdict: not a units or sign bug (the convex and two-stage tests in tests/test_validation_check.py "
              "agree with retraining at minima; here the scores equal the parameter response's first-order effect). "
              "The 10⁴× comes from influence functions applied off a minimum with an approximate curvature and a tiny "
              f"damping: the study's λ ({out['lambda_study'] / eig['max']:.1e}·θ_max) leaves "
              f"{100 * eig['fraction_below_lambda']:.0f} % of EK-FAC's near-null spectrum undamped, so the solve "
              "amplifies the gradient's components there by up to 1/λ; the exact Gauss-Newton matrix has curvature "
              f"there (residual {e['relative_residual']:.3g}), and the actual training ({c['optimizer_steps']} AdamW "
              f"steps) moves W by {r['dW_actual_norm']:.2g} when the group is removed. The prediction falls about as "
              "1/λ as λ grows (the sweep); auto's defaults: `minilm_defaults_case1_top2.csv` (two layers).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from influkit import hf
    from studies import minilm_domain_adaptation as dapt

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--table-only", action="store_true", help="write minilm_scale.md from minilm_scale.json")
    args = parser.parse_args(argv)
    summary_path = RESULTS / "minilm_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    if args.table_only:
        (RESULTS / "minilm_scale.md").write_text(markdown(json.loads((RESULTS / "minilm_scale.json").read_text()), summary))
        return 0
    torch.set_num_threads(1)
    start = time.perf_counter()
    path = hf.checkpoint_dir(dapt.PACKAGE)
    cfg = dapt.Config(per_source=15 if args.quick else 30, n_finetune=40 if args.quick else 100,
                      n_test=12 if args.quick else 40, top_layers=1, pre_epochs=1, head_epochs=20)
    data = dapt.load_data(cfg, path)
    init = hf.pretrained(dapt.BertForMaskedLM, path, seed=cfg.seed)
    trained = dapt.train_all(cfg, data, path, variants=("case1",))
    pre = trained.pre
    test = hf.pack(data.test[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chain = dapt.chain(trained, "case1", cfg, residual=False)
        query = chain.query(test, progress=False)
        res = query.scores(progress=False)
    names = chain.plans[0].trained
    m = len(pre)
    lam = chain.solve_configs[0].damping
    total = res.total.double()
    group = torch.argsort(total, descending=True)[: args.k]
    x, y = pre.data.take(group)
    g_sum = per_example_grads(pre, x, y, names).double().sum(0)
    s = query.s.double().reshape(-1)
    ekfac = chain.curvature(0).approximations["ekfac"]
    u = ekfac.matvec(s.to(query.s.dtype)).double() + lam * s  # u = (C + λI) s exactly, C EK-FAC's
    solve0 = chain.solver(0)
    dw_pred = solve0.solve(g_sum.to(query.s.dtype)).x.double() / m
    predicted_table = float(res.removal[group].sum())

    # the actual response: the MLM stage re-run (seed 0) with everything and without G
    def run_mlm(keep_mask: torch.Tensor) -> tuple[torch.Tensor, float]:
        mlm = copy.deepcopy(init)
        stage = dapt.pretrain_stage(mlm, data, cfg)
        mlm.train()
        dapt.train_mlm(stage, cfg, keep=keep_mask, seed=cfg.seed)
        mlm.eval()
        clf = dapt.classifier(mlm, path, cfg)
        head = dapt.finetune_stage(clf, data, cfg, "classifier")
        dapt.fit_head(head, cfg, seed=cfg.seed)
        return flat(stage, names), float(dapt.test_losses(head, data.test[1]).sum())

    everything = torch.ones(m, dtype=torch.bool)
    without = everything.clone()
    without[group] = False
    w_all, f_all = run_mlm(everything)
    w_without, f_without = run_mlm(without)
    dw_act = w_without - w_all
    theta0 = flat(dapt.pretrain_stage(copy.deepcopy(init), data, cfg), names)
    theta_hat = flat(pre, names)

    # the EK-FAC solve against the exact Gauss-Newton matrix, in its units
    gauss_newton = chain._curvature_for(0, "gauss-newton").operator
    gs = gauss_newton.matvec(s.to(query.s.dtype)).double()
    residual = float(torch.linalg.norm(gs + lam * s - u) / torch.linalg.norm(u))
    rayleigh_g, rayleigh_c = float(s @ gs), float(s @ (u - lam * s))
    along = {}  # vᵀGv / vᵀCv along gradient directions, where the empirical Fisher has support: the units check
    for label, v in (("u", u), ("group_gradient", g_sum)):
        v = v / v.norm()
        vg = float(v @ gauss_newton.matvec(v.to(query.s.dtype)).double())
        vc = float(v @ ekfac.matvec(v.to(query.s.dtype)).double())
        along[label] = {"vGv": vg, "vCv": vc, "ratio": vg / vc}
    eigenvalues = torch.cat([b.eigenvalues.reshape(-1).double() + b.shift for b in ekfac.blocks
                             if hasattr(b, "eigenvalues")] + [(b.values + b.shift).reshape(-1).double()
                                                             for b in ekfac.blocks if not hasattr(b, "eigenvalues")])

    # the damping sweep: the group's predicted Δf = (1/m) Σ_{i∈G} ∇g_iᵀ s_λ
    steps = cfg.pre_epochs * -(-m // cfg.batch)
    sweep = []
    for label, value in [(f"λ_study·10^{j}", lam * 10**j) for j in range(6)] + [("1/(ηT)", 1 / (cfg.pre_lr * steps))]:
        other = chain.with_solve([dataclasses.replace(chain.solve_configs[0], damping=value), chain.solve_configs[1]])
        s_lam = other.query(test, progress=False).s.double().reshape(-1)
        dw = other.solver(0).solve(g_sum.to(query.s.dtype)).x.double() / m
        sweep.append({"damping": label, "lambda": value, "predicted": float(g_sum @ s_lam) / m,
                      "dW_norm": float(dw.norm())})
    sweep.append({"damping": "identity (s = u)", "lambda": float("nan"), "predicted": float(g_sum @ u) / m,
                  "dW_norm": float(g_sum.norm()) / m})

    position = res.diagnostics["stages"][0]
    out = {
        "config": {"corpus": m, "n_test": cfg.n_test, "k": args.k, "pre_epochs": cfg.pre_epochs, "pre_lr": cfg.pre_lr,
                   "batch": cfg.batch, "optimizer_steps": steps, "p_stage1": int(s.numel())},
        "stage1_position": {key: position.get(key) for key in ("verdict", "gradient_norm", "min_eigenvalue",
                                                              "max_eigenvalue")},
        "lambda_study": lam,
        "curvature_eigenvalues": {"mean": float(eigenvalues.mean()), "max": float(eigenvalues.max()),
                                  "median": float(eigenvalues.median()),
                                  "fraction_below_lambda": float((eigenvalues < lam).double().mean())},
        "units": {"predicted_sum_of_removal": predicted_table, "u_dot_dW_predicted": float(u @ dw_pred),
                  "relative_difference": abs(predicted_table - float(u @ dw_pred)) / abs(predicted_table)},
        "response": {"dW_predicted_norm": float(dw_pred.norm()), "dW_actual_norm": float(dw_act.norm()),
                     "ratio_predicted_to_actual": float(dw_pred.norm() / dw_act.norm()),
                     "cosine": float(dw_pred @ dw_act / (dw_pred.norm() * dw_act.norm())),
                     "whole_training_movement_norm": float((theta_hat - theta0).norm()),
                     "baseline_reproduces_trained_run": float((w_all - theta_hat).norm())},
        "test_loss": {"baseline_sum": f_all, "actual_change": f_without - f_all, "u_dot_dW_actual": float(u @ dw_act),
                      "predicted_change": predicted_table},
        "ekfac_vs_gauss_newton": {"relative_residual": residual, "sGs": rayleigh_g, "sCs": rayleigh_c,
                                  "ratio_sGs_to_sCs": rayleigh_g / rayleigh_c, "along_gradients": along},
        "damping_sweep": sweep,
        "seconds": time.perf_counter() - start,
    }
    out_dir = RESULTS if not args.quick else Path("/tmp/minilm_scale")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "minilm_scale.json").write_text(json.dumps(out, indent=1, default=float) + "\n")
    (out_dir / "minilm_scale.md").write_text(markdown(out, summary))
    if not args.quick:
        from benchmarks.manifest import record

        record(out_dir, ["minilm_scale.json", "minilm_scale.md"], note="shared machine: 2 cores, several helpers' jobs beside this one")
    print(json.dumps(out, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
