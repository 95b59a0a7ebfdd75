"""Chain / Link / Query: N-stage influence against an independent ground truth, equivalences and persistence.

The ground truth for a 3-stage chain is computed without the chain's backward recursion: the stationarity
conditions of all three stages are stacked into one map G(x) over x = (θ_1, θ_2, θ_3), its Jacobian J is formed
explicitly, and dx/dε = −J⁻¹ [∇ℓ_1(z); 0; 0] (implicit differentiation of the whole chain at once). The
same derivative is checked against central finite differences of the chain re-optimized by Newton's method.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call

import influkit as ik
from influkit.params import ParamSpace
from conftest import cross_entropy as ce, l2 as l2_of

ALPHA = 0.05
DECAY = 0.05


class Net(nn.Module):
    """enc → tanh → adapter → tanh → head: the block each stage inherits is enc (and adapter)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.enc = nn.Linear(4, 3)
        self.adapter = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.adapter(torch.tanh(self.enc(x)))))


l2 = l2_of(DECAY)  # the regularizer every stage here trains with


def data(seed: int, n: int = 24):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    y = (x[:, 0] + 0.5 * x[:, 1] * x[:, 2] + 0.3 * torch.randn(n, generator=gen) > 0).long()
    return x, y


ENC = ["enc.weight", "enc.bias"]
ADAPTER = ["adapter.weight", "adapter.bias"]
HEAD = ["head.weight", "head.bias"]


class ThreeStages:
    """Pretrain (all) → adapt (link 1 shares enc) → finetune (link 2 shares enc + adapter), solved exactly."""

    def __init__(self, case1: int, case2: int, solution: torch.Tensor | None = None):
        """solution: the stacked optimum x of an earlier instance with the same cases (skips the Newton solves)."""
        self.cases = (case1, case2)
        self.models = [Net(seed) for seed in (0, 1, 2)]
        self.data = [data(10), data(11), data(12)]
        self.test = data(13, n=10)
        self.z = torch.tensor([0, 3, 7, 11])
        self.trained = [
            ENC + ADAPTER + HEAD,
            (ADAPTER + HEAD) if case1 == 1 else (ENC + ADAPTER + HEAD),
            HEAD if case2 == 1 else (ENC + ADAPTER + HEAD),
        ]
        self.inherited = [[], ENC, ENC + ADAPTER]
        self.spaces = [ParamSpace({n: dict(self.models[k].named_parameters())[n].detach() for n in self.trained[k]}) for k in range(3)]
        x = self.solve_all(0.0) if solution is None else solution
        self.x = x
        for k in range(3):
            with torch.no_grad():
                full = self.full_params(k, self.split(x))
                for name, p in self.models[k].named_parameters():
                    p.copy_(full[name])

    # ---- the stages as explicit functions of the stacked vector x = (θ_1, θ_2, θ_3) ----
    def split(self, x):
        return list(torch.split(x, [s.dim for s in self.spaces]))

    def inherited_values(self, k, thetas):
        """c_k: the values stage k takes for its inherited block, from stage k−1's parameters."""
        if k == 0:
            return {}
        previous = self.full_params(k - 1, thetas)
        return {n: previous[n] for n in self.inherited[k]}

    def full_params(self, k, thetas):
        params = {n: p.detach() for n, p in self.models[k].named_parameters()}
        case = self.cases[k - 1] if k else None
        if case == 1:
            params.update(self.inherited_values(k, thetas))
        params.update(self.spaces[k].unflatten(thetas[k]))
        return params

    def objective(self, k, thetas, eps=0.0, z=None):
        params = self.full_params(k, thetas)
        x, y = self.data[k]
        value = ce(functional_call(self.models[k], params, (x,)), y).mean() + l2(self.spaces[k].unflatten(thetas[k]))
        if k and self.cases[k - 1] == 2:
            centre = self.inherited_values(k, thetas)
            value = value + ALPHA * sum(((params[n] - centre[n]) ** 2).sum() for n in centre)
        if eps:
            zx, zy = self.data[0][0][z], self.data[0][1][z]
            value = value + eps * ce(functional_call(self.models[0], params, (zx,)), zy).sum()
        return value

    def test_loss(self, thetas):
        params = self.full_params(2, thetas)
        return ce(functional_call(self.models[2], params, (self.test[0],)), self.test[1]).sum()

    def stationarity(self, x):
        """G(x) = (∇_θ1 F_1, ∇_θ2 F_2, ∇_θ3 F_3), each stage's gradient with the earlier stages' values as inputs."""
        thetas = self.split(x)

        def stage_gradient(k):
            def f(theta):
                local = list(thetas)
                local[k] = theta
                return self.objective(k, local)
            return torch.func.grad(f)(thetas[k])

        return torch.cat([stage_gradient(k) for k in range(3)])

    # ---- exact re-optimization, stage by stage ----
    def solve_all(self, eps, z=None, start=None):
        thetas = [s.flatten({n: dict(self.models[k].named_parameters())[n].detach() for n in s.names}) for k, s in enumerate(self.spaces)] if start is None else self.split(start)
        thetas = [t.clone() for t in thetas]
        for k in range(3):
            def f(theta, k=k):
                local = list(thetas)
                local[k] = theta
                return self.objective(k, local, eps if k == 0 else 0.0, z)
            thetas[k] = newton(f, thetas[k])
        return torch.cat(thetas)

    def chain(self, solver="direct", solve=None):
        stages = [ik.Stage(self.models[k], ce, self.data[k], params=self.trained[k], regularizer=l2) for k in range(3)]
        links = [
            ik.Link("enc", case=self.cases[0], alpha=ALPHA),
            ik.Link({"enc": "enc", "adapter": "adapter"}, case=self.cases[1], alpha=ALPHA),
        ]
        return ik.Chain(stages, links, solve=solve or ik.SolveConfig(solver=solver))


def newton(f, theta, steps=100):
    """Damped Newton with backtracking to ‖∇f‖ ≤ 1e-13."""
    for _ in range(steps):
        g = torch.func.grad(f)(theta)
        if g.norm() < 1e-13:
            break
        h = torch.func.hessian(f)(theta)
        low = float(torch.linalg.eigvalsh(h)[0])
        shift = 0.0 if low > 1e-8 else 1e-3 - low
        step = torch.linalg.solve(h + shift * torch.eye(h.shape[0]), g)
        value, t = f(theta), 1.0
        while f(theta - t * step) > value + 1e-15 and t > 1e-6:
            t /= 2
        theta = theta - t * step
    return theta


CASES = list(itertools.product((1, 2), (1, 2)))


@pytest.fixture(scope="module", params=CASES, ids=[f"links{a}{b}" for a, b in CASES])
def three(request):
    return ThreeStages(*request.param)


def implicit_truth(three: ThreeStages, z_index: int) -> float:
    """dI/dε of the test loss by implicit differentiation of all three stationarity conditions at once."""
    x = three.x
    jac = torch.func.jacrev(three.stationarity)(x)
    thetas = three.split(x)

    def g(theta1):
        return three.objective(0, [theta1, *thetas[1:]], 1.0, torch.tensor([z_index])) - three.objective(0, [theta1, *thetas[1:]])

    rhs = torch.cat([torch.func.grad(g)(thetas[0]), torch.zeros(x.shape[0] - thetas[0].shape[0])])
    dx = -torch.linalg.solve(jac, rhs)
    grad_f = torch.func.grad(lambda v: three.test_loss(three.split(v)))(x)
    return float(grad_f @ dx)


def test_three_stage_chain_matches_implicit_differentiation(three):
    res = three.chain().query(three.test).scores(three.z)
    truth = torch.tensor([implicit_truth(three, int(i)) for i in three.z])
    torch.testing.assert_close(res.values, truth, rtol=1e-9, atol=1e-12)
    assert res.method == f"chain case {three.cases[0]}-{three.cases[1]}"
    assert [s["stage"] for s in res.diagnostics["solves"]] == [0, 1, 2]


def test_three_stage_chain_matches_finite_differences(three):
    res = three.chain().query(three.test).scores(three.z[:2])
    eps = 1e-6  # the central difference's O(ε²) error is ~1e-10 here (measured: it shrinks 100× per 10× in ε)
    for row, i in enumerate(three.z[:2]):
        plus = three.test_loss(three.split(three.solve_all(eps, torch.tensor([int(i)]), start=three.x)))
        minus = three.test_loss(three.split(three.solve_all(-eps, torch.tensor([int(i)]), start=three.x)))
        fd = float(plus - minus) / (2 * eps)
        assert abs(float(res.values[row]) - fd) <= 1e-7 * max(1.0, abs(fd)), (float(res.values[row]), fd)


def test_iterative_solver_agrees_with_direct(three):
    direct = three.chain("direct").query(three.test).scores(three.z)
    minres = three.chain("minres").query(three.test).scores(three.z)
    torch.testing.assert_close(minres.values, direct.values, rtol=1e-7, atol=1e-10)


# ---- equivalences with the one- and two-stage entry points ----

@pytest.fixture(scope="module")
def two():
    return ThreeStages(1, 2)


def test_one_stage_chain_equals_influence(two):
    stage = ik.Stage(two.models[0], ce, two.data[0], regularizer=l2)
    test = two.data[0][0][:5], two.data[0][1][:5]
    for solver in ("direct", "minres"):
        old = ik.influence(stage, two.z, test, solve=ik.SolveConfig(solver=solver), progress=False)
        new = ik.Chain([stage], solve=ik.SolveConfig(solver=solver)).query(test).scores(two.z)
        torch.testing.assert_close(new.values, old.values, rtol=1e-10, atol=1e-12)
        assert new.method == "single-stage"


@pytest.mark.parametrize("case", [1, 2])
def test_two_stage_chain_equals_score(two, case):
    pre = ik.Stage(two.models[0], ce, two.data[0], regularizer=l2)
    fin = ik.Stage(two.models[1], ce, two.data[1], params=two.trained[1] if case == 1 else None, regularizer=l2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # case 1 on a finetuned encoder: the drift warning
        old = ik.score(pre, fin, two.z, two.test, shared="enc", case=case, alpha=ALPHA,
                       solve=ik.SolveConfig(solver="direct", damping=0.0), progress=False)
        chain = ik.Chain([pre, fin], [ik.Link("enc", case=case, alpha=ALPHA)], solve=ik.SolveConfig(solver="direct"))
        new = chain.query(two.test).scores(two.z)
    torch.testing.assert_close(new.values, old.values, rtol=1e-10, atol=1e-12)
    assert new.method == old.method == f"multi-stage case {case}"


def test_per_test_columns_sum_to_the_total(two):
    chain = two.chain()
    total = chain.query(two.test).scores(two.z)
    per = chain.query(two.test, per_test=True).scores(two.z)
    assert per.values.shape == (len(two.z), two.test[0].shape[0])
    torch.testing.assert_close(per.values.sum(1), total.values, rtol=1e-10, atol=1e-12)


def test_scoring_in_parts_equals_scoring_whole(two):
    chain = two.chain()
    query = chain.query(two.test)
    whole = query.scores(chunk_size=4)
    first, second = query.scores(torch.arange(0, 12), chunk_size=4), query.scores(torch.arange(12, 24), chunk_size=4)
    assert torch.equal(torch.cat([first.values, second.values]), whole.values)
    assert torch.equal(torch.cat([first.index, second.index]), whole.index)
    pairs = query.scores((two.data[0][0][:12], two.data[0][1][:12]), chunk_size=4)
    assert torch.equal(pairs.values, first.values)


def test_fit_is_kept_and_queries_do_not_refactor(two):
    chain = two.chain().fit()
    operators = [chain.operator(k) for k in range(3)]
    chain.query(two.test)
    chain.query((two.test[0][:3], two.test[1][:3]))
    assert [chain.operator(k) for k in range(3)] == operators
    assert all(len(op._dense._factors) == 1 for op in operators)


@pytest.mark.parametrize("solver", ["direct", "ekfac"])
def test_with_solve_reuses_the_fit_and_equals_a_fresh_chain(two, solver):
    chain = two.chain(solve=ik.SolveConfig(solver=solver, damping=0.1)).fit()
    operators = [chain.operator(k) for k in range(3)]
    fitted = [dict(chain.curvature(k).approximations) for k in range(3)]
    swept = chain.with_solve(ik.SolveConfig(solver=solver, damping=0.5))
    assert [swept.operator(k) for k in range(3)] == operators  # same Hessians: nothing rebuilt
    assert [swept.curvature(k).approximations for k in range(3)] == fitted  # factors not refitted
    fresh = two.chain(solve=ik.SolveConfig(solver=solver, damping=0.5))
    torch.testing.assert_close(swept.query(two.test).scores(two.z).values, fresh.query(two.test).scores(two.z).values,
                               rtol=1e-10, atol=1e-12)
    other = chain.with_solve(ik.SolveConfig(solver=solver, damping=0.5), curvature=ik.CurvatureConfig(matrix="gauss-newton"))
    assert all(other.operator(k) is not operators[k] for k in range(3))  # another matrix: fitted anew


@pytest.mark.filterwarnings("ignore")  # untrained finetunes: the stationarity and Case 1 warnings
@pytest.mark.parametrize("solver", ["auto", "ekfac"])
def test_a_new_finetune_reuses_the_pretraining_fit_and_equals_a_fresh_chain(two, solver):
    """Two finetunes of one pretrained stage: the second chain takes stage 0's fit from the first (same operator,
    same position, same factors) and scores what the same chain fitted from scratch scores."""
    solve = ik.SolveConfig(solver=solver, damping=0.1)
    pre = ik.Stage(two.models[0], ce, two.data[0], regularizer=l2)

    def finetune(seed):
        return ik.Stage(Net(seed), ce, data(seed), params=HEAD + ADAPTER, regularizer=l2)

    link = ik.Link("enc", case=1)
    first = ik.Chain([pre, finetune(21)], [link], solve=solve, progress=False).fit()
    second_fin = finetune(22)
    second = ik.Chain([pre, second_fin], [link], solve=solve, progress=False).reuse(first)
    assert second.reused == 1
    second.fit()
    assert second.curvature(0) is first.curvature(0) and second.positions[0] is first.positions[0]
    assert second.curvature(1) is not first.curvature(1)
    fresh = ik.Chain([pre, second_fin], [link], solve=solve, progress=False)
    torch.testing.assert_close(second.query(two.test).scores(two.z).values,
                               fresh.query(two.test).scores(two.z).values, rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore")
def test_reuse_refuses_changed_parameters_and_chains_sharing_nothing(two):
    model = Net(0)
    model.load_state_dict(two.models[0].state_dict())
    pre = ik.Stage(model, ce, two.data[0], regularizer=l2)
    fin = ik.Stage(Net(23), ce, data(23), params=HEAD, regularizer=l2)
    first = ik.Chain([pre, fin], [ik.Link("enc", case=1)], progress=False).fit()
    other_pre = ik.Stage(model, ce, two.data[0], regularizer=l2)  # the same model, another Stage object
    with pytest.raises(ik.InputError, match="another Stage object"):
        ik.Chain([other_pre, fin], [ik.Link("enc", case=1)], progress=False).reuse(first)
    with pytest.raises(ik.InputError, match="CurvatureConfig differs"):  # another matrix: not the same fit
        ik.Chain([pre, fin], [ik.Link("enc", case=1)], curvature=ik.CurvatureConfig(matrix="gauss-newton"),
                 progress=False).reuse(first)
    other_damping = ik.Chain([pre, fin], [ik.Link("enc", case=1)], solve=ik.SolveConfig(solver="ekfac", damping=0.3),
                             progress=False).reuse(first)  # another solve on the same fit: shared
    assert other_damping.reused == 2
    with torch.no_grad():
        model.enc.bias.add_(0.1)  # the pretrained stage moved after the first chain was fitted
    with pytest.raises(ik.InputError, match="changed since"):
        ik.Chain([pre, fin], [ik.Link("enc", case=1)], progress=False).reuse(first)
    fitted = ik.Chain([pre, fin], [ik.Link("enc", case=1)], progress=False).fit()
    with pytest.raises(ik.InputError, match="already fitted"):
        fitted.reuse(first)


# ---- persistence ----

def test_query_and_result_round_trip_bit_identical(two, tmp_path):
    chain = two.chain()
    query = chain.query(two.test, per_test=True)
    query.save(tmp_path / "q.anything")
    back = ik.load_query(tmp_path / "q.anything", chain)
    assert torch.equal(back.s, query.s)
    assert json.dumps(back.solves, sort_keys=True) == json.dumps(query.solves, sort_keys=True)
    res = back.scores(two.z)
    assert torch.equal(res.values, query.scores(two.z).values)
    res.save(tmp_path / "scores.bin")
    loaded = ik.load(tmp_path / "scores.bin")
    assert torch.equal(loaded.values, res.values) and torch.equal(loaded.index, res.index)
    assert loaded.diagnostics == res.diagnostics and loaded.method == res.method
    assert torch.equal(loaded.removal, res.removal)


def test_chain_fit_round_trip(two, tmp_path):
    chain = two.chain().fit()
    chain.save(tmp_path / "fit.st")
    fresh = two.chain().load(tmp_path / "fit.st")
    for k in range(3):
        assert torch.equal(fresh.operator(k).dense(), chain.operator(k).dense())
    assert torch.equal(fresh.query(two.test).s, chain.query(two.test).s)


def test_query_for_another_chain_is_refused(two, tmp_path):
    two.chain().query(two.test).save(tmp_path / "q")
    other = ThreeStages(1, 1).chain()
    with pytest.raises(ik.FileFormatError, match="another chain"):
        ik.load_query(tmp_path / "q", other)
    changed = ik.Chain(two.chain().stages, two.chain().links, solve=ik.SolveConfig(solver="direct", damping=1e-3))
    with pytest.raises(ik.FileFormatError, match="another chain"):
        ik.load_query(tmp_path / "q", changed)


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {_Payload.marker}",))


def test_pickle_payload_is_refused_and_never_executed(two, tmp_path):
    """load_query's side; ik.load's is in test_results.py."""
    _Payload.marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps({"s": _Payload()}))
    torch.save({"s": torch.zeros(3)}, tmp_path / "torch.pt")
    for bad in (path, tmp_path / "torch.pt"):
        with pytest.raises(ik.FileFormatError, match="not an influkit file"):
            ik.load_query(bad, two.chain())
    assert not _Payload.marker.exists()


def test_tampered_or_foreign_query_file_is_refused(two, tmp_path):
    chain = two.chain()
    path = chain.query(two.test).save(tmp_path / "q")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # flip bits of the last byte of s
    path.write_bytes(bytes(raw))
    with pytest.raises(ik.FileFormatError, match="modified"):
        ik.load_query(path, chain)
    result_path = chain.query(two.test).scores(two.z).save(tmp_path / "r")
    with pytest.raises(ik.FileFormatError, match="holds an influkit 'influence-result'"):
        ik.load_query(result_path, chain)


# ---- configuration and errors ----

def test_auto_solver_says_what_it_chose(two):
    chain = ik.Chain([ik.Stage(two.models[0], ce, two.data[0], regularizer=l2)])
    res = chain.query(two.test).scores(two.z)
    solve = res.diagnostics["solves"][0]
    assert res.diagnostics["stages"][0]["verdict"] == "minimum"
    assert solve["solver"] == "cg_spd" and solve["choice"].startswith("auto: at a minimum")  # one right-hand side
    many = chain.query(two.test, per_test=True).scores(two.z).diagnostics["solves"][0]
    assert many["solver"] == "direct" and "right-hand sides" in many["choice"]  # one factorization for them all
    assert ik.SolveConfig().choose(10**6)[0] == "minres"


def test_chain_errors(two):
    stages = two.chain().stages
    with pytest.raises(ik.InputError, match="need 2 links"):
        ik.Chain(stages, [ik.Link("enc")])
    with pytest.raises(ik.InputError, match="one per stage"):
        ik.Chain(stages, two.chain().links, solve=[ik.SolveConfig()] * 2)
    with pytest.raises(ik.InputError, match="alpha"):
        ik.Link("enc", case=2, alpha=-0.1)
    with pytest.raises(ik.InputError, match="case"):
        ik.Link("enc", case=3)
    with pytest.raises(ik.InputError, match="unknown solver"):
        ik.SolveConfig(solver="nope")
    with pytest.raises(ik.InputError, match="damping"):
        ik.SolveConfig(damping=-1.0)
    with pytest.raises(ik.ParameterError, match="matches no parameter"):
        ik.Chain(stages[:2], [ik.Link("encoder")])
    frozen = ik.Stage(two.models[0], ce, two.data[0], params=HEAD, regularizer=l2)
    with pytest.raises(ik.ParameterError, match="neither trained"):
        ik.Chain([frozen, stages[1]], [ik.Link("enc")])
    head_only = ik.Stage(two.models[1], ce, two.data[1], params=ENC, regularizer=l2)
    with pytest.raises(ik.ParameterError, match="trains nothing besides"):
        ik.Chain([stages[0], head_only], [ik.Link("enc", case=1)])


# ---- progress, early checks, explicit settings (issue 38) ----

def test_progress_off_prints_nothing_and_on_draws_a_bar_on_every_phase(two, capsys, monkeypatch):
    """progress=False prints nothing; progress=True (with the bars' delay at 0) draws the stationarity check's,
    the solve's and the scoring's bars, on ik.influence and on Chain/query/scores alike."""
    from influkit import progress

    stage = ik.Stage(two.models[0], ce, two.data[0], regularizer=l2)
    test = two.data[0][0][:5], two.data[0][1][:5]
    solve = ik.SolveConfig(solver="minres")
    ik.influence(stage, two.z, test, solve=solve, progress=False)
    ik.Chain([stage], solve=solve, progress=False).query(test).scores(two.z)
    quiet = capsys.readouterr()
    assert quiet.err == "" and quiet.out == ""
    monkeypatch.setattr(progress, "DELAY", 0.0)
    ik.influence(stage, two.z, test, solve=solve, progress=True)
    shown = capsys.readouterr().err
    for phase in ("Lanczos", "minres solve", "scoring"):
        assert phase in shown, phase
    ik.Chain([stage], solve=solve).query(test).scores(two.z)  # on by default
    assert "minres solve" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["shape", "index", "measure"])
def test_a_malformed_test_set_fails_before_the_fit(two, bad, monkeypatch):
    """A test set of the wrong width, an index out of range, or a measure that does not return one value per
    example is refused before any Hessian-vector product or gradient pass of the fit."""
    from influkit import curvature, stationarity

    calls = []
    monkeypatch.setattr(curvature, "hvp", lambda *a, **k: calls.append("hvp"))
    monkeypatch.setattr(stationarity, "assess", lambda *a, **k: calls.append("assess"))
    stage = ik.Stage(two.models[0], ce, two.data[0], regularizer=l2)
    x, y = two.data[0]
    given = {"shape": ((x[:3, :-1], y[:3]), None), "index": (torch.tensor([0, 10_000]), None),
             "measure": ((x[:3], y[:3]), lambda out, t: out.sum())}[bad]
    with pytest.raises(ik.InfluenceError):
        ik.Chain([stage]).query(given[0], measure=given[1])
    with pytest.raises(ik.InfluenceError):
        ik.influence(stage, torch.tensor([10_000]) if bad == "index" else None, given[0], measure=given[1])
    assert calls == []


@pytest.mark.parametrize("solver", ["ekfac", "direct", "minres", "cg_spd"])
def test_an_explicit_solver_is_used_on_every_stage_without_a_warning_replacing_it(two, solver):
    """A named solver runs on every stage of a two-stage chain, as named (no StationarityWarning is turned into
    another choice): the diagnostics record it and no reason starts with 'auto'."""
    pre = ik.Stage(two.models[0], ce, two.data[0], regularizer=l2)
    fin = ik.Stage(two.models[1], ce, two.data[1], params=two.trained[1], regularizer=l2)
    config = ik.SolveConfig(solver=solver, damping=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # not at a minimum of the damped objective; drift
        res = ik.Chain([pre, fin], [ik.Link("enc", case=1)], solve=config).query(two.test).scores()
    assert [s["solver"] for s in res.diagnostics["solves"]] == [solver, solver]
    assert not any(s["choice"].startswith("auto") for s in res.diagnostics["solves"])
    assert len(res.values) == len(pre)  # z defaults to every stage-1 example
