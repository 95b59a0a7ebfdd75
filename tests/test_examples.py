"""The short examples (examples/<use case>/) run to the end and print what their docstrings promise (the ones with
a ``--quick`` size at that size; the scoring job with the command its docstring gives)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

import pytest
from conftest import need

ROOT = Path(__file__).resolve().parents[1]
# script -> a line its output must contain
EXAMPLES = {
    "ssl/moons.py": "per-example: test accuracy",
    "turnover/digits.py": "most negative self-influences hold",
    "cleansing/digits.py": "share of the flipped labels found",
    "elmo/tweets.py --quick": "pretraining solve: minres",
    "unrolled/digits.py": "single-digit drops replayed: Pearson r",
    "unrolled/trainer.py": "replay vs the Trainer's weights: max |difference| 0.0",
    "multistage/digits.py --quick": "Pearson r between the two cases' scores",
    "multistage/report.py --quick": "case1_result.safetensors",
    "jobs/score_job.toml": "720 examples scored on 1 process(es)",
}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_runs(script, tmp_path):
    if script.startswith("elmo/") or script == "unrolled/trainer.py":
        need("h5py") if script.startswith("elmo/") else pytest.importorskip("transformers")
        from influkit.elmo import corpora

        try:
            corpora.vader_archive()
        except corpora.DataUnavailable as exc:
            pytest.skip(f"vaderSentiment sdist unavailable: {exc}")
    else:
        need("sklearn")
    env = os.environ | {"PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
    path, *args = script.split()
    if path.endswith(".toml"):  # a job: `influkit score` on a copy (its scores go beside the config file)
        shutil.copytree(ROOT / "examples" / Path(path).parent, tmp_path / "job")
        command = [sys.executable, "-m", "influkit", "score", str(tmp_path / "job" / Path(path).name), "--quiet"]
    else:
        command = [sys.executable, str(ROOT / "examples" / path), *args]
    out = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert EXAMPLES[script] in out.stdout, out.stdout
    if path.startswith("multistage/"):  # the galleries / the page and the result it renders again
        written = ["multistage_gallery_case1.png", "multistage_gallery_case2.png"] if path.endswith("digits.py") else \
            ["case1_report.html", "case1_result.safetensors"]
        out_dir = tmp_path / "influkit-results" / ("multistage/quick" if path.endswith("digits.py") else "report")
        for name in written:
            assert (out_dir / name).stat().st_size > 0, name
    if path.startswith("jobs/"):  # every pretraining digit 0–3 scored, in the order of the index
        values = np.load(tmp_path / "job" / "score_job_scores" / "values.npy")
        index = np.load(tmp_path / "job" / "score_job_scores" / "index.npy")
        assert values.shape[0] == 720 and np.isfinite(values).all() and (index == np.arange(720)).all()
    if script == "unrolled/digits.py":  # the exact metagradient predicts single drops of the replayed run
        r = float(re.search(r"replayed change (-?[0-9.]+) \(metagradient\)", out.stdout).group(1))
        assert r > 0.95, out.stdout
