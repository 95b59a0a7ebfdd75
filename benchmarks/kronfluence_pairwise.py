"""kronfluence 1.0.1 as the pairwise peer of ``ik.pairwise``: its ``Analyzer.compute_pairwise_scores`` on a
classifier, data and damping the caller gives (nothing of kronfluence is copied), timed and with its peak resident
memory sampled.

kronfluence fits EK-FAC factors (covariances and eigenvalue correction with labels it samples from the model's
softmax, on the first ``fit_examples`` training examples), then, per query batch, preconditions the batch's
per-example query gradients and takes their inner products with every training example's gradient, batch by
training batch. score[q, z] = ∇ℓ_q(θ)ᵀ (G_ekfac + λI)⁻¹ ∇ℓ_z(θ) with λ absolute (``damping_factor``). It holds the
whole (n_query, n_train) matrix in memory (float32) and writes it to one safetensors file at the end; nothing
bounds its memory. influkit's I(z, q) = −∇ℓ_zᵀ (G + λI)⁻¹ ∇ℓ_q, so the two agree up to the sign and G's
approximation (EK-FAC of a sampled Fisher there, the exact Gauss-Newton matrix here).

Runs only in the bench venv (``bash scripts/bench-env.sh``; kronfluence installed with ``--no-deps``).
"""

from __future__ import annotations

import copy
import tempfile
import time
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset

from .resident import Peak, rss_now


@dataclass(frozen=True)
class PeerRun:
    """kronfluence's pairwise run: scores (n_query, n_train) as it returns them, seconds of each phase, resident
    memory (bytes) before scoring and its peak while ``compute_pairwise_scores`` ran."""

    scores: torch.Tensor
    fit_seconds: float
    pairwise_seconds: float
    resident_before: int
    peak_resident: int
    version: str


def pairwise_scores(model: nn.Module, train: tuple[torch.Tensor, torch.Tensor],
                    test: tuple[torch.Tensor, torch.Tensor], *, damping: float, fit_examples: int,
                    query_batch: int, train_batch: int) -> PeerRun:
    """kronfluence's EK-FAC pairwise scores of every (test, train) pair of a cross-entropy classifier."""
    import kronfluence
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task

    class Classification(Task):
        def compute_train_loss(self, batch, model, sample=False):
            inputs, labels = batch
            logits = model(inputs)
            if sample:
                with torch.no_grad():
                    labels = torch.multinomial(torch.softmax(logits.detach(), -1), 1).squeeze(-1)
            return nn.functional.cross_entropy(logits, labels, reduction="sum")

        def compute_measurement(self, batch, model):
            inputs, labels = batch
            return nn.functional.cross_entropy(model(inputs), labels, reduction="sum")

    task = Classification()
    peer = prepare_model(copy.deepcopy(model).eval(), task)
    train_data, test_data = TensorDataset(*train), TensorDataset(*test)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        analyzer = Analyzer("bench_pairwise", model=peer, task=task, cpu=True, disable_tqdm=True, output_dir=tmp)
        start = time.perf_counter()
        analyzer.fit_all_factors(
            "ekfac", dataset=train_data, per_device_batch_size=train_batch, overwrite_output_dir=True,
            factor_args=FactorArguments(strategy="ekfac", covariance_max_examples=fit_examples,
                                        lambda_max_examples=fit_examples))
        fit_seconds = time.perf_counter() - start
        before = rss_now()
        with Peak() as peak:
            start = time.perf_counter()
            analyzer.compute_pairwise_scores(
                "scores", "ekfac", query_dataset=test_data, train_dataset=train_data,
                per_device_query_batch_size=query_batch, per_device_train_batch_size=train_batch,
                score_args=ScoreArguments(damping_factor=damping), overwrite_output_dir=True)
            scores = analyzer.load_pairwise_scores("scores")["all_modules"]
            seconds = time.perf_counter() - start
    return PeerRun(scores=scores, fit_seconds=fit_seconds, pairwise_seconds=seconds, resident_before=before,
                   peak_resident=peak.peak, version=kronfluence.__version__)
