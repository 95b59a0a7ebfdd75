"""Load and save ELMo weight files (TensorFlow/allennlp HDF5 layout) and their ``options.json``.

Dataset layout (d = 0 forward, 1 backward; l = LSTM layer; i = filter bank; k = highway layer):

    char_embed                                   (261, char_dim)          row k − 1 embeds character id k
    CNN/W_cnn_i, CNN/b_cnn_i                     (1, width_i, char_dim, count_i), (count_i,)
    CNN_high_k/{W_transform, W_carry}            (n_filters, n_filters)
    CNN_high_k/{b_transform, b_carry}            (n_filters,)
    CNN_proj/W_proj, CNN_proj/b_proj             (n_filters, proj), (proj,)
    RNN_d/RNN/MultiRNNCell/Cell{l}/LSTMCell/W_0  (proj + proj, 4·cell)   TF gate order i, j, f, o
    RNN_d/RNN/MultiRNNCell/Cell{l}/LSTMCell/B    (4·cell,)               forget bias +1 added at run time
    RNN_d/RNN/MultiRNNCell/Cell{l}/LSTMCell/W_P_0 (cell, proj)

:class:`~influkit.elmo.bilm.ElmoBiLM` stores its parameters in exactly these shapes, so loading and
saving copy arrays unchanged: a float32 file loaded and saved again is bit-identical. Datasets of the
file that the biLM does not use (e.g. a softmax) are ignored, as allennlp does.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..errors import InputError
from ..extras import require
from .bilm import ElmoBiLM, ElmoOptions

h5py = require("h5py", "influkit.elmo (allennlp weight and embedding files)")


def dataset_names(options: ElmoOptions) -> dict[str, str]:
    """Map from HDF5 dataset path to :class:`ElmoBiLM` parameter name for a biLM with ``options``."""
    names = {"char_embed": "char_cnn.char_embed"}
    for i in range(len(options.filters)):
        names[f"CNN/W_cnn_{i}"] = f"char_cnn.conv_weights.{i}"
        names[f"CNN/b_cnn_{i}"] = f"char_cnn.conv_biases.{i}"
    for k in range(options.n_highway):
        for part in ("W_transform", "b_transform", "W_carry", "b_carry"):
            names[f"CNN_high_{k}/{part}"] = f"char_cnn.highways.{k}.{part}"
    names["CNN_proj/W_proj"] = "char_cnn.W_proj"
    names["CNN_proj/b_proj"] = "char_cnn.b_proj"
    for d, stack in enumerate(("forward_layers", "backward_layers")):
        for layer in range(options.n_layers):
            cell = f"RNN_{d}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"
            names[f"{cell}/W_0"] = f"lstm.{stack}.{layer}.W"
            names[f"{cell}/B"] = f"lstm.{stack}.{layer}.B"
            names[f"{cell}/W_P_0"] = f"lstm.{stack}.{layer}.W_P"
    return names


def _existing(path: str | Path, what: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"ELMo {what} {str(path)!r} does not exist; give the path of an existing file.")
    return path


def read_options(options_file: str | Path) -> ElmoOptions:
    """:class:`ElmoOptions` read from an ELMo ``options.json``."""
    path = _existing(options_file, "options file")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"ELMo options file {str(path)!r} is not valid JSON ({exc}); give an options.json.") from exc
    return ElmoOptions.from_dict(raw)


def write_options(options: ElmoOptions, options_file: str | Path) -> None:
    """Write ``options`` as an ELMo ``options.json`` (nested ``lstm`` / ``char_cnn`` sections)."""
    Path(options_file).write_text(json.dumps(options.to_dict(), indent=2) + "\n")


def load_weights(bilm: ElmoBiLM, weight_file: str | Path) -> ElmoBiLM:
    """``bilm`` with every parameter copied from an ELMo HDF5 weight file (cast to the biLM's dtype).

    Raises :class:`InputError` naming the dataset when the file lacks one the options call for or holds
    it in another shape — the sign that options.json and the weight file do not belong together.
    """
    path = _existing(weight_file, "weight file")
    params = dict(bilm.named_parameters())
    with h5py.File(path, "r") as fin:
        for dataset, name in dataset_names(bilm.options).items():
            target = params[name]
            if dataset not in fin:
                raise InputError(
                    f"weight file {str(path)!r} has no dataset {dataset!r} that the options require; "
                    "use the options.json that came with this weight file."
                )
            array = fin[dataset][...]
            if tuple(array.shape) != tuple(target.shape):
                raise InputError(
                    f"dataset {dataset!r} of {str(path)!r} has shape {array.shape} but the options imply "
                    f"{tuple(target.shape)}; use the options.json that came with this weight file."
                )
            with torch.no_grad():
                target.copy_(torch.from_numpy(array))
    return bilm


def load_elmo(
    options_file: str | Path,
    weight_file: str | Path,
    *,
    stateful: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> ElmoBiLM:
    """A pretrained :class:`ElmoBiLM` in eval mode built from ``options.json`` and an HDF5 weight file."""
    bilm = ElmoBiLM(read_options(options_file), stateful=stateful, device=device, dtype=dtype)
    return load_weights(bilm, weight_file).eval()


def save_weights(bilm: ElmoBiLM, weight_file: str | Path, dtype: np.dtype | str = "float32") -> None:
    """Write the parameters of ``bilm`` as an ELMo HDF5 weight file with ``dtype`` datasets (float32 default).

    The file has exactly the datasets of :func:`dataset_names`, contiguous and uncompressed, as the
    TensorFlow-exported files; it is overwritten if it exists.
    """
    params = dict(bilm.named_parameters())
    with h5py.File(weight_file, "w") as fout:
        for dataset, name in dataset_names(bilm.options).items():
            fout.create_dataset(dataset, data=params[name].detach().cpu().numpy().astype(dtype))
