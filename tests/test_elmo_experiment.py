"""The ELMo multi-stage influence experiment (studies/elmo_influence.py) in its CI-sized ``--quick`` form."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch

from benchmarks.common import study
from conftest import need

need("h5py")  # influkit.elmo (influkit[elmo])

from influkit.elmo import corpora  # noqa: E402


@pytest.fixture
def one_thread():
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)


@pytest.fixture(scope="module")
def vader_archive():
    try:
        return corpora.vader_archive()
    except corpora.DataUnavailable as exc:
        pytest.skip(f"the vaderSentiment sdist (corpus and rated tweets) is not available offline: {exc}")


def test_corpus_and_sentiment_data_are_read_from_the_sdist(vader_archive):
    sentences = corpora.vader_corpus()
    assert len(sentences) == 5190 + 3708
    texts, labels = corpora.sentiment_data("tweets", min_abs_rating=0.5)
    assert 3000 < len(texts) < 4200 and set(labels) == {0, 1}
    assert corpora.tokenize("It's &amp; GREAT!!") == ["it's", "&", "great", "!", "!"]
    assert corpora.build_vocabulary([["b", "a", "b"], ["c"]], 2) == ["b", "a"]


def test_missing_data_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("INFLUKIT_CACHE", str(tmp_path))
    with pytest.raises(corpora.DataUnavailable, match="pip download --no-deps --no-binary :all: vaderSentiment"):
        corpora.vader_archive(download=False)
    with pytest.raises(corpora.DataUnavailable, match="apt-get install -y fortunes"):
        corpora.fortunes_sentences(tmp_path / "none")


@pytest.mark.slow
def test_quick_experiment_writes_finite_results(vader_archive, tmp_path, one_thread):
    example = study("elmo_influence")
    assert example.main(["--quick", "--out", str(tmp_path)]) == 0
    for name in ("summary.json", "scores.csv", "table1_top_bottom.csv", "loo.csv", "loo_scatter.png",
                 "elmo_options.json", "elmo_weights.hdf5"):  # fmt: skip
        assert (tmp_path / name).exists(), name
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["pretraining"]["reload_identical"]
    assert math.isfinite(summary["pretraining"]["perplexity_heldout"])
    assert summary["influence_test_set"]["finite"] and summary["influence_test_sentence"]["finite"]
    assert summary["loo"]["noise_rerun_same_seed"] == 0.0
    scores = pd.read_csv(tmp_path / "scores.csv")
    assert len(scores) == summary["data"]["pretrain_sentences"]
    assert scores[["influence_test_set", "influence_test_sentence"]].notna().all().all()
    table = pd.read_csv(tmp_path / "table1_top_bottom.csv")
    assert set(table["test"].str.startswith("tweet")) == {True, False}
    loo = pd.read_csv(tmp_path / "loo.csv")
    assert len(loo) == 4 and loo["actual_change"].notna().all()
