"""The layer registry: one :class:`Layer` class per module type, looked up by ``isinstance`` (the most specific
registered class of the module's MRO wins), and the plan of which trained parameters of a model such layers own.

A layer type is written once and serves both users of recorded inputs and output-gradients: contraction scoring
(:mod:`influkit.contraction`) and factored curvature (:mod:`influkit.factored`). A new module type is one class::

    from influkit.layers import Layer, register

    @register(MyNorm)
    class MyNormLayer(Layer):
        kind = "mynorm"
        def inputs(self, inp): ...          # per-token inputs of one recorded call
        def grads(self, grad): ...          # per-token output-gradients, (B, T, out)
        def contract(self, a, g, weight, bias): ...   # (B,) Σ_t ⟨∂ℓ_i/∂θ_t, direction⟩

Optionally also :meth:`Layer.example_gradients` with its two costs, so that scoring against many directions can form
the per-example gradient rows once instead of contracting once per direction (:meth:`Layer.forms_rows`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn

from ..errors import InputError

LAYER_TYPES: dict[type[nn.Module], type["Layer"]] = {}


def register(*module_types: type[nn.Module]):
    """Class decorator: ``cls`` handles modules of ``module_types`` (and their subclasses, unless a subclass is
    registered itself). Registering a type again replaces its class."""
    if not module_types or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in module_types):
        raise InputError(f"register() takes nn.Module subclasses, got {module_types!r}.")

    def decorate(cls: type[Layer]) -> type[Layer]:
        if not (isinstance(cls, type) and issubclass(cls, Layer)):
            raise InputError(f"@register decorates a subclass of influkit.layers.Layer, got {cls!r}.")
        for module_type in module_types:
            LAYER_TYPES[module_type] = cls
        return cls

    return decorate


def layer_type(module: nn.Module) -> type["Layer"] | None:
    """The registered Layer class of ``module``: the first class of ``type(module).__mro__`` that is registered."""
    return next((LAYER_TYPES[k] for k in type(module).__mro__ if k in LAYER_TYPES), None)


class Layer:
    """A module of a registered type and the trained names of its ``weight`` and ``bias`` (None: not trained).

    A forward hook records each call's input; autograd gives the output-gradient g = ∂ℓ/∂y of each call (per
    example: examples do not mix in eval mode). From these a subclass gives

    - :meth:`inputs` / :meth:`grads`: the call's per-token inputs a (B, T, ·) and output-gradients g (B, T, out),
      tokens t being positions, patches or time steps, so that a per-example gradient is a sum over tokens;
    - :meth:`contract`: (B,) ⟨∇θ ℓ_i, S⟩ summed over the call's tokens, never forming ∇θ ℓ_i;
    - optionally :meth:`example_gradients`: the per-example gradient rows themselves (B × :attr:`size`), with the
      costs :meth:`contract_cost` and :meth:`gradient_cost` that :meth:`forms_rows` compares;
    - with ``kronecker``, the Kronecker statistics of the block matrix M (``shape`` = rows × cols) whose per-example
      gradient is Σ_t ā_t g_tᵀ or its transpose: :meth:`add_covariances` (Σ ā āᵀ, Σ g gᵀ) and
      :meth:`example_squares` (EK-FAC's corrected eigenvalues and the diagonal Gauss-Newton). ``inputs_first``:
      M's rows index the inputs (the weight is stored (in, out)), else its outputs; ``one_hot``: the inputs are
      token ids, so the input factor A is diagonal (token frequencies).
    """

    kind: ClassVar[str] = "layer"
    kronecker: ClassVar[bool] = False
    inputs_first: ClassVar[bool] = False
    one_hot: ClassVar[bool] = False

    def __init__(self, name: str, module: nn.Module, weight: str | None, bias: str | None):
        self.name, self.module, self.weight, self.bias = name, module, weight, bias

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, weight={self.weight!r}, bias={self.bias!r})"

    @property
    def params(self) -> list[str]:
        """The trained parameter names this layer owns."""
        return [n for n in (self.weight, self.bias) if n is not None]

    def without(self, names) -> "Layer | None":
        """This layer with the parameters ``names`` left out, or None if none is left."""
        out = copy.copy(self)
        out.weight = None if self.weight in names else self.weight
        out.bias = None if self.bias in names else self.bias
        return out if out.params else None

    def unsupported(self) -> str | None:
        """Why hooks cannot follow this module's parameters (e.g. a grouped convolution), or None."""
        return None

    def record(self, inp: torch.Tensor, out: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, output) of one call as recorded for a batch of ``batch``; an output returned in place of ``out``
        replaces it in the forward."""
        return inp, out

    def inputs(self, inp: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def grads(self, grad: torch.Tensor) -> torch.Tensor:
        """(B, T, d) output-gradients of one call from ∂ℓ/∂y (d the last dimension)."""
        return grad.reshape(grad.shape[0], -1, grad.shape[-1])

    def contract(self, a: torch.Tensor, g: torch.Tensor, weight: torch.Tensor | None,
                 bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    @property
    def size(self) -> int:
        """n: how many trained numbers this layer owns (its per-example gradient row's length)."""
        return sum(getattr(self.module, part).numel() for part, name in (("weight", self.weight), ("bias", self.bias))
                   if name is not None)

    def example_gradients(self, a: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
        """Per-example gradients of the call, one (B, numel) block per trained parameter in :attr:`params` order,
        flattened as the parameter is stored (so that Σ blocks @ their directions = :meth:`contract` per column)."""
        raise NotImplementedError

    def example_norms(self, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """(B,) float64 ‖∇θ ℓ_i‖² over this layer's trained parameters: the squared :meth:`example_gradients` rows
        (a subclass may get them without forming the rows)."""
        return sum(rows.pow(2).sum(1, dtype=torch.float64) for rows in self.example_gradients(a, g))

    def contract_cost(self, tokens: int) -> int | None:
        """Per example and direction: flops + elements read/written by :meth:`contract` (None: no cost model, and
        then no :meth:`example_gradients` is used)."""
        return None

    def gradient_cost(self, tokens: int) -> int | None:
        """Per example: flops + elements read/written by :meth:`example_gradients`."""
        return None

    def forms_rows(self, tokens: int, directions: int) -> bool:
        """Whether forming the per-example gradient rows once and multiplying them by all k directions costs less
        than k contractions, per example (flops + elements moved):

            gradient_cost(T) + n · (k + 2)  <  k · contract_cost(T)

        (n · k the product's flops, 2n writing and reading the rows back). For a dense layer (rows r, cols c,
        T tokens) that is ≈ T·r·c + r·c·(k + 3) < k·T·(r·c + r + c): rows when both T and k exceed 1 or 2, the
        contraction for one direction or one token per example (then both are the same product)."""
        contract, form = self.contract_cost(tokens), self.gradient_cost(tokens)
        if contract is None or form is None:
            return False
        return form + self.size * (directions + 2) < directions * contract

    def oriented(self, input_side, grad_side) -> tuple:
        """(rows side, cols side) of M from a pair given as (input factor's, output-gradient factor's)."""
        return (input_side, grad_side) if self.inputs_first else (grad_side, input_side)

    def describe(self) -> dict:
        out = {"module": self.name, "kind": self.kind, "weight": self.weight, "bias": self.bias}
        return out | ({"block": list(self.shape)} if self.kronecker else {})


def _trained(tensor, canonical: dict[int, str], trained: set[str]) -> str | None:
    name = canonical.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
    return name if name in trained else None


def plan(model: nn.Module, names: Sequence[str]) -> tuple[list[Layer], dict[str, str]]:
    """(the registered layers owning trained ``names``, {every other trained name: why no layer handles it}).

    Names are canonical (a tensor's first name in ``model.named_parameters()``, as :class:`~influkit.Stage` uses),
    so a weight tied between modules is owned by each of its layers. A parameter is handled in all of its uses or
    in none: one that an unsupported module also uses is left out of every layer."""
    trained = set(names)
    canonical: dict[int, str] = {}
    for pname, param in model.named_parameters():
        canonical.setdefault(id(param), pname)
    found, reasons = [], {}
    for mname, module in model.named_modules():
        cls = layer_type(module)
        if cls is None:
            continue
        weight = _trained(getattr(module, "weight", None), canonical, trained)
        bias = _trained(getattr(module, "bias", None), canonical, trained)
        if weight is None and bias is None:
            continue
        layer = cls(mname, module, weight, bias)
        why = layer.unsupported()
        if why is None:
            found.append(layer)
            continue
        if weight is not None:
            reasons[weight] = why
        if bias is not None:
            reasons[bias] = f"{why}: the bias is not used without its layer's weight"
    layers = [kept for layer in found if (kept := layer.without(reasons)) is not None]
    covered = {n for layer in layers for n in layer.params}
    for name in names:
        if name not in covered and name not in reasons:
            owner = model.get_submodule(name.rpartition(".")[0])
            reasons[name] = f"{type(owner).__name__} is not a registered layer type (influkit.layers.register)"
    return layers, reasons
