"""Validation of influence scores: leave-out retraining, the linear datamodeling score and agreement metrics."""

from .chain_loo import ChainRecipe, leave_out_retrain_chain, retrain_chain
from . import lds
from .lds import (
    ChainRetrain,
    LDSRun,
    gradient_dot,
    lds_per_query,
    lds_table,
    load_lds,
    plot_lds,
    random_subsets,
    run_lds,
    seed_agreement,
)
from .loo import TwoStageRecipe, leave_out_retrain, noise_floor
from .metrics import loo_corr, pearson, sign_agreement, spearman, top_k_overlap

__all__ = [
    "ChainRecipe",
    "ChainRetrain",
    "LDSRun",
    "TwoStageRecipe",
    "gradient_dot",
    "lds",  # the module: influkit.validation.lds.lds is the metric
    "lds_per_query",
    "lds_table",
    "leave_out_retrain",
    "leave_out_retrain_chain",
    "load_lds",
    "loo_corr",
    "noise_floor",
    "pearson",
    "plot_lds",
    "random_subsets",
    "retrain_chain",
    "run_lds",
    "seed_agreement",
    "sign_agreement",
    "spearman",
    "top_k_overlap",
]
