"""The documentation stays true: every default quoted in a user page is the code's, user pages cite no internal
material, the README stays short and the landing page speaks to users."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

import influkit as ik
from influkit import auto, progress, solvers, stationarity
from influkit.index import DEFAULT_DIM
from influkit.unrolled import stability

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CONTRIBUTOR_PAGES = ("architecture.md", "api.md")  # where a change goes; the generated reference
USER_PAGES = sorted(p for p in [*DOCS.glob("*.md"), *(DOCS / "guides").glob("*.md")] if p.name not in CONTRIBUTOR_PAGES)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def power(x: float) -> str:
    """10⁶ for 1e6, 2·10⁶ for 2e6, 10⁻³ for 1e-3: how the pages write round powers of ten."""
    mantissa, exponent = f"{x:.0e}".split("e")
    return ("" if mantissa == "1" else f"{mantissa}·") + "10" + str(int(exponent)).translate(SUPERSCRIPT)


def scientific(x: float) -> str:
    """1e-3 for 0.001: how the pages write a tolerance."""
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _link_alpha() -> float:
    return inspect.signature(ik.Link).parameters["alpha"].default


def _cli():
    from influkit import cli

    return cli


# (page, phrase as the page writes it, filled from the code). A changed default changes the phrase, which the page
# then no longer contains: the test names the page to update.
QUOTED = [
    ("concepts.md", lambda: f"`ik.Link(shared, case=1, alpha={_link_alpha()})`"),
    ("concepts.md", lambda: f"step 1/({solvers.STEP_MARGIN}·λ_max) by default"),
    ("concepts.md", lambda: f"λ = {auto.DAMPING_RATIO}·θ_max·min(1, r/{auto.R_REF})"),
    ("concepts.md", lambda: f"at r ≥ {auto.R_REF} it bounds the condition number of G + λI by about "
                            f"{1 + 1 / auto.DAMPING_RATIO:.0f}"),
    ("concepts.md", lambda: f"tol is {scientific(solvers.default_tol(torch.float64))} in float64 and "
                            f"{scientific(solvers.default_tol(torch.float32))} in float32 for exact methods, and "
                            f"{solvers.APPROXIMATE_TOL} for the approximate inverses"),
    ("concepts.md", lambda: f"right-hand sides when p ≤ {auto.DIRECT_MAX:,}"),
    ("concepts.md", lambda: f"the dense pseudo-inverse (p ≤ {auto.DIRECT_MAX:,})"),
    ("concepts.md", lambda: f"above {power(auto.PRECONDITION_MIN)} parameters"),
    ("concepts.md", lambda: f'"non-stationary"` (r > {scientific(stationarity.GRADIENT_TOL)})'),
    ("guides/defaults.md", lambda: f"of min(n, {stationarity.SAMPLE}) examples (`eigenvalue_source"),
    ("guides/defaults.md", lambda: f"Stationary when r ≤ {power(stationarity.GRADIENT_TOL)}"),
    ("guides/defaults.md", lambda: f"stationary): {stationarity.STEPS} Lanczos steps on the exact H"),
    ("guides/defaults.md", lambda: f"it: {stationarity.LARGEST_STEPS} Lanczos steps (`stationarity.LARGEST_STEPS`)"),
    ("guides/defaults.md", lambda: f"stage gets the {stationarity.STEPS} Lanczos steps on the exact H"),
    ("guides/defaults.md", lambda: f"the full check ({stationarity.STEPS} exact products"),
    ("guides/defaults.md", lambda: f"s = min(n, max({stationarity.LIGHT_SAMPLE_MIN}, min({stationarity.SAMPLE}, "
                                   f"⌈n/{stationarity.LIGHT_SAMPLE_SHARE}⌉)))"),
    ("guides/defaults.md", lambda: f"several right-hand sides and p ≤ {auto.DIRECT_MAX:,}"),
    ("guides/defaults.md", lambda: f"pseudo-inverse for p ≤ {auto.DIRECT_MAX:,}"),
    ("guides/defaults.md", lambda: f"p·n_rhs > {power(auto.APPROXIMATE_WORK)}"),
    ("guides/defaults.md", lambda: f"Above {power(auto.PRECONDITION_MIN)} parameters (`auto.PRECONDITION_MIN`)"),
    ("guides/defaults.md", lambda: f"λ = {auto.DAMPING_RATIO} · θ_max · min(1, r / {auto.R_REF})"),
    ("guides/defaults.md", lambda: f"At r ≥ {auto.R_REF} — the relative gradient norms"),
    ("guides/defaults.md", lambda: f"by about {1 + 1 / auto.DAMPING_RATIO:.0f}. Nearer the minimum"),
    ("guides/defaults.md", lambda: f"of the previous rule ({auto.DAMPING_RATIO}·θ_max unscaled)"),
    ("guides/defaults.md", lambda: f"and stays {auto.DAMPING_RATIO}·θ_max"),
    ("guides/defaults.md", lambda: f"`influkit.progress.DELAY` ({progress.DELAY:g}) seconds"),
    ("guides/gradient-index.md", lambda: f"(default {DEFAULT_DIM:,}: with int8 rows and the row's 4-byte scale at "
                                         f"most {DEFAULT_DIM + 4:,} bytes a row)"),
    ("guides/gradient-index.md", lambda: f"at most `dim={DEFAULT_DIM}` numbers per example, int8 rows with their "
                                         f"scale, at most {DEFAULT_DIM + 4:,} bytes a row"),
    ("guides/gradient-index.md", lambda: f"the default index takes {DEFAULT_DIM + 4:,} bytes per example"),
    ("guides/gradient-index.md", lambda: f"at the default (`whitened-eigenpairs`, {DEFAULT_DIM}, int8, "
                                         f"{DEFAULT_DIM + 4} bytes per example)"),
    ("guides/adam-runs.md", lambda: f"(`margin=m`, default {stability.MARGIN}:"),
    ("guides/cli.md", lambda: f"(default {_cli().LDS_SUBSETS}; `--n-pretrain` default {_cli().LDS_N_PRETRAIN})"),
]
# a number said to be a default: "default 0.5", "(default 4,000", "1/(1.05·λ_max) by default"
DEFAULT_NUMBER = re.compile(r"\bdefaults?\b[^.;\n]{0,30}?(?<![\w.])(?<!stage )(\d[\d,.]*\d|\d)|\d[\d,.]*\S* by default")


def prose(page: Path, tables: bool = True) -> str:
    """The page without its fenced code blocks (and without its table rows unless ``tables``), whitespace runs
    collapsed to one space."""
    text = FENCE.sub(" ", page.read_text())
    if not tables:
        text = "\n".join(line for line in text.splitlines() if not line.startswith("|"))
    return " ".join(text.split())


@pytest.mark.parametrize("page, phrase", QUOTED, ids=[f"{p}:{i}" for i, (p, _) in enumerate(QUOTED)])
def test_a_quoted_default_is_the_codes(page, phrase):
    text = prose(DOCS / page)
    assert phrase() in text, f"docs/{page} no longer says {phrase()!r}: update the page to the code's default"


def quoted_defaults_not_checked(text: str, phrases: list[str]) -> list[str]:
    """The "default N" phrases of ``text`` that no phrase of ``phrases`` covers."""
    covered = [range(m.start(), m.end()) for p in phrases for m in re.finditer(re.escape(p), text)]
    return [m.group() for m in DEFAULT_NUMBER.finditer(text)
            if not any(m.start() in span or m.end() - 1 in span for span in covered)]


@pytest.mark.parametrize("page", USER_PAGES, ids=[p.relative_to(DOCS).as_posix() for p in USER_PAGES])
def test_every_quoted_default_is_checked(page):
    """A page that quotes a number as a default has that phrase in QUOTED, so the number follows the code."""
    name = page.relative_to(DOCS).as_posix()
    phrases = [phrase() for p, phrase in QUOTED if p == name]
    assert quoted_defaults_not_checked(prose(page, tables=False), phrases) == []


def test_the_default_scanner_finds_an_unchecked_default():
    text = "The bar appears after 2 seconds by default; the batch size (default 8) is fine; stage 1 defaults to all."
    assert quoted_defaults_not_checked(text, ["2 seconds by default"]) == ["default 8"]


def option_defaults(text: str) -> dict[str, str]:
    """{option: default} of the rows of the CLI page's option tables whose default is one plain value."""
    rows = re.findall(r"^\| `(--[\w-]+)[^`]*` \|.*\| ([\w.-]+) \|$", text, re.M)
    return dict(rows)


def test_the_cli_pages_option_defaults_are_the_parsers():
    """Each single-valued default in the CLI guide's option tables is the argparse default of that option (or, where
    that is None, the experiment's setting it falls back to)."""
    import argparse

    from influkit.apps.digits import DigitsSetup

    parsers = [action.choices for action in _cli().parser()._actions if isinstance(action, argparse._SubParsersAction)][0]
    actual = {}
    for sub in parsers.values():
        for action in sub._actions:
            for option in action.option_strings:
                fallback = getattr(DigitsSetup, action.dest, None) if action.default is None else action.default
                actual.setdefault(option, set()).add(fallback)
    quoted = option_defaults((DOCS / "guides" / "cli.md").read_text())
    assert len(quoted) >= 6
    for option, default in quoted.items():
        shown = {str(value) for value in actual[option]} | {"off" for value in actual[option] if value is False}
        assert default in shown, f"docs/guides/cli.md says {option} defaults to {default}; the parser: {shown}"


INTERNAL = re.compile(r"(?<![\w.-])(?:tests|studies|benchmarks|scripts|influkit)/[\w./*-]*"  # a repository path
                      r"|\btest_\w+\.py\b|\b[Ii]ssues? \d+|#\d{2,}\b|\bDESIGN\b|\bSTYLE\.md\b")


def internal_citations(text: str) -> list[str]:
    """Repository paths, test files, issue numbers and internal notes cited by ``text``."""
    return [m.group() for m in INTERNAL.finditer(text)]


@pytest.mark.parametrize("page", USER_PAGES, ids=[p.relative_to(DOCS).as_posix() for p in USER_PAGES])
def test_user_pages_cite_no_internal_material(page):
    """Outside code blocks, a user page links pages of the site, not the repository's files, tests or issues."""
    assert internal_citations(prose(page)) == []


def test_the_citation_check_finds_planted_citations():
    text = ("see `studies/results/x/lds.csv`, tests/test_chain.py, the MLP of issue 37, docs/DESIGN §1 and "
            "influkit/auto.py; fine: [Results](../results/studies-x.md), `influkit.auto`, examples/jobs/a.toml")
    assert internal_citations(text) == ["studies/results/x/lds.csv", "tests/test_chain.py", "issue 37", "DESIGN",
                                        "influkit/auto.py"]


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_landing_page_speaks_to_users():
    """docs/index.md: what influkit answers, how to install it, the first result, and which method to use — not how
    the site or the package is built; its Reference lists no issue log."""
    text = (DOCS / "index.md").read_text()
    assert "pip install influkit" in text and "```python" in text and "guides/which-method" in text
    assert not re.search(r"Sphinx|__path__|MyST|autodoc", text)
    reference = re.search(r":caption: Reference\n(.*?)```", text, re.S).group(1).split()
    for page in reference:
        title = (DOCS / f"{page}.md").read_text().splitlines()[0] if (DOCS / f"{page}.md").exists() else page
        assert not re.search(r"[Ii]ssue \d+|reorganization", title), page
