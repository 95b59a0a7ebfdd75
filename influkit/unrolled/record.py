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

Record the user's own ``torch.optim`` loop with :meth:`Record.watch` (:mod:`.watch`: dropout, schedulers, clipping,
gradient accumulation, parameter groups), train with :meth:`Record.train` (seeded mini-batches, a learning-rate
schedule), or drive a loop through :meth:`Record.recorder` (``with record.recorder(stage, opt) as rec:
rec.step(batch_indices, lr)``); each updates the stage's model in place, so after training it holds the recorded
final parameters. What a stage trains and inherits is its :class:`influkit.links.StagePlan`, as in ``ik.Chain``.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from ..errors import InputError
from ..links import Link
from ..per_token import token_losses
from ..stage import Stage
from .optimizers import Optimizer, State, Tensors
from .run import StageRun


class StageRecorder:
    """Records one stage while the user's loop drives it: ``step(indices, lr)`` trains and records one step.

    The model's inherited block is set to the previous stage's final values when the recorder opens, and the
    model's trained parameters follow every step (in place), so the model always holds the current θ_t.
    """

    def __init__(self, record: "Record", run: StageRun):
        self.record, self.run = record, run
        named = dict(run.stage.model.named_parameters())  # the inherited block is in it (the run's plan put it)
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
        n = len(self.run.stage)
        if int(idx.min()) < 0 or int(idx.max()) >= n:
            raise InputError(f"step indices must lie in [0, {n}), the stage's {n} examples; got "
                             f"{[int(i) for i in idx if not 0 <= int(i) < n][:5]} (negative indices are refused: "
                             "an example's id is its position in the stage's data).")
        run = self.run
        t = run.steps
        run.batches.append(idx)
        run.lrs.append(float(run.optimizer.lr if lr is None else lr))
        _, x, y = run.batch(t)
        w = torch.ones(idx.numel(), dtype=x.dtype if x.is_floating_point() else next(iter(self.theta.values())).dtype,
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

    def branch(self, stages: int | None = None) -> "Record":
        """A new record holding this one's first ``stages`` recorded stages (default: all), the same runs: continue
        it with another finetune of the same pretrained run (``branch().train(...)``), this record unchanged."""
        count = len(self) if stages is None else stages
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= len(self):
            raise InputError(f"stages must be a whole number in [0, {len(self)}], got {stages!r}.")
        out = Record()
        out.runs = list(self.runs[:count])
        return out

    def recorder(self, stage: Stage, optimizer: Optimizer, *, link: Link | None = None,
                 checkpoint_every: int = 16) -> StageRecorder:
        """A :class:`StageRecorder` for the next stage (``link`` joins it to the previous one, as in ``ik.Chain``)."""
        return StageRecorder(self, StageRun(stage, optimizer, link, self.runs[-1] if self.runs else None,
                                            checkpoint_every))

    def watch(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader, loss_fn, *,
              link: Link | None = None, accumulate: int = 1, checkpoint_every: int = 16):
        """A :class:`~.watch.Watch` recording the next stage from the user's own loop: ``with record.watch(model,
        optimizer, loader, loss_fn) as run:`` around it, nothing else changed (:mod:`.watch`).

        optimizer: the loop's ``torch.optim.SGD``, ``Adam`` or ``AdamW`` (fresh; any parameter groups and
        ``lr_scheduler``); its parameters are the stage's trained ones. loader: the loop's DataLoader over a
        map-style dataset of (input, target) pairs. loss_fn(outputs, targets) → (B,) per-example losses; the loop's
        loss is ``loss_fn(model(x), y).mean()`` (``/ accumulate`` with gradient accumulation; ``+ run.penalty()``
        under a Case 2 link). link: joins the stage to the previous one, as in ``ik.Chain``; the model's inherited
        block is set to the previous stage's final values when the watch is made. Dropout may stay on: each
        forward's generator state is recorded and replayed."""
        from .watch import Watch

        return Watch(self, model, optimizer, loader, loss_fn, link=link, accumulate=accumulate,
                     checkpoint_every=checkpoint_every)

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
        if w is not None and (not torch.is_tensor(w) or w.shape not in ((len(run.stage),), token_shape(run))):
            raise InputError(f"{name}[{k}] must be a tensor of shape ({len(run.stage)},), one weight per example of "
                             f"stage {k} (or, for a language-model stage, {token_shape(run)}: one per token), or None.")
    return weights


def token_shape(run) -> tuple[int, ...] | None:
    """(n, L): the shape of per-token weights of ``run``'s stage (one per token term its loss declares,
    :mod:`influkit.per_token`), or None when its loss declares no split or its batches are kept as fed (a
    Trainer's collator pads each batch to its own length)."""
    stage = run.stage
    if getattr(stage.loss, "token_losses", None) is None or run.inputs is not None:
        return None
    x, y = stage.data.take(torch.arange(1))
    with torch.no_grad():
        return (len(stage), token_losses(stage, stage.trained(), x, y).shape[1])


def token_weights(record: Record) -> Record:
    """The record with every language-model stage's data weights spread over its tokens: w_{z,t} = w_z (n, L),
    so the reverse pass differentiates each token term (:mod:`influkit.per_token`); the same run (Σ_t ℓ_t = ℓ), its
    checkpoints shared. Stages whose loss declares no split keep per-example weights."""
    out = Record()
    for run in record.runs:
        moved = copy.copy(run)
        shape = token_shape(run)
        if shape is not None:
            w = torch.ones(len(run.stage), dtype=torch.float64) if run.weights is None else run.weights
            moved.weights = w.reshape(-1, 1).expand(shape).contiguous().to(run.stage.device) if w.dim() == 1 else w
        out.runs.append(moved)
    return out
