"""Validation of influence scores: leave-out retraining and agreement metrics."""

from .chain_loo import ChainRecipe, leave_out_retrain_chain, retrain_chain
from .loo import TwoStageRecipe, leave_out_retrain, noise_floor
from .metrics import loo_corr, pearson, sign_agreement, spearman, top_k_overlap

__all__ = [
    "ChainRecipe",
    "TwoStageRecipe",
    "leave_out_retrain",
    "leave_out_retrain_chain",
    "loo_corr",
    "noise_floor",
    "pearson",
    "retrain_chain",
    "sign_agreement",
    "spearman",
    "top_k_overlap",
]
