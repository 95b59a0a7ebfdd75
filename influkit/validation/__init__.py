"""Validation of influence scores: leave-out retraining, the linear datamodeling score and agreement metrics.

The metrics are plain functions (:mod:`.metrics`, :mod:`.lds`); :mod:`.retrain` re-trains a
:class:`~influkit.chain.Chain` on part of its stage-1 data (the one retrainer), :mod:`.loo` compares leave-out
re-training with the predicted removal effects; :mod:`.check` checks a result against the user's own retraining
function, with the noise floor of retraining itself; :mod:`.reference` holds the
explicit-Hessian formulas the tests take as ground truth. The LDS re-training harness, its baselines and plots
are an application: :mod:`influkit.apps.lds`.
"""

from . import lds
from .lds import lds_per_query, lds_table, predicted_outputs, random_subsets, seed_agreement
from .check import RetrainingCheck, check_retraining, plot_check
from .loo import leave_out_retrain
from .metrics import loo_corr, pearson, sign_agreement, spearman, top_k_overlap
from .retrain import Retrainer

__all__ = [
    "Retrainer",
    "RetrainingCheck",
    "check_retraining",
    "plot_check",
    "lds",  # the module: influkit.validation.lds.lds is the metric
    "lds_per_query",
    "lds_table",
    "leave_out_retrain",
    "loo_corr",
    "pearson",
    "predicted_outputs",
    "random_subsets",
    "seed_agreement",
    "sign_agreement",
    "spearman",
    "top_k_overlap",
]
