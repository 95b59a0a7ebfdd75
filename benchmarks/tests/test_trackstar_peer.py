"""benchmarks/trackstar_peer.py runs Bergson's TrackStar on a record's checkpoints and reads its scores in influkit's
order and sign: with unit-normalized (preconditioned) gradients on both sides, a training document that is a copy of
a test document has cosine 1 with it at every checkpoint, the largest any document can have, so its loss-signed score
(negative: it lowers the test loss) is that test document's smallest, and the summed scores are −1 per checkpoint.
Skipped where Bergson is not installed (it lives in the bench venv: scripts/bench-env.sh)."""
import importlib.util

import pytest
import torch


pytestmark = pytest.mark.skipif(importlib.util.find_spec("bergson") is None,
                                reason="bergson not installed (bash scripts/bench-env.sh)")


def test_a_copy_of_the_test_document_is_its_most_helpful_training_document():
    from benchmarks.tests.conftest import gpt2_record, snippets
    from benchmarks.trackstar_peer import trackstar_scores

    texts = snippets(14)
    train, test = texts[:12] + [texts[12]], texts[12:14]  # row 12 is a copy of test document 0
    record, tokenizer = gpt2_record(train)
    steps = [2, 4]
    scores = torch.as_tensor(trackstar_scores(record, tokenizer, train, test, steps)).double()
    assert scores.shape == (len(train), len(test))
    assert int(scores[:, 0].argmin()) == 12
    assert float(scores[12, 0]) == pytest.approx(-len(steps), abs=1e-3)
