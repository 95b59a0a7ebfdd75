"""The pretrain/finetune model pair of the multi-stage ELMo experiment (Chen et al. 2020, §5 / Table 1).

- Pretraining: :class:`~influkit.elmo.BiLMWithSoftmax` — the biLM W (attribute ``bilm``) and softmax U,
  loss g(z) = :func:`~influkit.elmo.bilm_lm_loss`.
- Finetuning: :class:`SentenceClassifier` — the *same* biLM object under the same attribute name ``bilm``
  (so ``shared="bilm"`` pairs the parameters), a fixed equal-weight :class:`~influkit.elmo.ScalarMix` over
  the ELMo layers, the mean over the sentence's tokens, a fixed standardization (buffers set once from the
  finetuning sentences), and the head Θ = Linear(2P, 64)-tanh-Linear(64, C).

Case 1 of the paper (ELMo fixed): train only ``head`` (``Stage(..., params="head")``). Because W does not
change in finetuning, the head can be fitted on precomputed :meth:`SentenceClassifier.features` with a
stage over ``model.head`` alone; its parameters are the same tensors as the full model's ``head.*``.
"""

from __future__ import annotations

import torch
from torch import nn

from .bilm import ElmoBiLM, ScalarMix, remove_sentence_boundaries


def make_head(in_dim: int, n_classes: int, hidden: int = 64, seed: int | None = None) -> nn.Sequential:
    """Linear(in_dim, hidden)-tanh-Linear(hidden, n_classes), seeded if ``seed`` is given."""
    if seed is not None:
        torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.Tanh(), nn.Linear(hidden, n_classes))


class SentenceClassifier(nn.Module):
    """Classifier on mean-pooled, scalar-mixed ELMo vectors; ``forward(char_ids (B, T, 50)) -> logits (B, C)``."""

    def __init__(self, bilm: ElmoBiLM, n_classes: int = 2, hidden: int = 64, seed: int | None = None):
        super().__init__()
        ref = bilm.char_cnn.W_proj
        self.bilm = bilm
        self.mix = ScalarMix(bilm.num_layers, device=ref.device, dtype=ref.dtype).requires_grad_(False)
        self.head = make_head(bilm.output_dim, n_classes, hidden, seed).to(device=ref.device, dtype=ref.dtype)
        self.register_buffer("feature_mean", torch.zeros(bilm.output_dim, device=ref.device, dtype=ref.dtype))
        self.register_buffer("feature_scale", torch.ones(bilm.output_dim, device=ref.device, dtype=ref.dtype))

    @torch.no_grad()
    def fit_standardization(self, char_ids: torch.Tensor) -> torch.Tensor:
        """Set the fixed (untrained) feature standardization to the mean/std of the pooled vectors of
        ``char_ids`` (the finetuning inputs); returns the standardized features (what :meth:`features` gives)."""
        self.feature_mean.zero_()
        self.feature_scale.fill_(1.0)
        raw = self.features(char_ids)
        self.feature_mean.copy_(raw.mean(dim=0))
        self.feature_scale.copy_(raw.std(dim=0).clamp_min(1e-6))
        return (raw - self.feature_mean) / self.feature_scale

    def pooled(self, char_ids: torch.Tensor) -> torch.Tensor:
        """(B, 2P) mean over tokens (markers and padding excluded) of the mixed ELMo layers, standardized
        with the fixed ``feature_mean``/``feature_scale`` buffers (0 and 1 until :meth:`fit_standardization`)."""
        out = self.bilm(char_ids)
        mixed, token_mask = remove_sentence_boundaries(self.mix(out.activations), out.mask)
        counts = token_mask.sum(dim=1, keepdim=True).clamp(min=1).to(mixed.dtype)
        return (mixed.sum(dim=1) / counts - self.feature_mean) / self.feature_scale

    @torch.no_grad()
    def features(self, char_ids: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
        """:meth:`pooled` for many sentences, in batches and without gradients."""
        return torch.cat([self.pooled(char_ids[s : s + batch_size]) for s in range(0, len(char_ids), batch_size)])

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.pooled(char_ids))
