"""influkit.report: the HTML page of a result — the right examples per query, rendered as they are, no network,
the same page again from a saved file (``influkit report``), and checked in a real browser when Chromium is there."""

from __future__ import annotations

import os
import re
import shutil
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import need

need("matplotlib")  # the report page draws with it (influkit[plot])

import influkit as ik
from influkit.cli import main as cli
from influkit.report import attach, screenshot, write_report
from influkit.validation.metrics import pearson

K = 4


class Page(HTMLParser):
    """Collects every tag's attributes and, per query block, the example ids of its harmful/helpful cards."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.cards: list[tuple[str, int]] = []  # (list kind, example id) in page order
        self.kind = ""
        self.in_caption = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "div" and attrs.get("class") in ("harmful", "helpful"):
            self.kind = attrs["class"]
        self.in_caption = tag == "b" and bool(self.kind)

    def handle_data(self, data):
        match = re.match(r"#(\d+)", data)
        if self.in_caption and match:
            self.cards.append((self.kind, int(match.group(1))))
        self.in_caption = False


@pytest.fixture(scope="module")
def digits_scores(logreg_digits):
    """Per-test influence of 300 real training digits on 3 test digits (multinomial logistic regression)."""
    stage, (test_x, test_y) = logreg_digits
    res = ik.influence(stage, torch.arange(len(stage)), (test_x[:3], test_y[:3]), solve=ik.SolveConfig(solver="direct"), per_test=True,
                       progress=False)
    return res, stage.data.take(torch.arange(len(stage))), (test_x, test_y)


@pytest.fixture
def digits_result(digits_scores):
    """A fresh copy per test."""
    res, train, test = digits_scores
    copy = ik.InfluenceResult(values=res.values.clone(), n_train=res.n_train, method=res.method,
                              diagnostics={k: v for k, v in res.diagnostics.items() if k != "report"})
    return copy, train, test


def test_page_shows_each_querys_extremes_as_thumbnails(digits_result, tmp_path):
    res, (train_x, train_y), (test_x, test_y) = digits_result
    before = dict(res.diagnostics)
    shown = attach(res, examples=train_x.reshape(-1, 8, 8), labels=train_y.tolist(), queries=test_x.reshape(-1, 8, 8), k=K)
    assert res.diagnostics == before and "report" not in res.diagnostics  # the report only reads the result
    path = write_report(shown, tmp_path / "page.html")
    text = path.read_text()
    page = Page(text)
    expected = []
    for j in range(3):
        order = torch.argsort(res.values[:, j], descending=True)
        expected += [("harmful", int(i)) for i in order[:K]] + [("helpful", int(i)) for i in order.flip(0)[:K]]
    assert page.cards == expected
    images = [a["src"] for t, a in page.tags if t == "img"]
    assert len(images) == 3 + 3 * 2 * K + 1  # queries, cards, histogram (no validation given)
    assert all(src.startswith("data:image/png;base64,") for src in images)
    # self-contained: no script, no link, nothing fetched
    assert not any(t in ("script", "link", "iframe") for t, _ in page.tags)
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:|//)|url\(|@import", text)
    assert "<style>" in text and "single-stage" in text and "direct" in text  # method and solve diagnostics
    stored = shown.diagnostics["report"]
    assert set(stored["examples"]) == {str(i) for _, i in expected}  # only what is shown is kept


def test_text_examples_are_shown_as_escaped_text(tmp_path):
    values = torch.tensor([3.0, -1.0, 0.5, -7.0, 2.0])
    texts = ["a fine review", "<script>alert(1)</script> & more", "meh", "the best film ever", "dull " * 300]
    res = ik.InfluenceResult(values=values, n_train=5, method="turn-over dropout", removal_eps=-1.0)
    text = write_report(res, tmp_path / "t.html", examples=texts, queries=["a query sentence"], k=2).read_text()
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; more" in text and "<script>" not in text
    assert Page(text).cards == [("harmful", 0), ("harmful", 4), ("helpful", 3), ("helpful", 1)]
    assert "a query sentence" in text and "dull " * 100 in text and "dull " * 130 not in text  # long text cut
    assert "removal -3" in text  # removal_eps · score with removal_eps = −1
    weighted = ik.InfluenceResult(values=values, n_train=5, removal_eps=torch.tensor([-0.5, 1, 1, 1, -2.0]),
                                  index=torch.tensor([10, 11, 12, 13, 14]))  # one ε per row (SSL weights)
    text = write_report(weighted, tmp_path / "w.html", examples=texts * 3, k=1).read_text()
    assert Page(text).cards == [("harmful", 10), ("helpful", 13)] and "removal -1.5" in text and "removal -7" in text


def test_saved_result_renders_the_same_page_from_the_cli(digits_result, tmp_path, capsys):
    res, (train_x, train_y), (test_x, _) = digits_result
    shown = attach(res, examples=train_x.reshape(-1, 8, 8), queries=test_x.reshape(-1, 64), image_shape=(8, 8), k=K)
    page = write_report(shown, tmp_path / "page.html")
    shown.save(tmp_path / "res.safetensors")
    assert cli(["report", str(tmp_path / "res.safetensors"), "-o", str(tmp_path / "again.html")]) == 0
    assert (tmp_path / "again.html").read_text() == page.read_text()
    assert "wrote" in capsys.readouterr().out
    assert cli(["report", str(tmp_path / "res.safetensors"), "--top", "2"]) == 0  # default output: RESULT.html
    assert len(Page((tmp_path / "res.safetensors.html").read_text()).cards) == 3 * 2 * 2


def test_validation_scatter_when_there_is_one(digits_result, tmp_path):
    res = ik.InfluenceResult(values=digits_result[0].total.clone(), n_train=300, method="single-stage")
    plain = write_report(res, tmp_path / "plain.html").read_text()
    assert "Validation" not in plain and plain.count("<img") == 1  # the histogram only
    gen = np.random.default_rng(0)
    predicted = gen.normal(size=12)
    loo = pd.DataFrame({"removed": [str(i) for i in range(12)], "predicted": predicted,
                        "actual": predicted + 0.3 * gen.normal(size=12)})
    text = write_report(res, tmp_path / "v.html", validation=loo).read_text()
    assert "Validation" in text and text.count("<img") == 2
    assert f"Pearson r = {pearson(loo['predicted'], loo['actual']):.3f}" in text


def test_bad_attachments_are_refused(digits_result, tmp_path):
    res, (train_x, _), _ = digits_result
    with pytest.raises(ik.InputError, match="examples has 10 entries"):
        write_report(res, tmp_path / "x.html", examples=train_x[:10])
    with pytest.raises(ik.InputError, match="actual"):
        write_report(res, tmp_path / "x.html", validation=pd.DataFrame({"predicted": [1.0, 2.0, 3.0]}))
    with pytest.raises(ik.InputError, match="one test example per column"):
        write_report(res, tmp_path / "x.html", queries=["only one"])
    with pytest.raises(ik.InputError, match="positive"):
        write_report(res, tmp_path / "x.html", k=0)


@pytest.mark.skipif(shutil.which("chromium") is None and not os.environ.get("INFLUKIT_REQUIRE_BROWSER"),
                    reason="Chromium not installed (apt-get install chromium); CI sets INFLUKIT_REQUIRE_BROWSER=1")
def test_chromium_renders_the_page(digits_result, tmp_path):
    """A real browser draws the page: a screenshot of the requested size, many colours, the cards' CSS borders."""
    from matplotlib import image as mpimg

    res, (train_x, train_y), (test_x, _) = digits_result
    page = write_report(res, tmp_path / "page.html", examples=train_x.reshape(-1, 8, 8), labels=train_y.tolist(),
                        queries=test_x.reshape(-1, 8, 8), k=K)
    png = screenshot(page, tmp_path / "shot.png", size=(900, 1300))
    pixels = mpimg.imread(png)[..., :3]
    assert pixels.shape == (1300, 900, 3)
    rgb = (pixels * 255).round().astype(int).reshape(-1, 3)
    assert len(np.unique(rgb, axis=0)) > 50  # text, grey thumbnails and borders, not a blank or error page
    assert (rgb.sum(1) < 600).mean() > 0.02  # something dark drawn on the white page
    for colour in ((0xC0, 0x39, 0x2B), (0x24, 0x71, 0xA3)):  # the harmful (red) and helpful (blue) card borders
        assert (np.abs(rgb - colour).sum(1) <= 6).sum() > 100, colour


def test_solves_table_says_converged_unconverged_or_not_checked(digits_result):
    """converged True / False / None (no residual computed) are shown as what they are, None never as a blank."""
    from influkit.report import render

    res, _, _ = digits_result
    base = {"method": "ekfac", "residual": 0.7, "tol": 0.5}
    res.diagnostics["solves"] = [{"stage": 0, **base, "converged": False}, {"stage": 1, **base, "converged": True},
                                 {"stage": 2, **base, "residual": float("nan"), "converged": None}]
    page = render(res)
    cells = re.findall(r"<td>(converged|unconverged|not checked)</td>", page)
    assert cells == ["unconverged", "converged", "not checked"]


def test_unrolled_results_say_what_their_score_is(tmp_path):
    """An unrolled result's page explains d measure / d w_z through the recorded training and −score on removal,
    not the influence function's d/dε."""
    from influkit.report import render

    torch.manual_seed(0)
    x, y = torch.randn(12, 3), torch.randint(0, 2, (12,))
    stage = ik.Stage(torch.nn.Linear(3, 2).eval(), lambda out, t: torch.nn.functional.cross_entropy(out, t, reduction="none"),
                     (x, y))
    record = ik.unrolled.Record()
    record.train(stage, ik.unrolled.SGD(lr=0.1), steps=3, batch_size=4)
    page = render(ik.unrolled.metagradients(record, (x[:2], y[:2]))[0])
    assert "d(test measure)/dw_z" in page and "through the recorded training" in page and "−score" in page
    assert "training objective + ε·loss(z)" not in page
    influence = render(ik.influence(stage, torch.arange(12), (x[:2], y[:2])))
    assert "training objective + ε·loss(z)" in influence and "dw_z" not in influence


def test_whole_test_set_header_and_settings_read_as_they_are(digits_result, tmp_path):
    """Every test example is on the page (the first ones in the strip, the rest behind <details>), the header says
    what the scores are over, and the settings are tables, not JSON."""
    from influkit.report import STRIP

    res, (train_x, _), (test_x, test_y) = digits_result
    summed = ik.InfluenceResult(values=res.total.clone(), n_train=300, method="multi-stage case 1",
                                diagnostics={"settings": {"n_test": 100, "per_test": False,
                                                          "links": [{"shared": {"body.weight": "body.weight"}, "case": 1,
                                                                     "alpha": None}],
                                                          "solve": [{"solver": "direct", "damping": 0.0}] * 2}})
    text = write_report(summed, tmp_path / "all.html", queries=test_x.reshape(-1, 8, 8),
                        query_labels=test_y.tolist()).read_text()
    assert text.count('alt="query ') == len(test_x) == 100
    strip, rest = text.split("<details class=\"more\">", 1)
    assert strip.count('alt="query ') == STRIP and f"the other {100 - STRIP} test examples" in rest
    assert "scores of 300 training examples summed over 100 test examples" in text and "(300)" not in text
    assert '{"' not in text and "[{" not in text  # no raw JSON
    settings = text.split("<h3>settings</h3>", 1)[1]
    assert "<th>solver</th>" in settings and "<th>link case</th>" in settings and "body.weight" in settings


def test_long_cells_are_collapsed_and_banners_name_what_is_off(digits_result):
    from influkit.report import LONG_CELL, render

    res, _, _ = digits_result
    choice = "auto chose minres on the Gauss-Newton matrix because " + "the stage is not at a minimum; " * 20
    res.diagnostics["solves"] = [{"stage": 0, "solver": "minres", "choice": choice, "converged": True}]
    res.diagnostics["stages"] = [
        {"verdict": "minimum", "gradient_norm": 1e-9, "min_eigenvalue": 0.1, "max_eigenvalue": 3.0, "gradient_tol": 1e-3},
        {"verdict": "non-stationary", "gradient_norm": 0.4, "min_eigenvalue": -0.2, "max_eigenvalue": 3.0,
         "gradient_tol": 1e-3, "proximal": {"alpha": 0.01, "alpha_fit": 0.137, "residual": 0.6, "agrees": False}}]
    page = render(res)
    cell = re.search(r'<details class="cell"><summary>(.*?)</summary>(.*?)</details>', page)
    assert cell and cell.group(1) == choice[:LONG_CELL] + "…" and cell.group(2) == choice  # the whole text, collapsed
    banners = re.findall(r'<div class="banner">(.*?)</div>', page)
    assert len(banners) == 2
    assert "stage 1 is not at a minimum" in banners[0] and "stage 0" not in "".join(banners)
    assert "α̂ = 0.137" in banners[1] and "alpha=α̂" in banners[1]
    res.diagnostics["stages"] = [res.diagnostics["stages"][0]]
    assert 'class="banner"' not in render(res)


def test_check_against_retraining_is_shown_with_its_noise_floor(digits_result, tmp_path):
    from influkit.validation import check_retraining

    res, _, _ = digits_result
    summed = ik.InfluenceResult(values=res.total.clone(), n_train=300, method="single-stage")
    shift = {0: 0.0, 1: 0.3, 2: -0.1}
    removal = summed.removal

    def retrain(keep, seed):  # a linear "retraining": the predicted change, plus what the seed adds
        dropped = torch.ones(300, dtype=torch.bool)
        dropped[keep] = False
        return float(1.1 * removal[dropped].sum()) + shift[seed]

    check = check_retraining(summed, retrain, k=5, seeds=3, random=2, progress=False)
    text = write_report(summed, tmp_path / "check.html", validation=check).read_text()
    assert "checked against retraining" in text and "most harmful" in text and "random 2" in text
    assert f"noise floor ±{check.noise_floor:.3g}" in text and text.count("<img") == 2
    # the table alone gives the same page; a leave-out frame with a noise floor draws it on the scatter
    assert write_report(summed, tmp_path / "t.html", validation=check.table).read_text() == text
    attach(summed, validation=check).save(tmp_path / "r.safetensors")  # the check travels with the saved result
    assert cli(["report", str(tmp_path / "r.safetensors"), "-o", str(tmp_path / "again.html")]) == 0
    assert (tmp_path / "again.html").read_text() == text
    loo = pd.DataFrame({"predicted": [0.1, 0.2, -0.3], "actual": [0.1, 0.25, -0.2], "noise_floor": 0.05})
    assert "noise floor ±0.05" in write_report(summed, tmp_path / "l.html", validation=loo).read_text()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Chromium not installed (apt-get install chromium)")
def test_chromium_lays_out_the_strip_without_overlap_and_collapses_long_cells(digits_result, tmp_path):
    """Measured in a real browser (a script appended to a copy of the page, the DOM dumped after layout): no two
    captions of the test-set strip overlap or run together (8 px apart at least, text to text), and no cell of the
    solves table, whose long ``choice`` is collapsed, is taller than 60 px."""
    import subprocess

    from influkit.report import CHROMIUM_FLAGS

    res, _, (test_x, test_y) = digits_result
    summed = ik.InfluenceResult(values=res.total.clone(), n_train=300, method="single-stage",
                                diagnostics={"solves": [{"stage": k, "choice": "a long reason " * 80, "solver": "minres",
                                                         "converged": True, "damping": 0.0057, "floor": float("nan"),
                                                         "iterations": 35, "preconditioner": None, "products": 36,
                                                         "residual": 9.04e-12, "seconds": 0.6, "tol": 1e-10,
                                                         "token_factors": []} for k in range(2)]})
    page = write_report(summed, tmp_path / "page.html", queries=test_x.reshape(-1, 8, 8),
                        query_labels=[f"digit {int(v)}" for v in test_y]).read_text()
    probe = """<script>
      const text = e => { const r = document.createRange(); r.selectNodeContents(e); return r.getBoundingClientRect(); };
      const boxes = [...document.querySelectorAll('.strip .queryitem .note')].map(text)  // the text's own extent
                                                                           .filter(b => b.width > 0);
      let overlaps = 0;
      for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
        const a = boxes[i], b = boxes[j];
        if (a.left < b.right + 8 && b.left < a.right + 8 && a.top < b.bottom && b.top < a.bottom) overlaps++;  // < 8 px apart
      }
      const tallest = Math.max(...[...document.querySelectorAll('td')].map(e => e.getBoundingClientRect().height));
      document.body.setAttribute('data-probe', `${boxes.length} ${overlaps} ${Math.round(tallest)}`);
    </script></body>"""
    (tmp_path / "probe.html").write_text(page.replace("</body>", probe))
    dom = subprocess.run(["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1100,1600",
                          "--dump-dom", (tmp_path / "probe.html").as_uri()], capture_output=True, text=True, timeout=120).stdout
    shown, overlaps, tallest = map(int, re.search(r'data-probe="(\d+) (\d+) (-?\d+)"', dom).groups())
    assert shown >= 16 and overlaps == 0 and tallest <= 60
