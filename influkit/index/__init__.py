"""A gradient index: a stage's per-example gradients compressed once to disk, queried by every chain built on it.

"Pretrain once, finetune many": the pretraining side of multi-stage influence — per-example gradients of stage 1 —
does not depend on the finetuning, so one index of the base model's corpus serves every finetuned head (Case 1),
finetuned encoder (Case 2), LoRA adapter and test set; only the chain's adjoint s on stage 1 changes.

- :class:`GradientIndex` (:mod:`.gradient_index`): ``build(stage, directory, IndexConfig(...))`` (sharded,
  resumable, under ``torchrun`` in parallel), ``append(stage)``, ``scores(query)`` (one matrix product),
  ``top(query, k)`` (candidates from the index, re-scored exactly by contraction; ``ann=True`` for faiss);
- :mod:`.projections`: the per-layer Kronecker-factored projections and the dimension rule;
- :mod:`.layout`: a batch's compressed rows and a direction's compressed columns;
- :mod:`.quantization`: int8 rows with a scale per row (the default storage) and the bound on their scores' error;
- :mod:`.shards`: the files (manifest, projections, shards) and the fingerprints of checkpoint and data;
- :mod:`.ann`: approximate inner-product search (faiss, the ``index`` extra);
- :mod:`.job`: ``influkit index build|query CONFIG``.
"""

from .gradient_index import DEFAULT_DIM, GradientIndex, IndexConfig
from .projections import PROJECTIONS, allot

__all__ = ["DEFAULT_DIM", "GradientIndex", "IndexConfig", "PROJECTIONS", "allot"]
