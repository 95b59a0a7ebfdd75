"""influkit.fitted: curvature settings apart from solve settings, and the fitted curvature a chain owns per stage —
with_solve refits nothing when only the solve settings change, and what a new CurvatureConfig needs when it does."""

from __future__ import annotations

import pytest
import torch

import influkit as ik
from influkit.factored.approximations import APPROXIMATIONS
from conftest import explicit_hessian


@pytest.fixture
def fits(monkeypatch):
    """name -> how many times that approximation was fitted."""
    counts = {name: 0 for name in APPROXIMATIONS}
    for name, kind in APPROXIMATIONS.items():
        original = kind.fit.__func__

        def counted(cls, *args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(cls, *args, **kwargs)

        monkeypatch.setattr(kind, "fit", classmethod(counted))
    return counts


@pytest.mark.parametrize("bad,match", [
    (dict(matrix="fisher"), "unknown matrix 'fisher'"),
    (dict(hessian_samples=0), "hessian_samples must be a positive"),
    (dict(fisher="true"), "unknown fisher 'true'"),
    (dict(rank=0), "rank must be a positive"),
    (dict(rank=2.5), "rank must be a positive"),
])
def test_curvature_config_refuses_bad_settings(bad, match):
    with pytest.raises(ik.InputError, match=match):
        ik.CurvatureConfig(**bad)


@pytest.mark.parametrize("bad,match", [
    (dict(solver="newton"), "unknown solver 'newton'"),
    (dict(damping=-1.0), "damping must be ≥ 0"),
    (dict(tol=-1e-3), "tol must be a relative residual ≥ 0"),
    (dict(max_iter=0), "max_iter must be ≥ 1"),
    (dict(solver="cg", preconditioner="ekfac"), "preconditioner"),
    (dict(solver="direct", deflate=True), "deflate"),
    (dict(preconditioner="lu"), "unknown preconditioner 'lu'"),
])
def test_solve_config_refuses_bad_settings(bad, match):
    with pytest.raises(ik.InputError, match=match):
        ik.SolveConfig(**bad)


@pytest.mark.parametrize("moved", ["matrix", "curvature", "hessian_samples", "seed", "fisher", "rank"])
def test_curvature_settings_are_not_solve_settings(moved):
    with pytest.raises(TypeError, match=moved):
        ik.SolveConfig(**{moved: None})


def test_chain_takes_one_curvature_config_or_one_per_stage(mlp_stage):
    with pytest.raises(ik.InputError, match="curvature must be one CurvatureConfig or one per stage"):
        ik.Chain([mlp_stage], curvature=[ik.CurvatureConfig()] * 2)
    with pytest.raises(ik.InputError, match="solve must be one SolveConfig"):
        ik.Chain([mlp_stage], solve=ik.CurvatureConfig())


def test_with_solve_refits_nothing_when_only_the_solve_settings_change(mlp_stage, fits):
    test = mlp_stage.data.take(torch.arange(4))
    chain = ik.Chain([mlp_stage], solve=ik.SolveConfig(solver="ekfac", damping=0.1)).fit()
    assert fits["ekfac"] == 1
    fitted = chain.curvature(0)
    for solve in (ik.SolveConfig(solver="ekfac", damping=1.0),
                  ik.SolveConfig(solver="minres", preconditioner="ekfac", damping=0.1, tol=1e-12)):
        other = chain.with_solve(solve)
        assert other.curvature(0) is fitted and other.operator(0) is chain.operator(0)
        other.query(test)
    assert fits["ekfac"] == 1  # the damping sweep and the preconditioned solve reuse the one fit
    # a new approximation on the same curvature settings: only it is fitted, once, on the same FittedCurvature
    chain.with_solve(ik.SolveConfig(solver="kfac", damping=0.1)).with_solve(ik.SolveConfig(solver="kfac", damping=2.0))
    assert fits["kfac"] == 1 and fits["ekfac"] == 1 and set(fitted.approximations) == {"ekfac", "kfac"}


def test_with_solve_refits_what_a_new_curvature_config_changes(mlp_stage, fits):
    """Each fitted item is kept or refitted by the settings it read: fisher → the factors; rank → the eigenpairs;
    hessian_samples → the operator and everything fitted on it."""
    chain = ik.Chain([mlp_stage], solve=ik.SolveConfig(solver="minres", preconditioner="ekfac", deflate=True,
                                                        damping=0.1)).fit()
    kept = chain.curvature(0)
    assert fits["ekfac"] == 1 and fits["arnoldi"] == 1
    products = chain.operator(0).products
    other = chain.with_solve(curvature=ik.CurvatureConfig(fisher="empirical"))
    assert fits["ekfac"] == 2 and fits["arnoldi"] == 1 and other.curvature(0) is not kept
    assert other.operator(0) is chain.operator(0) and chain.operator(0).products == products
    assert other.curvature(0).approximations["ekfac"].info["fisher"] == "empirical"
    assert kept.approximations["ekfac"].info["fisher"] == "sampled"  # the old chain's fit is untouched
    assert other.solve_configs == chain.solve_configs  # None keeps this chain's solve settings
    ranked = chain.with_solve(curvature=ik.CurvatureConfig(rank=7))
    assert fits["ekfac"] == 2 and fits["arnoldi"] == 2
    assert ranked.curvature(0).approximations["ekfac"] is kept.approximations["ekfac"]
    assert ranked.curvature(0).approximations["arnoldi"].eigenvalues.numel() == 7
    sampled = chain.with_solve(curvature=ik.CurvatureConfig(hessian_samples=30))
    assert fits["ekfac"] == 3 and fits["arnoldi"] == 3 and sampled.operator(0) is not chain.operator(0)
    assert sampled.operator(0).indices.numel() == 30
    # the derived fits equal fresh ones
    for derived, config in ((other, ik.CurvatureConfig(fisher="empirical")), (ranked, ik.CurvatureConfig(rank=7))):
        fresh = ik.Chain([mlp_stage], solve=chain.solve_configs, curvature=config)
        test = mlp_stage.data.take(torch.arange(3))
        torch.testing.assert_close(derived.query(test).s, fresh.query(test).s, rtol=1e-9, atol=1e-12)


def test_what_each_fit_read_survives_save_and_load(mlp_stage, tmp_path, fits):
    solve = ik.SolveConfig(solver="ekfac", damping=0.1)
    ik.Chain([mlp_stage], solve=solve).fit().save(tmp_path / "fit.st")
    loaded = ik.Chain([mlp_stage], solve=solve).load(tmp_path / "fit.st")
    assert fits["ekfac"] == 1 and loaded.curvature(0).reads["ekfac"] == {"fisher": "sampled", "seed": 0}
    loaded.with_solve(curvature=ik.CurvatureConfig(rank=3))
    assert fits["ekfac"] == 1  # rank is not a setting EK-FAC reads: the loaded factors are kept


def test_direct_on_a_kept_dense_hessian_is_exact_after_with_solve(mlp_stage):
    """with_solve hands the same operator (and its dense H) to direct; the new damping's answer is the exact one."""
    test = mlp_stage.data.take(torch.arange(3))
    chain = ik.Chain([mlp_stage], solve=ik.SolveConfig(solver="direct", damping=0.1)).fit()
    products = chain.operator(0).products
    swept = chain.with_solve(ik.SolveConfig(solver="direct", damping=0.7))
    q = swept.query(test)
    assert chain.operator(0).products == products  # the dense Hessian was not built again
    h = explicit_hessian(mlp_stage) + 0.7 * torch.eye(q.s.shape[0])
    from influkit.gradients import total_grad

    expected = torch.linalg.solve(h, total_grad(mlp_stage, *test, mlp_stage.param_names))
    torch.testing.assert_close(q.s, expected, rtol=1e-9, atol=1e-12)


def test_a_new_approximation_is_one_registered_class(mlp_stage, tmp_path):
    """Register a class (fit + from_state), name it as a solver's approximation: the chain fits, uses and saves it."""
    from influkit.factored.approximations import Approximation, register
    from influkit.solvers import REGISTRY, _Approximation
    from influkit.solvers import register as register_solver

    class Scaled:
        """C = c·I with c the mean diagonal of H (estimated from the dense H here)."""

        def __init__(self, c, info):
            self.c, self.info = c, info

        def solve(self, rhs, damping):
            return rhs / (self.c + damping)

        def state(self, prefix=""):
            return {f"{prefix}c": torch.tensor([self.c])}, {"info": self.info}

    @register("scaled_identity")
    class ScaledIdentity(Approximation):
        needs_stage = False

        @classmethod
        def fit(cls, operator, config, *, memory=None, progress=False):
            return Scaled(float(torch.diagonal(operator.dense()).mean()), {"seed": config.seed})

        @classmethod
        def from_state(cls, tensors, meta, operator, prefix=""):
            return Scaled(float(tensors[f"{prefix}c"]), meta["info"])

    @register_solver("scaled_identity")
    class ScaledSolve(_Approximation):
        def _prepare(self, progress):
            self.approximation = self._approximation("scaled_identity", progress)

    try:
        test = mlp_stage.data.take(torch.arange(3))
        chain = ik.Chain([mlp_stage], solve=ik.SolveConfig(solver="scaled_identity", damping=0.5, residual=True))
        q = chain.query(test)
        c = float(torch.diagonal(explicit_hessian(mlp_stage)).mean())
        from influkit.gradients import total_grad

        torch.testing.assert_close(q.s, total_grad(mlp_stage, *test, mlp_stage.param_names) / (c + 0.5))
        assert q.solves[0]["tol"] == ik.solvers.APPROXIMATE_TOL
        assert q.solves[0]["converged"] is (q.solves[0]["residual"] <= q.solves[0]["tol"])
        chain.save(tmp_path / "fit.st")
        loaded = ik.Chain([mlp_stage], solve=chain.solve_configs).load(tmp_path / "fit.st")
        assert loaded.curvature(0).approximations["scaled_identity"].c == c
        assert torch.equal(loaded.query(test).s, q.s)
    finally:
        APPROXIMATIONS.pop("scaled_identity")
        REGISTRY.pop("scaled_identity")
