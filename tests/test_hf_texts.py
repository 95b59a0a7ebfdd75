"""Text in, text out (influkit.hf.texts): a tiny float64 GPT-2 saved to a directory with a locally trained tokenizer,
a corpus as a JSON-lines file, a list of strings or a datasets.Dataset, prompt + completion queries; the table's
scores are the chain's per-test scores of the completion's log-probability, its rows the highest, the shaded tokens
sum to each text's score; the page is drawn by a real browser; the same from a TOML job file on the command line."""

from __future__ import annotations

import html
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("pandas")

import influkit as ik  # noqa: E402
from influkit import hf  # noqa: E402
from influkit.cli import main as cli_main  # noqa: E402
from conftest import need  # noqa: E402

CORPUS = ["the movie was great fun", "a dull and boring film", "great acting and a great story", "boring plot",
          "the food was great", "an awful boring meal", "fun for the whole family", "the story was dull"]
QUERIES = [("the film was", " great"), ("the plot was", " boring")]
SOLVE = ik.SolveConfig(solver="direct", damping=0.1)
PARAMS = "transformer.h.0.mlp"  # 228 trained values: the exact solve stays small


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny GPT-2 (float64) and its byte-level BPE tokenizer, saved as transformers saves them."""
    tokenizer = hf.train_bpe(CORPUS * 3, vocab_size=400, min_frequency=1)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_positions=16, n_embd=8, n_layer=1, n_head=2,
                                     n_inner=12, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     attn_implementation="eager", bos_token_id=0, eos_token_id=0, pad_token_id=1)
    model = transformers.GPT2LMHeadModel(config).double()
    path = tmp_path_factory.mktemp("model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def explain(model_dir, corpus, **kwargs):
    return hf.explain(model_dir, corpus, QUERIES, k=3, max_length=16, dtype=torch.float64, solve=SOLVE,
                      params=PARAMS, progress=False, **kwargs)


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")
def test_table_holds_the_top_texts_and_tokens_sum_to_their_scores(model_dir, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(CORPUS)) + "\n")
    result = explain(model_dir, corpus)
    table = result.table
    assert list(table.columns) == ["query", "prompt", "completion", "rank", "row", "score", "text"]
    assert len(table) == 3 * len(QUERIES)
    # the scores: the chain's per-test scores of the completion's mean log-probability, the top 3 of each query
    model, tokenizer = hf.texts.load_model(model_dir, dtype=torch.float64)
    stage = hf.causal_lm_stage(model, hf.causal_lm_batch(tokenizer, CORPUS, 16), params=PARAMS)
    test = hf.pack(hf.completion_batch(tokenizer, [p for p, _ in QUERIES], [c for _, c in QUERIES], 16))
    query = ik.Chain([stage], solve=SOLVE, progress=False).query(test, per_test=True,
                                                                 measure=hf.texts.completion_log_probability)
    values = query.scores().values
    for q in range(len(QUERIES)):
        rows = table[table["query"] == q]
        expected = values[:, q].argsort(descending=True)[:3]
        assert rows["row"].tolist() == expected.tolist() and rows["rank"].tolist() == [1, 2, 3]
        np.testing.assert_allclose(rows["score"].to_numpy(), values[expected, q].numpy(), rtol=1e-10)
        assert rows["text"].tolist() == [CORPUS[i] for i in expected]
        for (_, row), tokens in zip(rows.iterrows(), result.tokens[q]):
            assert "".join(t for t, _ in tokens) == "<|endoftext|>" + row["text"]
            assert abs(sum(s for _, s in tokens) - row["score"]) <= 1e-10 * abs(row["score"])
    # the same from a list of strings
    again = explain(model_dir, CORPUS)
    assert again.table.equals(table)


def test_corpus_and_queries_are_checked(model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "no text field"}\n')
    with pytest.raises(ik.InputError, match="text_field"):
        explain(model_dir, bad)
    with pytest.raises(ik.InputError, match="does not exist"):
        explain(model_dir, tmp_path / "missing.jsonl")
    with pytest.raises(ik.InputError, match="non-empty strings"):
        explain(model_dir, ["fine", ""])
    with pytest.raises(ik.InputError, match="prompt"):
        hf.explain(model_dir, CORPUS, [{"prompt": "x"}], progress=False)
    with pytest.raises(ik.InputError, match="tokenizer="):
        hf.explain(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2)), CORPUS,
                   QUERIES, progress=False)


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")
def test_a_datasets_dataset_is_read_as_the_corpus(model_dir):
    dataset = need("datasets").Dataset.from_dict({"body": CORPUS, "label": list(range(len(CORPUS)))})
    assert hf.read_corpus(dataset, "body") == CORPUS
    with pytest.raises(ik.InputError, match="text_field"):
        hf.read_corpus(dataset)
    assert explain(model_dir, dataset, text_field="body").table.equals(explain(model_dir, CORPUS).table)


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")
@pytest.mark.skipif(shutil.which("chromium") is None and not os.environ.get("INFLUKIT_REQUIRE_BROWSER"),
                    reason="Chromium not installed (apt-get install chromium); CI sets INFLUKIT_REQUIRE_BROWSER=1")
def test_chromium_draws_the_shaded_tokens(model_dir, tmp_path):
    from matplotlib import image as mpimg

    from influkit.report import screenshot

    result = explain(model_dir, CORPUS)
    page = result.write_html(tmp_path / "page.html")
    text = page.read_text()
    assert text.count("<section class='query'>") == 2 and "the plot was<b class='completion'> boring</b>" in text
    shown = html.unescape(re.sub(r"<[^>]+>", "", text))  # what the page reads as
    assert all(row in shown for row in result.table["text"])
    pixels = mpimg.imread(screenshot(page, tmp_path / "shot.png", size=(900, 900)))[..., :3]
    rgb = (pixels * 255).round().astype(int).reshape(-1, 3)
    assert (rgb.sum(1) < 300).mean() > 0.005  # text drawn
    blue = (rgb[:, 2] - rgb[:, 0] > 40).sum()  # shades of rgba(36, 113, 163, a) over white
    red = (rgb[:, 0] - rgb[:, 2] > 40).sum()  # shades of rgba(192, 57, 43, a)
    assert blue > 200 and red > 200, (blue, red)


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")
def test_the_command_line_runs_a_toml_job(model_dir, tmp_path, capsys):
    (tmp_path / "corpus.jsonl").write_text("\n".join(json.dumps(t) for t in CORPUS))
    queries = "\n".join(f'[[queries]]\nprompt = "{p}"\ncompletion = "{c}"' for p, c in QUERIES)
    (tmp_path / "job.toml").write_text(
        f'model = "{model_dir}"\ncorpus = "corpus.jsonl"\nk = 3\nmax_length = 16\ndtype = "float64"\n'
        f'out = "explained"\nparams = "{PARAMS}"\n[solve]\nsolver = "direct"\ndamping = 0.1\n{queries}\n')
    assert cli_main(["explain", str(tmp_path / "job.toml"), "--quiet"]) == 0
    table = __import__("pandas").read_csv(tmp_path / "explained" / "top.csv")
    expected = explain(model_dir, CORPUS).table
    assert table["row"].tolist() == expected["row"].tolist()
    np.testing.assert_allclose(table["score"].to_numpy(), expected["score"].to_numpy(), rtol=1e-10)
    assert (tmp_path / "explained" / "explain.html").read_text().count("<section class='query'>") == 2
    assert "explain.html" in capsys.readouterr().out
    (tmp_path / "bad.toml").write_text('model = "x"\n')
    assert cli_main(["explain", str(tmp_path / "bad.toml")]) == 2
