"""``vmap`` with a fallback: batch a function with ``torch.func.vmap``, or loop when vmap cannot trace it.

Losses that call ``.item()``/``.tolist()`` or branch on tensor values (``if out.sum() > 0``) cannot run under
``vmap``; they still have well-defined per-example gradients. :func:`vmap_or_loop` then warns once per
stage (naming the cause and the fix) and maps the function over the batch in a Python loop instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.func import vmap

from .errors import VectorizationWarning, warn

_VMAP_FAILURES = ("vmap:", "doesn't have storage", "data-dependent", "Batching rule not implemented")
_LOOPING: "weakref.WeakSet[object]" = weakref.WeakSet()  # owners whose function vmap could not trace (nothing is
# written onto the owner itself; an owner that cannot be weakly referenced is tried under vmap each time)


def _is_vmap_failure(exc: RuntimeError) -> bool:
    return any(marker in str(exc) for marker in _VMAP_FAILURES)


def vmap_or_loop(fn: Callable, in_dims: tuple, owner: object, *args):
    """``vmap(fn, in_dims)(*args)``, or the same result by looping over the batched arguments if vmap fails.

    owner: the object (a Stage) whose loss is being mapped; its first failure warns, later calls loop silently
    (the owner is remembered here, in a weak set, not marked).
    The outputs of ``fn`` are tensors or dicts of tensors; they are stacked along a new first dimension.
    """
    if _remembered(owner):
        return _loop(fn, in_dims, *args)
    try:
        return vmap(fn, in_dims=in_dims)(*args)
    except RuntimeError as exc:
        if not _is_vmap_failure(exc):
            raise
        warn(
            "the loss cannot run under torch.func.vmap (it calls .item()/.tolist() or branches on tensor values: "
            f"{str(exc).splitlines()[0][:120]}); per-example gradients and batched products now loop over examples, "
            "which is much slower. Rewrite the loss with tensor operations only (torch.where instead of if) to "
            "vectorize it.",
            VectorizationWarning,
        )
        try:
            _LOOPING.add(owner)
        except TypeError:
            pass
        return _loop(fn, in_dims, *args)


def _remembered(owner: object) -> bool:
    try:
        return owner in _LOOPING
    except TypeError:
        return False


def _loop(fn: Callable, in_dims: tuple, *args):
    size = next(arg.shape[0] if torch.is_tensor(arg) else next(iter(arg.values())).shape[0]
                for arg, dim in zip(args, in_dims) if dim is not None)

    def item(arg, dim, i):
        if dim is None:
            return arg
        return arg[i] if torch.is_tensor(arg) else {k: v[i] for k, v in arg.items()}

    outs = [fn(*(item(a, d, i) for a, d in zip(args, in_dims))) for i in range(size)]
    if isinstance(outs[0], dict):
        return {k: torch.stack([o[k] for o in outs]) for k in outs[0]}
    return torch.stack(outs)
