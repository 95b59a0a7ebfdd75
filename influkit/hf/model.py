"""``HFModel``: a transformers model as an influkit model — packed inputs in, logits out, same parameter names.

influkit calls ``model(inputs)`` on one tensor (``torch.func.functional_call`` over a dict of parameters);
a transformers model takes keyword tensors and returns a ``ModelOutput``. :class:`HFModel` bridges the two
without renaming anything: it registers the transformers model's own child modules as its children, so its
parameter names are exactly the model's (``bert.encoder.layer.0...``, ``classifier.weight``) and a shared
block is named by the same prefix in both stages (``shared="bert"``). Tied weights (a masked-LM decoder tied
to the word embeddings) stay tied under ``functional_call``.

The attention mask is passed to the transformers model as a ready 4-D additive mask (0 where attended, the
dtype's minimum where padded), which transformers ≥ 5 uses as given: its own 2-D → 4-D conversion asks
``mask.all()`` (a data-dependent branch ``torch.func.vmap`` cannot trace), the 4-D mask gives the same
logits and lets per-example gradients be vectorized. Because it is used as given, a decoder (``causal=True``)
gets the causal mask built in as well: position i attends to the unpadded positions j ≤ i.

Second derivatives: the fused CPU kernels of ``scaled_dot_product_attention`` (transformers' default
``attn_implementation="sdpa"``) have neither a double-backward nor a forward-mode rule, so Hessian-vector
products would fail; :class:`HFModel` runs the model with the composite ``MATH`` backend, which is
differentiable to any order, gives the same values, and leaves the model's config untouched.

Dropout: transformers models apply dropout when ``module.training`` is set (attention dropout is a
probability read inside the attention function, not always an ``nn.Dropout`` layer), with the probabilities
of the config (``hidden_dropout_prob``, ``attention_probs_dropout_prob``, ``classifier_dropout``, ...).
:func:`check_eval_mode` therefore refuses any module in train mode and names those probabilities.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import InputError, ModelModeError
from .batches import unpack


def dropout_probabilities(model: nn.Module) -> dict[str, float]:
    """The non-zero dropout probabilities of a transformers model's config ({attribute: p}), e.g.
    ``{"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}``."""
    config = getattr(model, "config", None)
    if config is None:
        return {}
    out = {}
    for key, value in sorted(vars(config).items()):
        if "dropout" in key and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            out[key] = float(value)
    return out


def check_eval_mode(model: nn.Module) -> None:
    """Raise :class:`~influkit.errors.ModelModeError` if any module of a transformers model is in train mode.

    In train mode the loss is a random variable (the config's dropout probabilities apply, some inside the
    attention function where no ``nn.Dropout`` module shows it), so it has no Hessian to invert.
    """
    training = [name or type(model).__name__ for name, m in model.named_modules() if m.training]
    if training:
        probs = dropout_probabilities(model)
        active = f"dropout {probs} is active" if probs else "train-mode behaviour is active"
        raise ModelModeError(
            f"the transformers model {type(model).__name__} is in train mode ({len(training)} modules, e.g. "
            f"{training[:3]}), so {active} and the loss is random; call model.eval() before building the stage "
            "(train with model.train() and switch back to eval() afterwards)."
        )


class HFModel(nn.Module):
    """A transformers model called on packed inputs (B, C, L) (see :func:`influkit.hf.pack`); returns its logits.

    model: a transformers ``PreTrainedModel`` (e.g. ``BertForMaskedLM``, ``BertForSequenceClassification``).
    fields: the names of the packed channels, ``("input_ids", "attention_mask"[, "token_type_ids"])``.
    causal: a decoder (GPT-2, Llama, ...): the attention mask also hides later positions.
    The parameter names are the model's own; ``train()``/``eval()``/``to()`` act on the wrapped model.
    """

    def __init__(self, model: nn.Module, fields: Sequence[str] = ("input_ids", "attention_mask"), *, causal: bool = False):
        super().__init__()
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise InputError(f"expected a transformers model (an nn.Module with a .config), got {type(model).__name__}.")
        if isinstance(model, HFModel):
            raise InputError("the model is already wrapped in HFModel; pass it as it is.")
        if model._parameters or model._buffers:
            raise InputError(
                f"{type(model).__name__} holds parameters or buffers directly on its root module "
                f"({list(model._parameters) + list(model._buffers)}); HFModel needs them inside child modules."
            )
        for name, child in model.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "hf_model", model)  # not a registered child: names stay the model's own
        self.fields = tuple(fields)
        self.causal = causal
        nn.Module.train(self, model.training)

    @property
    def config(self):
        """The transformers config of the wrapped model."""
        return self.hf_model.config

    def train(self, mode: bool = True) -> "HFModel":
        super().train(mode)
        self.hf_model.training = mode  # the root's own flag (children are shared and already set)
        return self

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        kwargs = unpack(inputs, self.fields)
        if "attention_mask" in kwargs:
            dtype = self.hf_model.get_input_embeddings().weight.dtype
            keep = kwargs["attention_mask"][:, None, None, :].to(dtype)  # (B, 1, 1, L): key j is a token
            if self.causal:
                length = keep.shape[-1]
                keep = keep * torch.ones(length, length, dtype=dtype, device=keep.device).tril()  # (B, 1, L, L): j ≤ i
            kwargs["attention_mask"] = (1.0 - keep) * torch.finfo(dtype).min
        with sdpa_kernel([SDPBackend.MATH]):  # differentiable twice (HVPs) and in forward mode
            return self.hf_model(**kwargs).logits

    def extra_repr(self) -> str:
        causal = ", causal" if self.causal else ""
        return f"{type(self.hf_model).__name__}, fields={self.fields}{causal}"
