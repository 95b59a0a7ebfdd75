"""influkit.hf.snippets: the four rated snippet files read from a vaderSentiment sdist, and the error that names
the pip command when the sdist is missing (checked on a small archive built here with the sdist's layout)."""

from __future__ import annotations

import io
import tarfile

import pytest

from influkit import hf
from influkit.errors import DataUnavailable, InfluenceError, InputError

ROWS = {
    "movieReviewSnippets": ["1\t2.5\tthe rock is destined to be great .", "2\t-3.1\ta dull , lifeless film ."],
    "amazonReviewSnippets": ["1_1\t1.0\tWorks fine &amp; cheap"],
    "nytEditorialSnippets": ["7\t-0.4\tThe senate stalled again.", "not a row"],
    "tweets": ["9\t3.0\tlove it!!", "10\tbad\tunrated line is skipped"],
}


def _tar_gz(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture
def sdist(tmp_path):
    inner = _tar_gz({f"hutto_ICWSM_2014/{name}_GroundTruth.txt": "\n".join(rows).encode() for name, rows in ROWS.items()})
    path = tmp_path / "vaderSentiment-3.3.2.tar.gz"
    path.write_bytes(_tar_gz({"vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz": inner}))
    return path


def test_rated_snippets_reads_every_source_in_order_with_ratings_and_decoded_text(sdist):
    snippets = hf.rated_snippets(archive=sdist)
    assert [(s.source, s.id, s.rating) for s in snippets] == [
        ("movie", "1", 2.5), ("movie", "2", -3.1), ("amazon", "1_1", 1.0), ("nyt", "7", -0.4), ("tweets", "9", 3.0)]
    assert snippets[2].text == "Works fine & cheap"
    assert [s.source for s in hf.rated_snippets(["tweets", "movie"], archive=sdist)] == ["tweets", "movie", "movie"]


def test_unknown_source_names_the_choices(sdist):
    with pytest.raises(InputError, match="choose among \\['movie', 'amazon', 'nyt', 'tweets'\\]"):
        hf.rated_snippets(["imdb"], archive=sdist)


def test_missing_archive_raises_an_influence_error_with_the_pip_command(tmp_path, monkeypatch):
    command = "pip download --no-deps --no-binary :all: vaderSentiment==3.3.2"
    with pytest.raises(DataUnavailable, match=command) as info:
        hf.rated_snippets(archive=tmp_path / "absent.tar.gz")
    assert isinstance(info.value, InfluenceError)
    monkeypatch.setenv("INFLUKIT_CACHE", str(tmp_path / "empty"))
    with pytest.raises(DataUnavailable, match=command):
        hf.rated_snippets(download=False)
