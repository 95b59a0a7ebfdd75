"""``nn.Conv1d`` / ``nn.Conv2d`` as a matrix product per output position: a_t is the input patch that output position
t sees (unfolded, padding included), W the weight reshaped to (out, in·kernel) (Grosse & Martens 2016)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .dense import Dense
from .registry import register


@register(nn.Conv1d, nn.Conv2d)
class Conv(Dense):
    """A 1-d or 2-d convolution (any stride, dilation, padding and padding mode; not grouped)."""

    @property
    def kind(self) -> str:
        return f"conv{len(self.module.kernel_size)}d"

    def matrix(self, w):
        return w.reshape(w.shape[0], -1)

    def unsupported(self):
        return f"grouped convolution (groups={self.module.groups})" if self.module.groups != 1 else None

    def _padding(self) -> list[int]:
        """F.pad's amounts (last dimension first) of the module's padding."""
        m = self.module
        if m.padding == "valid":
            return [0] * (2 * len(m.kernel_size))
        if m.padding == "same":
            pads = []
            for k, d in zip(reversed(m.kernel_size), reversed(m.dilation)):
                total = d * (k - 1)
                pads += [total // 2, total - total // 2]
            return pads
        return [p for p in reversed(m.padding) for _ in range(2)]

    def inputs(self, inp):
        """(B, T, in·kernel) patches, T the output positions."""
        m = self.module
        mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
        x = F.pad(inp, self._padding(), mode=mode)
        kernel, dilation, stride = m.kernel_size, m.dilation, m.stride
        if len(kernel) == 1:  # a 1-d convolution is a 2-d one of height 1
            x = x.unsqueeze(2)
            kernel, dilation, stride = (1, *kernel), (1, *dilation), (1, *stride)
        return F.unfold(x, kernel, dilation=dilation, stride=stride).transpose(1, 2)

    def grads(self, grad):
        return grad.reshape(grad.shape[0], grad.shape[1], -1).transpose(1, 2)
