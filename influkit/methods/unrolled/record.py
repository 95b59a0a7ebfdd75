"""A record of training as it ran — what replay and the metagradient need, and nothing the user must keep in sync.

Every stage k is trained by the pure step of :class:`StageRun` on the data-weighted loss

    L_t(θ; w) = (1/|B_t|) Σ_{z∈B_t} w_z ℓ(z; θ) + R(θ) + α Σ_{s∈S} ‖θ_s − S̄_s‖²,     w = 1 in the recorded run,

(R the stage's regularizer; the proximal term only under a Case 2 :class:`influkit.Link` with α > 0, S̄ the
previous stage's final shared block), followed by the optimizer's pure update (:mod:`.optimizers`). The record
keeps, per stage: the initial trained parameters and optimizer state, each step's batch indices and learning rate,
the optimizer and its hyper-parameters, which parameters train and which are inherited from the previous stage
(Case 1: fixed at its final values; Case 2: start from them), and checkpoints (θ_t, optimizer state_t) every
``checkpoint_every`` steps plus the last. A replay repeats the same operations on the same inputs, so on one
device and thread setting it reproduces the checkpoints bit for bit (:func:`influkit.unrolled.verify` checks it).

Use :meth:`Record.train` (seeded mini-batches, a learning-rate schedule) or drive your own loop with
:meth:`Record.recorder` (``with record.recorder(stage, opt) as rec: rec.step(batch_indices, lr)``); both update the
stage's model in place, so after training it holds the recorded final parameters.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch.func import grad
from tqdm.auto import tqdm

from ..chain import Link
from ..errors import InputError, ParameterError
from ..params import shared_parameters
from ..stage import Stage
from .optimizers import SGD, Adam, Optimizer, State, Tensors


def tensor_bytes(tree) -> int:
    """Bytes of every tensor in a (nested) dict / tuple / list of tensors."""
    if torch.is_tensor(tree):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (tuple, list)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


class StageRun:
    """One recorded stage: its objective, optimizer, per-step batches and learning rates, and checkpoints.

    trained: names of the parameters the optimizer updates (θ). inherited: {this stage's name: previous stage's
    name} for the shared block; ``anchors`` holds its values at the end of the previous stage (S̄). frozen: the
    inherited names that stay fixed (Case 1; they enter the model from ``anchors``). alpha: the proximal weight
    (Case 2, else 0). checkpoints: {step: (θ_step, state_step)}, step 0 and the last included. weights: the data
    weights w of the run the checkpoints hold, shape (n,) — None for a recorded run (w = 1); a record re-run at
    other weights (:func:`influkit.unrolled.reweighted`) carries them, and replay and the reverse pass use them.
    """

    def __init__(self, stage: Stage, optimizer: Optimizer, link: Link | None, previous: "StageRun | None",
                 every: int):
        if not isinstance(stage, Stage):
            raise InputError(f"stage must be an influkit.Stage, got {type(stage).__name__}.")
        if not isinstance(optimizer, (SGD, Adam)):
            raise InputError(
                f"optimizer must be ik.unrolled.SGD, Adam or AdamW (pure update rules replay can repeat), "
                f"got {type(optimizer).__name__}."
            )
        if int(every) < 1:
            raise InputError(f"checkpoint_every must be ≥ 1, got {every!r}.")
        if (previous is None) != (link is None):
            raise InputError(
                "the first stage of a record takes no link, and every later stage needs link=ik.Link(shared, case=...) "
                "saying which block it inherits from the previous stage."
            )
        self.stage, self.optimizer, self.link, self.every = stage, optimizer, link, int(every)
        self.inherited: dict[str, str] = {}
        self.anchors: Tensors = {}
        if link is not None:
            self.inherited = shared_parameters(previous.stage.model, stage.model, link.shared)
            final = previous.final
            dead = [m for m in self.inherited.values() if m not in final]
            if dead:
                raise ParameterError(
                    f"shared parameters {dead} are neither trained in the previous stage nor inherited by it, so no "
                    "data reaches them; include them in that stage's params."
                )
            self.anchors = {n: final[m].clone() for n, m in self.inherited.items()}
        case = link.case if link is not None else 0
        order = [n for n, _ in stage.model.named_parameters()]
        chosen = set(stage.param_names) | (set(self.inherited) if case == 2 else set())
        self.trained = [n for n in order if n in chosen and not (case == 1 and n in self.inherited)]
        if not self.trained:
            raise ParameterError("this stage trains nothing besides the fixed shared block; give it params to train.")
        self.frozen = [n for n in self.inherited if n not in self.trained]
        self.alpha = link.alpha if case == 2 else 0.0
        self.batches: list[torch.Tensor] = []
        self.lrs: list[float] = []
        self.checkpoints: dict[int, tuple[Tensors, State]] = {}
        self.weights: torch.Tensor | None = None
        self.seconds = 0.0

    # ------------------------------------------------------------------------------------------ the pure step
    def objective(self, theta: Tensors, anchors: Tensors, x: torch.Tensor, y: torch.Tensor,
                  w: torch.Tensor, *, size: int | None = None, penalties: bool = True) -> torch.Tensor:
        """L_t(θ; w) on one batch (module docstring): the data-weighted mean loss + R(θ) + the proximal term.

        size: the divisor of the data term (default the batch's length; a part of a batch passes the whole one's);
        penalties: False leaves out R and the proximal term (the data term of one part of a sum over parts)."""
        params = {n: anchors[n] for n in self.frozen} | theta
        losses = self.stage.losses(params, x, y)
        value = (w * losses).sum() / (losses.shape[0] if size is None else size)
        if not penalties:
            return value
        reg = self.stage.regularization(theta)
        if reg is not None:
            value = value + reg
        if self.alpha:
            value = value + self.proximal(anchors)(theta)
        return value

    def proximal(self, anchors: Tensors | None = None):
        """The Case 2 proximal term θ ↦ α Σ_{s∈S} ‖θ_s − S̄_s‖² (S̄: ``anchors``, default the recorded ones), or None
        without one: the ``extra`` of the stage's curvature operators."""
        if not self.alpha:
            return None
        anchors, alpha = self.anchors if anchors is None else anchors, self.alpha
        return lambda theta: alpha * sum(((theta[n] - anchors[n]) ** 2).sum() for n in self.inherited)

    def batch(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indices, inputs, targets) of step t."""
        idx = self.batches[t]
        x, y = self.stage.data.take(idx)
        return idx, x, y

    def step(self, t: int, theta: Tensors, state: State, anchors: Tensors, w: torch.Tensor,
             x: torch.Tensor, y: torch.Tensor) -> tuple[Tensors, State]:
        """(θ_{t+1}, state_{t+1}) = update(θ_t, state_t, ∇_θ L_t(θ_t; w), lr_t): a pure function of its inputs."""
        grads = grad(self.objective)(theta, anchors, x, y, w)
        return self.optimizer.update(theta, state, grads, self.lrs[t], t + 1)

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


class StageRecorder:
    """Records one stage while the user's loop drives it: ``step(indices, lr)`` trains and records one step.

    The model's inherited block is set to the previous stage's final values when the recorder opens, and the
    model's trained parameters follow every step (in place), so the model always holds the current θ_t.
    """

    def __init__(self, record: "Record", run: StageRun):
        self.record, self.run = record, run
        named = dict(run.stage.model.named_parameters())
        with torch.no_grad():
            for n, value in run.anchors.items():
                named[n].copy_(value)
        self._named = named
        self.theta: Tensors = {n: named[n].detach().clone() for n in run.trained}
        self.state: State = run.optimizer.init(self.theta)
        run.checkpoints[0] = (self.theta, self.state)
        self._start = time.perf_counter()
        self._finished = False

    def step(self, indices, lr: float | None = None) -> None:
        """One optimizer step on the examples at ``indices`` (ids into the stage's data) with learning rate ``lr``
        (default: the optimizer's)."""
        if self._finished:
            raise InputError("this stage's recording is finished; open a new recorder for another stage.")
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1).cpu()
        if idx.numel() == 0:
            raise InputError("a step needs at least one example index.")
        run = self.run
        t = run.steps
        run.batches.append(idx)
        run.lrs.append(float(run.optimizer.lr if lr is None else lr))
        _, x, y = run.batch(t)
        w = torch.ones(idx.numel(), dtype=x.dtype if x.is_floating_point() else torch.get_default_dtype(),
                       device=run.stage.device)
        self.theta, self.state = run.step(t, self.theta, self.state, run.anchors, w, x, y)
        if (t + 1) % run.every == 0:
            run.checkpoints[t + 1] = (self.theta, self.state)
        with torch.no_grad():
            for n, value in self.theta.items():
                self._named[n].copy_(value)

    def finish(self) -> StageRun:
        """Close the recording (keeps the last checkpoint) and append the stage to the record."""
        if not self._finished:
            if self.run.steps == 0:
                raise InputError("no step was recorded; call step(indices) at least once.")
            self.run.checkpoints[self.run.steps] = (self.theta, self.state)
            self.run.seconds = time.perf_counter() - self._start
            self.record.runs.append(self.run)
            self._finished = True
        return self.run

    def __enter__(self) -> "StageRecorder":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.finish()


class Record:
    """A recorded training run of one or more stages (pretraining, then finetuning from its result, ...).

    ``record.runs[k]`` is stage k's :class:`StageRun`; :func:`influkit.unrolled.verify` checks that replay
    reproduces it.
    """

    def __init__(self) -> None:
        self.runs: list[StageRun] = []

    def __len__(self) -> int:
        return len(self.runs)

    def __repr__(self) -> str:
        return f"Record({self.runs})"

    def recorder(self, stage: Stage, optimizer: Optimizer, *, link: Link | None = None,
                 checkpoint_every: int = 16) -> StageRecorder:
        """A :class:`StageRecorder` for the next stage (``link`` joins it to the previous one, as in ``ik.Chain``)."""
        return StageRecorder(self, StageRun(stage, optimizer, link, self.runs[-1] if self.runs else None,
                                            checkpoint_every))

    def train(self, stage: Stage, optimizer: Optimizer, *, steps: int, batch_size: int, seed: int = 0,
              link: Link | None = None, schedule: Callable[[int], float] | None = None,
              checkpoint_every: int | None = None, progress: bool = False) -> StageRun:
        """Train and record the next stage: ``steps`` steps on seeded mini-batches, the model updated in place.

        Batches walk through seeded random permutations of the stage's data (a full batch, in order, when
        ``batch_size`` ≥ the data size: gradient descent). schedule(t) gives step t's learning rate (default the
        optimizer's lr). checkpoint_every: default ⌈√steps⌉, which makes replay's memory O(√steps) states.
        """
        if int(steps) < 1 or int(batch_size) < 1:
            raise InputError(f"steps and batch_size must be ≥ 1, got {steps!r} and {batch_size!r}.")
        every = checkpoint_every or max(1, math.ceil(math.sqrt(int(steps))))
        n = len(stage)
        gen = torch.Generator().manual_seed(seed)
        order = torch.empty(0, dtype=torch.long)
        with self.recorder(stage, optimizer, link=link, checkpoint_every=every) as rec:
            for t in tqdm(range(int(steps)), desc="train (recorded)", disable=not progress, leave=False):
                if batch_size >= n:
                    idx = torch.arange(n)
                else:
                    if order.numel() < batch_size:
                        order = torch.cat([order, torch.randperm(n, generator=gen)])
                    idx, order = order[:batch_size], order[batch_size:]
                rec.step(idx, None if schedule is None else schedule(t))
        return rec.run


def stage_weights(record: Record, weights, name: str = "weights") -> list[torch.Tensor | None]:
    """Per-stage data weights: ``weights`` is None, one tensor (stage 0's), or one entry (tensor or None) per stage;
    None leaves a stage at the weights its run carries (w = 1 for a recorded run)."""
    if weights is None:
        return [None] * len(record)
    if torch.is_tensor(weights):
        weights = [weights]
    weights = list(weights) + [None] * (len(record) - len(weights))
    if len(weights) != len(record):
        raise InputError(f"{name} has {len(weights)} entries for a record of {len(record)} stages; give at most one "
                         "entry per stage (None keeps a stage's weights).")
    for k, (w, run) in enumerate(zip(weights, record.runs)):
        if w is not None and (not torch.is_tensor(w) or w.shape != (len(run.stage),)):
            raise InputError(f"{name}[{k}] must be a tensor of shape ({len(run.stage)},), one weight per example of "
                             f"stage {k}, or None.")
    return weights
