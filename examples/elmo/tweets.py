"""ELMo (``influkit.elmo``): which pretraining sentences of a biLM most influence a tweet classifier built on it.

Loads the small biLM that ``studies/elmo_influence.py`` pretrained on vaderSentiment's review and editorial
snippets — allennlp-format files (options JSON, HDF5 weights) plus its softmax and vocabulary, committed in
``studies/results/elmo/`` —, fits a classifier head on the frozen ELMo features of rated tweets, and scores
pretraining sentences with a Case 1 chain whose pretraining loss g(z) is the biLM's per-sentence loss
(``bilm_lm_loss``). The pretraining solve is MINRES preconditioned by EK-FAC, damped by 1 (the study's setting).

Needs ``pip install 'influkit[elmo]'`` and the vaderSentiment 3.3.2 sdist (``influkit.elmo.corpora`` fetches it
with pip).

    python examples/elmo/tweets.py [--quick]

``--quick`` scores 30 pretraining sentences with a head fitted on 80 tweets and tested on 40 (the full run: 300,
300 and 100).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

import influkit as ik
from influkit.elmo import BiLMWithSoftmax, Vocabulary, batch_sentences, bilm_lm_loss, load_elmo
from influkit.elmo.corpora import sentiment_data, tokenize, vader_corpus
from influkit.elmo.models import SentenceClassifier
from influkit.training import fit_lbfgs

PRETRAINED = Path(__file__).resolve().parents[2] / "studies" / "results" / "elmo"


def cross_entropy(outputs, targets):
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


def l2(params):
    return 5e-3 * sum((p**2).sum() for p in params.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="30 pretraining sentences, 80 + 40 tweets (CI size)")
    args = parser.parse_args(argv)
    n_sentences, n_train, n_test = (30, 80, 40) if args.quick else (300, 300, 100)
    torch.set_num_threads(1)
    vocab = Vocabulary((PRETRAINED / "vocab.txt").read_text().split("\n"))
    lm = BiLMWithSoftmax(load_elmo(PRETRAINED / "elmo_options.json", PRETRAINED / "elmo_weights.hdf5"), len(vocab))
    lm.softmax.load_state_dict(load_file(PRETRAINED / "softmax.safetensors"))
    sentences = [t for t in map(tokenize, vader_corpus()) if 3 <= len(t) <= 16][:n_sentences]
    char, token_ids, _ = batch_sentences(sentences, vocab)
    pre = ik.Stage(lm.eval(), bilm_lm_loss, (char, token_ids))  # g(z): the biLM loss of sentence z

    texts, labels = sentiment_data("tweets", min_abs_rating=0.5)
    n = n_train + n_test
    tweets, _, _ = batch_sentences([tokenize(t)[:24] or ["."] for t in texts[:n]], vocab)
    y = torch.tensor(labels[:n])
    clf = SentenceClassifier(lm.bilm, 2, hidden=64, seed=0).eval()
    features = clf.fit_standardization(tweets[:n_train])
    fit_lbfgs(ik.Stage(clf.head, cross_entropy, (features, y[:n_train]), regularizer=l2), max_iter=400, tol=1e-6)
    fin = ik.Stage(clf, cross_entropy, (tweets[:n_train], y[:n_train]), params="head", regularizer=l2)

    solve = [ik.SolveConfig(solver="minres", damping=1.0, preconditioner="ekfac", max_iter=40),
             ik.SolveConfig(solver="direct", damping=1e-8)]
    curvature = [ik.CurvatureConfig(fisher="empirical"), ik.CurvatureConfig()]
    res = ik.Chain([pre, fin], [ik.Link("bilm", case=1)], solve=solve, curvature=curvature).query(
        (tweets[n_train:], y[n_train:])).scores()
    texts_of = [" ".join(s) for s in sentences]
    print("pretraining sentences whose up-weighting most raises the test tweets' loss:")
    print(res.top(5, texts=texts_of)[["score", "text"]].to_string(index=False))
    print("... and most lowers it:")
    print(res.top(5, harmful=False, texts=texts_of)[["score", "text"]].to_string(index=False))
    solve0 = res.diagnostics["solves"][0]
    print(f"pretraining solve: {solve0['solver']}, {solve0['iterations']} iterations, residual {solve0['residual']:.1e}")


if __name__ == "__main__":
    main()
