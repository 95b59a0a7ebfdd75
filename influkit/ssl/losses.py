"""Unsupervised SSL losses with constant (detached) targets, and the input augmentations they use.

An unsupervised loss ℓ_U(u; θ) compares the model's output on an input x'(u) with a target t(u) built from
the model's own prediction and then held constant (no gradient flows through it):

    ℓ_U(u; θ) = −Σ_c t_c(u) log softmax(f(x'(u); θ))_c        (a soft cross-entropy)

- pseudo-labelling (Lee 2013): x' = u, t = one-hot(argmax p(u)), zeroed below a confidence threshold;
- consistency (UDA / FixMatch): x' = augment(u), t = one-hot(argmax p(u)) (or the sharpened p(u)^{1/T}),
  zeroed when max p(u) is below the threshold.

Each loss is split into ``prepare(model, inputs) -> (x', t)`` (draws the augmentation, builds the detached
targets) and ``on_outputs(outputs, t) -> (B,)``, so influence computations can hold x' and t fixed while
differentiating (and cache the last layer's input features); calling the loss does both steps.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InputError


def soft_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Returns (B,) per-example losses −Σ_c targets_c · log softmax(outputs)_c (linear in ``targets``)."""
    return -(targets * torch.log_softmax(outputs, dim=-1)).sum(dim=-1)


def confident_targets(
    logits: torch.Tensor, threshold: float = 0.0, temperature: float | None = None
) -> torch.Tensor:
    """Returns detached (B, C) targets: one-hot argmax of ``logits`` (or p^{1/T} renormalized), 0 rows where max p < threshold."""
    probs = torch.softmax(logits.detach(), dim=-1)
    confidence, labels = probs.max(dim=-1)
    if temperature is None:
        classes = torch.arange(probs.shape[-1], device=probs.device)
        targets = (labels.unsqueeze(-1) == classes).to(probs.dtype)
    else:
        sharp = probs ** (1.0 / temperature)
        targets = sharp / sharp.sum(dim=-1, keepdim=True)
    return targets * (confidence >= threshold).to(probs.dtype).unsqueeze(-1)


class UnsupervisedLoss:
    """Base of the SSL losses: ``loss(model, inputs) -> (B,)`` = ``on_outputs(model(x'), t)``, (x', t) = ``prepare``."""

    def prepare(self, model: nn.Module, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (x', t): the inputs the loss differentiates through and their detached (B, C) targets."""
        raise NotImplementedError

    @staticmethod
    def on_outputs(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Returns (B,) losses of the model outputs on x' against the prepared targets (soft cross-entropy)."""
        return soft_cross_entropy(outputs, targets)

    def __call__(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        if inputs.shape[0] == 0:
            raise InputError("the unlabeled batch is empty: give at least one unlabeled example.")
        grad_inputs, targets = self.prepare(model, inputs)
        return self.on_outputs(model(grad_inputs), targets)


class PseudoLabel(UnsupervisedLoss):
    """Pseudo-labelling (Lee 2013): cross-entropy against the model's own argmax prediction, kept if max p ≥ threshold."""

    def __init__(self, threshold: float = 0.0):
        self.threshold = threshold

    def prepare(self, model: nn.Module, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            logits = model(inputs)
        return inputs, confident_targets(logits, self.threshold)


class Consistency(UnsupervisedLoss):
    """Consistency under augmentation (UDA / FixMatch): the prediction on augment(u) must match the confident prediction on u.

    augment: callable(inputs) -> augmented inputs of the same shape (e.g. :class:`ShiftNoise`).
    threshold: minimum max-probability on the clean input for the example to count (FixMatch's τ).
    temperature: None for hard one-hot targets (FixMatch); T < 1 for UDA's sharpened soft targets.
    """

    def __init__(self, augment, threshold: float = 0.8, temperature: float | None = None):
        self.augment = augment
        self.threshold = threshold
        self.temperature = temperature

    def prepare(self, model: nn.Module, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            logits = model(inputs)
        return self.augment(inputs), confident_targets(logits, self.threshold, self.temperature)


class ShiftNoise:
    """Augmentation of flattened images: a random shift by up to ``max_shift`` pixels (zero fill) plus Gaussian noise.

    shape: (H, W) of one image; inputs are (B, H·W). seed: the augmentation draws come from its own generator,
    so a run is reproducible whatever else consumes torch's global random state.
    """

    def __init__(self, shape: tuple[int, int] = (8, 8), max_shift: int = 1, noise: float = 0.05, seed: int = 0):
        self.shape = shape
        self.max_shift = max_shift
        self.noise = noise
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        h, w = self.shape
        if inputs.dim() != 2 or inputs.shape[1] != h * w:
            raise InputError(f"ShiftNoise expects flattened (B, {h * w}) images, got {tuple(inputs.shape)}.")
        b, s = inputs.shape[0], self.max_shift
        images = nn.functional.pad(inputs.reshape(b, h, w), (s, s, s, s))
        dy = torch.randint(-s, s + 1, (b,), generator=self.generator).to(inputs.device)
        dx = torch.randint(-s, s + 1, (b,), generator=self.generator).to(inputs.device)
        rows = torch.arange(h, device=inputs.device)[None, :] + s - dy[:, None]
        cols = torch.arange(w, device=inputs.device)[None, :] + s - dx[:, None]
        batch = torch.arange(b, device=inputs.device)[:, None, None]
        shifted = images[batch, rows[:, :, None], cols[:, None, :]].reshape(b, h * w)
        noise = torch.randn(shifted.shape, generator=self.generator, dtype=shifted.dtype).to(inputs.device)
        return shifted + self.noise * noise
