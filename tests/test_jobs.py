"""``influkit score CONFIG``: a job from a config file, in one process and under torchrun with 2 ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import influkit as ik
from influkit import jobs
from influkit.cli import main

FACTORY = textwrap.dedent(
    """
    import torch
    from torch import nn
    import influkit as ik

    def ce(out, y):
        return nn.functional.cross_entropy(out, y, reduction="none")

    def build(device):
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1)
        f64 = {"dtype": torch.float64, "device": device}  # explicit: the same numbers whatever the default dtype
        pre = nn.Sequential(nn.Linear(5, 4, **f64), nn.Tanh(), nn.Linear(4, 3, **f64))
        fin = nn.Sequential(nn.Linear(5, 4, **f64), nn.Tanh(), nn.Linear(4, 2, **f64))
        fin[0].load_state_dict(pre[0].state_dict())
        zx, zy = torch.randn(50, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, (50,), generator=gen)
        fx, fy = torch.randn(30, 5, generator=gen, dtype=torch.float64), torch.randint(0, 2, (30,), generator=gen)
        stages = [ik.Stage(pre, ce, (zx, zy)), ik.Stage(fin, ce, (fx, fy), params="2")]
        return {"stages": stages, "links": [ik.Link("0", case=1)], "test": torch.arange(8), "z": torch.arange(45)}
    """
)

CONFIG = textwrap.dedent(
    """
    factory = "job_factory:build"
    out = "scores"
    chunk_size = 4
    per_test = true
    device = "cpu"
    [solve]
    solver = "direct"
    damping = 0.1
    """
)


@pytest.fixture
def job(tmp_path):
    (tmp_path / "job_factory.py").write_text(FACTORY)
    (tmp_path / "job.toml").write_text(CONFIG)
    yield tmp_path / "job.toml"
    sys.modules.pop("job_factory", None)


def expected(job):
    sys.path.insert(0, str(job.parent))
    import job_factory

    built = job_factory.build(torch.device("cpu"))
    chain = ik.Chain(built["stages"], built["links"], solve=ik.SolveConfig(solver="direct", damping=0.1))
    return chain.query(built["test"], per_test=True).scores(built["z"], chunk_size=4)


def test_job_in_one_process_matches_the_chain(job, capsys):
    assert main(["score", str(job), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "multi-stage case 1: 45 examples scored on 1 process(es); 12 chunks computed, 0 resumed" in printed
    truth = expected(job)
    values = np.load(job.parent / "scores" / "values.npy")
    assert np.array_equal(values, truth.values.numpy())
    query = ik.load_query(job.parent / "scores" / "query.safetensors", truth_chain(job))
    assert query.per_test and query.n_test == 8


def truth_chain(job):
    import job_factory

    built = job_factory.build(torch.device("cpu"))
    return ik.Chain(built["stages"], built["links"], solve=ik.SolveConfig(solver="direct", damping=0.1))


def test_job_under_torchrun_with_two_ranks(job):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node=2", "-m", "influkit", "score", str(job), "--quiet"],
        capture_output=True, text=True, timeout=240, env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "scored on 2 process(es)" in proc.stdout
    values = np.load(job.parent / "scores" / "values.npy")
    np.testing.assert_allclose(values, expected(job).values.numpy(), rtol=1e-10, atol=1e-12)


def test_bad_configs_say_what_to_fix(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('factory = "nowhere"\n')
    with pytest.raises(ik.InputError, match="module:function"):
        jobs.read_config(bad)
    bad.write_text('factory = "m:f"\nsolver = "direct"\n')
    with pytest.raises(ik.InputError, match="unknown settings"):
        jobs.read_config(bad)
    bad.write_text('factory = "no_such_module:build"\n')
    with pytest.raises(ik.InputError, match="cannot import"):
        jobs.run(bad)
