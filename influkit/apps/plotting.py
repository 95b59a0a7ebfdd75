"""Pictures of influence results: predicted-vs-actual scatter with Pearson r, score histograms, image galleries.

Every function draws on a given matplotlib Axes (or makes a figure) and returns the Figure; ``save`` writes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..extras import require
from ..validation.metrics import pearson, spearman

plt = require("matplotlib.pyplot", "influkit.apps.plotting")


def _axes(ax):
    if ax is None:
        fig, ax = plt.subplots(figsize=(4.8, 4.2))
        return fig, ax
    return ax.figure, ax


def scatter_with_r(
    predicted, actual, *, ax=None, title: str = "", label: str = "", own_scale: bool = False
) -> plt.Figure:
    """Predicted vs actual change of the test loss, the identity line, and Pearson r / Spearman ρ in the title.

    own_scale: for predictions on another scale than the actual changes (e.g. the identity-Hessian ablation):
    no y = x line — it would stretch the x-axis to the actual changes' range and squeeze the points onto a
    vertical line — so the x-axis spans the predictions only; a least-squares line shows the trend instead.
    """
    fig, ax = _axes(ax)
    p, a = np.asarray(predicted, float), np.asarray(actual, float)
    ax.scatter(p, a, s=16, alpha=0.8, label=label or None)
    if own_scale:
        span = p.max() - p.min()
        pad = 0.05 * span if span > 0 else max(abs(p.max()), 1e-12)
        ax.set_xlim(p.min() - pad, p.max() + pad)
        if span > 0:
            slope, intercept = np.polyfit(p, a, 1)
            xs = np.array([p.min(), p.max()])
            ax.plot(xs, slope * xs + intercept, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("predicted change of test loss (own scale)")
    else:
        lo, hi = min(p.min(), a.min()), max(p.max(), a.max())
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--")
        ax.set_xlabel("predicted change of test loss (influence)")
    ax.set_ylabel("actual change (leave-out retraining)")
    stats = f"Pearson r = {pearson(p, a):.3f}, Spearman ρ = {spearman(p, a):.3f}"
    ax.set_title(f"{title}\n{stats}" if title else stats, fontsize=9)
    fig.tight_layout()
    return fig


def caption(fig: plt.Figure, text: str, *, fontsize: float = 8) -> plt.Figure:
    """A caption line under the figure's axes (the axes are shrunk to make room)."""
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.text(0.5, 0.015, text, ha="center", va="bottom", fontsize=fontsize, wrap=True)
    return fig


def score_histograms(scores: dict[str, Sequence[float]], *, ax=None, bins: int = 50, title: str = "") -> plt.Figure:
    """Overlaid histograms of several score sets, each labelled with its mean |score|."""
    fig, ax = _axes(ax)
    for name, values in scores.items():
        v = np.asarray(values, float)
        ax.hist(v, bins=bins, alpha=0.5, label=f"{name} (mean |score| = {np.abs(v).mean():.3g})")
    ax.set_xlabel("influence score")
    ax.set_ylabel("pretraining examples")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def image_gallery(
    images, captions: Sequence[str], *, shape: tuple[int, int] = (8, 8), columns: int = 8, title: str = ""
) -> plt.Figure:
    """A grid of grey-scale images (rows of ``images`` reshaped to ``shape``) with a caption under each."""
    images = np.asarray(images, float).reshape(len(captions), *shape)
    rows = int(np.ceil(len(captions) / columns))
    fig, axes = plt.subplots(rows, columns, figsize=(1.3 * columns, 1.9 * rows + 0.5), squeeze=False)
    for ax in axes.ravel():
        ax.axis("off")
    for ax, image, caption in zip(axes.ravel(), images, captions):
        ax.imshow(image, cmap="gray_r")
        ax.set_title(caption, fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def save(fig: plt.Figure, path: str | Path, dpi: int = 110) -> Path:
    """Write ``fig`` to ``path`` (parents created) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
