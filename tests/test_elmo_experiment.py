"""The ELMo experiment's data: the vaderSentiment corpus and rated tweets read from the sdist, and the error that
names the command when they are missing."""

from __future__ import annotations

import pytest

from conftest import need

need("h5py")  # influkit.elmo (influkit[elmo])

from influkit.elmo import corpora  # noqa: E402


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
