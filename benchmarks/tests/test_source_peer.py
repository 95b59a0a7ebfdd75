"""benchmarks/source_peer.py runs Bergson's SOURCE on a record's checkpoints and reads its scores in influkit's order
and sign: with one segment of one checkpoint, the score of training document i for a query that is training document
j is −g_iᵀ M g_j, with g the documents' gradients at that checkpoint and M Bergson's unrolled EK-FAC function (positive
on each eigendirection). So with the training documents themselves as the queries the scores form a symmetric matrix
(rows in the stage's order, columns in the queries') that is negative semidefinite (loss-signed: a document lowers its
own loss). Skipped where Bergson is not installed (it lives in the bench venv: scripts/bench-env.sh)."""
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bergson") is None,
                                reason="bergson not installed (bash scripts/bench-env.sh)")


def test_one_segment_scores_the_training_documents_as_a_symmetric_negative_semidefinite_matrix():
    from benchmarks.source_peer import source_scores
    from benchmarks.tests.conftest import gpt2_record, snippets

    texts = [s for s in snippets(40) if len(s) <= 28][:12]  # each within the model's 32 positions
    record, tokenizer = gpt2_record(texts)
    scores = torch.as_tensor(source_scores(record, tokenizer, texts, texts, [6], 1)).double()
    assert scores.shape == (12, 12)
    largest = float(scores.abs().max())
    torch.testing.assert_close(scores, scores.T, rtol=0, atol=1e-5 * largest)
    eigenvalues = torch.linalg.eigvalsh((scores + scores.T) / 2)
    assert float(eigenvalues.max()) <= 1e-5 * largest and float(eigenvalues.min()) < -0.1 * largest
    with pytest.raises(ValueError, match="do not cut into 2 equal segments"):
        source_scores(record, tokenizer, texts, texts, [2, 4, 6], 2)
