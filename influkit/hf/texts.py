"""Text in, text out: which training texts made a causal LM's completions likely, and which of their tokens.

    result = hf.explain("path/to/model", "corpus.jsonl", [("The movie was", " great")], k=5)
    result.table                       # pandas: per query its k top training texts, their scores
    result.write_html("explain.html")  # each query with its top texts, tokens shaded by their per-token score

The training objective is the model's mean next-token loss over the corpus (:func:`~influkit.hf.causal_lm_stage`);
a query is a prompt and a completion, and what is attributed is the completion's log-probability given the prompt,
m(x) = Σ_{t∈completion} log p(x_t | x_<t) / |completion| (the negated mean completion loss). A text's score is
dm/dε for up-weighting it in the training objective (influence functions, :class:`~influkit.Chain`): positive
texts make the completion *more* likely. Its per-token scores (:mod:`influkit.per_token`) split that score over
the text's tokens, token t carrying the part that comes through the prediction of token t; they sum to the score.

The corpus is a JSON-lines file (one object per line with a ``text_field`` entry, or one JSON string per line), a
list of strings, or a map-style ``datasets.Dataset`` (rows are read as ``dataset[i][text_field]``). The model is a
directory that ``transformers.AutoModelForCausalLM.from_pretrained`` reads (its tokenizer from the same directory
unless given), or a loaded model with ``tokenizer=``. Nothing is downloaded.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..chain import Chain
from ..errors import InputError
from ..fitted import CurvatureConfig
from ..pairwise import top_rows
from ..solvers import SolveConfig
from .batches import pack
from .causal import causal_lm_batch, completion_batch, context_length
from .losses import causal_lm_losses
from .stages import causal_lm_stage

LEGEND = ("Score of a text: the change of the completion's mean log-probability per unit up-weighting of the text "
          "in training (influence function).")
POSITIVE, NEGATIVE = (36, 113, 163), (192, 57, 43)  # shades: raises (blue) / lowers (red) the completion's probability


def completion_log_probability(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B,) the mean log-probability of each sequence's labelled tokens, −:func:`~influkit.hf.causal_lm_losses`."""
    return -causal_lm_losses(logits, labels)


@dataclass
class TextAttribution:
    """The top training texts of each query: ``table`` (pandas: query, prompt, completion, rank, row, score, text)
    and, per query and rank, the text's tokens with their per-token scores (``tokens[q][r]``: [(token, score)])."""

    table: "object"
    tokens: list[list[list[tuple[str, float]]]]
    queries: list[tuple[str, str]]
    diagnostics: dict = field(default_factory=dict)

    def html(self, title: str = "Which training texts made these completions likely", legend: str = LEGEND) -> str:
        """A self-contained page: per query its top texts, each token shaded by its score (blue raises the
        completion's probability, red lowers it; the shade's strength relative to the text's largest |score|).
        legend: what a text's score is."""
        parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
                 f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>",
                 f"<p class='legend'>{html.escape(legend)} Tokens: "
                 f"<span class='tok' style='background:rgba{POSITIVE + (0.6,)}'>raises</span> "
                 f"<span class='tok' style='background:rgba{NEGATIVE + (0.6,)}'>lowers</span> "
                 "the completion's probability; they sum to the text's score.</p>"]
        for q, (prompt, completion) in enumerate(self.queries):
            rows = self.table[self.table["query"] == q]
            parts.append(f"<section class='query'><h2>Query {q}</h2><p class='prompt'>{html.escape(prompt)}"
                         f"<b class='completion'>{html.escape(completion)}</b></p><ol>")
            for (_, row), tokens in zip(rows.iterrows(), self.tokens[q]):
                parts.append(f"<li><div class='meta'>training text {int(row['row'])} · score "
                             f"{row['score']:+.4g}</div><div class='text'>{_shaded(tokens)}</div></li>")
            parts.append("</ol></section>")
        parts.append("</body></html>")
        return "".join(parts)

    def write_html(self, path: str | Path, **kwargs) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.html(**kwargs), encoding="utf-8")
        return path


_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1000px; padding: 0 16px; color: #1d232b; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin: 0; }
.query { border: 1px solid #d6dbe1; border-radius: 6px; padding: 12px 16px; margin: 16px 0; }
.prompt { font-size: 1.05em; } .completion { background: #eef3f8; padding: 0 3px; }
.meta { color: #59636e; font-size: 0.85em; } .text { margin: 2px 0 10px; line-height: 1.9; }
.tok { border-radius: 3px; padding: 1px 0; white-space: pre-wrap; }
.legend { color: #59636e; }
"""


def _shaded(tokens: Sequence[tuple[str, float]]) -> str:
    largest = max((abs(s) for _, s in tokens), default=0.0) or 1.0
    spans = []
    for token, score in tokens:
        colour = POSITIVE if score > 0 else NEGATIVE
        alpha = round(0.75 * abs(score) / largest, 3)
        spans.append(f"<span class='tok' title='{score:+.3g}' style='background:rgba{colour + (alpha,)}'>"
                     f"{html.escape(token)}</span>")
    return "".join(spans)


def read_corpus(corpus, text_field: str = "text") -> list[str]:
    """The corpus's texts: from a JSON-lines file, a list of strings or a map-style ``datasets.Dataset``."""
    if isinstance(corpus, (str, Path)):
        path = Path(corpus)
        if not path.is_file():
            raise InputError(f"corpus file {path} does not exist; give a JSON-lines file, a list of strings or a "
                             "datasets.Dataset.")
        texts = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{number} is not JSON ({exc.msg}); one JSON object per line.") from exc
            texts.append(entry if isinstance(entry, str) else _field(entry, text_field, f"{path}:{number}"))
    elif hasattr(corpus, "column_names") and hasattr(corpus, "__getitem__"):
        if text_field not in corpus.column_names:
            raise InputError(f"the dataset has columns {corpus.column_names}, no {text_field!r}; pass "
                             "text_field= naming the text column.")
        texts = [corpus[i][text_field] for i in range(len(corpus))]
    elif isinstance(corpus, Sequence):
        texts = list(corpus)
    else:
        raise InputError(f"corpus must be a JSON-lines path, a list of strings or a datasets.Dataset, got "
                         f"{type(corpus).__name__}.")
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()]
    if bad or not texts:
        raise InputError(f"the corpus needs non-empty strings; entries {bad[:5]} are not." if texts else
                         "the corpus is empty.")
    return texts


def _field(entry, text_field: str, where: str) -> str:
    if not isinstance(entry, dict) or text_field not in entry:
        raise InputError(f"{where} has no {text_field!r} entry; pass text_field= naming it.")
    return entry[text_field]


def read_queries(queries) -> list[tuple[str, str]]:
    """(prompt, completion) pairs from pairs or from {"prompt", "completion"} mappings."""
    pairs = []
    for i, q in enumerate(queries):
        if isinstance(q, dict):
            if "prompt" not in q or "completion" not in q:
                raise InputError(f"query {i} needs 'prompt' and 'completion' entries, got {sorted(q)}.")
            q = (q["prompt"], q["completion"])
        if not (isinstance(q, (tuple, list)) and len(q) == 2 and all(isinstance(s, str) for s in q)):
            raise InputError(f"query {i} must be a (prompt, completion) pair of strings.")
        pairs.append((q[0], q[1]))
    if not pairs:
        raise InputError("give at least one (prompt, completion) query.")
    return pairs


def load_model(model, tokenizer=None, dtype: torch.dtype | None = None):
    """(model in eval mode, tokenizer): read from a directory (``transformers`` Auto classes, local files only),
    or the loaded model with its ``tokenizer``."""
    if isinstance(model, (str, Path)):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(model)
        if not path.is_dir():
            raise InputError(f"model directory {path} does not exist (nothing is downloaded).")
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    if tokenizer is None:
        raise InputError("a loaded model needs tokenizer=; or pass the model's directory.")
    if dtype is not None:
        model = model.to(dtype)
    return model.eval(), tokenizer


def explain(model, corpus, queries, *, tokenizer=None, k: int = 5, max_length: int | None = None,
            text_field: str = "text", params=None, solve: SolveConfig = SolveConfig(),
            curvature: CurvatureConfig | str = CurvatureConfig(), dtype: torch.dtype | None = None,
            memory: int | None = None, out: str | Path | None = None, progress: bool = True) -> TextAttribution:
    """The ``k`` training texts of ``corpus`` with the highest scores on each query's completion, with per-token
    scores (module docstring). max_length: tokens per text and per query (default the model's context, at most
    128); params: what training trained (names or prefixes; default every parameter); solve, curvature, memory: as
    :class:`~influkit.Chain` takes them; dtype: cast the model (e.g. torch.float64); out: a directory to stream the
    (n_texts, n_queries) scores to, resumable (:meth:`~influkit.chain.Query.scores`)."""
    import pandas as pd

    if k < 1:
        raise InputError(f"k must be ≥ 1, got {k}.")
    model, tokenizer = load_model(model, tokenizer, dtype)
    texts, pairs = read_corpus(corpus, text_field), read_queries(queries)
    max_length = max_length or min(context_length(model) or 128, 128)
    stage = causal_lm_stage(model, causal_lm_batch(tokenizer, texts, max_length), params=params)
    curvature = CurvatureConfig(curvature) if isinstance(curvature, str) else curvature
    chain = Chain([stage], solve=solve, curvature=curvature, memory=memory, progress=progress)
    test = pack(completion_batch(tokenizer, [p for p, _ in pairs], [c for _, c in pairs], max_length))
    query = chain.query(test, measure=completion_log_probability, per_test=True, progress=progress)
    scores = query.scores(out=out, progress=progress)
    k = min(k, len(texts))
    values, chunk = scores.values, scores.diagnostics["chunks"]["chunk_size"]
    top = top_rows(((values[a : a + chunk], torch.arange(a, min(a + chunk, len(texts))))
                    for a in range(0, len(texts), chunk)), k)[1]  # (k, n_queries) rows, read a chunk at a time
    rows = torch.unique(top.reshape(-1))
    tokens = query.token_scores(rows, progress=progress).values  # (u, L, n_queries)
    where = {int(r): i for i, r in enumerate(rows)}
    inputs = stage.data.take(rows)[0][:, 0]  # input_ids
    keep = stage.data.take(rows)[0][:, 1].bool()
    records, shaded = [], []
    for q, (prompt, completion) in enumerate(pairs):
        shaded.append([])
        for rank, row in enumerate(top[:, q].tolist(), 1):
            i = where[row]
            ids = inputs[i][keep[i]].tolist()
            shaded[-1].append([(tokenizer.decode([t]), float(s)) for t, s in zip(ids, tokens[i, : len(ids), q])])
            records.append({"query": q, "prompt": prompt, "completion": completion, "rank": rank, "row": row,
                            "score": float(values[row, q]), "text": texts[row]})
    return TextAttribution(pd.DataFrame.from_records(records), shaded, pairs,
                           {"solves": query.solves, "stages": query.stages, "scores": scores.diagnostics})


JOB_KEYS = {"model", "tokenizer", "corpus", "text_field", "queries", "k", "max_length", "dtype", "params", "out",
            "memory", "solve", "curvature"}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def run_job(path: str | Path, *, progress: bool = True) -> tuple[TextAttribution, Path]:
    """Run the ``influkit explain`` job of the TOML file ``path``; returns (the result, its output folder), where
    ``top.csv`` (the table), ``explain.html`` (the page) and ``scores/`` (every text's scores) are written::

        model = "path/to/model"          # a transformers model directory (its tokenizer too, unless tokenizer = DIR)
        corpus = "corpus.jsonl"          # JSON lines: objects with a "text" entry (text_field = ...) or strings
        k = 5                            # top texts per query
        out = "explained"                # the output folder (relative paths: to the job file's folder)
        dtype = "float64"                # optional: cast the model; max_length, params, memory likewise optional
        [solve]                          # a SolveConfig; [curvature] a CurvatureConfig (optional)
        solver = "direct"
        [[queries]]                      # or queries = "queries.jsonl" ({"prompt": ..., "completion": ...} lines)
        prompt = "The movie was"
        completion = " great"
    """
    import tomllib

    path = Path(path).resolve()
    if not path.is_file():
        raise InputError(f"job file {path} does not exist.")
    try:
        job = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{path} is not valid TOML: {exc}") from exc
    unknown, missing = sorted(set(job) - JOB_KEYS), sorted({"model", "corpus", "queries"} - set(job))
    if unknown or missing:
        raise InputError(f"{path}: " + (f"unknown settings {unknown} (known: {sorted(JOB_KEYS)})" if unknown else
                                        f"missing {missing}: give model, corpus and queries"))
    here = path.parent
    queries = job["queries"]
    if isinstance(queries, str):
        queries = [json.loads(line) for line in (here / queries).read_text().splitlines() if line.strip()]
    if job.get("dtype") is not None and job["dtype"] not in DTYPES:
        raise InputError(f"{path}: dtype must be one of {sorted(DTYPES)}, got {job['dtype']!r}.")
    tokenizer = None
    if "tokenizer" in job:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(here / job["tokenizer"], local_files_only=True)
    corpus = job["corpus"]
    out = here / job.get("out", "explained")
    result = explain(here / job["model"], here / corpus if isinstance(corpus, str) else corpus, queries,
                     tokenizer=tokenizer, k=int(job.get("k", 5)), max_length=job.get("max_length"),
                     text_field=job.get("text_field", "text"), params=job.get("params"),
                     solve=SolveConfig(**job.get("solve", {})), curvature=CurvatureConfig(**job.get("curvature", {})),
                     dtype=DTYPES.get(job.get("dtype")), memory=job.get("memory"), out=out / "scores",
                     progress=progress)
    result.table.to_csv(out / "top.csv", index=False)
    result.write_html(out / "explain.html")
    return result, out


def main(config: str | Path, *, quiet: bool = False) -> int:
    """The ``influkit explain`` command: run the job, print each query's top texts."""
    result, out = run_job(config, progress=not quiet)
    for q, (prompt, completion) in enumerate(result.queries):
        rows = result.table[result.table["query"] == q]
        print(f"{prompt!r} → {completion!r}:")
        for _, row in rows.iterrows():
            print(f"  {int(row['rank'])}. [{row['score']:+.4g}] text {int(row['row'])}: {row['text'][:100]!r}")
    print(f"wrote {out / 'top.csv'} and {out / 'explain.html'}")
    return 0
