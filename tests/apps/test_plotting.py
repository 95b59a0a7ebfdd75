"""influkit.apps.plotting: the predicted-vs-actual scatter, also for predictions on their own scale."""

from __future__ import annotations

from conftest import need

matplotlib = need("matplotlib")

matplotlib.use("Agg")

import numpy as np  # noqa: E402

from influkit.apps import plotting  # noqa: E402


def test_scatter_own_scale_spans_the_predictions_not_the_actual_changes():
    rng = np.random.default_rng(0)
    actual = rng.normal(size=30)
    tiny = 1e-3 * actual + 1e-4 * rng.normal(size=30)  # identity-Hessian scores: another scale
    shared = plotting.scatter_with_r(tiny, actual)
    lo, hi = shared.axes[0].get_xlim()
    assert hi - lo > 1.0  # the y = x line stretches the x-axis to the actual changes: points collapse at 0
    own = plotting.scatter_with_r(tiny, actual, own_scale=True, title="identity (own x-scale)")
    lo, hi = own.axes[0].get_xlim()
    assert lo <= tiny.min() and hi >= tiny.max() and hi - lo < 0.1
    assert "own x-scale" in own.axes[0].get_title() and "Pearson r" in own.axes[0].get_title()
    plotting.plt.close("all")


def test_caption_adds_text_under_the_axes():
    fig = plotting.scatter_with_r([0.0, 1.0, 2.0], [0.1, 0.9, 2.2])
    plotting.caption(fig, "identity scores live on another scale")
    assert any("another scale" in t.get_text() for t in fig.texts)
    assert fig.axes[0].get_position().y0 > 0.05
    plotting.plt.close(fig)
