"""influkit.hf for language models: causal-LM stages (GPT-2, Llama), completion queries, LoRA links — tiny float64
models checked against the explicit-Hessian formula.

Ground truth is DESIGN §1 computed directly: the Hessians of each objective over flattened parameters are
built by ``influkit.validation.reference.explicit_hessian`` (``jacfwd`` of ``grad``) and inverted densely;
single-stage scores are −∇f(T)ᵀ H⁻¹ ∇g(z), Case 1 / Case 2 scores are assembled from the Hessian blocks without
the chain's adjoint recursion. The causal loss itself is checked against transformers' own ``labels=`` loss and
an explicit sum of log-probabilities. Float64 throughout: GPT-2 uses eager attention; Llama uses "sdpa", which
HFModel runs with the composite MATH kernel (Llama's eager path takes its softmax in float32), and its RMSNorm
is computed in the model's dtype (transformers casts it to float32) — otherwise the checks would stop at ~1e-7.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
peft = pytest.importorskip("peft")

import influkit as ik  # noqa: E402
from influkit import hf  # noqa: E402
from influkit.gradients import per_example_grads_serial  # noqa: E402
from influkit.validation.reference import explicit_hessian  # noqa: E402

VOCAB, LENGTH, BOS, PAD = 24, 8, 0, 1
DECAY, ALPHA = 0.05, 0.1


def gpt2(**kw):
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=8, n_layer=1, n_head=2, n_inner=12, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager", initializer_range=0.5, bos_token_id=BOS,
        eos_token_id=BOS, pad_token_id=PAD,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(_update(config, kw))


def llama(**kw):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=8, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=LENGTH, attn_implementation="sdpa", initializer_range=0.5,
        bos_token_id=BOS, eos_token_id=BOS, pad_token_id=PAD,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(_update(config, kw))
    for module in model.modules():  # RMSNorm computes in float32 whatever the dtype: keep float64 exact
        if type(module).__name__ == "LlamaRMSNorm":
            module.forward = types.MethodType(rms_norm_in_own_dtype, module)
    return model


def rms_norm_in_own_dtype(self, x: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm without its cast to float32 (made for half precision; in float64 it would limit the
    checks to ~1e-7): x / sqrt(mean(x²) + eps) · weight."""
    return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def _update(config, kw):
    for key, value in kw.items():
        setattr(config, key, value)
    return config


def qwen2(**kw):
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=8, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=LENGTH, attn_implementation="sdpa", initializer_range=0.5,
        bos_token_id=BOS, eos_token_id=BOS, pad_token_id=PAD, use_sliding_window=False,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(_update(config, kw))


MODELS = {"gpt2": (gpt2, ["c_attn"], True), "llama": (llama, ["q_proj", "v_proj"], False)}
DECODERS = {"gpt2": gpt2, "llama": llama, "qwen2": qwen2}  # the mask and the loss are also checked on Qwen2


def documents(n: int, seed: int) -> dict[str, torch.Tensor]:
    """n random documents <bos> w … w <pad>… of 3–8 tokens, labelled on their tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, LENGTH), generator=gen)
    lengths = torch.randint(3, LENGTH + 1, (n,), generator=gen)
    keep = torch.arange(LENGTH) < lengths[:, None]
    ids[:, 0] = BOS
    ids = torch.where(keep, ids, PAD)
    return {"input_ids": ids, "attention_mask": keep.long(), "labels": torch.where(keep, ids, -100)}


def completions(n: int, seed: int) -> dict[str, torch.Tensor]:
    """n prompt + completion sequences of 5–8 tokens: labels −100 on the prompt (2–4 tokens) and padding."""
    batch = documents(n, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    lengths = torch.randint(5, LENGTH + 1, (n,), generator=gen)
    prompt = torch.randint(2, 5, (n,), generator=gen)
    pos = torch.arange(LENGTH)
    keep = pos < lengths[:, None]
    ids = torch.where(keep, batch["input_ids"].clamp(min=2), PAD)
    ids[:, 0] = BOS
    labels = torch.where(keep & (pos >= prompt[:, None]), ids, -100)
    return {"input_ids": ids, "attention_mask": keep.long(), "labels": labels}


def l2(params):
    return 0.5 * DECAY * sum((p**2).sum() for p in params.values())


def pretrain_stage(kind: str, n: int = 10) -> ik.Stage:
    torch.manual_seed(0)
    model = DECODERS[kind]().double().eval()
    return hf.causal_lm_stage(model, documents(n, 0), regularizer=l2)


def lora_model(pre: ik.Stage, kind: str, perturb: float = 0.0):
    """The pretrained model (+ ``perturb``·noise on the base, standing in for Case 2 finetuning) with random
    LoRA adapters."""
    base = copy.deepcopy(pre.model.hf_model)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in base.parameters():
            p.add_(perturb * torch.randn_like(p))
    _, targets, fan_in_fan_out = MODELS[kind]
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets, fan_in_fan_out=fan_in_fan_out,
                             lora_dropout=0.0, init_lora_weights=False)  # fmt: skip  (B ≠ 0: the adapters act)
    return peft.get_peft_model(base, config).double().eval()


def flat_hessian(stage: ik.Stage, names: list[str], extra=None) -> torch.Tensor:
    h = explicit_hessian(stage, names, extra=extra, chunk_size=None)
    torch.testing.assert_close(h, h.T, rtol=0, atol=1e-10)
    return h


def expanded(stage: ik.Stage, names: list[str]) -> list[str]:
    """The parameter name of every entry of the flattened vector over ``names``."""
    state = stage.state()
    return [n for n in names for _ in range(state[n].numel())]


# --- the causal model and its loss ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_wrapper_is_causal_and_ignores_padding(kind):
    torch.manual_seed(0)
    model = DECODERS[kind]().double().eval()
    batch = documents(6, 3)
    wrapped = hf.HFModel(model, causal=True)
    logits = wrapped(hf.pack(batch)[0])
    for row in range(6):
        n = int(batch["attention_mask"][row].sum())
        alone = model(input_ids=batch["input_ids"][row : row + 1, :n]).logits  # transformers' own causal mask
        torch.testing.assert_close(logits[row : row + 1, :n], alone, rtol=0, atol=1e-10)
    # a later token does not change earlier logits
    changed = batch["input_ids"].clone()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB
    later = wrapped(hf.pack(batch | {"input_ids": changed})[0])
    torch.testing.assert_close(later[:, :-1], logits[:, :-1], rtol=0, atol=0)
    assert logits[:, 1:].std(0).min() > 1e-3  # the rows differ after the shared <bos>, so the comparisons can fail


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_causal_loss_is_the_transformers_loss(kind):
    stage = pretrain_stage(kind)
    model = stage.model.hf_model
    batch = documents(10, 0)
    losses = stage.losses(stage.trained(), *stage.data.take(torch.arange(10)))
    for row in range(10):
        n = int(batch["attention_mask"][row].sum())
        ids = batch["input_ids"][row : row + 1, :n]
        expected = model(input_ids=ids, labels=ids).loss  # transformers shifts the labels itself (in float32)
        torch.testing.assert_close(losses[row].float(), expected, rtol=1e-6, atol=1e-6)


def test_prompt_tokens_carry_no_loss():
    stage = pretrain_stage("gpt2")
    batch = completions(6, 4)
    x, y = hf.pack(batch)
    logits = stage.model(x)
    loss = hf.causal_lm_losses(logits, y)
    # explicit: f(x) = −(1/|C|) Σ_{t∈C} log p(token t | tokens < t), C the completion's positions
    logp = torch.log_softmax(logits, -1)
    for row in range(6):
        positions = [t for t in range(1, LENGTH) if y[row, t] != -100]
        assert positions and min(positions) >= 2
        expected = -sum(logp[row, t - 1, y[row, t]] for t in positions) / len(positions)
        torch.testing.assert_close(loss[row], expected, rtol=1e-12, atol=1e-12)
    first = int((y[0] != -100).nonzero()[0])  # the first completion token, predicted at position first − 1
    prompt_logits = logits.clone()
    prompt_logits[:, : first - 1] += torch.randn_like(prompt_logits[:, : first - 1])  # logits predicting prompt tokens
    assert torch.equal(hf.causal_lm_losses(prompt_logits, y)[0], loss[0])
    unmasked = torch.where(batch["attention_mask"] == 1, batch["input_ids"], -100)  # the prompt labelled as well
    assert not torch.equal(hf.causal_lm_losses(logits, unmasked)[0], loss[0])  # so the −100 is what excludes it
    completion_logits = logits.clone()
    completion_logits[0, first - 1] += torch.randn_like(completion_logits[0, first - 1])
    assert not torch.equal(hf.causal_lm_losses(completion_logits, y)[0], loss[0])
    y_other = y.clone()
    y_other[0, first] = (y_other[0, first] + 1) % VOCAB
    assert not torch.equal(hf.causal_lm_losses(logits, y_other)[0], loss[0])


# --- tokenizer and batches ------------------------------------------------------------------------------

TEXTS = ["the movie was great and the cast was fun .", "a dull plot , bad acting and a long film !",
         "the food was good but the service was slow .", "not great , not bad : an average show ."] * 4  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return hf.train_bpe(TEXTS, vocab_size=300, min_frequency=1)


def test_train_bpe_and_document_batches(tokenizer):
    assert tokenizer.convert_ids_to_tokens([0, 1]) == list(hf.BPE_SPECIAL_TOKENS)
    batch = hf.causal_lm_batch(tokenizer, TEXTS[:3], max_length=24)
    ids, keep, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    assert ids.shape == (3, 24) and (ids[:, 0] == tokenizer.bos_token_id).all()
    assert torch.equal(labels[keep == 1], ids[keep == 1]) and (labels[keep == 0] == -100).all()
    assert (ids[keep == 0] == tokenizer.pad_token_id).all() and (keep[:, 0] == 1).all()
    assert tokenizer.decode(ids[0][keep[0] == 1], skip_special_tokens=True) == TEXTS[0]
    with pytest.raises(ik.InputError, match="max_length=4"):
        hf.causal_lm_batch(tokenizer, TEXTS[:3], max_length=4, truncation=False)


def test_completion_batch_masks_the_prompt(tokenizer):
    batch = hf.completion_batch(tokenizer, ["positive:", "negative:"], [" great film", " a dull plot"], max_length=16)
    for row, (prompt, completion) in enumerate([("positive:", " great film"), ("negative:", " a dull plot")]):
        n_prompt = len(tokenizer(prompt)["input_ids"])
        labelled = batch["labels"][row] != -100
        assert not labelled[:n_prompt].any() and labelled.any()
        assert tokenizer.decode(batch["labels"][row][labelled]) == completion
        text = batch["input_ids"][row][batch["attention_mask"][row] == 1]
        assert tokenizer.decode(text, skip_special_tokens=True) == prompt + completion


def test_tokenizer_without_pad_token_is_refused(tokenizer):
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None
    with pytest.raises(ik.InputError, match="no pad token"):
        hf.causal_lm_batch(no_pad, TEXTS[:2], max_length=16)
    with pytest.raises(ik.InputError, match="no pad token"):
        hf.completion_batch(no_pad, ["positive:"], [" great"], max_length=16)


def test_sequences_longer_than_the_context_are_refused(tokenizer):
    with pytest.raises(ik.InputError, match="longer than max_length=6"):
        hf.completion_batch(tokenizer, ["positive: the movie was"], [" great and the cast was fun"], max_length=6)
    torch.manual_seed(0)
    model = gpt2(vocab_size=len(tokenizer)).eval()  # context: LENGTH = 8 positions
    assert hf.context_length(model) == LENGTH and hf.context_length(llama()) == LENGTH
    batch = hf.completion_batch(tokenizer, ["positive:"], [" great and the cast was fun"], max_length=32)
    with pytest.raises(ik.InputError, match="32 tokens are longer than the model.s context of 8 positions"):
        hf.causal_lm_stage(model, batch)


def test_top_shows_the_documents_text():
    res = ik.InfluenceResult(values=torch.tensor([0.5, -2.0, 3.0]), n_train=3)
    top = res.top(2, texts=["first", "second", "third"])
    assert list(top["text"]) == ["third", "first"] and list(top["example"]) == [2, 0]
    assert "text" not in res.top(2).columns
    with pytest.raises(ik.InputError, match="no entry"):
        res.top(2, texts=["first"])


# --- influence against the explicit-Hessian formula -----------------------------------------------------


def test_single_stage_equals_the_explicit_hessian_formula(pretrained):
    _, stage, names, h = pretrained  # the pretraining stage of each model and its explicit Hessian
    test = hf.pack(completions(3, 9))
    res = ik.influence(stage, None, test, solve=ik.SolveConfig(solver="direct"), per_test=True, progress=False)
    g_z = per_example_grads_serial(stage, *stage.data.take(torch.arange(len(stage))), names)
    g_t = per_example_grads_serial(stage, *test, names)
    expected = -g_z @ torch.linalg.solve(h, g_t.T)  # (m, n_test): −∇g(z)ᵀ H⁻¹ ∇f(x_t)
    assert expected.abs().max() > 1e-4
    torch.testing.assert_close(res.values, expected, rtol=1e-8, atol=1e-10)


def test_peft_names_resolve_to_the_pretrained_names():
    pre = pretrain_stage("gpt2")
    lora = lora_model(pre, "gpt2")
    mapping = hf.lora_shared(pre, lora)
    assert mapping["base_model.model.transformer.h.0.attn.c_attn.base_layer.weight"] == "transformer.h.0.attn.c_attn.weight"
    assert mapping["base_model.model.transformer.wte.weight"] == "transformer.wte.weight"
    assert sorted(mapping.values()) == sorted(pre.param_names)  # the whole pretrained model is the base
    assert not any(hf.is_adapter(n) for n in mapping)
    fin = hf.causal_lm_stage(lora, completions(8, 5))
    adapters = [n for n, _ in lora.named_parameters() if hf.is_adapter(n)]
    assert adapters and fin.param_names == adapters  # peft leaves only the adapters trainable
    chain = ik.Chain([pre, fin], [hf.lora_link(pre, fin, case=1)])
    assert chain.plans[1].trained == adapters and sorted(chain.plans[1].inherited) == sorted(mapping)
    # a plain Link with module prefixes finds the wrapped base layers too (influkit.params), adapters not shared
    plain = ik.Chain([pre, fin], [ik.Link({"base_model.model.transformer": "transformer"}, case=1)])
    assert plain.plans[1].inherited == hf.lora_shared(pre, lora, shared="transformer") == mapping
    # a prefix in either naming selects the base under it, never the adapters
    block = hf.lora_shared(pre, lora, shared="transformer.h")
    assert block == hf.lora_shared(pre, lora, shared="base_model.model.transformer.h")
    assert set(block.values()) == {n for n in pre.param_names if n.startswith("transformer.h.")}


def test_a_link_naming_the_adapters_is_refused():
    pre = pretrain_stage("gpt2")
    lora = lora_model(pre, "gpt2")
    with pytest.raises(ik.ParameterError, match="matches the LoRA adapters"):
        hf.lora_link(pre, lora, shared="base_model.model.transformer.h.0.attn.c_attn.lora_A")
    with pytest.raises(ik.ParameterError, match="matches the LoRA adapters"):
        hf.lora_link(pre, lora, shared="transformer.h.0.attn.c_attn.lora_B.default")
    with pytest.raises(ik.ParameterError, match="no LoRA adapter"):
        hf.lora_link(pre, pre.model.hf_model)


@pytest.fixture(scope="module", params=sorted(MODELS))
def pretrained(request):
    """(kind, the pretraining stage, its parameter names, its explicit Hessian H_G): built once per model."""
    pre = pretrain_stage(request.param)
    names = list(pre.param_names)
    return request.param, pre, names, flat_hessian(pre, names)


@pytest.mark.parametrize("case", [1, 2])
def test_lora_chain_equals_the_explicit_hessian_formula(pretrained, case):
    kind, pre, pre_names, h_g = pretrained
    lora = lora_model(pre, kind, perturb=0.0 if case == 1 else 0.05)
    fin = hf.causal_lm_stage(lora, completions(12, 11), regularizer=l2)
    test = hf.pack(completions(4, 99))
    link = hf.lora_link(pre, fin, case=case, alpha=ALPHA)
    chain = ik.Chain([pre, fin], [link], solve=ik.SolveConfig(solver="direct"))
    res = chain.query(test).scores()

    shared = dict(link.shared)  # {PEFT name: pretrained name}
    adapters = list(fin.param_names)
    # DESIGN §1, directly: I_{z,W} = −[H_G⁻¹ ∇g(z)]_W, rows in the order of the PEFT names of W
    g_z = per_example_grads_serial(pre, *pre.data.take(torch.arange(len(pre))), pre_names)
    solved = -torch.linalg.solve(h_g, g_z.T)
    offsets, start = {}, 0
    for n in pre_names:
        offsets[n] = (start, start + pre.state()[n].numel())
        start = offsets[n][1]
    base = [n for n, _ in fin.model.named_parameters() if n in shared]
    i_zw = torch.cat([solved[slice(*offsets[shared[n]])] for n in base])
    if case == 1:
        names = base + adapters
        h_f = flat_hessian(fin, names)
        grad_t = per_example_grads_serial(fin, *test, names).sum(0)
        k = i_zw.shape[0]
        i_zt = -torch.linalg.solve(h_f[k:, k:], h_f[k:, :k] @ i_zw)
        expected = grad_t[k:] @ i_zt + grad_t[:k] @ i_zw
    else:
        names = [n for n, _ in fin.model.named_parameters() if n in shared or n in adapters]
        centre = {n: pre.state()[shared[n]] for n in base}
        proximal = lambda p: ALPHA * sum(((p[n] - c) ** 2).sum() for n, c in centre.items())  # noqa: E731
        h_f = flat_hessian(fin, names, extra=proximal)
        grad_t = per_example_grads_serial(fin, *test, names).sum(0)
        rows = expanded(fin, names)
        rhs = torch.zeros(len(rows), i_zw.shape[1], dtype=torch.float64)
        w_rows = torch.tensor([i for i, n in enumerate(rows) if n in centre])
        rhs[w_rows] = 2 * ALPHA * i_zw  # ∂²/∂(W,Θ)∂W̄ = [−2αI; 0], dW̄/dε = I_{z,W}
        expected = grad_t @ torch.linalg.solve(h_f, rhs)
    assert expected.abs().max() > 1e-5
    torch.testing.assert_close(res.values, expected, rtol=1e-8, atol=1e-10)
