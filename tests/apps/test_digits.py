"""influkit.apps.digits and the ``influkit demo`` command: the two-stage digits experiment end to end."""

from __future__ import annotations

import pandas as pd
import pytest

import influkit.cli


@pytest.mark.slow
def test_cli_demo_writes_outputs(tmp_path):
    argv = ["demo", "--removals", "6", "--n-pretrain", "120", "--n-test", "60", "--out", str(tmp_path),
            "--quiet", "--threads", "1"]
    assert influkit.cli.main(argv) == 0
    for name in ("case1_scatter.png", "case1_gallery.png", "case1_loo.csv"):
        assert (tmp_path / name).stat().st_size > 0, name
    loo = pd.read_csv(tmp_path / "case1_loo.csv")
    assert len(loo) == 6 and {"predicted", "actual", "identity"} <= set(loo.columns)
