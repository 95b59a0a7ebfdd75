"""Benchmark of influkit's core: HVP cost, per-example gradients, inverse-Hessian solvers.

1. HVP / gradient cost ratio (goal ≤ 2.5): one Hessian-vector product over the data (``curvature.hvp``,
   modes "fwd-rev" = jvp of grad and "rev-rev" = vjp of grad) divided by one full gradient over the same data
   (``curvature.gradient``); a plain ``torch.autograd.grad`` of the mean loss is timed too, to separate
   influkit's overhead from the arithmetic. Models: L2 logistic regression and the 64→32→10 tanh MLP on 1,000
   digits (float64), and the multi-stage paper's MNIST CNN on random 28×28 inputs (float32).
2. Per-example gradients (goal ≥ 20×): ``gradients.per_example_grads`` (chunked vmap) vs
   ``per_example_grads_serial`` (one autograd call per example) on the MNIST CNN (Table A of the multi-stage
   paper's appendix: CONV 32 5×5 tanh, MAX-POOL 2×2, CONV 64 5×5 tanh, MAX-POOL 2×2, FC 10).
3. Solvers on real, ill-conditioned Hessians (trained to ‖∇L‖ ≈ 0): each of direct, cg (on H²), cg_spd,
   minres, lissa solves H x = b (b = the summed gradient of 100 test points) at tol = 1e-6 on its own system;
   reported: iterations, HVPs, seconds, the method's own relative residual, the true ‖Hx − b‖/‖b‖ and the
   relative error vs the direct solution; κ and λ_min come from the dense Hessian's eigenvalues.
4. Where the direct solver's time goes: dense H by batched HVPs (``HessianOperator.dense``) vs
   ``torch.func.hessian``, and eigh (what ``solve(..., "direct")`` uses) vs Cholesky.

Run: ``python -m benchmarks.bench_core`` (several minutes) or ``--quick`` (small sizes, about a minute).
Single-threaded: torch.set_num_threads(1).
"""

from __future__ import annotations

import argparse
import time
import warnings

import pandas as pd
import torch

import influkit as ik
from benchmarks.common import Tee, banner, cross_entropy, explicit_hessian, mnist_cnn, setup, timed, trained_stage
from influkit.curvature import HessianOperator, gradient, hvp
from influkit.gradients import per_example_grads, per_example_grads_serial, total_grad

SOLVERS = ("direct", "cg", "cg_spd", "minres", "lissa")


def raw_gradient(stage: ik.Stage):
    """∇ of mean loss + R by one plain torch.autograd.grad call on the model itself (no influkit)."""
    params = [p for n, p in stage.model.named_parameters() if n in stage.param_names]
    x, y = stage.data.take(torch.arange(len(stage)))

    def run():
        loss = stage.loss(stage.model(x), y).mean()
        if stage.regularizer is not None:
            loss = loss + stage.regularizer(dict(zip(stage.param_names, params)))
        return torch.autograd.grad(loss, params)

    return run


def hvp_ratio(name: str, stage: ik.Stage, repeat: int) -> list[dict]:
    names = stage.param_names
    gen = torch.Generator().manual_seed(0)
    v = {k: torch.randn(t.shape, generator=gen, dtype=t.dtype) for k, t in stage.trained().items()}
    t_grad, _ = timed(lambda: gradient(stage, names), repeat=repeat, warmup=2)
    t_raw, _ = timed(raw_gradient(stage), repeat=repeat, warmup=2)
    rows = []
    for mode in ("fwd-rev", "rev-rev"):
        t_hvp, _ = timed(lambda: hvp(stage, v, mode=mode), repeat=repeat, warmup=2)
        rows.append(
            {
                "model": name, "p": stage.num_trained, "n": len(stage), "mode": mode,
                "grad_ms": 1e3 * t_grad, "raw_grad_ms": 1e3 * t_raw, "hvp_ms": 1e3 * t_hvp,
                "hvp/grad": t_hvp / t_grad, "hvp/raw_grad": t_hvp / t_raw,
                "goal<=2.5": "yes" if t_hvp / t_grad <= 2.5 else "no",
            }
        )
    return rows


def cnn_stage(n: int) -> ik.Stage:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (n,), generator=gen)
    return ik.Stage(mnist_cnn().eval(), cross_entropy, (x, y), batch_size=n)


def solver_table(name: str, stage: ik.Stage, test, log) -> pd.DataFrame:
    start = time.perf_counter()
    h = explicit_hessian(stage)
    evals = torch.linalg.eigvalsh(h)
    kappa = float(evals.abs().max() / evals.abs().min())
    log(
        f"[{name}] dense Hessian (torch.func.hessian) + eigvalsh in {time.perf_counter() - start:.1f}s: "
        f"λ_min = {float(evals[0]):.3e}, λ_max = {float(evals[-1]):.3e}, κ = {kappa:.2e}, "
        f"{'indefinite' if evals[0] < 0 else 'positive definite'}"
    )
    b = total_grad(stage, *test)
    results, x_direct = [], None
    for method in SOLVERS:
        op = HessianOperator(stage)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sol = ik.solve(op, b, method, tol=1e-6)
        if method == "direct":
            x_direct = sol.x
        true_res = float((h @ sol.x - b).norm() / b.norm())
        results.append(
            {
                "problem": name, "solver": method, "iterations": sol.iterations, "HVPs": sol.products,
                "seconds": sol.seconds, "own_residual": sol.residual, "true_residual": true_res,
                "rel_err_vs_direct": float((sol.x - x_direct).norm() / x_direct.norm()),
                "converged": sol.converged,
            }
        )
        log(f"  {method:7s} {sol.iterations:5d} it {sol.products:6d} HVPs {sol.seconds:8.2f}s  "
            f"res {sol.residual:.1e} true res {true_res:.1e} err {results[-1]['rel_err_vs_direct']:.1e}")
    frame = pd.DataFrame(results)
    frame.attrs.update(kappa=kappa, lmin=float(evals[0]), lmax=float(evals[-1]))
    return frame


def direct_breakdown(name: str, stage: ik.Stage) -> dict:
    op = HessianOperator(stage)
    t_dense, h = timed(op.dense)
    t_func, _ = timed(lambda: explicit_hessian(stage))
    t_eigh, _ = timed(lambda: torch.linalg.eigh(h))
    t_chol, _ = timed(lambda: torch.linalg.cholesky_ex(h))
    return {
        "problem": name, "p": op.dim, "HessianOperator.dense_s": t_dense, "func.hessian_s": t_func,
        "eigh_s": t_eigh, "cholesky_s": t_chol,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="n=300, MLP hidden 8, 32 CNN examples")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    setup(args.threads)
    log = Tee()
    banner(log, "bench_core: HVP cost, per-example gradients, solvers")
    n_train, n_test, hidden, n_cnn, repeat = (300, 30, 8, 32, 3) if args.quick else (1000, 100, 32, 128, 10)

    stages = {name: trained_stage(name, n_train, n_test, hidden=hidden, log=log) for name in ("logreg", "mlp")}

    log("\n## 1. cost of one HVP over the data / one full gradient over the same data (goal ≤ 2.5)")
    rows = []
    for name, (stage, _, _) in stages.items():
        rows += hvp_ratio(name, stage, repeat)
    rows += hvp_ratio("mnist_cnn (random 28×28, float32)", cnn_stage(n_cnn), max(2, repeat // 3))
    log.table(pd.DataFrame(rows))

    log("\n## 2. per-example gradients on the MNIST CNN (goal ≥ 20×)")
    cnn = cnn_stage(n_cnn)
    x, y = cnn.data.take(torch.arange(n_cnn))
    t_serial, g_serial = timed(lambda: per_example_grads_serial(cnn, x, y), repeat=1, warmup=1)
    pe_rows = []
    for chunk in (32, 128):
        t_vmap, g_vmap = timed(lambda: per_example_grads(cnn, x, y, chunk_size=chunk), repeat=2, warmup=1)
        pe_rows.append(
            {
                "N": n_cnn, "p": cnn.num_trained, "chunk": chunk, "serial_s": t_serial, "vmap_s": t_vmap,
                "speedup": t_serial / t_vmap, "max_abs_diff": float((g_vmap - g_serial).abs().max()),
                "goal>=20x": "yes" if t_serial / t_vmap >= 20 else "no",
            }
        )
    log.table(pd.DataFrame(pe_rows))

    log("\n## 3. solvers at tol = 1e-6 on real Hessians (b = summed test gradient)")
    frames = [solver_table(name, stage, test, log) for name, (stage, test, _) in stages.items()]
    table = pd.concat(frames)
    for f in frames:
        log(f"{f.problem.iloc[0]}: κ = {f.attrs['kappa']:.2e}, λ_min = {f.attrs['lmin']:.3e}, λ_max = {f.attrs['lmax']:.3e}")
    log.table(table)
    log("\nrecommendation (fastest solver with error ≤ 1e-6 vs direct):")
    for f in frames:
        ok = f[f.rel_err_vs_direct <= 1e-6].sort_values("seconds")
        it = f[(f.rel_err_vs_direct <= 1e-6) & (f.solver != "direct")].sort_values("seconds")
        best = ok.iloc[0]
        extra = f"; best iterative: {it.iloc[0].solver} ({it.iloc[0].seconds:.2f}s)" if len(it) else "; no iterative solver reached it"
        log(f"  {best.problem}: {best.solver} ({best.seconds:.2f}s){extra}")

    log("\n## 4. where direct spends its time: dense H and factorization")
    log.table(pd.DataFrame([direct_breakdown(name, s) for name, (s, _, _) in stages.items()]))
    path = log.save("bench_core_quick" if args.quick else "bench_core")
    log(f"# written to {path}")


if __name__ == "__main__":
    main()
