"""One recorded stage (:class:`StageRun`): its objective, optimizer, per-step batches, learning rates, random states
and checkpoints, with the pure step that replay repeats; and the helpers that restore a step's random state and
module modes. :mod:`.record` builds runs (``Record.train``, ``Record.recorder``), :mod:`.watch` from the user's loop.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext

import torch
from torch.func import grad

from ..errors import InputError
from ..links import Link, StagePlan
from ..per_token import token_losses
from ..stage import Stage
from .optimizers import SGD, Adam, Groups, Optimizer, State, Tensors
from .padding import PaddingRows


def tensor_bytes(tree) -> int:
    """Bytes of every tensor in a (nested) dict / tuple / list of tensors."""
    if torch.is_tensor(tree):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (tuple, list)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


@contextmanager
def replaying(rng: dict | None, modes: list[tuple[torch.nn.Module, bool]] | None):
    """Inside the block: the random-number generators at the recorded states ``rng`` ({"cpu": state, "cuda:i":
    state}) and the modules in the recorded train/eval ``modes`` ([(module, training)]); the caller's generator
    states and modes are restored after, so a replay leaves the user's randomness and modules untouched."""
    if rng is None and modes is None:
        yield
        return
    kept_rng = {device: generator_state(device) for device in (rng or {})}
    changed = [(module, module.training) for module, training in (modes or ()) if module.training != training]
    try:
        for device, value in (rng or {}).items():
            set_generator_state(device, value)
        for module, training in changed:
            module.training = not training
        yield
    finally:
        for device, value in kept_rng.items():
            set_generator_state(device, value)
        for module, training in changed:
            module.training = training


def module_modes(model: torch.nn.Module, modes: dict[str, bool]) -> list[tuple[torch.nn.Module, bool]]:
    """[(module, training)] of ``model``'s modules named in ``modes`` ({module name: training})."""
    modules = dict(model.named_modules())
    return [(modules[name], training) for name, training in modes.items()]


def generator_state(device: str) -> torch.Tensor:
    """The default generator's state on ``device`` ("cpu" or "cuda:i")."""
    return torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state(device)


def set_generator_state(device: str, state: torch.Tensor) -> None:
    """Set the default generator's state on ``device`` ("cpu" or "cuda:i")."""
    if device == "cpu":
        torch.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state, device)



def cropped(x: torch.Tensor, y: torch.Tensor, width: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of a micro-batch cut back to its own ``width`` (a Trainer pads it to its step's longest), or as fed."""
    if width is None:
        return x, y
    return x[..., :width], (y[:, :width] if y.dim() == 2 else y)

class StageRun:
    """One recorded stage: its objective, optimizer, per-step batches and learning rates, and checkpoints.

    plan: the stage's :class:`influkit.links.StagePlan` — the one place that decides what a stage trains and
    inherits, shared with :class:`influkit.Chain`: trained names (θ), inherited names {this stage's: previous
    stage's} (``inherited``), the fixed ones (``frozen``, Case 1; they enter the model from ``anchors``, the previous
    stage's final values S̄) and the proximal weight ``alpha`` (Case 2, else 0). checkpoints: {step: (θ_step,
    state_step)}, step 0 and the last included. weights: the data weights w of the run the checkpoints hold, shape
    (n,) — None for a recorded run (w = 1); a record re-run at other weights (:func:`influkit.unrolled.reweighted`)
    carries them, and replay and the reverse pass use them.

    A run recorded from the user's own loop (:meth:`Record.watch`) also keeps, per step: its micro-batches
    (``parts[t]``: their sizes, in the order their gradients were accumulated), the random-number generator states
    each one's forward started from (``rngs[t]``), the gradient clipping (``clips[t]``: (max_norm, norm_type) or
    None), and once the modules' train/eval flags (``modes``); the data term of a micro-batch is divided by
    ``accumulate`` as the loop divided it. A Trainer run (``influkit.hf.RecordCallback``) keeps each step's batch
    as its collator made it (``inputs[t]``, its micro-batches padded to the longest, ``widths[t]`` their own lengths
    where they differ) and the divisor of each micro-batch's summed loss (``divisors[t]``: its number of predicted
    tokens, or the count the Trainer passed as ``num_items_in_batch`` where the model divides by that; a pair
    (divisor, accumulation) where the Trainer then divides by its accumulation steps), and clips in the model's
    parameter order (``clip_order``). ``padding``: the
    model's embeddings with a padding row (:class:`~.padding.PaddingRows`), whose rows the reverse pass feeds as
    inputs of their own. ``autocast``: (device type, dtype) of a run trained under ``torch.autocast`` (bf16), whose
    forwards replay repeats under it; None for a run in the parameters' own dtype.
    """

    def __init__(self, stage: Stage, optimizer: Optimizer, link: Link | None, previous: "StageRun | None",
                 every: int):
        if not isinstance(stage, Stage):
            raise InputError(f"stage must be an influkit.Stage, got {type(stage).__name__}.")
        if not isinstance(optimizer, (SGD, Adam, Groups)):
            raise InputError(
                f"optimizer must be ik.unrolled.SGD, Adam or AdamW (pure update rules replay can repeat), "
                f"got {type(optimizer).__name__}; to record a torch.optim optimizer use record.watch(...)."
            )
        if int(every) < 1:
            raise InputError(f"checkpoint_every must be ≥ 1, got {every!r}.")
        if (previous is None) != (link is None):
            raise InputError(
                "the first stage of a record takes no link, and every later stage needs link=ik.Link(shared, case=...) "
                "saying which block it inherits from the previous stage."
            )
        if previous is not None and previous.steps not in previous.checkpoints:
            raise InputError("the previous stage's recording was not finished; leave its `with` block first.")
        self.stage, self.optimizer, self.link, self.every = stage, optimizer, link, int(every)
        self.plan = StagePlan(stage, link, None if previous is None else previous.plan, inherit=True)
        self.inherited = self.plan.inherited
        self.anchors: Tensors = {} if previous is None else \
            {n: previous.final[m].clone() for n, m in self.inherited.items()}
        self.trained = list(self.plan.trained)
        self.frozen = list(self.plan.fixed)
        self.alpha = link.alpha if self.plan.case == 2 else 0.0
        self.batches: list[torch.Tensor] = []
        self.lrs: list = []
        self.parts: list[list[int] | None] = []
        self.rngs: list[list | None] = []
        self.clips: list[tuple[float, float] | None] = []
        self.modes: dict[str, bool] | None = None
        self.accumulate = 1
        self.divisors: list[list[int | tuple[int, int]] | None] = []
        self.widths: list[list[int] | None] = []
        self.autocast: tuple[str, torch.dtype] | None = None
        self.clip_order: list[str] | None = None
        self.inputs: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.padding: PaddingRows | None = None
        self._mode_list: tuple | None = None  # (modes, [(module, training)]) resolved by mode_list()
        self.checkpoints: dict[int, tuple[Tensors, State]] = {}
        self.weights: torch.Tensor | None = None
        self.seconds = 0.0

    # ------------------------------------------------------------------------------------------ the pure step
    def precision(self, mixed: bool = True):
        """The recorded autocast around a forward (``mixed`` and a run recorded under autocast), else nothing."""
        if not mixed or self.autocast is None:
            return nullcontext()
        device, dtype = self.autocast
        return torch.autocast(device, dtype=dtype)

    def objective(self, theta: Tensors, anchors: Tensors, x: torch.Tensor, y: torch.Tensor,
                  w: torch.Tensor, *, size: int | tuple | None = None, penalties: bool = True,
                  mixed: bool = True) -> torch.Tensor:
        """L_t(θ; w) on one batch (module docstring): the data-weighted mean loss + R(θ) + the proximal term, divided
        by ``accumulate`` (a micro-batch of an accumulated step).

        w: (B,) per-example weights, or (B, L) per-token weights of the loss's declared token terms
        (:mod:`influkit.per_token`; the run's ``weights`` of :func:`~.record.token_weights`);
        size: the divisor of the data term (default the batch's length; a part of a batch passes the whole one's),
        or a tuple of divisors applied in turn (a Trainer's micro-batch: its loss's, then the accumulation's);
        penalties: False leaves out R and the proximal term (the data term of one part of a sum over parts);
        mixed: the forward under the recorded autocast (a mixed-precision run's own arithmetic), else in the
        parameters' dtype."""
        params = {n: anchors[n] for n in self.frozen} | theta
        with self.precision(mixed):
            # per-token weights (B, L) weight the loss's declared token terms (influkit.per_token), whose rows sum
            # to it
            losses = token_losses(self.stage, params, x, y) if w.dim() == 2 else self.stage.losses(params, x, y)
        value = (w * losses).sum()
        for divisor in (size if isinstance(size, tuple) else (losses.shape[0] if size is None else size,)):
            value = value / divisor
        if penalties:
            reg = self.stage.regularization(theta)
            if reg is not None:
                value = value + reg
            if self.alpha:
                value = value + self.plan.proximal_term(theta, anchors)
        return value / self.accumulate if self.accumulate != 1 else value

    def proximal(self, anchors: Tensors | None = None):
        """The Case 2 proximal term θ ↦ α Σ_{s∈S} ‖θ_s − S̄_s‖² (S̄: ``anchors``, default the recorded ones), or None
        without one: the ``extra`` of the stage's curvature operators."""
        if not self.alpha:
            return None
        anchors = self.anchors if anchors is None else anchors
        return lambda theta: self.plan.proximal_term(theta, anchors)

    def batch(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indices, inputs, targets) of step t: the stage's examples at its indices, or the batch as it was fed
        where the run keeps it (``inputs``: a Trainer's collator masks each batch anew)."""
        idx = self.batches[t]
        if self.inputs is not None:
            x, y = self.inputs[t]
            return idx, x.to(self.stage.device), y.to(self.stage.device)
        x, y = self.stage.data.take(idx)
        return idx, x, y

    def gradient(self, t: int, theta: Tensors, anchors: Tensors,
                 batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], *, size: int | None = None, penalties: bool = True, graph: bool = False,
                 rows: Tensors | None = None, mixed: bool = True) -> Tensors:
        """∇_θ L_t(θ; w) of step t on ``batch`` = (x, y, w): summed over its micro-batches in the recorded order, each from its
        recorded generator state and module modes (:func:`replaying`). graph: False takes ``torch.func.grad`` (a
        pure function, composable with torch.func transforms); True ``torch.autograd.grad(create_graph=True)`` from
        θ as autograd leaves (a graph to pull back through). rows: the embeddings' padding rows fed as inputs of
        their own (:class:`~.padding.PaddingRows`; the reverse pass adds their cotangents). mixed: as
        :meth:`objective`; under the recorded autocast the gradient is a value only (``torch.autograd.grad`` from
        detached copies of θ: torch.func.grad fails on scaled_dot_product_attention under autocast), the
        metagradient's graphs are taken without it."""
        x, y, w = batch
        values = mixed and self.autocast is not None and not graph
        total = None
        for part, rng, divisor, width in self.micro_batches(t, x.shape[0], size):
            xp, yp = cropped(x[part], y[part], width)
            with replaying(rng, self.mode_list()), self._feeding(rows):
                if graph or values:
                    leaves = {n: v.detach().requires_grad_() for n, v in theta.items()} if values else theta
                    with torch.enable_grad():
                        loss = self.objective(leaves, anchors, xp, yp, w[part], size=divisor, penalties=penalties,
                                              mixed=mixed)
                        g = dict(zip(theta, torch.autograd.grad(loss, list(leaves.values()), create_graph=graph)))
                else:
                    g = grad(self.objective)(theta, anchors, xp, yp, w[part], size=divisor, penalties=penalties,
                                             mixed=mixed)
            total = g if total is None else {n: total[n] + g[n] for n in total}
        return total

    def micro_batches(self, t: int, rows: int,
                      size: int | None = None) -> list[tuple[slice, dict | None, object, int | None]]:
        """[(rows of the batch, recorded generator state, divisor of its data term, width)] of step t's micro-batches,
        in the order their gradients were accumulated (one part of all ``rows`` divided by ``size`` where none were
        recorded); width: a Trainer's micro-batch padded to its step's longest is cut back to its own length (None:
        as fed)."""
        parts = self.parts[t] if t < len(self.parts) and self.parts[t] is not None else [rows]
        rngs = self.rngs[t] if t < len(self.rngs) and self.rngs[t] is not None else [None] * len(parts)
        divisors = self.divisors[t] if t < len(self.divisors) and self.divisors[t] is not None else \
            [size if len(parts) == 1 else count for count in parts]
        widths = self.widths[t] if t < len(self.widths) and self.widths[t] is not None else [None] * len(parts)
        starts = [sum(parts[:i]) for i in range(len(parts))]
        return [(slice(b, b + count), rng, divisor, width)
                for b, count, rng, divisor, width in zip(starts, parts, rngs, divisors, widths)]

    def data_scale(self, t: int) -> float:
        """Σ_j |B_j| / (d_j a_j) over step t's micro-batches: the examples per unit of divisor its data term takes
        (1 for a plain mean over the batch; a masked-LM batch's examples per predicted token)."""
        parts = self.parts[t] if t < len(self.parts) and self.parts[t] is not None else [len(self.batches[t])]
        divisors = self.divisors[t] if t < len(self.divisors) and self.divisors[t] is not None else \
            [len(self.batches[t]) if len(parts) == 1 else count for count in parts]
        return sum(count / math.prod(d if isinstance(d, tuple) else (d,)) for count, d in zip(parts, divisors)) / \
            self.accumulate

    def _feeding(self, rows: Tensors | None):
        return self.padding.feeding(rows) if self.padding is not None else nullcontext()

    def mode_list(self) -> list[tuple[torch.nn.Module, bool]] | None:
        """The recorded modes as [(module, training)] (None where none were recorded), resolved once."""
        if self.modes is None:
            return None
        if self._mode_list is None or self._mode_list[0] is not self.modes:
            self._mode_list = (self.modes, module_modes(self.stage.model, self.modes))
        return self._mode_list[1]

    def recorded_clip(self, t: int) -> tuple[float, float] | None:
        """Step t's recorded gradient clipping (max_norm, norm_type), or None."""
        return self.clips[t] if t < len(self.clips) else None

    def clipped(self, t: int, grads: Tensors) -> Tensors:
        """Step t's gradient as its recorded clipping scaled it (unchanged without one)."""
        clip = self.recorded_clip(t)
        return grads if clip is None else self.optimizer.clip(grads, *clip, order=self.clip_order)

    def clip_tangent(self, t: int, grads: Tensors, tangent: Tensors) -> Tensors:
        """Step t's recorded clipping's Jacobian at ``grads`` applied to ``tangent`` (a leading dimension allowed;
        unchanged without one)."""
        clip = self.recorded_clip(t)
        return tangent if clip is None else self.optimizer.clip_tangent(grads, tangent, *clip, order=self.clip_order)

    def update(self, t: int, theta: Tensors, state: State, grads: Tensors) -> tuple[Tensors, State]:
        """(θ_{t+1}, state_{t+1}): step t's gradient clipped as recorded, then the optimizer's update at step t's
        learning rate(s)."""
        return self.optimizer.update(theta, state, self.clipped(t, grads), self.lrs[t], t + 1)

    def update_vjp(self, t: int, theta: Tensors, state: State, grads: Tensors):
        """(θ_{t+1}, state_{t+1}, pullback) of :meth:`update` (the same operations, so the same values), with
        pullback(θ̄_{t+1}, s̄_{t+1}) = (θ̄_t, s̄_t, ḡ_t) its vector-Jacobian product in closed form (the rules'
        ``pullback``, then the clipping's ``clip_pullback``; cotangents may carry a leading dimension q)."""
        clip, clipped = self.recorded_clip(t), self.clipped(t, grads)
        new = self.optimizer.update(theta, state, clipped, self.lrs[t], t + 1)

        def pullback(theta_bar: Tensors, state_bar: State) -> tuple[Tensors, State, Tensors]:
            out_theta, out_state, clipped_bar = self.optimizer.pullback(theta, state, clipped, self.lrs[t], t + 1,
                                                                        new, (theta_bar, state_bar))
            if clip is None:
                return out_theta, out_state, clipped_bar
            return out_theta, out_state, self.optimizer.clip_pullback(grads, clipped_bar, *clip, order=self.clip_order)

        return new[0], new[1], pullback

    def step(self, t: int, theta: Tensors, state: State, anchors: Tensors, w: torch.Tensor,
             x: torch.Tensor, y: torch.Tensor) -> tuple[Tensors, State]:
        """(θ_{t+1}, state_{t+1}) = update(θ_t, state_t, ∇_θ L_t(θ_t; w), lr_t): a pure function of its inputs."""
        return self.update(t, theta, state, self.gradient(t, theta, anchors, (x, y, w)))

    # ----------------------------------------------------------------------------------------------- access
    @property
    def steps(self) -> int:
        return len(self.batches)

    @property
    def final(self) -> Tensors:
        """The stage's recorded final values of everything that data reaches: θ_T and the fixed shared block."""
        if self.steps not in self.checkpoints:
            raise InputError("this stage's recording was not finished; leave its `with` block or call finish().")
        return {n: self.anchors[n] for n in self.frozen} | self.checkpoints[self.steps][0]

    def segments(self) -> list[tuple[int, int]]:
        """The checkpointed segments [a, b) of the run, in order."""
        marks = sorted(self.checkpoints)
        return list(zip(marks[:-1], marks[1:]))

    def checkpoint_bytes(self) -> int:
        """Bytes held by the checkpoints (θ and optimizer state)."""
        return tensor_bytes(list(self.checkpoints.values()))

    def __repr__(self) -> str:
        kind = type(self.optimizer).__name__
        return (f"StageRun({kind}, {self.steps} steps, {len(self.trained)} trained tensors, "
                f"{len(self.frozen)} fixed inherited, {len(self.checkpoints)} checkpoints)")
