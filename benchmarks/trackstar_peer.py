"""Bergson's TrackStar (EleutherAI, ``bergson==2.5.1``, ``bergson.cli.trackstar``) as a benchmark peer on the
checkpoints of a recorded causal-LM run (``influkit.unrolled.Record``, one stage), through Bergson's own pipeline
(nothing of it is copied).

Runs in the bench venv (``bash scripts/bench-env.sh``). Bergson's pipeline takes a model directory, a tokenizer and
text datasets: each chosen checkpoint θ_c of the record is written with ``save_pretrained`` beside the tokenizer, the
training and test texts as Hugging Face datasets on disk (rows in the stage's order), and ``trackstar`` runs on each
(its autocorrelation Hessian of the training gradients as the preconditioner — no query Hessian mixed in, the test
set being 12 documents — Rademacher projection to 16 × 16 per module of every ``Conv1D`` / ``nn.Linear`` of
``model.base_model``, unit-normalized (``unit_normalize``: R^{-1/2} g / ‖R^{-1/2} g‖ on both sides); no Adam
second-moment normalization: Bergson reads that only from an ``optimizer.pt`` file, which a record does not write).
Its pipeline scores one model; the row sums the scores over
the chosen checkpoints (equal weights). Bergson's loss-signed scores (negative: z lowers the query's loss) are
influkit's sign, s_z(t) ≈ d loss_t / d w_z.
"""

from __future__ import annotations

import torch

from benchmarks.bergson_checkpoints import bergson_inputs
from influkit.unrolled import Record


def trackstar_scores(record: Record, tokenizer, train_texts: list[str], test_texts: list[str],
                     steps: list[int]) -> torch.Tensor:
    """(n, q) Σ_{c ∈ steps} TrackStar_c(z, t) (Bergson's loss-signed scores at the record's checkpoint c)."""
    from bergson.cli.trackstar import trackstar
    from bergson.config.config import (DataConfig, PreprocessConfig, QuerySetConfig, TrackstarConfig,
                                       TrackstarIndexConfig)
    from bergson.data import load_scores_loss_signed

    model = record.runs[0].stage.model
    total = None
    with bergson_inputs(record, tokenizer, train_texts, test_texts, steps) as (root, dirs):
        for c, directory in zip(steps, dirs):
            index = TrackstarIndexConfig(run_path=str(root / f"run_{c}"), model=directory,
                                         data=DataConfig(dataset=str(root / "train"), truncation=True),
                                         precision="fp32", token_batch_size=model.config.n_positions)
            trackstar(index, TrackstarConfig(query=QuerySetConfig(dataset=str(root / "test")), mix_hessians=False,
                                             stats_sample_size=None,
                                             preprocess_cfg=PreprocessConfig(unit_normalize=True)))
            scores, _ = load_scores_loss_signed(str(root / f"run_{c}" / "scores"))
            total = scores if total is None else total + scores
    return total
