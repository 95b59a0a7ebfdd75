"""Forward hooks that record every call of a set of layers during one forward of a batch."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from .registry import Layer

NEVER_CALLED = "never called through its forward (e.g. weights used through F.linear, nn.MultiheadAttention.out_proj)"


class Recorder:
    """Context manager: ``calls[name]`` lists (input, output) of each call of layer ``name`` whose output needs a
    gradient (inputs detached; outputs kept for autograd.grad to reach the output-gradients)."""

    def __init__(self, layers: Sequence[Layer], batch: int):
        self.layers, self.batch = list(layers), batch
        self.calls: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {layer.name: [] for layer in self.layers}
        self._handles = []

    def __enter__(self) -> "Recorder":
        for layer in self.layers:
            self._handles.append(layer.module.register_forward_hook(partial(self._hook, layer)))
        return self

    def _hook(self, layer: Layer, module, args, output):
        if not (args and torch.is_tensor(args[0]) and torch.is_tensor(output) and output.requires_grad):
            return None
        inp, out = layer.record(args[0].detach(), output, self.batch)
        self.calls[layer.name].append((inp, out))
        return None if out is output else out

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def misfits(self) -> dict[str, str]:
        """{layer name: why its recorded calls give no per-example statistics}: never called, or not batch-first."""
        out = {}
        for layer in self.layers:
            calls = self.calls[layer.name]
            if not calls:
                out[layer.name] = NEVER_CALLED
            for inp, y in calls:
                if inp.shape[0] != self.batch or y.shape[0] != self.batch:
                    out[layer.name] = (f"called on inputs of shape {tuple(inp.shape)}, not batch-first for a batch "
                                       f"of {self.batch}")
        return out
