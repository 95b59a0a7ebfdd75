"""LoRA / PEFT finetuning as a chain link: the frozen base inside the PEFT wrapper is the shared block.

``peft.get_peft_model(model, LoraConfig(...))`` renames the pretrained parameters: ``transformer.h.0.attn.c_attn.weight``
becomes ``base_model.model.transformer.h.0.attn.c_attn.base_layer.weight`` and the adapters
``...c_attn.lora_A.default.weight``, ``...lora_B.default.weight`` appear beside it. :func:`lora_shared` pairs every
base parameter of the PEFT model with its pretrained name; :func:`lora_link` wraps that mapping in a :class:`~influkit.Link`:

- Case 1 (LoRA as trained): the base W is frozen at the pretrained W̄, the finetuning stage trains the
  adapters Θ — exactly the multi-stage paper's Case 1, influence flowing from the pretraining documents
  through W̄ into the adapters' optimum;
- Case 2: base and adapters finetuned, the base pulled towards W̄ by α‖W − W̄‖² (the chain adds it).

Adapter parameters are recognised by a name component starting with ``lora_`` (``lora_A``, ``lora_B``,
``lora_embedding_A``, ``lora_magnitude_vector``); they are never part of the shared block.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from ..chain import Link
from ..errors import ParameterError
from ..stage import Stage

WRAPPER_PREFIX = "base_model.model."
WRAPPER_PARTS = ("base_layer", "original_module")


def _module(model: nn.Module | Stage) -> nn.Module:
    return model.model if isinstance(model, Stage) else model


def is_adapter(name: str) -> bool:
    """True for a PEFT adapter parameter (a name component starting with ``lora_``)."""
    return any(part.startswith("lora_") for part in name.split("."))


def pretrained_name(name: str) -> str:
    """The pretrained model's name of a PEFT base parameter: the wrapper prefix and ``base_layer`` dropped.

    ``base_model.model.transformer.h.0.attn.c_attn.base_layer.weight`` → ``transformer.h.0.attn.c_attn.weight``.
    """
    if name.startswith(WRAPPER_PREFIX):
        name = name[len(WRAPPER_PREFIX) :]
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def lora_shared(
    pretrained: nn.Module | Stage, peft_model: nn.Module | Stage, shared: str | Iterable[str] | None = None
) -> dict[str, str]:
    """{PEFT name: pretrained name} for the base parameters the PEFT model inherits, checked to agree in shape.

    shared: module prefixes of the shared block, in either naming (``"transformer"`` or
    ``"base_model.model.transformer"``; default: every base parameter the pretrained model also has). Adapters
    under a prefix are left to the finetuning stage; a prefix that selects adapters and no base parameter raises
    :class:`~influkit.errors.ParameterError`, as does a base parameter the pretrained model lacks.
    """
    pre = dict(_module(pretrained).named_parameters())
    fin = dict(_module(peft_model).named_parameters())
    adapters = [n for n in fin if is_adapter(n)]
    if not adapters:
        raise ParameterError(
            f"{type(_module(peft_model)).__name__} has no LoRA adapter parameters (no 'lora_' in any name); wrap the "
            "finetuned model with peft.get_peft_model(model, LoraConfig(...)), or use ik.Link for a plain model."
        )
    base = {n: pretrained_name(n) for n in fin if not is_adapter(n)}
    if shared is None:
        chosen = {f: p for f, p in base.items() if p in pre}
    else:
        chosen = {}
        for sel in [shared] if isinstance(shared, str) else list(shared):
            prefix = sel.rstrip(".") + "."
            under = lambda n: n == sel or n.startswith(prefix)  # noqa: E731
            hits = {f: p for f, p in base.items() if under(f) or under(p)}
            if not hits:
                hit_adapters = [n for n in adapters if under(n) or under(pretrained_name(n))]
                if hit_adapters:
                    raise ParameterError(
                        f"shared={sel!r} matches the LoRA adapters ({hit_adapters[:2]}...), which the finetuning stage "
                        "trains, not the frozen base; name the pretrained block instead (e.g. shared="
                        f"{sorted({p.split('.')[0] for p in base.values()})[0]!r}, or shared=None for the whole base)."
                    )
                raise ParameterError(
                    f"shared={sel!r} matches no base parameter of the PEFT model; its base modules are "
                    f"{sorted({p.split('.')[0] for p in base.values()})} (pretrained naming)."
                )
            chosen.update(hits)
    missing = {f: p for f, p in chosen.items() if p not in pre}
    if missing:
        f, p = next(iter(missing.items()))
        raise ParameterError(
            f"the PEFT base parameter {f!r} corresponds to {p!r}, which the pretrained model "
            f"({type(_module(pretrained)).__name__}) does not have; narrow shared= to the pretrained block."
        )
    if not chosen:
        raise ParameterError(
            "the PEFT model's base shares no parameter name with the pretrained model; is it the same architecture?"
        )
    for f, p in chosen.items():
        if pre[p].shape != fin[f].shape:
            raise ParameterError(
                f"{f!r} has shape {tuple(fin[f].shape)} in the PEFT model but {p!r} has {tuple(pre[p].shape)} in the "
                "pretrained model; they must be the same block."
            )
    return chosen


def lora_link(
    pretrained: nn.Module | Stage,
    peft_model: nn.Module | Stage,
    *,
    case: int = 1,
    alpha: float = 0.01,
    shared: str | Iterable[str] | None = None,
) -> Link:
    """The :class:`~influkit.Link` from a pretraining stage to a LoRA finetuning stage (module docstring).

    Case 1: the base is fixed (the finetuning stage trains the adapters); Case 2: base + adapters finetuned with
    the proximal term α‖W − W̄‖². ``shared`` selects part of the base (:func:`lora_shared`).
    """
    return Link(lora_shared(pretrained, peft_model, shared), case=case, alpha=alpha)
