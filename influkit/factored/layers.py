"""Which trained parameters get Kronecker factors, and the per-layer inputs a and output-gradients g that make them.

A layer's parameters are written as one block matrix M so that its per-example gradient is a sum of outer
products over the layer's tokens t (positions, patches, time steps, and every call of the module in one forward):

- ``nn.Linear``:  M = [W | b] (out × in+1), ∇_M ℓ = Σ_t g_t ā_tᵀ with ā = [a; 1] (bias as a homogeneous coordinate);
- ``nn.Conv2d``:  M = [W.reshape(out, in·kh·kw) | b], a_t the unfolded input patch of output position t;
- ``nn.Embedding``: M = W (vocabulary × dim), ∇_M ℓ = Σ_t e_{x_t} g_tᵀ (one-hot inputs, so the input factor is the
  diagonal of token frequencies); ``padding_idx`` tokens carry no gradient and are left out.

Every other trained parameter (and any layer the hooks cannot follow: grouped or non-zero-padded convolutions,
``max_norm`` embeddings, weights shared between modules, modules never called through their ``forward`` or
not batch-first) gets a diagonal block; :func:`plan_layers` says why for each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

KINDS = {nn.Linear: "linear", nn.Conv2d: "conv2d", nn.Embedding: "embedding"}
_EXAMPLE_CHUNK_BYTES = 64 * 2**20


@dataclass
class Layer:
    """One Kronecker-factored layer: module ``name`` of ``kind`` with block matrix M of shape (rows, cols).

    linear/conv2d: rows = outputs, cols = inputs (+1 with a trained ``bias``); embedding: rows = vocabulary,
    cols = embedding dimension.
    """

    name: str
    kind: str
    module: nn.Module
    weight: str
    bias: str | None
    rows: int
    cols: int

    def describe(self) -> dict:
        return {"module": self.name, "kind": self.kind, "weight": self.weight, "bias": self.bias,
                "block": [self.rows, self.cols]}


def _param_name(module_name: str, attr: str) -> str:
    return f"{module_name}.{attr}" if module_name else attr


def _conv_padding(module: nn.Conv2d) -> tuple[int, int, int, int] | None:
    """(left, right, top, bottom) zero padding of a Conv2d, or None if it cannot be expressed."""
    if isinstance(module.padding, str):
        if module.padding == "valid":
            return (0, 0, 0, 0)
        pads = []
        for k, d in zip(reversed(module.kernel_size), reversed(module.dilation)):  # width first, as F.pad wants
            total = d * (k - 1)
            pads += [total // 2, total - total // 2]
        return tuple(pads)
    ph, pw = module.padding
    return (pw, pw, ph, ph)


def _unsupported(module: nn.Module) -> str | None:
    if isinstance(module, nn.Conv2d):
        if module.groups != 1:
            return f"grouped convolution (groups={module.groups})"
        if module.padding_mode != "zeros":
            return f"padding_mode={module.padding_mode!r}"
    if isinstance(module, nn.Embedding) and module.max_norm is not None:
        return "max_norm embedding (its forward rescales the weights)"
    return None


def plan_layers(model: nn.Module, names: Sequence[str]) -> tuple[list[Layer], dict[str, str]]:
    """(Kronecker-factored layers, {parameter name: why it gets a diagonal block}) for the trained ``names``."""
    trained = set(names)
    owners: dict[int, list[str]] = {}
    for pname, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(pname)
    layers: list[Layer] = []
    covered: set[str] = set()
    reasons: dict[str, str] = {}
    for mname, module in model.named_modules():
        kind = KINDS.get(type(module))
        if kind is None:
            continue
        weight = _param_name(mname, "weight")
        if weight not in trained:
            continue
        why = _unsupported(module)
        aliases = owners.get(id(module.weight), [weight])
        if why is None and len(aliases) > 1:
            why = f"weight shared by several modules ({', '.join(aliases)})"
        bias = _param_name(mname, "bias") if getattr(module, "bias", None) is not None else None
        if bias is not None and (bias not in trained or len(owners.get(id(module.bias), [bias])) > 1):
            bias = None
        if why is not None:
            reasons[weight] = why
            continue
        if kind == "linear":
            rows, cols = module.out_features, module.in_features + (bias is not None)
        elif kind == "conv2d":
            kh, kw = module.kernel_size
            rows, cols = module.out_channels, module.in_channels * kh * kw + (bias is not None)
        else:
            rows, cols = module.num_embeddings, module.embedding_dim
        layers.append(Layer(mname, kind, module, weight, bias, rows, cols))
        covered.add(weight)
        if bias is not None:
            covered.add(bias)
    for name in names:
        if name in covered or name in reasons:
            continue
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        module = model.get_submodule(owner) if owner else model
        if type(module) in KINDS:
            reasons[name] = "bias trained without its layer's weight" if name.endswith("bias") else "shared parameter"
        else:
            reasons[name] = f"{type(module).__name__} has no Kronecker factors"
    return layers, reasons


class Recorder:
    """Forward hooks that keep (input, output) of every call of the given layers during one forward."""

    def __init__(self, layers: Sequence[Layer]):
        self.layers = list(layers)
        self.calls: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {layer.name: [] for layer in self.layers}
        self._handles = []

    def __enter__(self) -> "Recorder":
        for layer in self.layers:
            self._handles.append(layer.module.register_forward_hook(partial(self._hook, layer.name)))
        return self

    def _hook(self, name, module, args, output) -> None:
        if args and torch.is_tensor(args[0]) and torch.is_tensor(output):
            self.calls[name].append((args[0].detach(), output))

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def check_calls(layer: Layer, calls, batch: int) -> str | None:
    """Why the recorded calls of ``layer`` cannot be factored (never called, not batch-first), or None."""
    if not calls:
        return "never called through its forward (e.g. weights used through F.linear, nn.MultiheadAttention.out_proj)"
    for inp, out in calls:
        if inp.shape[0] != batch or out.shape[0] != batch or not out.requires_grad:
            return f"inputs of shape {tuple(inp.shape)} are not batch-first for a batch of {batch}"
    return None


def layer_inputs(layer: Layer, inp: torch.Tensor) -> torch.Tensor:
    """The layer's per-token inputs of one call: (B, T, in) in the model's dtype (conv: unfolded patches), or
    (B, T) token ids. The homogeneous coordinate of a trained bias is not appended (see :func:`with_bias`)."""
    batch = inp.shape[0]
    if layer.kind == "embedding":
        return inp.reshape(batch, -1)
    if layer.kind == "linear":
        return inp.reshape(batch, -1, inp.shape[-1])
    module = layer.module
    x = F.pad(inp, _conv_padding(module))
    return F.unfold(x, module.kernel_size, dilation=module.dilation, padding=0, stride=module.stride).transpose(1, 2)


def with_bias(layer: Layer, a: torch.Tensor, right: torch.Tensor | None = None) -> torch.Tensor:
    """ā R for ā = [a, 1] (a trained bias) or a, without materializing ā when R is given (ā R = a R[:-1] + R[-1])."""
    if right is not None:
        right = right.to(a.dtype)
        return a @ right[:-1] + right[-1] if layer.bias is not None else a @ right
    if layer.bias is None:
        return a
    return torch.cat([a, torch.ones(*a.shape[:-1], 1, dtype=a.dtype, device=a.device)], dim=-1)


def layer_grads(layer: Layer, grad: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """The output-gradients of one call: (B, T, d) in the model's dtype (d = out features / channels / embedding dim)."""
    g = torch.zeros_like(out) if grad is None else grad
    batch = g.shape[0]
    if layer.kind == "conv2d":
        return g.reshape(batch, g.shape[1], -1).transpose(1, 2)
    return g.reshape(batch, -1, g.shape[-1])


def example_squares(layer: Layer, a: torch.Tensor, g: torch.Tensor, left=None, right=None) -> torch.Tensor:
    """Σ_{j,i} (Lᵀ ∇_M ℓ_ij R)², elementwise, over pseudo-gradient columns j and examples i: (rows, cols) float64.

    a: (B, T, in) inputs (token ids (B, T) for an embedding), g: (k, B, T, d) output-gradients; L and R are
    the eigenbases of the two factors (None: the standard basis), so with them this is EK-FAC's eigenvalue
    correction and without them the diagonal of the (sampled) Gauss-Newton block. Products run in the
    model's dtype, per batch; the caller accumulates the float64 result over batches.
    """
    if layer.kind == "embedding":
        return _embedding_squares(layer, a, g, right)
    a = with_bias(layer, a, right)
    if left is not None:
        g = g @ left.to(g.dtype)
    k, batch, tokens, rows = g.shape
    if tokens == 1:  # ∇_M ℓ_ij = g aᵀ: the squares factor, Σ_i (Σ_j g_ij²) (a_i²)ᵀ is one product
        return ((g[:, :, 0] ** 2).sum(0).T @ (a[:, 0] ** 2)).to(torch.float64)
    total = torch.zeros(rows, a.shape[2], dtype=torch.float64, device=a.device)
    chunk = max(1, _EXAMPLE_CHUNK_BYTES // (a.element_size() * k * rows * a.shape[2]))
    for s in range(0, batch, chunk):
        grads = torch.einsum("kbto,bti->kboi", g[:, s : s + chunk], a[s : s + chunk])
        total += (grads**2).sum((0, 1)).to(torch.float64)
    return total


def _embedding_squares(layer: Layer, ids: torch.Tensor, g: torch.Tensor, right=None) -> torch.Tensor:
    """Σ_{j,i} ((∇_W ℓ_ij) R)² for an embedding, ∇_W ℓ_ij = Σ_t e_{x_it} g_ijtᵀ (rows touched by example i only)."""
    vocab, dim = layer.rows, layer.cols
    if right is not None:
        g = g @ right.to(g.dtype)
    keep = token_mask(layer, ids)
    batch = ids.shape[0]
    keys = (torch.arange(batch, device=ids.device)[:, None] * vocab + ids)[keep]
    unique, inverse = torch.unique(keys, return_inverse=True)
    total = torch.zeros(vocab, dim, dtype=torch.float64, device=g.device)
    for j in range(g.shape[0]):
        summed = torch.zeros(unique.shape[0], dim, dtype=g.dtype, device=g.device)
        summed.index_add_(0, inverse, g[j][keep])
        total.index_add_(0, unique % vocab, (summed**2).to(torch.float64))
    return total


def token_mask(layer: Layer, ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the embedding tokens that carry gradient (not ``padding_idx``)."""
    padding = layer.module.padding_idx
    return torch.ones_like(ids, dtype=torch.bool) if padding is None else ids != padding
