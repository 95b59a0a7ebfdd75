"""Agreement between predicted and actual effects of removing training examples, as plain functions."""

from __future__ import annotations

import numpy as np

from ..errors import InputError


def _pair(predicted, actual) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(predicted, dtype=float).reshape(-1)
    a = np.asarray(actual, dtype=float).reshape(-1)
    if p.shape != a.shape:
        raise InputError(f"predicted has {p.size} values but actual has {a.size}; pair them one to one.")
    if p.size < 3:
        raise InputError("need at least 3 (predicted, actual) pairs to measure agreement.")
    if not (np.isfinite(p).all() and np.isfinite(a).all()):
        raise InputError("predicted or actual holds NaN/Inf; drop the failed removals first.")
    return p, a


def ranks(values) -> np.ndarray:
    """1-based ranks of a 1-D array, tied values sharing the mean of their ranks (as Spearman's ρ needs)."""
    v = np.asarray(values, dtype=float)
    ordered = np.sort(v)
    return (np.searchsorted(ordered, v, "left") + np.searchsorted(ordered, v, "right") + 1) / 2.0


def _correlation(p: np.ndarray, a: np.ndarray) -> float:
    """Σ(p − p̄)(a − ā) / √(Σ(p − p̄)² Σ(a − ā)²); NaN when either side is constant."""
    p, a = p - p.mean(), a - a.mean()
    denom = np.sqrt((p**2).sum() * (a**2).sum())
    return float((p * a).sum() / denom) if denom > 0 else float("nan")


def pearson(predicted, actual) -> float:
    """Pearson correlation r between predicted and actual changes (NaN if either is constant)."""
    return _correlation(*_pair(predicted, actual))


def spearman(predicted, actual) -> float:
    """Spearman rank correlation ρ between predicted and actual changes: Pearson's r of their (mean-tied) ranks."""
    p, a = _pair(predicted, actual)
    return _correlation(ranks(p), ranks(a))


def sign_agreement(predicted, actual) -> float:
    """Fraction of pairs whose predicted and actual changes have the same sign."""
    p, a = _pair(predicted, actual)
    return float(np.mean(np.sign(p) == np.sign(a)))


def top_k_overlap(predicted, actual, k: int) -> float:
    """|top-k by predicted ∩ top-k by actual| / k, ranking by the (signed) change, largest first."""
    p, a = _pair(predicted, actual)
    if not 0 < k <= p.size:
        raise InputError(f"k must be in 1..{p.size}, got {k}.")
    top_p = set(np.argsort(-p, kind="stable")[:k])
    top_a = set(np.argsort(-a, kind="stable")[:k])
    return len(top_p & top_a) / k


def loo_corr(predicted, actual) -> dict[str, float]:
    """Pearson, Spearman, sign agreement and top-10% overlap of predicted vs actual leave-one-out changes."""
    p, a = _pair(predicted, actual)
    return {
        "pearson": pearson(p, a),
        "spearman": spearman(p, a),
        "sign_agreement": sign_agreement(p, a),
        "top10%_overlap": top_k_overlap(p, a, max(1, p.size // 10)),
        "n": int(p.size),
    }
