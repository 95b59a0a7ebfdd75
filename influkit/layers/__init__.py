"""One registry of layer types: what contraction scoring and factored curvature need from each kind of module.

- :mod:`.registry`: the :class:`Layer` base class, ``@register(module_type)`` and the lookup (``isinstance``; the
  most specific registered class wins), and :func:`plan` (which trained parameters registered layers own);
- :mod:`.recorder`: the one forward-hook :class:`Recorder` both use;
- the layer types: :mod:`.dense` (``nn.Linear``), :mod:`.conv` (``nn.Conv1d``, ``nn.Conv2d``), :mod:`.embedding`,
  :mod:`.norm` (``nn.LayerNorm``, ``nn.RMSNorm``). Packages for other libraries register their own
  (:mod:`influkit.hf` registers transformers' ``Conv1D``).
"""

from .conv import Conv
from .dense import Dense, Linear
from .embedding import Embedding
from .norm import LayerNorm, Norm, RMSNorm
from .recorder import Recorder
from .registry import LAYER_TYPES, Layer, layer_type, plan, register

__all__ = [
    "Conv",
    "Dense",
    "Embedding",
    "LAYER_TYPES",
    "Layer",
    "LayerNorm",
    "Linear",
    "Norm",
    "RMSNorm",
    "Recorder",
    "layer_type",
    "plan",
    "register",
]
