"""Human-rated text for transformers: the four snippet sets of Hutto & Gilbert (ICWSM 2014), labelled by source.

The source distribution of ``vaderSentiment==3.3.2`` (not the wheel) ships
``additional_resources/hutto_ICWSM_2014.tar.gz`` with four files of ``id <TAB> mean rating <TAB> text``, each
sentence rated by about 20 people on −4 (most negative) … 4 (most positive):

=========  ==========================  ========  =====================================
source     file                        snippets  text
=========  ==========================  ========  =====================================
movie      movieReviewSnippets         10,605    Rotten Tomatoes review sentences (lower-cased, tokenized)
amazon     amazonReviewSnippets        3,708     Amazon product-review sentences
nyt        nytEditorialSnippets        5,190     New York Times editorial sentences
tweets     tweets                      4,200     tweets
=========  ==========================  ========  =====================================

The archive is read in place (nothing is installed or imported from it); :mod:`influkit.elmo.corpora` finds it
in the cache (``$INFLUKIT_CACHE`` or ``~/.cache/influkit``) or fetches it once with pip.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError

SOURCES = {"movie": "movieReviewSnippets", "amazon": "amazonReviewSnippets", "nyt": "nytEditorialSnippets",
           "tweets": "tweets"}


@dataclass(frozen=True)
class Snippet:
    """One rated sentence: its source (a key of ``SOURCES``), id in that file, mean human rating in [−4, 4], text."""

    source: str
    id: str
    rating: float
    text: str


def rated_snippets(sources: Sequence[str] = tuple(SOURCES), *, archive: str | Path | None = None,
                   download: bool = True) -> list[Snippet]:
    """Every snippet of ``sources`` (keys of ``SOURCES``), in file order, source by source; HTML entities decoded.

    Needs the vaderSentiment 3.3.2 sdist, fetched once with

        pip download --no-binary :all: --no-deps vaderSentiment==3.3.2 -d ~/.cache/influkit

    archive: the path of ``vaderSentiment-3.3.2.tar.gz`` (default: the cache; with ``download`` the command above
    is run when it is absent). A missing archive raises :class:`~influkit.errors.DataUnavailable` whose message
    holds that command.
    """
    from ..elmo.corpora import read_vader_set, vader_archive

    unknown = [s for s in sources if s not in SOURCES]
    if unknown or not sources:
        raise InputError(f"unknown snippet sources {unknown or list(sources)}; choose among {list(SOURCES)}.")
    path = vader_archive(download=download) if archive is None else Path(archive)
    return [Snippet(source, ident, rating, html.unescape(text))
            for source in sources for ident, rating, text in read_vader_set(SOURCES[source], path)]
