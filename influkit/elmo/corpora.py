"""Real English text for the ELMo influence experiment, from packages one can install: corpus, labels, tokens.

Source (chosen because it is a plain ``pip download`` from PyPI, so CI needs no apt package): the
source distribution of ``vaderSentiment==3.3.2`` ships ``additional_resources/hutto_ICWSM_2014.tar.gz``,
the human-rated sentence sets of Hutto & Gilbert (ICWSM 2014), each line ``id <TAB> mean rating <TAB> text``:

- ``nytEditorialSnippets`` (5,190 New York Times editorial sentences) and ``amazonReviewSnippets`` (3,708
  product-review sentences) — used, without their ratings, as the **pretraining corpus**;
- ``tweets`` (4,200 tweets rated −4…4 by ~20 people each) — the **labelled sentiment data**;
- ``movieReviewSnippets`` (10,605 Rotten-Tomatoes snippets) — available as another labelled set.

:func:`vader_archive` finds the sdist in the cache (``$INFLUKIT_CACHE`` or ``~/.cache/influkit``) or runs
``python -m pip download --no-deps --no-binary :all: vaderSentiment==3.3.2 -d <cache>`` once; the archive
is checked against its SHA-256 and read in place (nothing is installed or imported from it).

Alternative corpus: Debian's ``fortunes`` (``apt-get install -y fortunes``, plain text under
``/usr/share/games/fortunes``), read by :func:`fortunes_sentences`.

Missing data raises :class:`DataUnavailable`, whose message holds the exact command that fixes it.
"""

from __future__ import annotations

import hashlib
import html
import io
import os
import re
import subprocess
import sys
import tarfile
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..errors import DataUnavailable

VADER_VERSION = "3.3.2"
VADER_SDIST = f"vaderSentiment-{VADER_VERSION}.tar.gz"
VADER_SHA256 = "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9"
_INNER = f"vaderSentiment-{VADER_VERSION}/additional_resources/hutto_ICWSM_2014.tar.gz"
VADER_SETS = ("tweets", "nytEditorialSnippets", "amazonReviewSnippets", "movieReviewSnippets")
FORTUNES_DIR = Path("/usr/share/games/fortunes")

_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|[^\sa-z0-9]")


def cache_dir() -> Path:
    """``$INFLUKIT_CACHE`` or ``~/.cache/influkit``."""
    return Path(os.environ.get("INFLUKIT_CACHE", Path.home() / ".cache" / "influkit")).expanduser()


def pip_download_command(dest: Path) -> list[str]:
    """The pip command that fetches the vaderSentiment sdist into ``dest``."""
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        f"vaderSentiment=={VADER_VERSION}", "-d", str(dest),
    ]  # fmt: skip


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def vader_archive(download: bool = True, timeout: float = 300.0) -> Path:
    """Path of the cached ``vaderSentiment-3.3.2.tar.gz`` sdist, fetched with pip on first use.

    Raises :class:`DataUnavailable` (with the command to run) if it is absent and cannot be downloaded.
    """
    dest = cache_dir()
    path = dest / VADER_SDIST
    if not path.exists() and download:
        dest.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run(
                pip_download_command(dest) + ["--retries", "2", "--timeout", "30"],
                check=True, capture_output=True, timeout=timeout,
            )  # fmt: skip
        except (subprocess.SubprocessError, OSError):
            pass
    if not path.exists():
        command = " ".join(pip_download_command(dest)).replace(sys.executable, "python")
        raise DataUnavailable(
            f"the vaderSentiment {VADER_VERSION} source archive (human-rated tweets and editorial/review "
            f"sentences) is not in {dest} and could not be downloaded; with access to PyPI run:\n    {command}"
        )
    if _sha256(path) != VADER_SHA256:
        raise DataUnavailable(f"{path} does not have the expected SHA-256 {VADER_SHA256}; delete it and rerun.")
    return path


def read_vader_set(name: str, archive: Path | None = None) -> list[tuple[str, float, str]]:
    """Rows (id, mean rating, text) of one ``<name>_GroundTruth.txt`` set of the vaderSentiment sdist."""
    if name not in VADER_SETS:
        raise ValueError(f"unknown set {name!r}; choose one of {VADER_SETS}.")
    archive = vader_archive() if archive is None else Path(archive)
    if not archive.is_file():
        command = " ".join(pip_download_command(archive.parent)).replace(sys.executable, "python")
        raise DataUnavailable(
            f"{archive} does not exist: the vaderSentiment {VADER_VERSION} source archive holds the rated sets; "
            f"fetch it with:\n    {command}"
        )
    with tarfile.open(archive, "r:gz") as outer:
        inner_bytes = outer.extractfile(_INNER).read()
    with tarfile.open(fileobj=io.BytesIO(inner_bytes), mode="r:gz") as inner:
        raw = inner.extractfile(f"hutto_ICWSM_2014/{name}_GroundTruth.txt").read()
    rows = []
    for line in raw.decode("utf-8", errors="replace").splitlines():
        parts = line.strip("\r\n").split("\t")
        if len(parts) < 3:
            continue
        try:
            rating = float(parts[1])
        except ValueError:
            continue
        rows.append((parts[0], rating, "\t".join(parts[2:]).strip()))
    return rows


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens (clitics like ``'s`` kept on the word) and single punctuation characters."""
    return _TOKEN.findall(html.unescape(text).lower())


def vader_corpus(sets: Sequence[str] = ("nytEditorialSnippets", "amazonReviewSnippets")) -> list[str]:
    """The pretraining corpus: the raw sentences of ``sets`` (ratings dropped), in file order."""
    archive = vader_archive()
    return [text for name in sets for _, _, text in read_vader_set(name, archive)]


def sentiment_data(name: str = "tweets", min_abs_rating: float = 0.5) -> tuple[list[str], list[int]]:
    """(texts, labels) of a rated set: label 1 if the mean rating is positive, else 0; |rating| below
    ``min_abs_rating`` (near-neutral) dropped."""
    rows = read_vader_set(name)
    kept = [(text, int(rating > 0)) for _, rating, text in rows if abs(rating) >= min_abs_rating]
    return [t for t, _ in kept], [y for _, y in kept]


def fortunes_sentences(directory: Path = FORTUNES_DIR) -> list[str]:
    """The cookies of Debian's ``fortunes`` files (``%``-separated, whitespace collapsed)."""
    files = sorted(p for p in directory.glob("*") if p.is_file() and not p.suffix) if directory.is_dir() else []
    if not files:
        raise DataUnavailable(
            f"no fortune files under {directory}; install them with:\n    apt-get update && apt-get install -y fortunes"
        )
    out = []
    for path in files:
        for cookie in path.read_text(encoding="utf-8", errors="replace").split("\n%\n"):
            text = " ".join(cookie.split())
            if text:
                out.append(text)
    return out


def build_vocabulary(sentences: Iterable[Sequence[str]], size: int) -> list[str]:
    """The ``size`` most frequent tokens (ties broken alphabetically), for :class:`~influkit.elmo.Vocabulary`."""
    counts = Counter(t for s in sentences for t in s)
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]
