"""influkit's command line: bad input ends with its message on stderr and a non-zero status, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cli_error_prints_the_message_and_exits_non_zero(tmp_path):
    bad = tmp_path / "scores.safetensors"
    bad.write_text("not an influkit file")
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    for path, message in ((bad, "is not an influkit file"), (tmp_path / "missing.safetensors", "does not exist")):
        done = subprocess.run([sys.executable, "-m", "influkit", "report", str(path)], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        assert done.returncode == 2
        assert done.stderr.startswith("influkit report: error: ") and message in done.stderr
        assert "Traceback" not in done.stderr and done.stdout == ""
