"""influkit.hf: transformers models as stages — packing, eval mode, deterministic masking, and a tiny float64
BERT chain (masked-LM pretraining → classification finetuning) checked against the explicit-Hessian formula.

Ground truth for the chain is DESIGN §1 computed directly: the Hessians of the pretraining objective over
(W, U) and of the finetuning objective over (W, Θ) are built explicitly over flattened parameters by
``influkit.validation.reference.explicit_hessian`` (``jacfwd`` of ``grad``; checked here again against
central finite differences of the gradient) and inverted densely, and the Case 1 / Case 2 influence of every
pretraining sentence is assembled from their blocks, without the chain's adjoint recursion. The models use
eager attention because forward-mode AD has no rule for CPU scaled-dot-product attention.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.func import grad

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import influkit as ik  # noqa: E402
from influkit import hf  # noqa: E402
from influkit.curvature import HessianOperator  # noqa: E402
from influkit.errors import VectorizationWarning  # noqa: E402
from influkit.gradients import per_example_grads, per_example_grads_serial  # noqa: E402
from influkit.params import ParamSpace, shared_parameters  # noqa: E402
from influkit.stage import check_eval_mode as generic_check_eval_mode  # noqa: E402
from influkit.validation.reference import explicit_hessian  # noqa: E402

BertConfig = transformers.BertConfig
BertForMaskedLM = transformers.BertForMaskedLM
BertForSequenceClassification = transformers.BertForSequenceClassification

VOCAB, LENGTH, MASK_ID, SPECIALS = 20, 8, 4, (0, 1, 2, 3, 4)  # [PAD] [UNK] [CLS] [SEP] [MASK]
DECAY, ALPHA = 0.05, 0.1


def tiny_config(**kw) -> BertConfig:
    base = dict(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=12,
                max_position_embeddings=LENGTH, num_labels=2, attn_implementation="eager",
                initializer_range=0.5)  # fmt: skip  (large weights: sentences get distinct outputs)
    return BertConfig(**(base | kw))


def tokens(n: int, seed: int) -> dict[str, torch.Tensor]:
    """n random 'sentences' [CLS] w … w [SEP] [PAD]… of 4–8 tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (n, LENGTH), generator=gen)
    lengths = torch.randint(4, LENGTH + 1, (n,), generator=gen)
    pos = torch.arange(LENGTH)
    ids[:, 0] = 2
    ids = torch.where(pos == (lengths - 1)[:, None], 3, ids)
    ids = torch.where(pos >= lengths[:, None], 0, ids)
    return {"input_ids": ids, "attention_mask": (pos < lengths[:, None]).long()}


def l2(params):
    return 0.5 * DECAY * sum((p**2).sum() for p in params.values())


def pretrain_stage(seed: int = 0, n: int = 10) -> ik.Stage:
    torch.manual_seed(seed)
    model = BertForMaskedLM(tiny_config()).double().eval()
    return hf.masked_lm_stage(model, tokens(n, seed), mask_token_id=MASK_ID, special_token_ids=SPECIALS,
                              seed=7, regularizer=l2)  # fmt: skip


def finetune_model(pre: ik.Stage, perturb: float = 0.0) -> BertForSequenceClassification:
    """A classifier whose bert block is the pretrained one (+ ``perturb``·noise, standing in for finetuning)."""
    torch.manual_seed(1)
    model = BertForSequenceClassification(tiny_config()).double().eval()
    state = pre.state()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in state:
                p.copy_(state[name] + perturb * torch.randn_like(p))
    return model


def labelled(n: int, seed: int) -> dict[str, torch.Tensor]:
    batch = tokens(n, seed)
    return batch | {"labels": (batch["input_ids"][:, 1] % 2).long()}


# --- packing and the model wrapper --------------------------------------------------------------------


def test_pack_round_trip_and_errors():
    batch = labelled(5, 0)
    inputs, targets = hf.pack(batch)
    assert inputs.shape == (5, 2, LENGTH) and torch.equal(targets, batch["labels"])
    back = hf.unpack(inputs, ("input_ids", "attention_mask"))
    assert torch.equal(back["input_ids"], batch["input_ids"]) and torch.equal(back["attention_mask"], batch["attention_mask"])
    with pytest.raises(ik.InputError, match="input_ids"):
        hf.pack({"attention_mask": batch["attention_mask"], "labels": batch["labels"]})
    with pytest.raises(ik.InputError, match="labels"):
        hf.pack({"input_ids": batch["input_ids"]})
    with pytest.raises(ik.InputError, match="shape"):
        hf.pack(batch | {"attention_mask": batch["attention_mask"][:, :3]})


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_wrapper_keeps_names_and_matches_the_model(attention):
    torch.manual_seed(0)
    model = BertForSequenceClassification(tiny_config(attn_implementation=attention)).float().eval()
    wrapped = hf.HFModel(model)
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in model.named_parameters()]
    batch = labelled(6, 3)
    inputs, _ = hf.pack(batch)
    expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(wrapped(inputs), expected, rtol=0, atol=1e-6)
    # padding is ignored: a padded row gives the logits of the same sentence without padding
    row = int(batch["attention_mask"].sum(1).argmin())
    short = batch["input_ids"][row : row + 1, : int(batch["attention_mask"][row].sum())]
    torch.testing.assert_close(wrapped(inputs[row : row + 1]), model(input_ids=short).logits, rtol=0, atol=1e-5)
    assert wrapped(inputs).dtype == torch.float32
    assert expected.std(0).min() > 1e-2  # the sentences' logits differ, so the comparisons above can fail


def test_hessian_vector_products_run_with_default_attention():
    """transformers' default sdpa attention gives the same Hessian-vector products as eager attention."""
    products = []
    for attention in ("sdpa", "eager"):
        torch.manual_seed(0)
        model = BertForSequenceClassification(tiny_config(attn_implementation=attention)).double().eval()
        stage = hf.classification_stage(model, labelled(6, 2))
        op = HessianOperator(stage, stage.param_names)
        vec = torch.randn(op.dim, 2, generator=torch.Generator().manual_seed(1))
        products.append(op.matvec(vec))
    assert products[1].abs().max() > 1e-3
    torch.testing.assert_close(products[0], products[1], rtol=1e-9, atol=1e-12)


def test_tied_decoder_stays_tied_under_the_stage():
    pre = pretrain_stage()
    names = pre.param_names
    assert "cls.predictions.decoder.weight" not in names and "bert.embeddings.word_embeddings.weight" in names
    params = pre.trained()
    x, y = pre.data.take(torch.arange(3))
    moved = dict(params)
    moved["bert.embeddings.word_embeddings.weight"] = params["bert.embeddings.word_embeddings.weight"] + 0.5
    # changing the embedding changes the decoder too: compare with the model changed in place
    model = pre.model.hf_model
    with torch.no_grad():
        model.bert.embeddings.word_embeddings.weight.add_(0.5)
        in_place = hf.masked_lm_losses(pre.model(x), y)
        model.bert.embeddings.word_embeddings.weight.sub_(0.5)
    torch.testing.assert_close(pre.losses(moved, x, y), in_place)


def test_eval_mode_check_understands_transformers_dropout():
    torch.manual_seed(0)
    model = BertForMaskedLM(tiny_config(attention_probs_dropout_prob=0.5, hidden_dropout_prob=0.0)).double()
    with pytest.raises(ik.ModelModeError, match="attention_probs_dropout_prob"):
        hf.masked_lm_stage(model, tokens(4, 0), mask_token_id=MASK_ID, special_token_ids=SPECIALS)
    model.eval()
    stage = hf.masked_lm_stage(model, tokens(4, 0), mask_token_id=MASK_ID, special_token_ids=SPECIALS)
    # only the attention module in train mode: no nn.Dropout layer is training, yet attention dropout is on
    attention = model.bert.encoder.layer[0].attention.self
    attention.train()
    attention.dropout.eval()
    generic_check_eval_mode(model)  # the generic check sees no training dropout layer ...
    x, y = stage.data.take(torch.arange(4))
    first, second = stage.losses(stage.trained(), x, y), stage.losses(stage.trained(), x, y)
    assert not torch.equal(first, second)  # ... but the loss is random
    with pytest.raises(ik.ModelModeError, match="train mode"):
        hf.check_eval_mode(model)


def test_shared_prefix_leaves_new_parameters_to_the_later_model():
    pre = pretrain_stage()
    fin_model = finetune_model(pre)
    mapping = shared_parameters(pre.model, fin_model, "bert")
    assert mapping and all(n.startswith(("bert.embeddings.", "bert.encoder.")) for n in mapping)
    assert set(mapping) == {n for n in pre.param_names if n.startswith("bert.")}
    with pytest.raises(ik.ParameterError, match="does not have"):
        shared_parameters(pre.model, fin_model, "bert.pooler")  # only the later model has it: nothing is shared
    with pytest.raises(ik.ParameterError, match="matches no parameter"):
        shared_parameters(pre.model, fin_model, "encoder")


# --- deterministic masking ------------------------------------------------------------------------------


def test_masking_is_a_function_of_the_example_index():
    batch = tokens(40, 5)
    a = hf.masked_lm_batch(batch, mask_token_id=MASK_ID, vocab_size=VOCAB, special_token_ids=SPECIALS, seed=3)
    b = hf.masked_lm_batch(batch, mask_token_id=MASK_ID, vocab_size=VOCAB, special_token_ids=SPECIALS, seed=3)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    # a subset keeps each example's mask when it keeps its index
    part = {k: v[10:20] for k, v in batch.items()}
    c = hf.masked_lm_batch(part, indices=torch.arange(10, 20), mask_token_id=MASK_ID, vocab_size=VOCAB,
                           special_token_ids=SPECIALS, seed=3)  # fmt: skip
    assert torch.equal(c["labels"], a["labels"][10:20])
    # the same sentence under another index (or another seed) gets another mask
    same = {k: v[:1].expand(12, -1) for k, v in batch.items()}
    d = hf.masked_lm_batch(same, mask_token_id=MASK_ID, vocab_size=VOCAB, special_token_ids=SPECIALS, seed=3)
    chosen = d["labels"] != -100
    assert len({tuple(row.tolist()) for row in chosen}) > 1
    e = hf.masked_lm_batch(batch, mask_token_id=MASK_ID, vocab_size=VOCAB, special_token_ids=SPECIALS, seed=4)
    assert not torch.equal(e["labels"], a["labels"])
    # never padding or specials, at least one prediction per sentence, labels are the original tokens
    picked = a["labels"] != -100
    assert not (picked & (batch["attention_mask"] == 0)).any()
    assert not (picked & torch.isin(batch["input_ids"], torch.tensor(SPECIALS))).any()
    assert picked.any(dim=1).all()
    assert torch.equal(a["labels"][picked], batch["input_ids"][picked])
    assert torch.equal(a["input_ids"][~picked], batch["input_ids"][~picked])


def test_masking_follows_the_bert_recipe():
    n, length = 400, 64
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 1000, (n, length), generator=gen)
    masked, labels = hf.mask_tokens(ids, None, torch.arange(n), mask_token_id=MASK_ID, vocab_size=1000,
                                    special_token_ids=SPECIALS, seed=0)  # fmt: skip
    picked = labels != -100
    assert abs(float(picked.float().mean()) - 0.15) < 0.01
    to_mask = float((masked[picked] == MASK_ID).float().mean())
    kept = float((masked[picked] == ids[picked]).float().mean())
    assert abs(to_mask - 0.8) < 0.02 and abs(kept - 0.1) < 0.02  # the remaining ≈0.1 are random tokens


def old_masks(batch: dict, seed: int) -> dict:
    """The masks of the rule before issue 22: random replacements uniform over the whole vocabulary, [PAD] too.

    The first replacement draw of each row is unchanged by the fix (specials are redrawn), so the old masked
    batch is the new one with the first draw put back where it was special.
    """
    new = hf.masked_lm_batch(batch, mask_token_id=MASK_ID, vocab_size=VOCAB, special_token_ids=SPECIALS, seed=seed)
    ids = new["input_ids"].clone()
    for i in range(ids.shape[0]):
        gen = torch.Generator().manual_seed(hf.example_seed(seed, i))
        torch.rand(LENGTH, generator=gen, dtype=torch.float32)
        action = torch.rand(LENGTH, generator=gen, dtype=torch.float32)
        first = torch.randint(VOCAB, (LENGTH,), generator=gen)
        at_random = (new["labels"][i] != -100) & (action >= 0.8) & (action < 0.9)
        ids[i] = torch.where(at_random, first, ids[i])
    return new | {"input_ids": ids}


def test_random_replacements_never_draw_special_tokens():
    """Mask seed 7 on the 10 test sentences (the stage of these tests) used to put [PAD] into sentence 7."""
    batch = tokens(10, 0)
    new = hf.masked_lm_batch(batch, mask_token_id=MASK_ID, vocab_size=VOCAB, special_token_ids=SPECIALS, seed=7)
    old = old_masks(batch, seed=7)
    picked = new["labels"] != -100
    assert (old["input_ids"][picked] == 0).sum() == 1 and (old["input_ids"][7][picked[7]] == 0).any()
    assert not torch.isin(new["input_ids"][picked], torch.tensor(SPECIALS[:MASK_ID])).any()
    changed = new["input_ids"] != old["input_ids"]
    assert changed.sum() == 1 and changed[7].any()  # only the special draw was redrawn; the rest is as before
    # over many rows: replacements are uniform over the 15 non-special ids, never a special one
    ids = torch.randint(5, VOCAB, (3000, LENGTH), generator=torch.Generator().manual_seed(0))
    masked, labels = hf.mask_tokens(ids, None, torch.arange(3000), mask_token_id=MASK_ID, vocab_size=VOCAB,
                                    special_token_ids=SPECIALS[:4], seed=0)  # [MASK] itself is never a replacement
    replaced = masked[(labels != -100) & (masked != MASK_ID) & (masked != ids)]
    assert replaced.numel() > 300 and replaced.min() >= 5
    counts = torch.bincount(replaced - 5, minlength=VOCAB - 5).double()
    assert counts.min() > 0.5 * counts.mean()
    with pytest.raises(ik.InputError, match="special"):
        hf.mask_tokens(ids[:2], None, [0, 1], mask_token_id=MASK_ID, vocab_size=5, special_token_ids=SPECIALS)
    with pytest.warns(UserWarning, match=r"\[PAD\]"):  # no special ids given: [PAD] could be drawn
        hf.mask_tokens(ids[:2], None, [0, 1], mask_token_id=MASK_ID, vocab_size=VOCAB)


def test_masks_do_not_depend_on_the_default_dtype():
    """The tests run with a float64 default, examples with float32: the same example gets the same mask."""
    batch = tokens(10, 0)
    here = hf.masked_lm_batch(batch, mask_token_id=MASK_ID, vocab_size=VOCAB, special_token_ids=SPECIALS, seed=7)
    torch.set_default_dtype(torch.float32)
    try:
        there = hf.masked_lm_batch(batch, mask_token_id=MASK_ID, vocab_size=VOCAB, special_token_ids=SPECIALS, seed=7)
    finally:
        torch.set_default_dtype(torch.float64)
    assert torch.get_default_dtype() == torch.float64
    assert torch.equal(here["input_ids"], there["input_ids"]) and torch.equal(here["labels"], there["labels"])


@pytest.mark.parametrize("rule", ["new", "old"])
def test_gradient_equals_central_differences_along_every_embedding_row(rule):
    """float64 tiny BERT: ∂G/∂(word-embedding row r)·d = (G(θ + h·d) − G(θ − h·d)) / 2h for every row r.

    Under the old masks [PAD] was an input at a predicted position; BERT's embedding drops the pad id's lookup
    from the gradient (padding_idx), so the check fails on row 0 — and passes everywhere with the fix.
    """
    torch.manual_seed(0)
    model = BertForMaskedLM(tiny_config()).double().eval()
    batch = tokens(10, 0)
    data = old_masks(batch, 7) if rule == "old" else hf.masked_lm_batch(
        batch, mask_token_id=MASK_ID, vocab_size=VOCAB, special_token_ids=SPECIALS, seed=7)
    stage = hf.masked_lm_stage(model, data, regularizer=l2)
    (name,) = [n for n in stage.param_names if "word_embeddings" in n]
    weight = stage.trained()[name].clone().requires_grad_(True)
    (g,) = torch.autograd.grad(stage.objective({name: weight}), weight)
    gen, h = torch.Generator().manual_seed(1), 1e-5
    errors = []
    for r in range(VOCAB):
        d = torch.zeros_like(weight)
        d[r] = torch.randn(weight.shape[1], generator=gen)
        with torch.no_grad():
            diff = (stage.objective({name: weight + h * d}) - stage.objective({name: weight - h * d})) / (2 * h)
        errors.append(float(abs((g * d).sum() - diff) / max(float(abs(diff)), 1e-3)))
    errors = torch.tensor(errors)
    if rule == "new":
        assert errors.max() < 1e-7, errors
    else:
        assert errors[0] > 1e-2 and errors[1:].max() < 1e-7, errors  # only the [PAD] row is wrong


def test_same_example_same_loss_twice_and_across_stage_builds():
    pre, again = pretrain_stage(), pretrain_stage()
    params = pre.trained()
    x, y = pre.data.take(torch.tensor([3]))
    first, second = pre.losses(params, x, y), pre.losses(params, x, y)
    assert torch.equal(first, second)
    x2, y2 = again.data.take(torch.tensor([3]))
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(again.losses(again.trained(), x2, y2), first)
    # the sentence at index 3 placed at index 0 is masked differently
    batch = tokens(10, 0)
    moved = {k: torch.cat([v[3:4], v[:3], v[4:]]) for k, v in batch.items()}
    other = hf.masked_lm_stage(pre.model, moved, mask_token_id=MASK_ID, special_token_ids=SPECIALS, seed=7)
    assert not torch.equal(other.data.take(torch.tensor([0]))[1], y)


def test_per_example_gradients_vectorize():
    pre = pretrain_stage()
    x, y = pre.data.take(torch.arange(len(pre)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", VectorizationWarning)
        fast = per_example_grads(pre, x, y)
    torch.testing.assert_close(fast, per_example_grads_serial(pre, x, y), rtol=1e-10, atol=1e-12)


def test_a_tokenizer_built_from_a_trained_vocabulary_encodes_as_the_trained_one():
    texts = ["the cat sat on the mat .", "a dog barked at the cat !", "cats and dogs are not friends ?"] * 5
    trained = hf.train_wordpiece(texts, vocab_size=60, min_frequency=1)
    vocabulary = trained.convert_ids_to_tokens(list(range(len(trained))))
    rebuilt = hf.wordpiece_tokenizer(vocabulary)
    assert rebuilt.convert_ids_to_tokens(list(range(len(rebuilt)))) == vocabulary
    assert rebuilt(texts + ["an unseen zebra"])["input_ids"] == trained(texts + ["an unseen zebra"])["input_ids"]
    with pytest.raises(ik.InputError, match=r"\[MASK\]"):
        hf.wordpiece_tokenizer([t for t in vocabulary if t != "[MASK]"])


def test_train_wordpiece_gives_a_bert_tokenizer():
    texts = ["the cat sat on the mat .", "a dog barked at the cat !", "cats and dogs are not friends ?"] * 5
    tok = hf.train_wordpiece(texts, vocab_size=80, min_frequency=1)
    assert tok.convert_ids_to_tokens(list(range(5))) == list(hf.SPECIAL_TOKENS)
    enc = tok(["the cat sat", "dogs barked at cats"], padding="max_length", truncation=True, max_length=10,
              return_tensors="pt")  # fmt: skip
    assert enc["input_ids"].shape == (2, 10)
    assert enc["input_ids"][0, 0] == tok.cls_token_id and tok.sep_token_id in enc["input_ids"][0].tolist()
    assert tok.decode(enc["input_ids"][1], skip_special_tokens=True) == "dogs barked at cats"
    torch.manual_seed(0)
    model = BertForMaskedLM(tiny_config(vocab_size=len(tok), max_position_embeddings=10)).eval()
    stage = hf.masked_lm_stage(model, enc, tokenizer=tok)
    _, labels = stage.data.take(torch.arange(2))
    assert ((labels != -100).sum(1) >= 1).all()


# --- the chain against the explicit-Hessian formula -----------------------------------------------------


def flat_hessian(stage: ik.Stage, names: list[str], extra=None) -> torch.Tensor:
    """∇² over ``names`` (flattened, in order) of the stage objective (+ ``extra``), explicit."""
    space = ParamSpace({n: stage.state()[n] for n in names})

    def objective(vec):
        params = space.unflatten(vec)
        value = stage.objective(params)
        return value + (extra(params) if extra is not None else 0.0)

    at = space.flatten({n: stage.state()[n] for n in names})
    h = explicit_hessian(stage, names, extra=extra, chunk_size=None)
    # the ground truth itself is checked: symmetric, and H·v equals a central difference of the gradient
    v = torch.randn(at.shape, generator=torch.Generator().manual_seed(0), dtype=at.dtype)
    eps = 1e-5
    diff = (grad(objective)(at + eps * v) - grad(objective)(at - eps * v)) / (2 * eps)
    torch.testing.assert_close(h, h.T, rtol=0, atol=1e-10)
    torch.testing.assert_close(h @ v, diff, rtol=1e-5, atol=1e-6)
    return h


def flat_grads(stage: ik.Stage, names: list[str], batch) -> torch.Tensor:
    """(N, p) per-example gradients over ``names`` by autograd, one example at a time."""
    return per_example_grads_serial(stage, *batch, names)


@pytest.fixture(scope="module")
def pretrained():
    pre = pretrain_stage()
    names = list(pre.param_names)
    return pre, names, flat_hessian(pre, names)


@pytest.mark.parametrize("case", [1, 2])
def test_score_equals_the_explicit_hessian_formula(pretrained, case):
    pre, pre_names, h_g = pretrained
    fin_model = finetune_model(pre, perturb=0.0 if case == 1 else 0.05)
    shared = [n for n in pre_names if n.startswith("bert.")]
    head = ["bert.pooler.dense.weight", "bert.pooler.dense.bias", "classifier.weight", "classifier.bias"]
    fin = hf.classification_stage(fin_model, labelled(12, 11), params=head if case == 1 else None, regularizer=l2)
    test = hf.pack(labelled(4, 99))

    config = ik.SolveConfig(solver="direct")
    res = ik.score(pre, fin, None, test, shared="bert", case=case, alpha=ALPHA,
                   solve=ik.SolveConfig(solver="direct", damping=0.0), progress=False)  # fmt: skip
    chain = ik.Chain([pre, fin], [ik.Link("bert", case=case, alpha=ALPHA)], solve=config)
    assert sorted(chain.plans[1].inherited) == sorted(shared)  # the classifier's pooler is its own, not shared

    # DESIGN §1, directly: I_{z,W} = −[H_G⁻¹ ∇g(z)]_W
    g_z = flat_grads(pre, pre_names, pre.data.take(torch.arange(len(pre))))
    w_rows = torch.tensor([i for i, n in enumerate(_expanded(pre, pre_names)) if n in shared])
    i_zw = -torch.linalg.solve(h_g, g_z.T)[w_rows]  # (|W|, m)
    fin_state = fin.state()
    if case == 1:
        names = shared + head
        h_f = flat_hessian(fin, names)
        grad_t = flat_grads(fin, names, test).sum(0)
        k = i_zw.shape[0]
        h_tt, h_tw = h_f[k:, k:], h_f[k:, :k]
        i_zt = -torch.linalg.solve(h_tt, h_tw @ i_zw)
        expected = grad_t[k:] @ i_zt + grad_t[:k] @ i_zw
    else:
        names = list(fin.param_names)
        centre = {n: pre.state()[n] for n in shared}
        proximal = lambda p: ALPHA * sum(((p[n] - c) ** 2).sum() for n, c in centre.items())  # noqa: E731
        h_f = flat_hessian(fin, names, extra=proximal)
        grad_t = flat_grads(fin, names, test).sum(0)
        expanded = _expanded(fin, names)
        w_in_fin = torch.tensor([i for i, n in enumerate(expanded) if n in centre])
        rhs = torch.zeros(len(expanded), i_zw.shape[1], dtype=torch.float64)
        rhs[w_in_fin] = 2 * ALPHA * i_zw  # ∂²/∂(W,Θ)∂W̄ = [−2αI; 0], dW̄/dε = I_{z,W}
        expected = grad_t @ torch.linalg.solve(h_f, rhs)
        assert not torch.equal(fin_state["bert.embeddings.word_embeddings.weight"],
                               pre.state()["bert.embeddings.word_embeddings.weight"])  # fmt: skip
    assert expected.abs().max() > 1e-6
    torch.testing.assert_close(res.values, expected, rtol=1e-6, atol=1e-10)
    # the same through the Chain, per test point
    per_test = chain.query(test, per_test=True).scores()
    torch.testing.assert_close(per_test.values.sum(1), expected, rtol=1e-6, atol=1e-10)


def _expanded(stage: ik.Stage, names: list[str]) -> list[str]:
    """The parameter name of every entry of the flattened vector over ``names``."""
    state = stage.state()
    return [n for n in names for _ in range(state[n].numel())]
