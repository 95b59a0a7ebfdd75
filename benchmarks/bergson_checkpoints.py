"""The files Bergson's pipelines read, written from a recorded causal-LM run (``influkit.unrolled.Record``, one
stage): the training and test texts as Hugging Face datasets on disk (rows in the stage's order) and each chosen
checkpoint θ_c of the record as a model directory (``save_pretrained`` beside the tokenizer). Used by the TrackStar
and SOURCE peers (:mod:`benchmarks.trackstar_peer`, :mod:`benchmarks.source_peer`)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from influkit.unrolled import Record


@contextmanager
def bergson_inputs(record: Record, tokenizer, train_texts: list[str], test_texts: list[str],
                   steps: list[int]) -> Iterator[tuple[Path, list[str]]]:
    """(folder, the checkpoint directories in the order of ``steps``); the folder holds ``train`` and ``test``.
    The stage's model is set to each checkpoint to save it and back to the run's final weights on exit."""
    from datasets import Dataset

    run = record.runs[0]
    missing = [c for c in steps if c not in run.checkpoints]
    if missing:
        raise ValueError(f"the record has no checkpoint at steps {missing}; "
                         f"its checkpoints: {sorted(run.checkpoints)}.")
    model = run.stage.model
    hf_model = getattr(model, "hf_model", model)  # influkit.hf.HFModel wraps it
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        Dataset.from_dict({"text": list(train_texts)}).save_to_disk(str(root / "train"))
        Dataset.from_dict({"text": list(test_texts)}).save_to_disk(str(root / "test"))
        dirs = []
        try:
            for c in steps:
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(run.checkpoints[c][0][n])
                hf_model.save_pretrained(root / f"checkpoint-{c}")
                tokenizer.save_pretrained(root / f"checkpoint-{c}")
                dirs.append(str(root / f"checkpoint-{c}"))
            yield root, dirs
        finally:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(run.final[n])
