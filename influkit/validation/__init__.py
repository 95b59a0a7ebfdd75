"""Validation of influence scores: leave-out retraining and agreement metrics."""

from .loo import TwoStageRecipe, leave_out_retrain, noise_floor
from .metrics import loo_corr, pearson, sign_agreement, spearman, top_k_overlap

__all__ = [
    "TwoStageRecipe",
    "leave_out_retrain",
    "loo_corr",
    "noise_floor",
    "pearson",
    "sign_agreement",
    "spearman",
    "top_k_overlap",
]
