"""Bergson's SOURCE (EleutherAI, ``bergson==2.5.1``, ``bergson.approx_unrolling``: approximate unrolled
differentiation, Bae et al. 2024) as a benchmark peer on the checkpoints of a recorded causal-LM run
(``influkit.unrolled.Record``, one stage), through Bergson's own pipeline (nothing of it is copied).

Runs in the bench venv (``bash scripts/bench-env.sh``). The chosen checkpoints θ_c of the record are written with
``save_pretrained`` beside the tokenizer, the training and test texts as Hugging Face datasets on disk (rows in the
stage's order); ``approx_unrolling_pipeline`` cuts them into ``segments`` equal groups, fits EK-FAC (K-FAC with the
eigenvalue correction) at each checkpoint, averages it per segment, walks the test gradient at the final checkpoint
back through the segments and scores every training example. Its SGD form: each segment's η·K is the record's mean
learning rate over the segment's steps times their number (``lr_list``, ``step_size_list``); the Adam form reads the
second moments only from an ``optimizer.pt`` per checkpoint, which a record does not write. Bergson's loss-signed
scores (negative: z lowers the query's loss) are influkit's sign, s_z(t) ≈ d loss_t / d w_z.
"""

from __future__ import annotations

import torch

from benchmarks.bergson_checkpoints import bergson_inputs
from influkit.unrolled import Record


def source_scores(record: Record, tokenizer, train_texts: list[str], test_texts: list[str], steps: list[int],
                  segments: int) -> torch.Tensor:
    """(n, q) Bergson's SOURCE scores over the record's checkpoints at ``steps`` (ascending, the last the final
    step), cut into ``segments`` groups of equally many."""
    from bergson.approx_unrolling.pipeline import approx_unrolling_pipeline
    from bergson.config.config import (ApproxUnrollingConfig, DataConfig, HessianConfig, IndexConfig,
                                       QuerySetConfig)
    from bergson.data import load_scores_loss_signed

    run = record.runs[0]
    if len(steps) % segments:
        raise ValueError(f"{len(steps)} checkpoints do not cut into {segments} equal segments.")
    per = len(steps) // segments
    ends = [0] + [steps[(k + 1) * per - 1] for k in range(segments)]
    lrs = [sum(float(run.lrs[t]) for t in range(a, b)) / (b - a) for a, b in zip(ends[:-1], ends[1:])]
    sizes = [b - a for a, b in zip(ends[:-1], ends[1:])]
    with bergson_inputs(record, tokenizer, train_texts, test_texts, steps) as (root, dirs):
        index = IndexConfig(run_path=str(root / "run"), model=dirs[-1],
                            data=DataConfig(dataset=str(root / "train"), truncation=True), precision="fp32",
                            token_batch_size=run.stage.model.config.n_positions)
        approx_unrolling_pipeline(index, HessianConfig(method="kfac", ev_correction=True),
                                  ApproxUnrollingConfig(checkpoints=dirs, segments=segments, lr_list=lrs,
                                                        step_size_list=sizes,
                                                        query=QuerySetConfig(dataset=str(root / "test"))))
        return load_scores_loss_signed(str(root / "run" / "scores"))[0]
