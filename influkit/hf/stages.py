"""Stages for transformers models: masked-LM and causal-LM pretraining, sequence classification, from dict batches.

    pre = hf.masked_lm_stage(mlm, tokenizer(sentences, ...), tokenizer=tokenizer)      # mlm: a BertForMaskedLM
    clf.bert.load_state_dict(mlm.bert.state_dict(), strict=False)  # the classifier starts from the pretrained encoder
    fin = hf.classification_stage(clf, tokenizer(tweets, ...) | {"labels": y})
    res = ik.score(pre, fin, z, x_test, shared="bert", case=1)

Each factory returns a plain :class:`influkit.Stage` whose model is an :class:`~influkit.hf.model.HFModel`
(same parameter names as the transformers model) and whose data are the packed (inputs, targets) tensors of
:func:`~influkit.hf.batches.pack`, so Hessian-vector products, vectorized per-example gradients, chains and
leave-out stages work unchanged. Test sets and examples to score are passed packed, ``hf.pack(batch)``, or as
indices into the stage's data.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from ..errors import InputError
from .masking import IGNORE
from ..stage import Regularizer, Stage
from .batches import FIELDS, fields_of, pack
from .causal import check_context
from .losses import causal_lm_losses, classification_losses, masked_lm_losses
from .masking import mask_tokens
from .model import HFModel, check_eval_mode


def _unwrap(model: nn.Module) -> nn.Module:
    return model.hf_model if isinstance(model, HFModel) else model


def _packed(data, what: str) -> tuple[torch.Tensor, torch.Tensor, tuple[str, ...]]:
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(torch.is_tensor(t) for t in data):
        inputs, targets = data
        if inputs.dim() != 3 or not 1 <= inputs.shape[1] <= len(FIELDS):
            raise InputError(
                f"{what}: packed inputs must be (batch, channels, length) from influkit.hf.pack, got {tuple(inputs.shape)}."
            )
        return inputs, targets, FIELDS[: inputs.shape[1]]
    raise InputError(
        f"{what} must be a dict batch (input_ids, attention_mask, labels) or packed (inputs, targets) tensors "
        f"from influkit.hf.pack, got {type(data).__name__}."
    )


def _stage_tensors(model: nn.Module, data, label=None) -> tuple[nn.Module, torch.Tensor, torch.Tensor, tuple[str, ...]]:
    """(the unwrapped model, packed inputs, targets, fields) of a stage's ``data``: a dict batch — completed by
    ``label(data)`` when it has no ``labels`` — or packed tensors; the model checked for eval mode."""
    model = _unwrap(model)
    check_eval_mode(model)
    if not isinstance(data, Mapping):
        inputs, targets, fields = _packed(data, "data")
        return model, inputs, targets, fields
    fields = fields_of(data)
    if "labels" not in data and label is not None:
        data = label(data)
    inputs, targets = pack(data, fields)
    return model, inputs, targets, fields


def masked_lm_batch(
    batch: Mapping,
    *,
    indices: torch.Tensor | Sequence[int] | None = None,
    tokenizer=None,
    mask_token_id: int | None = None,
    vocab_size: int | None = None,
    special_token_ids: Sequence[int] | None = None,
    seed: int = 0,
    mask_prob: float = 0.15,
) -> dict[str, torch.Tensor]:
    """The dict batch with ``input_ids`` masked and ``labels`` added, row b masked as example ``indices[b]``.

    indices: the examples' indices in the pretraining set (default 0..B−1) — keep them when taking subsets,
    so an example keeps its mask. tokenizer: a transformers tokenizer supplying ``mask_token_id``,
    ``all_special_ids`` and the vocabulary size (or give those three explicitly). See
    :mod:`influkit.hf.masking` for the recipe and why the mask must be a function of the index.
    """
    if tokenizer is not None:
        mask_token_id = tokenizer.mask_token_id if mask_token_id is None else mask_token_id
        special_token_ids = list(tokenizer.all_special_ids) if special_token_ids is None else special_token_ids
        vocab_size = len(tokenizer) if vocab_size is None else vocab_size
    if mask_token_id is None or vocab_size is None:
        raise InputError("masking needs the [MASK] id and the vocabulary size: pass tokenizer= or mask_token_id= and vocab_size=.")
    ids = torch.as_tensor(batch["input_ids"])
    indices = torch.arange(ids.shape[0]) if indices is None else indices
    masked, labels = mask_tokens(
        ids, batch.get("attention_mask"), indices, mask_token_id=mask_token_id, vocab_size=vocab_size,
        special_token_ids=special_token_ids or (), seed=seed, mask_prob=mask_prob,
    )  # fmt: skip
    return {**{k: v for k, v in batch.items() if k in FIELDS}, "input_ids": masked, "labels": labels}


def masked_lm_stage(
    model: nn.Module,
    data,
    *,
    tokenizer=None,
    mask_token_id: int | None = None,
    special_token_ids: Sequence[int] | None = None,
    seed: int = 0,
    mask_prob: float = 0.15,
    indices: torch.Tensor | Sequence[int] | None = None,
    params: str | Iterable[str] | None = None,
    regularizer: Regularizer | None = None,
    batch_size: int | None = None,
) -> Stage:
    """A :class:`~influkit.Stage` minimizing G = (1/m) Σ_z g(z) + R, g(z) the masked-LM loss of sentence z.

    model: a transformers masked-LM model (e.g. ``BertForMaskedLM``) in eval mode, float32 or float64.
    data: a dict batch — the tokenizer's output (``input_ids``, ``attention_mask``), padded to one length —
    which is masked deterministically per example (:func:`masked_lm_batch`, seeded by (``seed``, index));
    or a dict that already holds masked ``input_ids`` and ``labels`` (−100 where no loss); or packed tensors.
    g(z) is the mean negative log-likelihood over the sentence's predicted tokens (:func:`masked_lm_losses`).
    Pretrain on the stage's own data (``stage.data``) so the minimized objective is the one influence assumes.
    """
    def label(batch):
        return masked_lm_batch(
            batch, indices=indices, tokenizer=tokenizer, mask_token_id=mask_token_id,
            vocab_size=None if tokenizer is not None else _unwrap(model).config.vocab_size,
            special_token_ids=special_token_ids, seed=seed, mask_prob=mask_prob,
        )  # fmt: skip

    model, inputs, targets, fields = _stage_tensors(model, data, label)
    if targets.dim() != 2 or targets.shape != inputs[:, 0].shape:
        raise InputError(f"masked-LM labels must be (batch, length) like input_ids, got {tuple(targets.shape)}.")
    return Stage(HFModel(model, fields), masked_lm_losses, (inputs, targets), params=params,
                 regularizer=regularizer, batch_size=batch_size)  # fmt: skip


def classification_stage(
    model: nn.Module,
    data,
    *,
    params: str | Iterable[str] | None = None,
    regularizer: Regularizer | None = None,
    batch_size: int | None = None,
) -> Stage:
    """A :class:`~influkit.Stage` minimizing F = (1/n) Σ_x f(x) + R, f the cross-entropy of sequence x's label.

    model: a transformers sequence-classification model (e.g. ``BertForSequenceClassification``) in eval mode.
    data: a dict batch (``input_ids``, ``attention_mask``, ``labels`` (B,) class ids) or packed tensors.
    params: what finetuning trains (names or prefixes, e.g. ``"classifier"`` for a new head only);
    in a chain, a Case 1 link keeps the shared block fixed whatever is listed here.
    """
    model, inputs, targets, fields = _stage_tensors(model, data)
    if targets.dim() != 1:
        raise InputError(f"classification labels must be (batch,) class ids, got shape {tuple(targets.shape)}.")
    return Stage(HFModel(model, fields), classification_losses, (inputs, targets), params=params,
                 regularizer=regularizer, batch_size=batch_size)  # fmt: skip


def causal_lm_stage(
    model: nn.Module,
    data,
    *,
    params: str | Iterable[str] | None = None,
    regularizer: Regularizer | None = None,
    batch_size: int | None = None,
) -> Stage:
    """A :class:`~influkit.Stage` minimizing G = (1/m) Σ_z g(z) + R, g(z) the mean next-token NLL of document z.

    model: a transformers decoder (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, or a PEFT
    model wrapping one) in eval mode; it is called with a causal + padding attention mask.
    data: a dict batch (:func:`~influkit.hf.causal_lm_batch` for documents, :func:`~influkit.hf.completion_batch`
    for prompt → completion pairs) whose ``labels`` (B, L) are aligned with ``input_ids`` and −100 where no loss
    is taken (padding, prompts); without ``labels``, every attended token is labelled. Or packed tensors.
    g is :func:`~influkit.hf.causal_lm_losses`. As a finetuning stage its loss on a completion batch is the
    query f(x) = mean NLL of the completion given the prompt. params: what the stage trains (default: every
    parameter requiring grad — for a PEFT model, the adapters). Sequences longer than the model's context
    (``n_positions`` / ``max_position_embeddings``) raise :class:`~influkit.errors.InputError`.
    Precision: in float64, Llama/Qwen models still compute their RMSNorm (and, with eager attention, the
    softmax) in float32, which limits agreement with float64 references to ~1e-7; ``attn_implementation="sdpa"``
    avoids the latter (tests/test_hf_lm.py shows both).
    """
    def label(batch):  # every attended token
        ids = torch.as_tensor(batch["input_ids"])
        keep = torch.as_tensor(batch.get("attention_mask", torch.ones_like(ids))).bool()
        return {**batch, "labels": torch.where(keep, ids, torch.full_like(ids, IGNORE))}

    model, inputs, targets, fields = _stage_tensors(model, data, label)
    if targets.dim() != 2 or targets.shape != inputs[:, 0].shape:
        raise InputError(f"causal-LM labels must be (batch, length) like input_ids, got {tuple(targets.shape)}.")
    check_context(model, inputs.shape[-1])
    return Stage(HFModel(model, fields, causal=True), causal_lm_losses, (inputs, targets), params=params,
                 regularizer=regularizer, batch_size=batch_size)  # fmt: skip
