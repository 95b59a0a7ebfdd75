"""influkit.apps.cleansing: mislabel detection by self-influence, and removing harmful pretraining digits."""

from __future__ import annotations

import pandas as pd
import pytest

from conftest import need

need("sklearn"), need("matplotlib")  # the digits experiment and its plots (influkit[apps])

import influkit.cli
from influkit.apps.cleansing import cleansing_table, mislabel_detection
from influkit.apps.digits import DigitsSetup
from influkit.errors import InputError


def test_mislabel_self_influence_beats_random():
    table, accuracies = mislabel_detection(n_train=300)
    assert list(table.index) == ["self-influence", "training loss", "random"]
    assert "10% checked" in table.columns
    assert table.loc["self-influence", "10% checked"] > table.loc["random", "10% checked"]
    assert ((table >= 0) & (table <= 1)).all().all()
    assert all(0.5 < a <= 1.0 for a in accuracies.values())


def test_cleansing_rejects_a_removal_count_outside_the_pretraining_set():
    with pytest.raises(InputError, match="cannot remove 0 of"):
        cleansing_table(DigitsSetup(n_pretrain=40, n_test=20), removals=0, seeds=1, progress=False)


@pytest.mark.slow
def test_cleansing_table_tiny():
    table = cleansing_table(DigitsSetup(n_pretrain=60, n_finetune=60, n_test=30), fraction=0.1, seeds=2, progress=False)
    assert list(table.index) == ["none", "top 10% harmful", "random 10%"]
    assert set(table.columns.get_level_values(0)) == {"test_accuracy", "test_loss"}
    assert set(table.columns.get_level_values(1)) == {"mean", "std"}
    acc = table[("test_accuracy", "mean")]
    assert ((acc > 0.5) & (acc <= 1.0)).all()
    assert table.notna().all().all()


@pytest.mark.slow
def test_cli_clean_honours_removals_and_solver(tmp_path, capsys):
    argv = ["clean", "--removals", "7", "--solver", "cg", "--seeds", "1", "--n-pretrain", "80", "--n-test", "40",
            "--out", str(tmp_path), "--quiet", "--threads", "1"]
    assert influkit.cli.main(argv) == 0
    table = pd.read_csv(tmp_path / "cleansing.csv", header=[0, 1], index_col=0)
    assert list(table.index) == ["none", "top 7 harmful", "random 7"]
    assert "top 7 harmful" in capsys.readouterr().out
