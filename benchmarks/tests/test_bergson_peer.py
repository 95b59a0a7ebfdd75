"""benchmarks/bergson_peer.py calls Bergson correctly: its unprojected index holds the per-example gradients (dot
products equal to explicit autograd ones, FAISS equal to the dot products), and its MAGIC scores are the derivative
of the test loss in the data weights (central finite differences of re-run training). Skipped where Bergson is not
installed (it lives in the bench venv: scripts/bench-env.sh)."""
import importlib.util

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bergson") is None,
                                reason="bergson not installed (bash scripts/bench-env.sh)")

LENGTH = 8


def tiny_gpt2(dtype=torch.float32):
    import transformers

    config = transformers.GPT2Config(vocab_size=32, n_positions=LENGTH, n_embd=16, n_layer=1, n_head=2,
                                     tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval().to(dtype)
    model.set_attn_implementation("eager")
    return model


def tokens(n, seed):
    return torch.randint(0, 32, (n, LENGTH), generator=torch.Generator().manual_seed(seed))


def test_unprojected_index_scores_are_the_gradient_dot_products():
    """projection_dim=0 stores each example's gradient of Σ_s ℓ_s for every Conv1D weight of the base model; the
    query's dot products (and FAISS Flat IP's) equal those of explicit per-example autograd gradients."""
    from transformers.pytorch_utils import Conv1D

    from benchmarks.bergson_peer import index_build_and_query

    model, corpus, queries = tiny_gpt2(), tokens(12, 0), tokens(3, 1)
    out = index_build_and_query(model, corpus, queries, projection_dim=0)
    weights = [m.weight for m in model.transformer.modules() if isinstance(m, Conv1D)]

    def grad(ids):
        logits = model(ids[None]).logits[0, :-1]
        loss = nn.functional.cross_entropy(logits, ids[1:], reduction="sum")
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, weights)])

    expected = torch.stack([grad(q) for q in queries]) @ torch.stack([grad(z) for z in corpus]).T
    torch.testing.assert_close(out.scores, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.faiss_scores, out.scores, rtol=1e-5, atol=1e-6)
    assert out.numbers_per_example == sum(w.numel() for w in weights)
    assert out.bytes_per_example == 4 * out.numbers_per_example


def test_magic_scores_are_finite_differences_of_retraining():
    """float64, 3 AdamW steps over 6 examples (each seen at two steps): score[z] = d L_test / d w_z matches the
    central difference (L(w_z = 1 + h) − L(w_z = 1 − h)) / 2h of Bergson's training re-run at those weights,
    h = 1e-6."""
    from benchmarks.bergson_peer import magic_scores

    model, data, test = tiny_gpt2(torch.float64), tokens(6, 2), tokens(2, 3)
    ids = [torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 0, 1]), torch.tensor([2, 3, 4, 5])]
    batches = [data[i] for i in ids]
    settings = {"example_ids": ids, "lr": 1e-2, "weight_decay": 0.01, "eps_root": 1e-30}
    out = magic_scores(model, batches, test, **settings)
    h = 1e-6  # AdamW's first steps bend the run sharply in w: at h = 1e-3 the difference is off by 0.2 %
    for z in range(6):
        up, down = torch.ones(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
        up[z], down[z] = 1 + h, 1 - h
        fd = (magic_scores(model, batches, test, weights=up, **settings).test_loss
              - magic_scores(model, batches, test, weights=down, **settings).test_loss) / (2 * h)
        assert float(out.scores[z]) == pytest.approx(fd, rel=1e-5, abs=1e-9), z


def test_causal_labels_move_masked_lm_labels_right_and_refuse_the_last_position():
    from benchmarks.bergson_peer import causal_labels

    labels = torch.tensor([[-100, 7, -100, 9, -100]])
    assert causal_labels(labels).tolist() == [[-100, -100, 7, -100, 9]]
    with pytest.raises(ValueError, match="last position"):
        causal_labels(torch.tensor([[-100, 7, 3]]))


def test_masked_lm_behind_the_causal_loss_is_its_own_weighted_loss():
    """studies.minilm_replay.CausalLossMaskedLM with causal_labels and Bergson's weighted_causal_lm_ce: at unit
    weights its loss is BertForMaskedLM's own masked-LM loss; a row weighted 0 drops out of it (the bare model
    ignores the weights, which is why MAGIC fails on it)."""
    import functools

    import transformers
    from bergson.utils.math import weighted_causal_lm_ce

    from benchmarks.bergson_peer import causal_labels
    from studies.minilm_replay import CausalLossMaskedLM

    config = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=LENGTH,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    bert = transformers.BertForMaskedLM(config).eval()
    ids = tokens(2, 2)
    labels = torch.full_like(ids, -100)
    labels[0, [1, 4]], labels[1, [2, 3, 5]] = ids[0, [1, 4]], ids[1, [2, 3, 5]]
    model = CausalLossMaskedLM(bert)
    model.loss_function = functools.partial(weighted_causal_lm_ce, reduction="mean")
    shifted = causal_labels(labels)
    own = bert(input_ids=ids, labels=labels).loss
    assert torch.allclose(model(ids, shifted, example_weight=torch.ones(2)).loss, own, atol=1e-6)
    first = bert(input_ids=ids[:1], labels=labels[:1]).loss
    weighted = model(ids, shifted, example_weight=torch.tensor([1.0, 0.0])).loss
    assert torch.allclose(weighted * 5 / 2, first, atol=1e-6)  # mean over the batch's 5 labelled tokens
