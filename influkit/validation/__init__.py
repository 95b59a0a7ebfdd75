"""Validation of influence scores: leave-out retraining, the linear datamodeling score and agreement metrics.

The metrics are plain functions (:mod:`.metrics`, :mod:`.lds`); :mod:`.loo` and :mod:`.chain_loo` re-train a
two-stage problem or a :class:`~influkit.chain.Chain` without some examples; :mod:`.reference` holds the
explicit-Hessian formulas the tests take as ground truth. The LDS re-training harness, its baselines and plots
are an application: :mod:`influkit.apps.lds`.
"""

from . import lds
from .chain_loo import ChainRecipe, leave_out_retrain_chain, retrain_chain
from .lds import lds_per_query, lds_table, predicted_outputs, random_subsets, seed_agreement
from .loo import TwoStageRecipe, leave_out_retrain, noise_floor
from .metrics import loo_corr, pearson, sign_agreement, spearman, top_k_overlap

__all__ = [
    "ChainRecipe",
    "TwoStageRecipe",
    "lds",  # the module: influkit.validation.lds.lds is the metric
    "lds_per_query",
    "lds_table",
    "leave_out_retrain",
    "leave_out_retrain_chain",
    "loo_corr",
    "noise_floor",
    "pearson",
    "predicted_outputs",
    "random_subsets",
    "retrain_chain",
    "seed_agreement",
    "sign_agreement",
    "spearman",
    "top_k_overlap",
]
