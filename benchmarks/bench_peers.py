"""Benchmark: influkit vs captum and pyDVL on the same job, side by side in one run.

Job: the removal effect of each of n_train (1,000) digits training points on the summed loss of n_test (100)
test points, Δ_i = ∇f(T)ᵀ H⁻¹ ∇ℓ(z_i) / n, for float64 L2-regularized logistic regression (fit_lbfgs +
newton_refine) and a 64→32→10 tanh MLP with a small L2 (L-BFGS then Newton; ‖∇L‖ is printed). Each method's
output is converted to Δ by its documented conventions and compared with the explicit-Hessian result
(``torch.func.hessian`` + LU solve + serial per-example gradients):

- influkit: ``ik.influence(stage, all_train, test, solve=SolveConfig(solver=...)).removal`` — H = Hessian of mean loss + L2.
- pyDVL (``pydvl.influence.torch``): H = mean-loss Hessian + ``regularization``·I, so regularization = L2
  weight; ``influences(x_test, y_test, x, y, mode=Up)[t, i] = ⟨H⁻¹∇ℓ(x_t), ∇ℓ(z_i)⟩``, so
  Δ_i = Σ_t influences[t, i] / n.
- captum (``captum.influence``): the Hessian of the *summed* loss (loss with reduction='none' is summed) plus
  ``hessian_reg``·I, so hessian_reg = n·L2 weight gives n·H; scores[t, i] = ∇ℓ(x_t)ᵀ (nH)⁻¹ ∇ℓ(z_i), so
  Δ_i = Σ_t scores[t, i]. Its low-rank defaults (projection_dim=50, Arnoldi dim 200) are replaced by full rank
  where that is feasible; the defaults are run too, to show their error.

Run: ``python -m benchmarks.bench_peers`` (full, several minutes) or ``--quick`` (n_train=300, n_test=30,
MLP hidden width 8; < 2 min). Peers need the ``bench`` extra (captum, pydvl); missing ones are reported.
All timings are single-threaded (torch.set_num_threads(1)) wall-clock seconds, after training.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import tempfile
import time
import traceback
import warnings

import pandas as pd
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import influkit as ik
from benchmarks.common import Tee, banner, rel_err, reference_removal, setup, trained_stage

TARGET = 1e-6  # the accuracy at which methods are compared


def version(pkg: str) -> str:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return "not installed"


# --------------------------------------------------------------------------------------------- influkit
def run_influkit(stage, test, solver: str, tol: float | None = None):
    n = len(stage)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = ik.influence(stage, torch.arange(n), test, solve=ik.SolveConfig(solver=solver, tol=tol))
    d = res.diagnostics["solves"][0]
    where = res.diagnostics["stages"][0]
    check = f"check {where['seconds']:.2f}s, {where.get('products', where['lanczos_steps'])} HVPs"
    return res.removal, f"{d['solver']}, {d['iterations']} it, {d['products']} HVPs; {where['verdict']} ({check})"


# --------------------------------------------------------------------------------------------- pyDVL
def run_pydvl(stage, test, kind: str, rtol: float = 1e-10):
    from pydvl.influence import InfluenceMode
    from pydvl.influence.torch import CgInfluence, DirectInfluence

    x, y = stage.data.take(torch.arange(len(stage)))
    weight = stage_l2(stage)
    loss = nn.functional.cross_entropy  # mean reduction: pyDVL's H is the mean-loss Hessian
    loader = DataLoader(TensorDataset(x, y), batch_size=len(stage))
    if kind == "direct":
        model = DirectInfluence(stage.model, loss, regularization=weight)
    else:
        model = CgInfluence(
            stage.model, loss, regularization=weight, rtol=rtol, atol=0.0, maxiter=10 * stage.num_trained,
            solve_simultaneously=True, warn_on_max_iteration=False,
        )
    model = model.fit(loader)
    scores = model.influences(test[0], test[1], x, y, mode=InfluenceMode.Up)  # (n_test, n_train)
    return scores.sum(0) / len(stage), "block CG" if kind == "cg" else "torch.func.hessian + LU"


def stage_l2(stage) -> float:
    """The L2 weight λ of R = λ/2‖θ‖², read off R itself (R at θ=1 is λ/2·p)."""
    ones = {k: torch.ones_like(v) for k, v in stage.trained().items()}
    return float(2 * stage.regularizer(ones) / stage.num_trained)


# --------------------------------------------------------------------------------------------- captum
def run_captum(stage, test, kind: str, full_rank: bool):
    from captum.influence import NaiveInfluenceFunction
    from captum.influence._core.arnoldi_influence_function import ArnoldiInfluenceFunction  # not exported in 0.9

    n, p = len(stage), stage.num_trained
    x, y = stage.data.take(torch.arange(n))
    reg = n * stage_l2(stage)  # captum's Hessian is the summed-loss Hessian: n·(H_mean) + reg·I = n·H
    loss = nn.CrossEntropyLoss(reduction="none")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "model.pt")
        torch.save(stage.model.state_dict(), ckpt)
        common = dict(loss_fn=loss, batch_size=n, show_progress=False)
        data = TensorDataset(x, y)
        if kind == "naive":
            extra = dict(projection_dim=p, hessian_inverse_tol=0.0) if full_rank else {}
            infl = NaiveInfluenceFunction(stage.model, data, ckpt, hessian_reg=reg, **common, **extra)
            note = f"eig of explicit H, rank {infl.R.shape[1]}"
        else:
            extra = dict(projection_dim=p, arnoldi_dim=p, arnoldi_tol=0.0, hessian_inverse_tol=0.0) if full_rank else {}
            infl = ArnoldiInfluenceFunction(stage.model, data, ckpt, hessian_reg=reg, **common, **extra)
            note = f"Arnoldi, dim {infl.arnoldi_dim}, rank {infl.projection_dim}"
        scores = infl.influence((test[0], test[1]))  # (n_test, n_train)
    return scores.sum(0), note


# --------------------------------------------------------------------------------------------- driver
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="n_train=300, n_test=30, MLP hidden 8 (< 2 min)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--problems", default="logreg,mlp")
    parser.add_argument("--no-peers", action="store_true")
    args = parser.parse_args(argv)
    setup(args.threads)
    log = Tee()
    banner(log, "bench_peers: removal effect of every training point on the summed test loss (float64)")
    log(f"# influkit {ik.__version__} | captum {version('captum')} | pydvl {version('pydvl')}")
    n_train, n_test, hidden = (300, 30, 8) if args.quick else (1000, 100, 32)
    summary = []
    for problem in args.problems.split(","):
        stage, test, norm = trained_stage(problem, n_train, n_test, hidden=hidden, log=log)
        start = time.perf_counter()
        ref, h = reference_removal(stage, test)
        evals = torch.linalg.eigvalsh(h)
        log(
            f"[{problem}] explicit-Hessian reference in {time.perf_counter() - start:.1f}s; eigenvalues of H in "
            f"[{float(evals[0]):.2e}, {float(evals[-1]):.2e}], κ = {float(evals[-1] / evals[0]):.2e}"
        )
        p = stage.num_trained
        methods = [
            ("influkit", "default (auto)", lambda: run_influkit(stage, test, "auto")),
            ("influkit", "direct", lambda: run_influkit(stage, test, "direct")),
            ("influkit", "cg_spd tol=1e-8", lambda: run_influkit(stage, test, "cg_spd", 1e-8)),
        ]
        if not args.quick:
            methods += [
                ("influkit", "cg_spd tol=1e-10", lambda: run_influkit(stage, test, "cg_spd", 1e-10)),
                ("influkit", "minres tol=1e-8", lambda: run_influkit(stage, test, "minres", 1e-8)),
            ]
        if not args.no_peers:
            methods += [
                ("pydvl", "DirectInfluence", lambda: run_pydvl(stage, test, "direct")),
                ("pydvl", "CgInfluence rtol=1e-8", lambda: run_pydvl(stage, test, "cg", 1e-8)),
                ("captum", "Naive full rank", lambda: run_captum(stage, test, "naive", True)),
                ("captum", "Naive defaults", lambda: run_captum(stage, test, "naive", False)),
                ("captum", "Arnoldi defaults", lambda: run_captum(stage, test, "arnoldi", False)),
            ]
            if p <= 1000 and not args.quick:  # O(p²) Python-level Gram-Schmidt: 2.9 M tuple dot products at p = 2,410
                methods.append(("captum", "Arnoldi full rank", lambda: run_captum(stage, test, "arnoldi", True)))
        rows = []
        for lib, setting, fn in methods:
            start = time.perf_counter()
            try:
                out, note = fn()
                seconds = time.perf_counter() - start
                err = rel_err(out, ref)
            except Exception as exc:  # a peer that cannot run is reported, not fatal
                seconds, err = time.perf_counter() - start, float("nan")
                note = f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                traceback.print_exc()
            rows.append({"library": lib, "setting": setting, "seconds": seconds, "rel_error": err, "notes": note})
            log(f"  {lib:8s} {setting:24s} {seconds:8.2f}s  rel.err {err:.1e}  {note}")
        frame = pd.DataFrame(rows)
        log(f"\n[{problem}] p={p}, n_train={n_train}, n_test={n_test}, ‖∇L‖={norm:.1e}, κ={float(evals[-1] / evals[0]):.1e}")
        log.table(frame)
        ok = frame[frame.rel_error <= TARGET]
        best_ik = ok[ok.library == "influkit"].sort_values("seconds").head(1)
        best_peer = ok[ok.library != "influkit"].sort_values("seconds").head(1)
        if len(best_ik) and len(best_peer):
            a, b = best_ik.iloc[0], best_peer.iloc[0]
            speedup = b.seconds / a.seconds
            verdict = "MET" if speedup >= 2 else "NOT MET"
            log(
                f"[{problem}] at rel.err ≤ {TARGET:.0e}: influkit {a.setting} {a.seconds:.2f}s vs fastest peer "
                f"{b.library} {b.setting} {b.seconds:.2f}s → influkit is {speedup:.2f}× faster (goal ≥ 2×: {verdict})\n"
            )
            summary.append((problem, a.setting, a.seconds, f"{b.library} {b.setting}", b.seconds, speedup))
            default = ok[(ok.library == "influkit") & (ok.setting == "default (auto)")]
            if len(default):
                d = default.iloc[0]
                log(f"[{problem}] every setting at its default: {d.seconds:.2f}s ({d.notes}) → {b.seconds / d.seconds:.2f}× "
                    f"the fastest peer (goal ≥ 2×: {'MET' if b.seconds >= 2 * d.seconds else 'NOT MET'})\n")
        else:
            log(f"[{problem}] no influkit/peer pair reached rel.err ≤ {TARGET:.0e}\n")
    if summary:
        log("summary (fastest at rel.err ≤ 1e-6):")
        log.table(pd.DataFrame(summary, columns=["problem", "influkit", "s", "fastest peer", "peer s", "speedup"]))
    path = log.save("bench_peers_quick" if args.quick else "bench_peers")
    log(f"# written to {path}")


if __name__ == "__main__":
    main()
