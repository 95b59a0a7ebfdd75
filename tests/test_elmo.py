"""ELMo biLM: exactness against allennlp 0.9.0's fixture (TensorFlow outputs), file round trips, LM-loss gradients."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import need
from torch.func import functional_call, grad, vmap

h5py = need("h5py")  # influkit.elmo reads allennlp files with it (influkit[elmo])

from influkit.elmo import (  # noqa: E402
    PAD_ID,
    BiLMWithSoftmax,
    ElmoBiLM,
    ElmoOptions,
    ElmoSentenceEncoder,
    EmbeddingsFile,
    ScalarMix,
    Vocabulary,
    batch_sentences,
    batch_to_char_ids,
    bilm_lm_loss,
    embed_sentences,
    load_elmo,
    read_options,
    remove_sentence_boundaries,
    save_weights,
    token_to_char_ids,
    write_embeddings_file,
    write_options,
)
from influkit.errors import InputError
from influkit.stage import Stage

FIXTURE = Path(
    os.environ.get(
        "INFLUKIT_ELMO_FIXTURE", Path(__file__).parents[1].parent / "shared" / "data" / "allennlp-elmo-fixture"
    )
)
needs_fixture = pytest.mark.skipif(
    not (FIXTURE / "lm_weights.hdf5").is_file(),
    reason=f"allennlp ELMo fixture not found at {FIXTURE}; set INFLUKIT_ELMO_FIXTURE to its directory "
    "(allennlp 0.9.0 wheel, allennlp/tests/fixtures/elmo/).",
)

TINY = ElmoOptions(
    char_embed_dim=3,
    filters=((1, 3), (2, 4), (3, 5)),
    n_highway=2,
    projection_dim=5,
    cell_dim=7,
    n_layers=2,
    cell_clip=3.0,
    proj_clip=3.0,
    activation="tanh",
)
SENTENCES = [["The", "cat", "sat", "."], ["Dogs", "bark"], ["A", "naïve", "cat", "barks", "loudly", "."]]


@pytest.fixture(scope="module")
def fixture_bilm():
    if not (FIXTURE / "lm_weights.hdf5").is_file():
        pytest.skip(f"allennlp ELMo fixture not found at {FIXTURE}; set INFLUKIT_ELMO_FIXTURE.")
    return load_elmo(FIXTURE / "options.json", FIXTURE / "lm_weights.hdf5")


def tiny_bilm(seed: int = 0, dtype=torch.float64) -> ElmoBiLM:
    torch.manual_seed(seed)
    return ElmoBiLM(TINY, dtype=dtype).eval()


# ---------------------------------------------------------------- exactness against the TensorFlow outputs


@needs_fixture
def test_bilm_reproduces_tensorflow_outputs_statefully():
    """allennlp's test_elmo_bilm protocol: batch i holds sentence i of each of the 3 files, state carried per row."""
    sentences = json.loads((FIXTURE / "sentences.json").read_text())
    expected = []
    for k in range(len(sentences)):
        with h5py.File(FIXTURE / f"lm_embeddings_{k}.hdf5", "r") as fin:
            expected.append([np.concatenate([fin[str(i)][0], fin[str(i)][1]], -1) for i in range(len(sentences[k]))])

    stateful = load_elmo(FIXTURE / "options.json", FIXTURE / "lm_weights.hdf5", stateful=True)
    stateless = load_elmo(FIXTURE / "options.json", FIXTURE / "lm_weights.hdf5")
    errors, stateless_errors = [], []
    with torch.no_grad():
        for i, batch in enumerate(zip(*sentences)):
            tokens = [s.split() for s in batch]
            ids = batch_to_char_ids(tokens)
            for model, errs in ((stateful, errors), (stateless, stateless_errors)):
                out = model(ids)
                top, mask = remove_sentence_boundaries(out.activations[2], out.mask)
                assert mask.sum(1).tolist() == [len(t) for t in tokens]
                errs.append(max(np.abs(top[k, : len(t)].numpy() - expected[k][i]).max() for k, t in enumerate(tokens)))
    print(f"max abs error vs TensorFlow biLM over 10 batches: {max(errors):.3g}")
    assert len(errors) == 10
    assert max(errors) <= 1e-5
    # the first batch starts from the zero state; later ones only match if the state is carried over
    assert stateless_errors[0] <= 1e-5 and max(stateless_errors[1:]) > 1e-2


@needs_fixture
def test_char_cnn_reproduces_token_embeddings(fixture_bilm):
    words = (FIXTURE / "vocab_test.txt").read_text().strip().split("\n")
    with h5py.File(FIXTURE / "elmo_token_embeddings.hdf5", "r") as fin:
        expected = fin["embedding"][...]
    assert len(words) == expected.shape[0] == 458
    with torch.no_grad():
        actual = fixture_bilm.token_embeddings(batch_to_char_ids([words])[0]).numpy()
        err = np.abs(actual - expected).max()
        print(f"max abs error of char-CNN token vectors: {err:.3g}")
        assert err <= 1e-5
        bilm64 = load_elmo(FIXTURE / "options.json", FIXTURE / "lm_weights.hdf5", dtype=torch.float64)
        as_float64 = bilm64.token_embeddings(batch_to_char_ids([words])[0])
        assert as_float64.dtype == torch.float64 and np.abs(as_float64.numpy() - expected).max() <= 1e-5
        # the markers the biLM inserts are the char ids of the tokens "<S>" and "</S>"
        out = fixture_bilm(batch_to_char_ids([["Don", "'t", "!"]]))
        markers = fixture_bilm.token_embeddings(torch.tensor([token_to_char_ids("<S>"), token_to_char_ids("</S>")]))
        assert torch.allclose(out.activations[0, 0, 0, :16], markers[0], atol=1e-6)
        assert torch.allclose(out.activations[0, 0, 4, :16], markers[1], atol=1e-6)
        assert torch.equal(out.activations[0, 0, :5, :16], out.activations[0, 0, :5, 16:])


def test_stateful_rows_carry_their_own_state_across_batch_sizes():
    """Row b's state depends only on the sentences row b has seen: a smaller batch leaves the other rows'
    states untouched, a larger batch starts its new rows from zero (allennlp's _EncoderBase protocol)."""
    batches = [[SENTENCES[0], SENTENCES[1]], [SENTENCES[2], SENTENCES[0], SENTENCES[1]], [SENTENCES[1]],
               [SENTENCES[0], SENTENCES[2], SENTENCES[2]]]
    batched = tiny_bilm(seed=4)
    batched.stateful = True
    outputs = [batched(batch_to_char_ids(b)).activations for b in batches]
    for row in range(3):
        alone = tiny_bilm(seed=4)
        alone.stateful = True
        for batch, out in zip(batches, outputs):
            if row < len(batch):
                n = len(batch[row])
                expected = alone(batch_to_char_ids([batch[row]])).activations[:, 0, : n + 2]
                torch.testing.assert_close(out[:, row, : n + 2], expected, rtol=1e-12, atol=1e-12)
    fresh = tiny_bilm(seed=4)
    batched.reset_states()
    torch.testing.assert_close(batched(batch_to_char_ids(batches[0])).activations,
                               fresh(batch_to_char_ids(batches[0])).activations)
    assert not torch.allclose(outputs[3][:, 0], fresh(batch_to_char_ids(batches[3])).activations[:, 0])


# ---------------------------------------------------------------- file round trips


@needs_fixture
def test_weight_file_round_trip_is_bit_identical(fixture_bilm, tmp_path):
    save_weights(fixture_bilm, tmp_path / "weights.hdf5")
    write_options(fixture_bilm.options, tmp_path / "options.json")

    def datasets(path):
        found = {}

        def keep(name, obj):
            if isinstance(obj, h5py.Dataset):
                found[name] = obj[...]

        with h5py.File(path, "r") as fin:
            fin.visititems(keep)  # a callback returning non-None would stop the visit early
        return found

    original, written = datasets(FIXTURE / "lm_weights.hdf5"), datasets(tmp_path / "weights.hdf5")
    assert sorted(original) == sorted(written) and len(original) == 33
    for name, array in original.items():
        assert written[name].dtype == array.dtype, name
        assert written[name].shape == array.shape, name
        assert written[name].tobytes() == array.tobytes(), name
    assert read_options(tmp_path / "options.json") == read_options(FIXTURE / "options.json")
    # a float64 copy writes back the same float32 bytes
    reloaded = load_elmo(tmp_path / "options.json", tmp_path / "weights.hdf5", dtype=torch.float64)
    save_weights(reloaded, tmp_path / "again.hdf5")
    again = datasets(tmp_path / "again.hdf5")
    assert all(again[n].tobytes() == a.tobytes() for n, a in original.items())


@needs_fixture
def test_weight_file_errors_name_the_problem(tmp_path):
    options = json.loads((FIXTURE / "options.json").read_text())
    options["lstm"]["projection_dim"] = 32
    (tmp_path / "options.json").write_text(json.dumps(options))
    with pytest.raises(InputError, match="CNN_proj/W_proj.*options.json"):
        load_elmo(tmp_path / "options.json", FIXTURE / "lm_weights.hdf5")
    with pytest.raises(InputError, match="does not exist"):
        load_elmo(FIXTURE / "options.json", tmp_path / "missing.hdf5")
    options = json.loads((FIXTURE / "options.json").read_text())
    options["lstm"]["n_layers"] = 3
    (tmp_path / "options.json").write_text(json.dumps(options))
    with pytest.raises(InputError, match="no dataset 'RNN_0/RNN/MultiRNNCell/Cell2/LSTMCell/W_0'"):
        load_elmo(tmp_path / "options.json", FIXTURE / "lm_weights.hdf5")


def test_embeddings_file_round_trip_and_streaming(tmp_path):
    bilm = tiny_bilm()
    sentences = SENTENCES + [[], ["cat"]]
    n = write_embeddings_file(tmp_path / "elmo.hdf5", bilm, iter(sentences), batch_size=2)
    assert n == len(sentences)

    with torch.no_grad():
        activations = bilm(batch_to_char_ids(sentences)).activations  # (3, B, T + 2, 10), <S> at position 0
    with EmbeddingsFile(tmp_path / "elmo.hdf5") as f:
        assert len(f) == len(sentences)
        keys = []
        for key, array in f:
            i = int(key)
            keys.append(key)
            assert array.dtype == np.float32 and array.shape == (3, len(sentences[i]), 10)
            expected = activations[:, i, 1 : len(sentences[i]) + 1].numpy()
            np.testing.assert_allclose(array, expected, rtol=0, atol=1e-6)  # float32 storage
            np.testing.assert_array_equal(array[0, :, :5], array[0, :, 5:])
        assert keys == [str(i) for i in range(len(sentences))]
        assert f.sentence_to_index() == {" ".join(s): str(i) for i, s in enumerate(sentences)}
        np.testing.assert_array_equal(f[4], f["4"])
        with pytest.raises(InputError, match="no sentence with index"):
            f[len(sentences)]
    with h5py.File(tmp_path / "elmo.hdf5", "r") as fin:  # allennlp's layout, read without influkit
        assert json.loads(fin["sentence_to_index"][0])["Dogs bark"] == "1"
        assert fin["0"].shape == (3, 4, 10)

    pulled = []

    def source():
        for s in sentences:
            pulled.append(s)
            yield s

    first = next(embed_sentences(bilm, source(), batch_size=2))
    assert len(pulled) == 2 and first[0] == sentences[0]


# ---------------------------------------------------------------- the LM loss g(z)


def test_lm_loss_matches_explicit_sum_and_ignores_padding():
    bilm = tiny_bilm()
    vocab = Vocabulary(["The", "cat", "sat", ".", "Dogs"])
    model = BiLMWithSoftmax(bilm, len(vocab)).eval()
    char_ids, token_ids, mask = batch_sentences(SENTENCES, vocab, length=8)
    assert char_ids.shape == (3, 8, 50) and token_ids[1, 2:].eq(PAD_ID).all() and mask.sum(1).tolist() == [4, 2, 6]
    assert token_ids[1, 1] == vocab.index("bark") == 2  # unknown -> <UNK>
    losses = bilm_lm_loss(model(char_ids), token_ids)
    assert losses.shape == (3,)

    for b, sentence in enumerate(SENTENCES):
        alone = model(batch_to_char_ids([sentence]))[0]  # (2, n + 2, V), no padding
        ids = [0] + [vocab.index(t) for t in sentence] + [1]
        logp = torch.log_softmax(alone, dim=-1)
        n = len(sentence)
        forward = -sum(logp[0, i, ids[i + 1]] for i in range(n + 1))
        backward = -sum(logp[1, i, ids[i - 1]] for i in range(1, n + 2))
        torch.testing.assert_close(losses[b], (forward + backward) / (2 * (n + 1)), rtol=1e-12, atol=1e-12)


def _coordinates(params, grads, gen, per_tensor=1):
    picks = []
    for name, g in grads.items():
        flat = g.reshape(-1).abs()
        candidates = torch.nonzero(flat >= 0.1 * flat.max()).reshape(-1)
        for j in torch.randperm(candidates.numel(), generator=gen)[:per_tensor]:
            picks.append((name, int(candidates[j])))
    return picks


def test_lm_loss_gradients_match_central_differences_float64():
    bilm = tiny_bilm(seed=1)
    vocab = Vocabulary(["The", "cat", "sat", ".", "Dogs", "bark"])
    torch.manual_seed(1)
    model = BiLMWithSoftmax(bilm, len(vocab)).eval()
    char_ids, token_ids, _ = batch_sentences(SENTENCES, vocab)
    weights = torch.tensor([0.3, 1.0, 0.7], dtype=torch.float64)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}

    def objective(p):
        return (bilm_lm_loss(functional_call(model, p, (char_ids,)), token_ids) * weights).sum()

    grads = torch.autograd.grad(objective({n: v.requires_grad_() for n, v in params.items()}), list(params.values()))
    grads = dict(zip(params, grads))
    params = {n: v.detach() for n, v in params.items()}
    picks = _coordinates(params, grads, torch.Generator().manual_seed(0))
    assert any(n.startswith("bilm.char_cnn.conv") for n, _ in picks) and any("lstm" in n for n, _ in picks)
    eps = 1e-4  # truncation O(eps²) and round-off O(1e-16·|g(z)|/eps) both stay far below 1e-6 here
    worst = 0.0
    with torch.no_grad():
        for name, idx in picks:
            shifted = dict(params)
            plus, minus = params[name].clone(), params[name].clone()
            plus.view(-1)[idx] += eps
            minus.view(-1)[idx] -= eps
            shifted[name] = plus
            f_plus = objective(shifted)
            shifted[name] = minus
            f_minus = objective(shifted)
            fd = (f_plus - f_minus) / (2 * eps)
            analytic = grads[name].reshape(-1)[idx]
            worst = max(worst, float(abs(fd - analytic) / abs(analytic)))
    print(f"{len(picks)} coordinates, worst relative error {worst:.3g}")
    assert len(picks) == len(params) == 31
    assert worst <= 1e-6


def test_per_example_gradients_by_vmap_match_single_sentence_gradients():
    """The loss is a pure per-row function, so influkit's vmap(grad) per-example gradients work."""
    bilm = tiny_bilm(seed=2)
    vocab = Vocabulary(["The", "cat", "sat", "."])
    model = BiLMWithSoftmax(bilm, len(vocab)).eval()
    char_ids, token_ids, _ = batch_sentences(SENTENCES, vocab)
    params = {n: p.detach() for n, p in model.named_parameters() if "lstm.forward_layers.1" in n or "softmax" in n}

    def single(p, x, y):
        return bilm_lm_loss(functional_call(model, p, (x.unsqueeze(0),)), y.unsqueeze(0)).squeeze(0)

    stage = Stage(model, bilm_lm_loss, (char_ids, token_ids))
    expected = bilm_lm_loss(model(char_ids), token_ids)
    torch.testing.assert_close(stage.losses(stage.trained(), char_ids, token_ids), expected)
    batched = vmap(grad(single), in_dims=(None, 0, 0))(params, char_ids, token_ids)
    for b, sentence in enumerate(SENTENCES):
        x, y, _ = batch_sentences([sentence], vocab)
        alone = grad(single)(params, x[0], y[0])
        for name in params:
            torch.testing.assert_close(batched[name][b], alone[name], rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- character ids and small modules


def test_character_ids_edge_cases():
    ids = token_to_char_ids("cat")
    assert ids[:5] == [259, 100, 98, 117, 260] and ids[5:] == [261] * 45
    assert token_to_char_ids("<S>") == [259, 257, 260] + [261] * 47
    assert token_to_char_ids("</S>") == [259, 258, 260] + [261] * 47
    assert token_to_char_ids("<s>")[:5] == [259, 61, 116, 63, 260]  # only the exact markers are special
    long = token_to_char_ids("x" * 60)
    assert len(long) == 50 and long[0] == 259 and long[1:49] == [121] * 48 and long[49] == 260
    exact = token_to_char_ids("y" * 48)
    assert exact == long[:1] + [122] * 48 + [260]
    assert token_to_char_ids("é")[:4] == [259, 196, 170, 260]  # UTF-8 bytes 0xC3 0xA9, +1
    cut = token_to_char_ids("a" + "€" * 20)  # 61 bytes: truncation to 48 bytes splits the 16th euro sign
    assert cut[1:49] == [98] + [b + 1 for b in ("€" * 16).encode("utf-8")[:47]] and cut[49] == 260
    assert token_to_char_ids("") == [259, 260] + [261] * 48

    batch = batch_to_char_ids([["a", "b"], []], length=3)
    assert batch.shape == (2, 3, 50) and batch.dtype == torch.long
    assert batch[0, 2].eq(0).all() and batch[1].eq(0).all()
    with pytest.raises(InputError, match="token lists"):
        batch_to_char_ids(["a sentence"])
    with pytest.raises(InputError, match="shorter than the longest"):
        batch_to_char_ids([["a", "b"]], length=1)
    with pytest.raises(InputError, match="shape"):
        tiny_bilm()(torch.zeros(2, 3, 49, dtype=torch.long))


def test_scalar_mix_and_sentence_encoder():
    bilm = tiny_bilm(seed=3)
    mix = ScalarMix(3, initial_weights=[0.5, -1.0, 2.0], gamma=1.5, dtype=torch.float64)
    layers = torch.randn(3, 2, 4, 10, dtype=torch.float64)
    w = torch.softmax(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64), 0)
    torch.testing.assert_close(mix(layers), 1.5 * (w[0] * layers[0] + w[1] * layers[1] + w[2] * layers[2]))

    encoder = ElmoSentenceEncoder(bilm, mix)
    assert not any(p.requires_grad for p in encoder.parameters())
    char_ids = batch_to_char_ids(SENTENCES)
    vectors = encoder(char_ids)
    assert vectors.shape == (3, encoder.output_dim) == (3, 10)
    with torch.no_grad():
        out = bilm(batch_to_char_ids([SENTENCES[1]]))  # alone: no padding, markers at 0 and 3
        expected = mix(out.activations)[0, 1:3].mean(0)
    torch.testing.assert_close(vectors[1], expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(InputError, match="stateless"):
        ElmoSentenceEncoder(ElmoBiLM(TINY, stateful=True))
