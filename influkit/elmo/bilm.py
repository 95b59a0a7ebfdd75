"""The ELMo biLM in plain PyTorch: character CNN, 2-layer bidirectional LSTM with projection, scalar mix.

Parameters are stored in the layout of the TensorFlow weight files (``x @ W`` matrices, TF gate order
i, j, f, o, forget bias added at run time), so loading and saving a weight file copies arrays unchanged.

Token representation (char CNN), per token with character ids c_1..c_50 (0 = no character):

    e_k = E[c_k - 1]  (zero for c_k = 0)                      char embedding, E = ``char_embed``
    f_w = act(max_t (conv_w(e)_t + b_w))                      one conv per filter width w, max over time
    x   = [f_1; …; f_W];  x ← t ⊙ relu(x W_T + b_T) + (1 − t) ⊙ x,  t = σ(x W_C + b_C)   highway layers
    r   = x W_proj + b_proj                                   projection to ``projection_dim``

Each LSTM layer and direction (TF ``LSTMCell`` with ``num_proj``, allennlp ``LstmCellWithProjection``):

    [i, j, f, o] = [x_t; h_{t−1}] W + B
    c_t = clip(σ(f + 1) ⊙ c_{t−1} + σ(i) ⊙ tanh(j), ±cell_clip)
    h_t = clip((σ(o) ⊙ tanh(c_t)) W_P, ±proj_clip)

Layer l > 0 adds its input to its output (skip connection). The forward direction reads the sentence
left to right, the backward direction right to left, each starting from its own initial state; padded
positions neither change the state nor produce output (outputs there are zero), so every row of a batch
is computed independently of the others.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError
from .characters import BOS_CHAR_IDS, EOS_CHAR_IDS, MAX_CHARS, NUM_CHAR_IDS

_ACTIVATIONS = {"relu": torch.relu, "tanh": torch.tanh}


@dataclass(frozen=True)
class ElmoOptions:
    """Architecture of an ELMo biLM, as in the ``options.json`` shipped with ELMo weight files.

    ``n_characters`` is only carried through to the written options: as in allennlp, the character table
    always has 261 rows (ids 1 … 261), whatever the options say.
    """

    char_embed_dim: int
    filters: tuple[tuple[int, int], ...]
    n_highway: int
    projection_dim: int
    cell_dim: int
    n_layers: int = 2
    cell_clip: float | None = None
    proj_clip: float | None = None
    use_skip_connections: bool = True
    activation: str = "relu"
    n_characters: int = 262
    max_characters_per_token: int = MAX_CHARS

    def __post_init__(self) -> None:
        if self.activation not in _ACTIVATIONS:
            raise InputError(
                f"char_cnn activation {self.activation!r} is not supported; use one of {sorted(_ACTIVATIONS)}."
            )
        if self.max_characters_per_token != MAX_CHARS:
            raise InputError(
                f"max_characters_per_token={self.max_characters_per_token}, but ELMo character ids always "
                f"have {MAX_CHARS} characters per token; set it to {MAX_CHARS} in the options."
            )
        if not self.filters or any(len(f) != 2 or f[0] < 1 or f[1] < 1 for f in self.filters):
            raise InputError(f"char_cnn filters must be a non-empty list of [width, count] pairs, got {self.filters}.")

    @property
    def n_filters(self) -> int:
        """Total number of CNN filters, the width of the highway layers."""
        return sum(count for _, count in self.filters)

    @classmethod
    def from_dict(cls, options: Mapping) -> ElmoOptions:
        """Options parsed from the nested ``{"lstm": …, "char_cnn": …}`` dict of an ``options.json``."""
        try:
            lstm, cnn = options["lstm"], options["char_cnn"]
            return cls(
                char_embed_dim=int(cnn["embedding"]["dim"]),
                filters=tuple((int(w), int(n)) for w, n in cnn["filters"]),
                n_highway=int(cnn["n_highway"]),
                projection_dim=int(lstm["projection_dim"]),
                cell_dim=int(lstm["dim"]),
                n_layers=int(lstm["n_layers"]),
                cell_clip=lstm.get("cell_clip"),
                proj_clip=lstm.get("proj_clip"),
                use_skip_connections=bool(lstm.get("use_skip_connections", False)),
                activation=cnn.get("activation", "relu"),
                n_characters=int(cnn.get("n_characters", 262)),
                max_characters_per_token=int(cnn.get("max_characters_per_token", MAX_CHARS)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(
                f"ELMo options are missing or malformed ({exc!r}); they need lstm.{{dim, projection_dim, "
                "n_layers}} and char_cnn.{embedding.dim, filters, n_highway} as in allennlp's options.json."
            ) from exc

    def to_dict(self) -> dict:
        """The nested ``options.json`` dict of these options (inverse of :meth:`from_dict`)."""
        return {
            "lstm": {
                "cell_clip": self.cell_clip,
                "use_skip_connections": self.use_skip_connections,
                "n_layers": self.n_layers,
                "proj_clip": self.proj_clip,
                "projection_dim": self.projection_dim,
                "dim": self.cell_dim,
            },
            "char_cnn": {
                "embedding": {"dim": self.char_embed_dim},
                "filters": [list(f) for f in self.filters],
                "n_highway": self.n_highway,
                "n_characters": self.n_characters,
                "max_characters_per_token": self.max_characters_per_token,
                "activation": self.activation,
            },
        }


def _uniform(shape: Sequence[int], fan_in: int, factory: dict) -> nn.Parameter:
    bound = 1.0 / math.sqrt(fan_in)
    return nn.Parameter(torch.empty(*shape, **factory).uniform_(-bound, bound))


class Highway(nn.Module):
    """One highway layer: t ⊙ relu(x W_transform + b_transform) + (1 − t) ⊙ x with t = σ(x W_carry + b_carry)."""

    def __init__(self, dim: int, factory: dict):
        super().__init__()
        self.W_transform = _uniform((dim, dim), dim, factory)
        self.b_transform = _uniform((dim,), dim, factory)
        self.W_carry = _uniform((dim, dim), dim, factory)
        self.b_carry = _uniform((dim,), dim, factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, dim) highway output for (N, dim) input."""
        gate = torch.sigmoid(x @ self.W_carry + self.b_carry)
        return gate * torch.relu(x @ self.W_transform + self.b_transform) + (1.0 - gate) * x


class CharCNN(nn.Module):
    """Context-independent token vectors from character ids (ELMo layer 0), shape (..., projection_dim)."""

    def __init__(self, options: ElmoOptions, factory: dict):
        super().__init__()
        self.activation = _ACTIVATIONS[options.activation]
        dim = options.char_embed_dim
        self.char_embed = nn.Parameter(torch.empty(NUM_CHAR_IDS - 1, dim, **factory).uniform_(-1.0, 1.0))
        self.conv_weights = nn.ParameterList(
            [_uniform((1, width, dim, count), width * dim, factory) for width, count in options.filters]
        )
        self.conv_biases = nn.ParameterList(
            [_uniform((count,), width * dim, factory) for width, count in options.filters]
        )
        self.highways = nn.ModuleList([Highway(options.n_filters, factory) for _ in range(options.n_highway)])
        self.W_proj = _uniform((options.n_filters, options.projection_dim), options.n_filters, factory)
        self.b_proj = _uniform((options.projection_dim,), options.n_filters, factory)

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        """(..., projection_dim) token vectors for (..., 50) character ids (+1-shifted, 0 = no character).

        Id 0 embeds to the zero vector; id k ≥ 1 to row k − 1 of ``char_embed``. Each filter bank is a
        valid cross-correlation over the 50 characters, max-pooled over positions, then ``activation``.
        """
        lead = char_ids.shape[:-1]
        table = F.pad(self.char_embed, (0, 0, 1, 0))
        chars = F.embedding(char_ids.reshape(-1, char_ids.shape[-1]), table).transpose(1, 2)
        pooled = [
            self.activation(F.conv1d(chars, w[0].permute(2, 1, 0), b).amax(dim=-1))
            for w, b in zip(self.conv_weights, self.conv_biases)
        ]
        x = torch.cat(pooled, dim=-1)
        for highway in self.highways:
            x = highway(x)
        return (x @ self.W_proj + self.b_proj).reshape(*lead, -1)


class LstmState(NamedTuple):
    """Recurrent state: ``h`` (n_layers, 2, B, projection_dim) and ``c`` (n_layers, 2, B, cell_dim); axis 1 is
    the direction (0 forward, 1 backward)."""

    h: torch.Tensor
    c: torch.Tensor


class ProjectedLstmCell(nn.Module):
    """One direction of one layer: an LSTM with clipped memory and a clipped projection of its output."""

    def __init__(self, input_dim: int, options: ElmoOptions, factory: dict):
        super().__init__()
        self.input_dim = input_dim
        self.cell_clip = options.cell_clip
        self.proj_clip = options.proj_clip
        fan_in = input_dim + options.projection_dim
        self.W = _uniform((fan_in, 4 * options.cell_dim), fan_in, factory)
        self.B = _uniform((4 * options.cell_dim,), fan_in, factory)
        self.W_P = _uniform((options.cell_dim, options.projection_dim), options.cell_dim, factory)

    def forward(
        self, inputs: torch.Tensor, mask: torch.Tensor, h: torch.Tensor, c: torch.Tensor, reverse: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(outputs (B, T, proj), final h (B, proj), final c (B, cell)) of one pass over (B, T, in) inputs.

        Position t of row b updates the state only where ``mask[b, t]``; ``reverse`` runs t = T−1 … 0.
        Outputs at masked positions are zero.
        """
        projected_inputs = inputs @ self.W[: self.input_dim] + self.B
        recurrent = self.W[self.input_dim :]
        steps = range(inputs.shape[1] - 1, -1, -1) if reverse else range(inputs.shape[1])
        outputs: list[torch.Tensor | None] = [None] * inputs.shape[1]
        for t in steps:
            i, j, f, o = (projected_inputs[:, t] + h @ recurrent).chunk(4, dim=-1)
            new_c = torch.sigmoid(f + 1.0) * c + torch.sigmoid(i) * torch.tanh(j)
            if self.cell_clip:
                new_c = new_c.clamp(-self.cell_clip, self.cell_clip)
            new_h = (torch.sigmoid(o) * torch.tanh(new_c)) @ self.W_P
            if self.proj_clip:
                new_h = new_h.clamp(-self.proj_clip, self.proj_clip)
            valid = mask[:, t].unsqueeze(-1)
            c = torch.where(valid, new_c, c)
            h = torch.where(valid, new_h, h)
            outputs[t] = torch.where(valid, new_h, torch.zeros_like(new_h))
        return torch.stack(outputs, dim=1), h, c


class ElmoLstm(nn.Module):
    """Stacked bidirectional LSTM of ELMo: independent forward and backward stacks with skip connections."""

    def __init__(self, options: ElmoOptions, factory: dict):
        super().__init__()
        self.options = options
        self.forward_layers = nn.ModuleList(
            [ProjectedLstmCell(options.projection_dim, options, factory) for _ in range(options.n_layers)]
        )
        self.backward_layers = nn.ModuleList(
            [ProjectedLstmCell(options.projection_dim, options, factory) for _ in range(options.n_layers)]
        )

    def zero_state(self, batch_size: int, like: torch.Tensor) -> LstmState:
        """All-zero :class:`LstmState` for ``batch_size`` rows, on the device and dtype of ``like``."""
        o = self.options
        return LstmState(
            like.new_zeros(o.n_layers, 2, batch_size, o.projection_dim),
            like.new_zeros(o.n_layers, 2, batch_size, o.cell_dim),
        )

    def forward(
        self, inputs: torch.Tensor, mask: torch.Tensor, state: LstmState | None = None
    ) -> tuple[torch.Tensor, LstmState]:
        """(n_layers, B, T, 2·proj) layer outputs [forward; backward] and the final :class:`LstmState`.

        ``inputs`` (B, T, proj) token vectors, ``mask`` (B, T) bool; ``state`` defaults to zeros.
        """
        if state is None:
            state = self.zero_state(inputs.shape[0], inputs)
        layer_outputs, final_h, final_c = [], [], []
        fwd_in = bwd_in = inputs
        for layer, (fwd_cell, bwd_cell) in enumerate(zip(self.forward_layers, self.backward_layers)):
            fwd_out, fh, fc = fwd_cell(fwd_in, mask, state.h[layer, 0], state.c[layer, 0], reverse=False)
            bwd_out, bh, bc = bwd_cell(bwd_in, mask, state.h[layer, 1], state.c[layer, 1], reverse=True)
            if layer > 0 and self.options.use_skip_connections:
                fwd_out, bwd_out = fwd_out + fwd_in, bwd_out + bwd_in
            layer_outputs.append(torch.cat([fwd_out, bwd_out], dim=-1))
            final_h.append(torch.stack([fh, bh]))
            final_c.append(torch.stack([fc, bc]))
            fwd_in, bwd_in = fwd_out, bwd_out
        return torch.stack(layer_outputs), LstmState(torch.stack(final_h), torch.stack(final_c))


class BiLMOutput(NamedTuple):
    """``activations`` (n_layers + 1, B, T + 2, 2·proj) — layer 0 is the char-CNN vector duplicated — and
    ``mask`` (B, T + 2) bool; position 0 is ``<S>`` and position len + 1 is ``</S>`` of each row."""

    activations: torch.Tensor
    mask: torch.Tensor


def add_sentence_boundaries(char_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T + 2, 50) character ids with ``<S>`` before and ``</S>`` after each sentence, and their (B, T + 2) mask.

    A token is present where any of its character ids is non-zero; sentences are left-aligned, so a row
    with n tokens becomes [<S>, w_1, …, w_n, </S>, 0, …] (an empty row becomes [<S>, </S>, 0, …]).
    """
    lengths = (char_ids > 0).any(dim=-1).sum(dim=-1, keepdim=True)
    positions = torch.arange(char_ids.shape[1] + 2, device=char_ids.device)
    bos = torch.tensor(BOS_CHAR_IDS, dtype=char_ids.dtype, device=char_ids.device)
    eos = torch.tensor(EOS_CHAR_IDS, dtype=char_ids.dtype, device=char_ids.device)
    ids = F.pad(char_ids, (0, 0, 1, 1))
    ids = torch.where((positions == 0).unsqueeze(-1), bos, ids)
    ids = torch.where((positions == lengths + 1).unsqueeze(-1), eos, ids)
    return ids, positions < lengths + 2


def remove_sentence_boundaries(tensor: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, ...) ``tensor`` without its ``<S>``/``</S>`` positions (zero at padding) and the (B, T) token mask.

    Inverse of :func:`add_sentence_boundaries` on a (B, T + 2, ...) tensor with (B, T + 2) mask.
    """
    token_mask = mask[:, 2:]
    shape = token_mask.shape + (1,) * (tensor.dim() - 2)
    return tensor[:, 1:-1] * token_mask.reshape(shape).to(tensor.dtype), token_mask


class ElmoBiLM(nn.Module):
    """The ELMo bidirectional language model: :class:`CharCNN` then :class:`ElmoLstm`.

    ``forward(char_ids)`` takes (B, T, 50) character ids without sentence markers (see
    :func:`~influkit.elmo.characters.batch_to_char_ids`), adds ``<S>``/``</S>`` and returns a
    :class:`BiLMOutput`. Parameters are randomly initialised; load pretrained ones with
    :func:`~influkit.elmo.weights.load_elmo`.

    By default every call starts from the zero state, so outputs are a pure function of the inputs (what
    influence functions need). ``stateful=True`` reproduces allennlp's ``ElmoLstm``: the final state of
    batch row b is kept and used as the initial state of row b in the next call; a larger batch appends
    zero states for the new rows, a smaller batch leaves the states of the rows beyond it untouched.
    ``reset_states()`` forgets them.
    """

    def __init__(
        self,
        options: ElmoOptions,
        *,
        stateful: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.options = options
        self.stateful = stateful
        self.char_cnn = CharCNN(options, factory)
        self.lstm = ElmoLstm(options, factory)
        self._states: LstmState | None = None

    @property
    def output_dim(self) -> int:
        """Width 2·projection_dim of every ELMo layer."""
        return 2 * self.options.projection_dim

    @property
    def num_layers(self) -> int:
        """Number of ELMo layers, the char-CNN layer included (n_layers + 1)."""
        return self.options.n_layers + 1

    def reset_states(self) -> None:
        """Forget the states carried between calls in ``stateful`` mode."""
        self._states = None

    def _check(self, char_ids: torch.Tensor) -> None:
        if not torch.is_tensor(char_ids) or char_ids.is_floating_point() or char_ids.dtype == torch.bool:
            raise InputError(
                "character ids must be an integer tensor (B, T, 50); build them with batch_to_char_ids."
            )
        if char_ids.dim() != 3 or char_ids.shape[-1] != MAX_CHARS:
            raise InputError(
                f"character ids must have shape (batch, tokens, {MAX_CHARS}), got {tuple(char_ids.shape)}; "
                "build them with batch_to_char_ids."
            )

    def _initial_state(self, batch_size: int, like: torch.Tensor) -> LstmState | None:
        if not self.stateful or self._states is None:
            return None
        h, c = (s.to(device=like.device, dtype=like.dtype) for s in self._states)
        missing = batch_size - h.shape[2]
        if missing > 0:
            zeros = self.lstm.zero_state(missing, like)
            h, c = torch.cat([h, zeros.h], dim=2), torch.cat([c, zeros.c], dim=2)
        self._states = LstmState(h, c)
        return LstmState(h[:, :, :batch_size], c[:, :, :batch_size])

    def _keep_states(self, final: LstmState) -> None:
        h, c = final.h.detach(), final.c.detach()
        if self._states is not None and self._states.h.shape[2] > h.shape[2]:
            rows = h.shape[2]
            h = torch.cat([h, self._states.h[:, :, rows:]], dim=2)
            c = torch.cat([c, self._states.c[:, :, rows:]], dim=2)
        self._states = LstmState(h, c)

    def token_embeddings(self, char_ids: torch.Tensor) -> torch.Tensor:
        """(..., projection_dim) char-CNN vectors of (..., 50) character ids, without adding sentence markers."""
        return self.char_cnn(char_ids)

    def forward(self, char_ids: torch.Tensor) -> BiLMOutput:
        """:class:`BiLMOutput` of the sentences in ``char_ids`` (B, T, 50), markers added at both ends."""
        self._check(char_ids)
        ids, mask = add_sentence_boundaries(char_ids)
        tokens = self.char_cnn(ids) * mask.unsqueeze(-1).to(self.char_cnn.W_proj.dtype)
        state = self._initial_state(ids.shape[0], tokens)
        lstm_out, final = self.lstm(tokens, mask, state)
        if self.stateful:
            self._keep_states(final)
        activations = torch.cat([torch.cat([tokens, tokens], dim=-1).unsqueeze(0), lstm_out], dim=0)
        return BiLMOutput(activations, mask)


class ScalarMix(nn.Module):
    """Learned layer average γ · Σ_k softmax(w)_k · layer_k (allennlp ``ScalarMix`` without layer norm)."""

    def __init__(
        self,
        num_layers: int,
        initial_weights: Sequence[float] | None = None,
        gamma: float = 1.0,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        weights = [0.0] * num_layers if initial_weights is None else list(initial_weights)
        if len(weights) != num_layers:
            raise InputError(f"{len(weights)} initial weights given for {num_layers} layers; give one per layer.")
        factory = {"device": device, "dtype": dtype or torch.get_default_dtype()}
        self.weights = nn.Parameter(torch.tensor(weights, **factory))
        self.gamma = nn.Parameter(torch.tensor(float(gamma), **factory))

    def forward(self, layers: torch.Tensor) -> torch.Tensor:
        """(...) mixture of the (num_layers, ...) stacked ``layers``."""
        if layers.shape[0] != self.weights.shape[0]:
            raise InputError(
                f"ScalarMix has {self.weights.shape[0]} weights but got {layers.shape[0]} layers; "
                "build it with num_layers=bilm.num_layers."
            )
        normed = torch.softmax(self.weights, dim=0).reshape((-1,) + (1,) * (layers.dim() - 1))
        return self.gamma * (normed.to(layers.dtype) * layers).sum(dim=0)


class ElmoSentenceEncoder(nn.Module):
    """Frozen sentence vectors: the mean over a sentence's tokens of the scalar-mixed ELMo layers, (B, 2·proj).

    Sentence markers and padding are excluded from the mean; an empty sentence gives the zero vector.
    All parameters have ``requires_grad=False``, so a classifier head put on top is the only trained part.
    """

    def __init__(self, bilm: ElmoBiLM, mix: ScalarMix | None = None):
        super().__init__()
        if bilm.stateful:
            raise InputError("the sentence encoder needs a stateless biLM; build it with stateful=False.")
        ref = bilm.char_cnn.W_proj
        self.bilm = bilm
        self.mix = mix if mix is not None else ScalarMix(bilm.num_layers, device=ref.device, dtype=ref.dtype)
        self.requires_grad_(False)

    @property
    def output_dim(self) -> int:
        """Width 2·projection_dim of the sentence vectors."""
        return self.bilm.output_dim

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        """(B, 2·proj) mean of the mixed ELMo layers over the tokens of each sentence in ``char_ids``."""
        out = self.bilm(char_ids)
        mixed, token_mask = remove_sentence_boundaries(self.mix(out.activations), out.mask)
        counts = token_mask.sum(dim=1, keepdim=True).clamp(min=1).to(mixed.dtype)
        return mixed.sum(dim=1) / counts
