"""torch.distributed execution (gloo, several processes on this machine) and streamed, resumable scoring.

Every distributed run must equal the single-process result to 1e-10 in float64; shards are disjoint and
complete; a killed streaming run resumes without recomputing finished chunks; a rank that raises makes the
others fail with a DistributedError instead of hanging.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch import nn

import influkit as ik
from influkit import distributed
from influkit.scoring import rank_chunks

from conftest import assert_a_failing_rank_fails_the_others, run_a_rank_that_may_fail, run_gloo_rank
from test_chain import ThreeStages, ce, l2

TESTS = Path(__file__).parent


def scenarios(solutions: dict):
    """name -> InfluenceResult for single-stage, Case 1, Case 2 and a 3-stage chain (float64, small).

    solutions: the trained optima {"12": x, "22": x} of ThreeStages(1, 2) and ThreeStages(2, 2).
    """
    one_two, two_two = ThreeStages(1, 2, solutions["12"]), ThreeStages(2, 2, solutions["22"])
    results = {}
    stage = ik.Stage(one_two.models[0], ce, one_two.data[0], regularizer=l2)
    results["single"] = ik.Chain([stage], solve=ik.SolveConfig(solver="minres", tol=1e-13)).query(one_two.test).scores(chunk_size=5)
    for case, problem in ((1, one_two), (2, two_two)):
        pre = ik.Stage(problem.models[0], ce, problem.data[0], regularizer=l2)
        fin = ik.Stage(problem.models[1], ce, problem.data[1], params=problem.trained[1], regularizer=l2)
        chain = ik.Chain([pre, fin], [ik.Link("enc", case=case, alpha=0.05)], solve=ik.SolveConfig(solver="direct"))
        results[f"case{case}"] = chain.query(problem.test).scores(chunk_size=5)
    results["three"] = one_two.chain("direct").query(one_two.test, per_test=True).scores(chunk_size=7)
    return results


def _worker(rank: int, world: int, init_file: str, out: str, solutions: dict) -> None:
    def save_every_scenario():
        for name, result in scenarios(solutions).items():
            result.save(Path(out) / f"{name}.rank{rank}")

    run_gloo_rank(rank, world, init_file, save_every_scenario)


@pytest.fixture(scope="module")
def solutions():
    return {"12": ThreeStages(1, 2).x, "22": ThreeStages(2, 2).x}


@pytest.fixture(scope="module")
def single_process(solutions):
    return scenarios(solutions)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_return_the_single_process_result(single_process, solutions, tmp_path, world):
    mp.start_processes(_worker, args=(world, str(tmp_path / "init"), str(tmp_path), solutions), nprocs=world,
                       start_method="spawn", join=True)
    for name, expected in single_process.items():
        for rank in range(world):
            got = ik.load(tmp_path / f"{name}.rank{rank}")
            torch.testing.assert_close(got.values, expected.values, rtol=1e-10, atol=1e-12)
            assert torch.equal(got.index, expected.index)
            assert got.diagnostics["chunks"]["ranks"] == world


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [1, 7, 24, 101])
def test_shards_are_disjoint_and_complete(monkeypatch, world, n):
    monkeypatch.setattr(distributed, "world_size", lambda: world)
    examples, chunks, rows = [], [], []
    for r in range(world):
        monkeypatch.setattr(distributed, "rank", lambda r=r: r)
        examples.append(distributed.shard(torch.arange(n)))
        mine, counts = rank_chunks(n, 5)
        chunks.extend(mine)
        rows = counts
    assert torch.equal(torch.cat(examples), torch.arange(n))
    assert chunks == list(range(-(-n // 5))) and sum(rows) == n


def _query_small_chain() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 4, generator=gen), torch.randint(0, 2, (30,), generator=gen)
    stage = ik.Stage(torch.nn.Linear(4, 2), ce, (x, y), regularizer=l2)
    ik.Chain([stage], solve=ik.SolveConfig(solver="minres")).query((x[:3], y[:3])).scores()


def _failing_worker(rank: int, world: int, init_file: str, out: str) -> None:
    run_a_rank_that_may_fail(rank, world, init_file, out, _query_small_chain)


def test_a_failing_rank_fails_the_others(tmp_path):
    assert_a_failing_rank_fails_the_others(_failing_worker, tmp_path)


# ---- streamed, resumable scoring ----

STREAM_SOLUTION = None  # ThreeStages(1, 1)'s optimum, set by the fixture below and passed to the subprocess

STREAM_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    from safetensors.torch import load_file
    sys.path.insert(0, {tests!r})
    torch.set_default_dtype(torch.float64); torch.set_num_threads(1)
    import test_distributed
    test_distributed.STREAM_SOLUTION = load_file({solution!r})["x"]
    chain, test = test_distributed.streaming_chain(slow={slow})
    chain.query(test).scores(chunk_size=4, out={out!r})
    """
)


def streaming_chain(slow: float = 0.0, damping: float = 0.0):
    """A 2-stage chain over 120 pretraining examples; ``slow`` seconds of sleep per scored chunk."""
    problem = ThreeStages(1, 1, STREAM_SOLUTION)
    x = torch.cat([problem.data[0][0]] * 5)
    y = torch.cat([problem.data[0][1]] * 5)

    def loss(out, target):
        if slow and out.shape[0] <= 4:  # a scoring chunk of 4 rows (contraction), or one vmapped per-example call
            time.sleep(slow)
        return ce(out, target)

    pre = ik.Stage(problem.models[0], loss, (x, y), regularizer=l2)
    fin = ik.Stage(problem.models[1], ce, problem.data[1], params=problem.trained[1], regularizer=l2)
    solve = ik.SolveConfig(solver="direct", damping=damping)
    return ik.Chain([pre, fin], [ik.Link("enc", case=1)], solve=solve), problem.test


@pytest.fixture(scope="module")
def stream_solution(tmp_path_factory):
    global STREAM_SOLUTION
    STREAM_SOLUTION = ThreeStages(1, 1).x
    path = tmp_path_factory.mktemp("solution") / "x.safetensors"
    save_file({"x": STREAM_SOLUTION}, str(path))
    return path


def test_killed_stream_resumes_without_recomputing(tmp_path, stream_solution):
    out = tmp_path / "scores"
    script = STREAM_SCRIPT.format(tests=str(TESTS), slow=0.05, out=str(out), solution=str(stream_solution))
    proc = subprocess.Popen([sys.executable, "-c", script], env=os.environ | {"OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while len(list(out.glob("chunk-*.safetensors"))) < 4 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = len(list(out.glob("chunk-*.safetensors")))
    assert 4 <= finished < 30, f"kill came too late: {finished} chunks"

    chain, test = streaming_chain()
    resumed = chain.query(test).scores(chunk_size=4, out=out)
    assert resumed.diagnostics["chunks"]["reused"] == finished
    assert resumed.diagnostics["chunks"]["computed"] == 30 - finished
    whole = chain.query(test).scores(chunk_size=4)
    assert torch.equal(resumed.values, whole.values) and torch.equal(resumed.index, whole.index)
    again = chain.query(test).scores(chunk_size=4, out=out)
    assert again.diagnostics["chunks"] == resumed.diagnostics["chunks"] | {"reused": 30, "computed": 0}


def test_resume_against_a_changed_query_is_refused(tmp_path, stream_solution):
    chain, test = streaming_chain()
    chain.query(test).scores(torch.arange(40), chunk_size=8, out=tmp_path)
    changed, _ = streaming_chain(damping=1e-3)
    with pytest.raises(ik.InputError, match="refusing to resume"):
        changed.query(test).scores(torch.arange(40), chunk_size=8, out=tmp_path)
    with pytest.raises(ik.InputError, match="rows"):
        chain.query(test).scores(torch.arange(48), chunk_size=8, out=tmp_path)
    with pytest.raises(ik.InputError, match="test set|query"):
        chain.query((test[0][:3], test[1][:3])).scores(torch.arange(40), chunk_size=8, out=tmp_path)


# ---- factored curvature (K-FAC, EK-FAC, diagonal Fisher) on sharded data ----


class Scaled(nn.Module):
    """Two linear layers (Kronecker blocks) and a free output scale (a diagonal block outside any layer)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.enc, self.head = nn.Linear(4, 3), nn.Linear(3, 2)
        self.scale = nn.Parameter(torch.tensor([1.5, 0.7]))

    def forward(self, x):
        return self.head(torch.tanh(self.enc(x))) * self.scale


FITS = {  # name -> fit_curvature arguments: several batches per rank, both EK-FAC paths, a subset of examples
    "kfac": dict(kind="kfac"),
    "ekfac": dict(kind="ekfac"),
    "ekfac_two_passes": dict(kind="ekfac", cache_bytes=0),
    "ekfac_subset": dict(kind="ekfac", indices=torch.tensor([0, 2, 3, 5, 8, 9, 13, 17, 18, 21, 22])),
    "diagonal": dict(kind="diagonal"),
}


def factored_scenarios(solutions: dict) -> dict[str, torch.Tensor]:
    """name -> tensor: every fitted factor, each curvature as a dense matrix, and Case 1 chain scores solved with
    EK-FAC as the approximate inverse and as the preconditioner of MINRES (float64)."""
    from influkit.factored import fit_curvature

    out = {}
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(24, 4, generator=gen)
    scaled = ik.Stage(Scaled(), ce, (x, (x[:, 0] > 0).long()), regularizer=l2)
    streamed, batches = [], scaled.batches

    def counted(indices=None, batch_size=None):  # the examples this process reads
        for inputs, targets in batches(indices, batch_size):
            streamed.append(inputs.shape[0])
            yield inputs, targets

    scaled.batches = counted
    for name, args in FITS.items():
        streamed.clear()
        curvature = fit_curvature(scaled, batch_size=5, seed=3, **args)
        out[f"{name}.streamed"] = torch.tensor(float(sum(streamed)))
        tensors, meta = curvature.state(f"{name}.")
        out |= {k: v for k, v in tensors.items() if not k.endswith((".left", ".right"))}  # eigenvectors: up to sign
        out[f"{name}.dense"] = curvature.dense()
        out[f"{name}.tokens"] = torch.tensor([layer["tokens_per_example"] for layer in meta["info"]["layers"]])
        assert meta["info"]["diagonal"] == {"scale": meta["info"]["diagonal"]["scale"]}
    problem = ThreeStages(1, 2, solutions["12"])
    pre = ik.Stage(problem.models[0], ce, problem.data[0], regularizer=l2)
    fin = ik.Stage(problem.models[1], ce, problem.data[1], params=problem.trained[1], regularizer=l2)
    for name, solve in (("ekfac", ik.SolveConfig(solver="ekfac", damping=1e-3)),
                        ("minres_ekfac", ik.SolveConfig(solver="minres", preconditioner="ekfac", tol=1e-13))):
        chain = ik.Chain([pre, fin], [ik.Link("enc", case=1)], solve=solve)
        chain.fit()
        out[f"scores.{name}"] = chain.query(problem.test).scores(chunk_size=5).values
    return out


def _factored_worker(rank: int, world: int, init_file: str, out: str, solutions: dict) -> None:
    def save_the_factored_scenarios():
        save_file({k: v.contiguous() for k, v in factored_scenarios(solutions).items()},
                  str(Path(out) / f"factored.rank{rank}"))

    run_gloo_rank(rank, world, init_file, save_the_factored_scenarios)


def test_factored_curvature_is_the_same_on_every_rank_and_equals_one_process(solutions, tmp_path):
    expected = factored_scenarios(solutions)
    mp.start_processes(_factored_worker, args=(2, str(tmp_path / "init"), str(tmp_path), solutions), nprocs=2,
                       start_method="spawn", join=True)
    ranks = [load_file(str(tmp_path / f"factored.rank{rank}")) for rank in range(2)]
    assert set(ranks[0]) == set(ranks[1]) == set(expected)
    for name, args in FITS.items():  # each rank read half of the examples (twice for EK-FAC's second pass)
        streamed = [float(ranks[r].pop(f"{name}.streamed")) for r in range(2)]
        assert streamed[0] + streamed[1] == float(expected.pop(f"{name}.streamed"))
        n, passes = len(args["indices"]) if "indices" in args else 24, 1 + ("cache_bytes" in args)
        assert streamed == [passes * (n // 2), passes * (n - n // 2)], name
    for name, value in expected.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name  # all-reduced sums: bit-identical factors
        torch.testing.assert_close(ranks[0][name], value, rtol=1e-10, atol=1e-12 * float(value.abs().max()), msg=name)


def test_sampled_labels_depend_on_the_example_index_only():
    """The same factors whatever the batch size, so sharding cannot change the sampled labels."""
    from influkit.factored import fit_curvature

    gen = torch.Generator().manual_seed(9)
    x = torch.randn(30, 4, generator=gen)
    stage = ik.Stage(Scaled(), ce, (x, (x[:, 1] > 0).long()))
    for kind in ("kfac", "diagonal"):
        whole = fit_curvature(stage, kind=kind, fisher="sampled", batch_size=30, seed=4).dense()
        pieces = fit_curvature(stage, kind=kind, fisher="sampled", batch_size=7, seed=4).dense()
        torch.testing.assert_close(pieces, whole, rtol=1e-12, atol=0)
        other = fit_curvature(stage, kind=kind, fisher="sampled", batch_size=30, seed=5).dense()
        assert not torch.allclose(other, whole)
