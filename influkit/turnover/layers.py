"""The turn-over dropout layer and the routing of example ids (and the flip switch) to it.

Example i only ever trains the sub-network selected by its own mask m_i; the flipped mask 1 − m_i selects
the sub-network that never saw i. Comparing the two on a test input gives i's influence (``influence.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..errors import InputError, ModelModeError
from .masks import HashedMasks, VolatileMasks


class TurnOverDropout(nn.Module):
    """Drop-in for ``nn.Dropout(p)`` whose mask is a fixed function of the example id, not fresh noise.

    With routed ids, example e's input x is multiplied elementwise by m_e / q (own mask, keep rate q = 1 − p)
    or, with ``flip``, by (1 − m_e) / p (the complement, keep rate p). Both factors have expectation 1 per
    unit, so for every p both sub-networks match, in expectation, the full network used without ids.
    Without routed ids the layer is the identity in eval mode and raises in train mode (training without
    ids would silently train the full network).

    p: drop probability, 0 < p < 1. masks: a mask generator (:class:`VolatileMasks` by default,
    :class:`HashedMasks` for appendix C). layer_id: distinguishes the layers' masks; when None,
    :func:`turnover_layers` assigns one in module order (a standalone layer uses 0).
    The mask covers every non-batch element of x (like ``nn.Dropout``).
    """

    def __init__(
        self,
        p: float = 0.5,
        *,
        masks: VolatileMasks | HashedMasks | None = None,
        layer_id: int | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 < p < 1.0:
            raise InputError(f"TurnOverDropout needs 0 < p < 1 (both sub-networks non-empty), got p={p}.")
        self.p = p
        self.masks = VolatileMasks() if masks is None else masks
        self.layer_id = layer_id
        self.ids: torch.Tensor | None = None
        self.flip = False

    def keep_mask(self, ids: torch.Tensor, n_units: int) -> torch.Tensor:
        """Returns the boolean own-mask m (len(ids), n_units) of the given examples in this layer (keep rate 1 − p).

        Repeated ids are generated once and gathered, so scoring many test points per example is cheap.
        """
        unique, inverse = torch.unique(ids, return_inverse=True)
        layer = 0 if self.layer_id is None else self.layer_id
        return self.masks.keep(unique, layer, n_units, 1.0 - self.p)[inverse]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ids is None:
            if self.training:
                raise ModelModeError(
                    "TurnOverDropout in train mode got no example ids; run the forward pass inside "
                    "`with model_with_ids(model, ids):` (or call model.eval() for the full network)."
                )
            return x
        ids = self.ids.to(x.device)
        if ids.shape[0] != x.shape[0]:
            raise InputError(
                f"{ids.shape[0]} example ids routed for a batch of {x.shape[0]}; pass one id per batch row."
            )
        keep = self.keep_mask(ids, x[0].numel()).reshape(x.shape)
        if self.flip:
            return x * (~keep).to(x.dtype) / self.p
        return x * keep.to(x.dtype) / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, layer_id={self.layer_id}, masks={self.masks!r}"


def turnover_layers(model: nn.Module) -> list[TurnOverDropout]:
    """Returns the model's TurnOverDropout layers in module order, giving unnumbered ones distinct layer ids.

    Raises ModelModeError when there is none.
    """
    layers = [module for module in model.modules() if isinstance(module, TurnOverDropout)]
    if not layers:
        raise ModelModeError(
            f"{type(model).__name__} holds no TurnOverDropout layer; replace its nn.Dropout with "
            "influkit.turnover.TurnOverDropout and train it with train_turnover."
        )
    taken = {layer.layer_id for layer in layers if layer.layer_id is not None}
    next_id = 0
    for layer in layers:
        if layer.layer_id is None:
            while next_id in taken:
                next_id += 1
            layer.layer_id = next_id
            taken.add(next_id)
    return layers


@contextmanager
def model_with_ids(model: nn.Module, ids: torch.Tensor, flip: bool = False) -> Iterator[nn.Module]:
    """Yields ``model`` with ``ids`` (one per batch row) and ``flip`` routed to all its TurnOverDropout layers.

    Inside the block each example runs on its own sub-network m_i (flip=False) or on its complement
    1 − m_i (flip=True); on exit the layers return to the identity / unrouted state.
    """
    ids = torch.as_tensor(ids)
    if ids.dim() != 1:
        raise InputError(f"ids must be 1-D (one example id per batch row), got shape {tuple(ids.shape)}.")
    layers = turnover_layers(model)
    for layer in layers:
        layer.ids, layer.flip = ids, flip
    try:
        yield model
    finally:
        for layer in layers:
            layer.ids, layer.flip = None, False
