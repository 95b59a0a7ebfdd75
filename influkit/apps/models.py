"""The multi-stage paper's architectures (Table A of its appendix): a CONV/MAX-POOL embedding with tanh
activations shared between stages, and task-specific fully connected heads with no output activation.
"""

from __future__ import annotations

from torch import nn


class EmbeddingClassifier(nn.Module):
    """``head(embedding(x))``: the shared embedding W and a task head (U when pretraining, Θ when finetuning)."""

    def __init__(self, embedding: nn.Module, head: nn.Module):
        super().__init__()
        self.embedding = embedding
        self.head = head

    def forward(self, x):
        return self.head(self.embedding(x))


def digits_embedding(channels: tuple[int, int] = (4, 8), pool: str = "avg") -> nn.Sequential:
    """The MNIST embedding of Table A adapted to 8×8 digits: CONV c1 3×3 (pad 1) → tanh → POOL 2×2 →
    CONV c2 3×3 (pad 1) → tanh → POOL 2×2 → flatten, giving c2·2·2 features.

    pool: "avg" (default) keeps the objective smooth, so training reaches a stationary point with a positive
    definite Hessian — the condition influence functions are derived under; "max" is Table A's choice, whose
    kinks stall L-BFGS and Newton steps when an argmax switches.
    """
    c1, c2 = channels
    pooling = {"avg": nn.AvgPool2d, "max": nn.MaxPool2d}[pool]
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, c1, 3, padding=1),
        nn.Tanh(),
        pooling(2),
        nn.Conv2d(c1, c2, 3, padding=1),
        nn.Tanh(),
        pooling(2),
        nn.Flatten(),
    )


def mnist_embedding() -> nn.Sequential:
    """Table A, MNIST: CONV 32 5×5+1 → tanh → MAX-POOL 2×2+2 → CONV 64 5×5+1 → tanh → MAX-POOL 2×2+2 → flatten
    (28×28 inputs give 64·4·4 = 1024 features)."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 28, 28)),
        nn.Conv2d(1, 32, 5),
        nn.Tanh(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5),
        nn.Tanh(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )


def digits_classifier(n_classes: int, channels: tuple[int, int] = (4, 8), pool: str = "avg") -> EmbeddingClassifier:
    """The digits embedding with an FC head of ``n_classes`` outputs."""
    return EmbeddingClassifier(digits_embedding(channels, pool), nn.Linear(channels[1] * 4, n_classes))


def mnist_classifier(n_classes: int) -> EmbeddingClassifier:
    """Table A's MNIST model: the CONV embedding with an FC head of ``n_classes`` outputs."""
    return EmbeddingClassifier(mnist_embedding(), nn.Linear(1024, n_classes))
