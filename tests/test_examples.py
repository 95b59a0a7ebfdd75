"""The short examples (examples/<use case>/) run to the end and print what their docstrings promise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import need

ROOT = Path(__file__).resolve().parents[1]
# script -> a line its output must contain
EXAMPLES = {
    "ssl/moons.py": "per-example: test accuracy",
    "turnover/digits.py": "most negative self-influences hold",
    "cleansing/digits.py": "share of the flipped labels found",
    "elmo/tweets.py": "pretraining solve: minres",
    "unrolled/digits.py": "single-digit drops replayed: Pearson r",
    "unrolled/trainer.py": "replay vs the Trainer's weights: max |difference| 0.0",
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
    out = subprocess.run([sys.executable, str(ROOT / "examples" / script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert EXAMPLES[script] in out.stdout, out.stdout
    if script == "unrolled/digits.py":  # the exact metagradient predicts single drops of the replayed run
        r = float(re.search(r"replayed change (-?[0-9.]+) \(metagradient\)", out.stdout).group(1))
        assert r > 0.95, out.stdout
