"""Bergson (EleutherAI, ``bergson==2.5.1``) as a benchmark peer: its MAGIC metagradients and its on-disk gradient
index, called through Bergson's own classes on a model and data the caller gives (nothing of Bergson is copied).

Runs in the bench venv (``bash scripts/bench-env.sh``: Bergson with ``--no-deps`` beside the CPU torch and the
modules it imports). Two entry points:

- :func:`magic_scores` — Bergson's MAGIC on one training run (a single stage): its functional ``Trainer`` trains
  the model with torchopt's differentiable AdamW (fp32) on the given batches, saving checkpoints; the query
  gradient of the test set is Bergson's ``compute_query_gradients`` at the final state; ``Trainer.backward``
  replays the run in reverse. score[z] = d L_test(θ_T(w)) / d w_z at w = 1, where step t minimizes
  Σ_{b∈B_t} w_{z_b} Σ_s ℓ_{b,s} / N_t (Bergson's ``weighted_causal_lm_ce``: the next-token cross-entropy summed over
  the batch's N_t predicted tokens, each example's tokens weighted by its w) and L_test is the mean next-token
  cross-entropy over the test tokens. Removing z predicts a change of −score.
- :func:`index_build_and_query` — Bergson's gradient index: ``collect_gradients`` writes each example's gradient of
  Σ_s ℓ_s (summed over its supervised tokens) for every ``nn.Linear`` / ``Conv1D`` weight of ``model.base_model``,
  projected per module on both sides by Rademacher matrices to p × p, into one memory-mapped ``gradients.bin``;
  ``Attributor`` answers a query by the dot products of the test examples' projected gradients with every row, and
  again through FAISS (``IndexFlatIP``: the same inner products). score[q, z] ≈ ∇ℓ_q · ∇ℓ_z (the plain gradient
  inner product; influkit's influence of z on q under an identity solve is its negative).

Labels follow Bergson's causal convention: position s predicts ``labels[:, s + 1]``. A masked LM (BERT) goes in
with :func:`causal_labels`, which moves each masked-LM label one position right (the last position must carry no
label: BERT's ``[SEP]``).
"""

from __future__ import annotations

import copy
import functools
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from benchmarks.resident import Peak

IGNORE = -100


def faiss_cpu():
    """faiss, with ``faiss.GpuIndex`` defined when the CPU build lacks it: Bergson 2.5.1 asks
    ``isinstance(index, faiss.GpuIndex)`` before moving an index to the CPU, and faiss-cpu has no such class (no
    index is one, which is the truth on a CPU build)."""
    import faiss

    if not hasattr(faiss, "GpuIndex"):
        faiss.GpuIndex = type("GpuIndex", (), {})
    return faiss


def causal_labels(labels: torch.Tensor) -> torch.Tensor:
    """(n, T) masked-LM labels (the token at s, or −100) moved to Bergson's causal convention: out[:, s + 1] =
    labels[:, s], out[:, 0] = −100, so that its shifted loss Σ_s CE(logits_s, out_{s+1}) is the masked-LM loss."""
    if bool((labels[:, -1] != IGNORE).any()):
        raise ValueError("the last position carries a masked-LM label, which Bergson's shifted loss cannot reach; "
                         "leave it unmasked (BERT's [SEP]).")
    return torch.cat([torch.full_like(labels[:, :1], IGNORE), labels[:, :-1]], dim=1)


# --------------------------------------------------------------------------------------------------------- MAGIC
@dataclass
class MagicResult:
    """Bergson's MAGIC scores (n,) = d L_test / d w_z, the seconds of each phase, the peak RSS (bytes)."""

    scores: torch.Tensor
    seconds: dict = field(default_factory=dict)
    peak_rss: int = 0
    test_loss: float = float("nan")
    final_params: dict = field(default_factory=dict)


def _stream(rows: list[list[int]], ids: list[int], batch_size: int, n_weights: int, device,
            labels: list[list[int]] | None = None):
    from datasets import Dataset

    from bergson.magic.data_stream import DataStream

    columns = {"input_ids": rows, "doc_ids": ids}
    if labels is not None:
        columns["labels"] = labels
    data = Dataset.from_dict(columns)
    return DataStream(data, batch_size, device=device, weight_shape=(n_weights,))


def magic_scores(model: torch.nn.Module, train_batches: Sequence[torch.Tensor], test_batch: torch.Tensor, *,
                 example_ids: Sequence[torch.Tensor] | None = None,
                 train_labels: Sequence[torch.Tensor] | None = None, test_labels: torch.Tensor | None = None,
                 lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_root: float = 1e-17,
                 weight_decay: float = 0.01, weights: torch.Tensor | None = None, save_mode: str = "sqrt",
                 workdir: str | Path | None = None, device: str = "cpu") -> MagicResult:
    """Bergson's MAGIC on one run: a :class:`MagicResult` with score[z] = d L_test(θ_T) / d w_z at w = 1.

    model: a Hugging Face causal LM (a copy is trained, with eager attention as Bergson's ``prepare_trainer`` loads
    it, its ``loss_function`` Bergson's ``weighted_causal_lm_ce``, mean over the batch's tokens); every parameter
    with ``requires_grad`` is trained.
    train_batches: one (B, T_t) input-id tensor per AdamW step (equal B; no padding, so every example has T_t − 1
    predicted tokens).
    train_labels, test_labels: the labels in Bergson's causal convention (:func:`causal_labels` for a masked LM),
    one (B, T_t) per batch and (q, T); default the input ids (the causal LM's next tokens). example_ids: the (B,) example index of each row (default 0, 1, …, in order); an example seen
    at several steps gets one weight. test_batch: (q, T) input ids; L_test is their mean next-token loss.
    weights: the data weights w (n,) the run is trained at and the derivative taken at (default 1; held in the
    model's dtype, where Bergson's DataStream holds float32).
    AdamW: torchopt's, constant ``lr``, decoupled weight decay, ``eps_root`` inside the square root (Bergson's default
    1e-17; at 0 a parameter whose gradient is exactly 0 so far — an unseen token's embedding row — has an infinite
    derivative of √v and the scores are NaN; otherwise the difference from torch.optim's arithmetic is below float32). save_mode: Bergson's checkpoint schedule (``sqrt``, ``all``, ``log``).
    seconds: ``train`` (forward with checkpoints), ``query`` (test gradient), ``backward`` (reverse replay),
    ``total``."""
    import torchopt

    from bergson.magic.cli import compute_query_gradients
    from bergson.magic.trainer import BackwardState, Trainer
    from bergson.utils.math import weighted_causal_lm_ce
    from torchopt.pytree import tree_iter

    batch_size = int(train_batches[0].shape[0])
    if any(int(b.shape[0]) != batch_size for b in train_batches):
        raise ValueError("every batch must hold the same number of rows (Bergson's DataStream slices fixed batches).")
    if example_ids is None:
        example_ids = list(torch.arange(len(train_batches) * batch_size).split(batch_size))
    ids = torch.cat([torch.as_tensor(i).reshape(-1) for i in example_ids])
    n = int(ids.max()) + 1
    rows = [row for b in train_batches for row in b.tolist()]
    labels = None if train_labels is None else [row for b in train_labels for row in b.tolist()]
    work = Path(tempfile.mkdtemp(prefix="bergson-magic-", dir=workdir))
    try:
        with Peak() as total:
            model = copy.deepcopy(model).to(device)
            model.set_attn_implementation("eager")  # as Bergson's prepare_trainer: SDPA has no double backward
            model.loss_function = functools.partial(weighted_causal_lm_ce, reduction="mean")
            stream = _stream(rows, ids.tolist(), batch_size, n, device, labels)
            dtype = next(model.parameters()).dtype
            stream.weights = torch.nn.Parameter(
                torch.ones(n, dtype=dtype, device=device) if weights is None else weights.to(device, dtype).clone())
            queries = _stream(test_batch.tolist(), list(range(len(test_batch))), len(test_batch), len(test_batch),
                              device, None if test_labels is None else test_labels.tolist())
            opt = torchopt.adamw(lr, betas=betas, eps=eps, eps_root=eps_root, weight_decay=weight_decay)
            trainer, state = Trainer.initialize(model, opt)
            t0 = time.perf_counter()
            state = trainer.train(state, stream, inplace=True, save_dir=str(work / "checkpoints"),
                                  save_mode=save_mode)
            t1 = time.perf_counter()
            final = {k: v.detach().clone() for k, v in state.params.items()}
            query_grads, test_loss = compute_query_gradients(state, model, queries, "mean")
            t2 = time.perf_counter()
            stream.requires_grad = True
            opt_grads = [torch.zeros_like(b) for b in tree_iter(state.opt_state)
                         if isinstance(b, torch.Tensor) and b.is_floating_point()]
            backward = BackwardState(query_grads, opt_grads, torch.zeros_like(stream.weights))
            backward = trainer.backward(str(work / "checkpoints"), stream, backward, state, inplace=True,
                                        save_mode=save_mode)
            t3 = time.perf_counter()
        seconds = {"train": t1 - t0, "query": t2 - t1, "backward": t3 - t2, "total": total.seconds}
        return MagicResult(backward.weight_grads.detach().cpu(), seconds, total.peak, float(test_loss), final)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------------------------------------- index
@dataclass
class IndexResult:
    """Scores (q, n) from Bergson's dot-product query and from its FAISS flat inner-product query, with seconds
    (``build``, ``load`` and ``query`` for each), bytes per example on disk and the peak RSS of the build."""

    scores: torch.Tensor
    faiss_scores: torch.Tensor | None
    seconds: dict
    bytes_per_example: float
    build_peak_rss: int
    numbers_per_example: int


def _as_corpus(corpus) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(corpus, torch.Tensor):
        return corpus, None
    ids, labels = corpus
    return ids, labels


def _test_loss_backward(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor | None) -> None:
    """Σ over the test examples of each one's summed shifted cross-entropy, backpropagated (the build's loss)."""
    from bergson.collector.collector import token_losses

    labels = ids if labels is None else labels
    logits = model(ids).logits[:, :-1]
    token_losses("ce", logits, labels[:, 1:]).sum().backward()
    model.zero_grad()


def _dense(values: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
    """Top-k lists (q, k) of (value, index) back into a dense (q, n) matrix."""
    out = torch.full((values.shape[0], n), float("nan"), dtype=torch.float32)
    out.scatter_(1, indices.long(), values.float())
    return out


def index_build_and_query(model: torch.nn.Module, corpus, queries, *, projection_dim: int = 16,
                          token_batch_size: int = 2048, faiss: bool = True, workdir: str | Path | None = None,
                          device: str = "cpu") -> IndexResult:
    """Bergson's gradient index of ``corpus`` queried by ``queries``: an :class:`IndexResult`, scores[q, z] ≈
    ∇ℓ_q · ∇ℓ_z (module docstring), with the FAISS flat inner-product scores beside (``faiss=False``: skipped).

    model: a Hugging Face model whose output has ``.logits`` and whose ``base_model`` holds the tracked linear
    modules (a causal LM, or a masked LM with :func:`causal_labels`). corpus and queries: (n, T) input ids, or
    (input_ids, labels) in Bergson's causal convention. projection_dim: p, each module's gradient stored as p × p
    (0: unprojected). The build writes the index under a temporary directory (``workdir``), removed at the end."""
    from bergson.query.attributor import Attributor
    from bergson.query.faiss_index import FaissConfig

    q_ids, q_labels = _as_corpus(queries)
    n = len(_as_corpus(corpus)[0])
    work = Path(tempfile.mkdtemp(prefix="bergson-index-", dir=workdir))
    try:
        seconds = {}
        with Peak() as build:
            cfg = build_index(model, corpus, work / "index", projection_dim=projection_dim,
                              token_batch_size=token_batch_size, device=device)
        seconds["build"] = build.seconds
        size = (work / "index" / "gradients.bin").stat().st_size

        def query(attributor) -> tuple[torch.Tensor, float]:
            start = time.perf_counter()
            with attributor.trace(model.base_model, k=None) as result:
                _test_loss_backward(model, q_ids, q_labels)
            return _dense(result.scores, result.indices, n), time.perf_counter() - start

        start = time.perf_counter()
        attributor = Attributor(cfg.run_path, device=device, unit_norm=False)
        seconds["load"] = time.perf_counter() - start
        scores, seconds["query"] = query(attributor)
        faiss_scores = None
        if faiss:
            faiss_cpu()
            start = time.perf_counter()
            attributor = Attributor(cfg.run_path, device=device, unit_norm=False, faiss_cfg=FaissConfig())
            seconds["faiss_load"] = time.perf_counter() - start
            faiss_scores, seconds["faiss_query"] = query(attributor)
        width = sum(int(np.prod(s)) for s in processor_shapes(cfg.run_path))
        return IndexResult(scores, faiss_scores, seconds, size / n, build.peak, width)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build_index(model: torch.nn.Module, corpus, run_path: str | Path, *, projection_dim: int = 16,
                token_batch_size: int = 2048, device: str = "cpu"):
    """Bergson's gradient index of ``corpus`` written to ``run_path`` (``gradients.bin``, ``info.json`` and its
    projection's settings): returns its IndexConfig. model and corpus as for :func:`index_build_and_query`."""
    from datasets import Dataset

    from bergson.collection import collect_gradients
    from bergson.config.config import IndexConfig, PreprocessConfig
    from bergson.data import allocate_batches
    from bergson.utils.worker_utils import create_processor

    ids, labels = _as_corpus(corpus)
    model = model.to(device).eval()
    columns = {"input_ids": ids.tolist(), "length": [ids.shape[1]] * len(ids)}
    if labels is not None:
        columns["labels"] = labels.tolist()
    data = Dataset.from_dict(columns)
    cfg = IndexConfig(run_path=str(run_path), projection_dim=projection_dim, loss_reduction="sum",
                      token_batch_size=token_batch_size)
    processor = create_processor(model, cfg)
    batches = allocate_batches(data["length"][:], cfg.token_batch_size)
    collect_gradients(model, data, processor, cfg, batches=batches, preprocess_cfg=PreprocessConfig())
    shutil.move(cfg.partial_run_path, cfg.run_path)
    return cfg


def processor_shapes(index_path: str | Path) -> list[tuple[int, ...]]:
    """The stored shape of each module's gradient in a built index (its ``info.json``)."""
    import json

    sizes = json.loads((Path(index_path) / "info.json").read_text())["grad_sizes"]
    return [(int(v),) if isinstance(v, int) else tuple(v) for v in sizes.values()]
