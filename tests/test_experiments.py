"""Fast end-to-end checks of the paper experiments: mislabel detection, the ``influkit demo`` CLI, cleansing."""

from __future__ import annotations

import pytest

import influkit.cli
from influkit.cleansing import cleansing_table, mislabel_detection
from influkit.experiments import DigitsSetup


def test_mislabel_self_influence_beats_random():
    table, accuracies = mislabel_detection(n_train=300)
    assert list(table.index) == ["self-influence", "training loss", "random"]
    assert "10% checked" in table.columns
    assert table.loc["self-influence", "10% checked"] > table.loc["random", "10% checked"]
    assert ((table >= 0) & (table <= 1)).all().all()
    assert all(0.5 < a <= 1.0 for a in accuracies.values())


@pytest.mark.slow
def test_cli_demo_writes_outputs(tmp_path):
    argv = ["demo", "--removals", "6", "--n-pretrain", "120", "--n-test", "60", "--out", str(tmp_path),
            "--quiet", "--threads", "1"]
    assert influkit.cli.main(argv) == 0
    for name in ("case1_scatter.png", "case1_gallery.png", "case1_loo.csv"):
        assert (tmp_path / name).stat().st_size > 0, name
    import pandas as pd

    loo = pd.read_csv(tmp_path / "case1_loo.csv")
    assert len(loo) == 6 and {"predicted", "actual", "identity"} <= set(loo.columns)


@pytest.mark.slow
def test_cleansing_table_tiny():
    table = cleansing_table(DigitsSetup(n_pretrain=120, n_test=60), fraction=0.1, seeds=2, progress=False)
    assert list(table.index) == ["none", "top 10% harmful", "random 10%"]
    assert set(table.columns.get_level_values(0)) == {"test_accuracy", "test_loss"}
    assert set(table.columns.get_level_values(1)) == {"mean", "std"}
    acc = table[("test_accuracy", "mean")]
    assert ((acc > 0.5) & (acc <= 1.0)).all()
    assert table.notna().all().all()
