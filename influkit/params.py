"""Parameter-space plumbing: choosing parameters by name or prefix, and flattening blocks of them to vectors.

Everything above this module (curvature, gradients, solvers, chains) works on flat vectors over an ordered
block of named parameters; :class:`ParamSpace` is the one place that maps between the two views.
:func:`resolve_names` turns user selectors (exact names or module prefixes) into parameter names, and
:func:`shared_parameters` pairs the parameters a later stage inherits with the earlier stage's names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from .errors import InputError, ParameterError

Params = dict[str, torch.Tensor]


def resolve_names(model: nn.Module, selectors: str | Iterable[str] | None) -> list[str]:
    """Parameter names of ``model`` selected by exact names or module prefixes (default: all requiring grad)."""
    all_names = [name for name, _ in model.named_parameters()]
    if selectors is None:
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        if not names:
            raise ParameterError("the model has no parameter that requires grad; pass params= explicitly.")
        return names
    if isinstance(selectors, str):
        selectors = [selectors]
    chosen: list[str] = []
    for sel in selectors:
        hits = [n for n in all_names if n == sel or n.startswith(sel.rstrip(".") + ".")]
        if not hits:
            raise ParameterError(
                f"{sel!r} matches no parameter of {type(model).__name__}; "
                f"known names start with: {sorted({n.split('.')[0] for n in all_names})}."
            )
        chosen.extend(h for h in hits if h not in chosen)
    return [n for n in all_names if n in chosen]


def shared_parameters(earlier: nn.Module, later: nn.Module, shared: str | Mapping[str, str]) -> dict[str, str]:
    """The parameters ``later`` inherits from ``earlier`` as {later_name: earlier_name}, checked to agree in shape.

    ``shared`` is a module prefix present in both models, or a mapping whose keys/values are parameter
    names or prefixes of the later/earlier model. Under a prefix, parameters that only the later model has
    (e.g. the pooler a Hugging Face classification model adds under ``bert.``) are its own, not shared.
    """
    pre = dict(earlier.named_parameters())
    fin = dict(later.named_parameters())
    pairs = {shared: shared} if isinstance(shared, str) else dict(shared)
    if not pairs:
        raise ParameterError("shared is empty: name the shared block (a module prefix or a name mapping).")
    mapping: dict[str, str] = {}
    for f_sel, p_sel in pairs.items():
        if f_sel in fin:
            hits = {f_sel: p_sel}
        else:
            f_prefix, p_prefix = f_sel.rstrip(".") + ".", p_sel.rstrip(".") + "."
            hits = {n: _unwrapped(p_prefix + n[len(f_prefix) :], pre) for n in fin if n.startswith(f_prefix)}
            if any(p in pre for p in hits.values()):  # parameters new in the later model are not shared
                hits = {f: p for f, p in hits.items() if p in pre}
        if not hits:
            raise ParameterError(
                f"shared={f_sel!r} matches no parameter of the later model "
                f"({type(later).__name__}); its modules are {sorted({n.split('.')[0] for n in fin})}."
            )
        for f_name, p_name in hits.items():
            if p_name not in pre:
                raise ParameterError(
                    f"shared parameter {f_name!r} of the later model maps to {p_name!r}, which the earlier "
                    f"model ({type(earlier).__name__}) does not have; pass shared={{later_name: "
                    "earlier_name}} to map them explicitly."
                )
            if pre[p_name].shape != fin[f_name].shape:
                raise ParameterError(
                    f"shared parameter {f_name!r} has shape {tuple(fin[f_name].shape)} in the later model but "
                    f"{p_name!r} has {tuple(pre[p_name].shape)} in the earlier model; they must be the same block."
                )
            mapping[f_name] = p_name
    return mapping


def _unwrapped(name: str, earlier: Mapping[str, torch.Tensor]) -> str:
    """``name`` without ``base_layer`` components when only that form is an earlier parameter: a PEFT (LoRA)
    wrapper keeps the wrapped layer's own parameters under ``<layer>.base_layer`` (see :mod:`influkit.hf.lora`)."""
    bare = ".".join(part for part in name.split(".") if part != "base_layer")
    return bare if name not in earlier and bare in earlier else name


def point(state: Mapping[str, torch.Tensor], names: Sequence[str], at: Mapping[str, torch.Tensor] | None = None) -> Params:
    """The values of ``names``: from ``at`` where given, else from ``state``; unknown names raise."""
    unknown = [n for n in names if n not in state]
    if unknown:
        raise ParameterError(f"unknown parameter names {unknown}; the model has {list(state)[:8]}...")
    return {n: (at[n] if at is not None and n in at else state[n]) for n in names}


class ParamSpace:
    """Flattening of a named parameter block to vectors: dict ↔ (p,) and batched dict (k, ...) ↔ (p, k)."""

    def __init__(self, params: Mapping[str, torch.Tensor]):
        if not params:
            raise ParameterError("the parameter block is empty: select at least one parameter.")
        self.names = list(params)
        self.shapes = [params[n].shape for n in self.names]
        self.sizes = [params[n].numel() for n in self.names]
        first = params[self.names[0]]
        self.dtype, self.device = first.dtype, first.device

    @property
    def dim(self) -> int:
        return sum(self.sizes)

    def flatten(self, tensors: Mapping[str, torch.Tensor], batched: bool = False) -> torch.Tensor:
        """(p,) from a dict; with ``batched`` a dict of (k, *shape) gives (p, k)."""
        if batched:
            return torch.cat([tensors[n].reshape(tensors[n].shape[0], -1) for n in self.names], dim=1).T
        return torch.cat([tensors[n].reshape(-1) for n in self.names])

    def unflatten(self, vec: torch.Tensor) -> Params:
        """A dict from (p,), or a dict of (k, *shape) from (p, k)."""
        if vec.shape[0] != self.dim:
            raise InputError(f"vector has {vec.shape[0]} entries, the parameter block has {self.dim}.")
        parts = torch.split(vec, self.sizes, dim=0)
        if vec.dim() == 1:
            return {n: part.reshape(shape) for n, part, shape in zip(self.names, parts, self.shapes)}
        k = vec.shape[1]
        return {n: part.T.reshape(k, *shape) for n, part, shape in zip(self.names, parts, self.shapes)}

    def zeros(self, k: int | None = None) -> torch.Tensor:
        shape = (self.dim,) if k is None else (self.dim, k)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)
