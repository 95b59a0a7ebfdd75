"""SSL with a learned weight per unlabeled example (Ren, Yeh, Schwing, "Not All Unlabeled Data are Equal", NeurIPS 2020).

- :mod:`.hypergradient` — :func:`hypergradient`, the one entry point: an InfluenceResult with values[u] =
  ∂L_S(V, θ*(Λ))/∂λ_u by influence functions (last-layer exact, full network through influkit's solvers,
  identity and Neumann-series baselines) and removal = −λ_u·values[u] (removing u sets its weight to 0)
- :mod:`.per_example` — closed forms for a final linear layer: per-example gradients and the Hessian
- :mod:`.madam` — M-Adam, the masked Adam for the weights
- :mod:`.losses` — pseudo-labelling and consistency losses, image augmentation
- :mod:`.trainer` — Algorithm 1 (:func:`train_ssl`, its settings :class:`SSLConfig`)
"""

from .hypergradient import hypergradient
from .losses import Consistency, PseudoLabel, ShiftNoise, UnsupervisedLoss, confident_targets, soft_cross_entropy
from .madam import MaskedAdam
from .per_example import (
    final_linear,
    head_features,
    last_layer_grads,
    linear_grad_dot,
    linear_hessian,
    linear_per_example_grads,
    logit_hessians,
    output_gradients,
)
from .trainer import MODES, SSLConfig, SSLRun, last_linear, train_ssl

__all__ = [
    "MODES",
    "Consistency",
    "MaskedAdam",
    "PseudoLabel",
    "SSLConfig",
    "SSLRun",
    "ShiftNoise",
    "UnsupervisedLoss",
    "confident_targets",
    "final_linear",
    "head_features",
    "hypergradient",
    "last_layer_grads",
    "last_linear",
    "linear_grad_dot",
    "linear_hessian",
    "linear_per_example_grads",
    "logit_hessians",
    "output_gradients",
    "soft_cross_entropy",
    "train_ssl",
]
