"""Recording the user's own ``torch.optim`` training loop, unchanged but for the ``with`` line.

    record = ik.unrolled.Record()
    with record.watch(model, optimizer, loader, loss_fn) as run:      # loss_fn(outputs, targets) -> (B,)
        for epoch in range(3):
            for x, y in loader:
                optimizer.zero_grad()
                loss_fn(model(x), y).mean().backward()
                run.clip_grad_norm_(1.0)                             # instead of torch.nn.utils.clip_grad_norm_
                optimizer.step()
                scheduler.step()

What is captured, through hooks on the user's own objects: the example indices of every batch from the loader's
batch sampler (the DataLoader is not rebuilt; indices queued as the sampler yields them and taken, in order, by
each forward pass that builds gradients), the random-number generator state each such forward starts from (CPU and
the model's CUDA devices: dropout masks are regenerated bit for bit), the modules' train/eval flags, and at every
``optimizer.step()`` the learning rate of every parameter group as the scheduler left it, the micro-batches
accumulated since the last step and the clipping asked through :meth:`Watch.clip_grad_norm_`. Checkpoints are the
run's own parameters and optimizer state. The step is the user's: torch.optim's arithmetic, which
:mod:`.optimizers` repeats kernel for kernel.

Replay computes step t's gradient as Σ_j ∇ [(1/|B_j|) Σ_{z∈B_j} w_z ℓ(z; θ_t) (+ α‖S − S̄‖², Case 2) ] / a over its
micro-batches j (a = ``accumulate``), so the loop's loss must be that: ``loss_fn(model(x), y).mean()`` (divided by
``accumulate`` when accumulating gradients; plus ``run.penalty()`` under a Case 2 link). The first step checks it:
its gradient is recomputed the replay's way and compared bit for bit with the loop's before the optimizer moves (under a
Case 2 link with α > 0 the second step's too: the proximal term's gradient is 0 at the first). The metagradient
compares every replayed segment with its checkpoint and refuses a run that replay does not reproduce.

Mixed precision: a loop under ``torch.autocast(..., dtype=torch.bfloat16)`` is recorded with its autocast, and
replay runs every forward under it, so the trajectory repeats bit for bit; the metagradient takes each step's
derivative in the parameters' dtype along it (:mod:`.metagradient`). float16 autocast is refused (its loss scaler
skips and rescales steps outside the record).

Refused before the first step (:class:`~influkit.errors.NotReplayable`, every reason in one message, each naming
the fix): another optimizer than SGD / Adam / AdamW, amsgrad, capturable or differentiable kernels, a fused SGD
(a fused Adam / AdamW is replayed by its own kernel), foreach kernels off the CPU,
an optimizer with state, a loader without a batch sampler, with its own collate_fn or over an iterable dataset,
batch-norm in train mode (its running statistics change outside the parameters), CUDA without deterministic
algorithms, a peft LoRA variant (DoRA detaches its weight norm in the forward, so the step's
derivative is not autograd's), and a shared block that the optimizer trains under a Case 1 link. During the run:
a forward pass on data that did not come from the loader, a parameter left without a gradient (torch.optim skips
it), a scheduler that changes momentum or betas, and a module switching between train and eval.
"""

from __future__ import annotations

import collections
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torch.utils.data._utils.collate import default_collate

from ..errors import InputError, NotReplayable
from ..links import Link
from ..stage import Stage
from .optimizers import from_torch, refuse, torch_refusals, torch_state
from .padding import PaddingRows
from .run import StageRun, generator_state

_NORMS = (nn.modules.batchnorm._BatchNorm,)
HYPER = ("momentum", "nesterov", "weight_decay", "dampening", "betas", "eps", "maximize")  # fixed while watched


class _Indices:
    """A batch sampler that queues each batch's indices as it yields them (the loader's own, wrapped)."""

    def __init__(self, sampler, queue: collections.deque):
        self.sampler, self.queue = sampler, queue

    def __iter__(self):
        self.queue.clear()  # a new epoch: indices prefetched by an abandoned iterator are void
        for batch in self.sampler:
            self.queue.append(torch.as_tensor(list(batch), dtype=torch.long))
            yield batch

    def __len__(self) -> int:
        return len(self.sampler)

    def __getattr__(self, name):
        return getattr(self.sampler, name)


def autocast_state() -> tuple[str, torch.dtype] | None:
    """(device type, dtype) of the autocast enabled now (CPU or CUDA), or None."""
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            return device, torch.get_autocast_dtype(device)
    return None


def precision_refusal(state: tuple[str, torch.dtype] | None) -> str | None:
    """Why a forward under autocast ``state`` is not replayed (float16: its loss scaler skips and rescales steps
    outside the record), or None."""
    if state is not None and state[1] != torch.bfloat16:
        return (f"autocast to {state[1]} on {state[0]}: only bfloat16 autocast is replayed (float16 needs a loss "
                "scaler, whose skipped and rescaled steps are not recorded); use dtype=torch.bfloat16 or no autocast.")
    return None


def check_replayable(model: nn.Module, optimizer: torch.optim.Optimizer, reasons: tuple[str, ...] = ()):
    """The optimizer's pure :class:`~.optimizers.Groups`, after refusing — every reason at once, the caller's
    ``reasons`` first — what replay cannot repeat in the model and the optimizer (module docstring)."""
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    names = {id(p): n for n, p in model.named_parameters()}
    refuse([*reasons, *model_refusals(model), *torch_refusals(optimizer, names)])
    return from_torch(optimizer, names)


def model_refusals(model: nn.Module) -> list[str]:
    """Every reason replay cannot repeat what ``model`` computes (module docstring), each naming its fix."""
    reasons = []
    norms = [n for n, m in model.named_modules() if isinstance(m, _NORMS) and m.training]
    if norms:
        reasons.append(f"batch-norm layers {norms[:3]} are in train mode: their running statistics change outside "
                       "the parameters and the optimizer; put them in eval mode (module.eval()) or use LayerNorm / "
                       "GroupNorm.")
    variants = lora_variants(model)
    if variants:
        name, kinds = next(iter(variants.items()))
        reasons.append(f"{name} runs the peft LoRA variant {kinds} (e.g. DoRA, use_dora=True), whose forward detaches "
                       "part of the weight (DoRA's column norm): replay repeats the steps, but autograd's second "
                       "derivative misses the detached part, so the metagradient would differ from re-run training; "
                       "use plain LoRA (LoraConfig(use_dora=False) and no other variant).")
    if any(p.device.type == "cuda" for p in model.parameters()) and not torch.are_deterministic_algorithms_enabled():
        reasons.append("CUDA kernels may be non-deterministic, so a replay would not repeat the run; call "
                       "torch.use_deterministic_algorithms(True) (and set CUBLAS_WORKSPACE_CONFIG=:4096:8) before "
                       "training.")
    return reasons


def lora_variants(model: nn.Module) -> dict[str, list[str]]:
    """{module name: [variant class names]} of the peft LoRA layers that run an active adapter as a variant (DoRA,
    aLoRA, ...) rather than plain LoRA: peft keeps such adapters in the layer's ``lora_variant`` dict."""
    out = {}
    for name, module in model.named_modules():
        variant = getattr(module, "lora_variant", None)
        if isinstance(variant, dict) and variant:
            active = getattr(module, "active_adapters", list(variant))
            kinds = [type(variant[a]).__name__ for a in active if a in variant]
            if kinds:
                out[name] = kinds
    return out


def eval_stage(model: nn.Module, build) -> Stage:
    """``build()`` (a :class:`Stage` of ``model``) run with the model in eval mode, its modules' modes restored after
    (a Stage checks eval mode; the watched run trains in train mode and replays in it)."""
    modes = {n: m.training for n, m in model.named_modules()}
    model.eval()
    try:
        return build()
    finally:
        for n, m in model.named_modules():
            m.training = modes[n]


class Watch:
    """Records one stage of the user's own loop (module docstring); made by :meth:`Record.watch`, used as a context
    manager. ``run`` is the :class:`StageRun` being recorded; leaving the block appends it to the record."""

    def __init__(self, record, model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader, loss_fn, *,
                 link: Link | None = None, accumulate: int = 1, checkpoint_every: int = 16):
        if not isinstance(loader, DataLoader):
            raise NotReplayable(f"loader must be the torch DataLoader the loop iterates, got {type(loader).__name__}.")
        if int(accumulate) < 1:
            raise InputError(f"accumulate must be ≥ 1, got {accumulate!r}.")
        reasons = []
        if isinstance(loader.dataset, IterableDataset) or loader.batch_sampler is None:
            reasons.append("the loader must batch a map-style dataset through its batch sampler (batch_size set, not "
                           "an IterableDataset): replay takes the examples by index.")
        if loader.collate_fn is not default_collate:
            reasons.append("the loader has its own collate_fn, which replay cannot repeat from indices; use the "
                           "default collate over a dataset of (input, target) pairs, or record a Hugging Face "
                           "Trainer with influkit.hf.RecordCallback.")
        groups = check_replayable(model, optimizer, tuple(reasons))
        dataset = loader.dataset  # a TensorDataset's own tensors: the rows default_collate stacks, taken at once
        data = dataset.tensors if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2 else dataset
        stage = eval_stage(model, lambda: Stage(model, loss_fn, data, params=[
            n for n, _ in model.named_parameters() if n in set(groups.order)]))
        self._setup(record, model, optimizer, groups, stage, loader, link=link, checkpoint_every=checkpoint_every)
        self.run.accumulate = int(accumulate)

    def _setup(self, record, model: nn.Module, optimizer: torch.optim.Optimizer, groups, stage: Stage,
               loader: DataLoader, *, link: Link | None, checkpoint_every: int) -> None:
        """The stage's :class:`StageRun` (its plan checked against what the optimizer trains) and the watch's state."""
        run = StageRun(stage, groups, link, record.runs[-1] if record.runs else None, checkpoint_every)
        run.padding = PaddingRows.of(model)
        trained = set(groups.order)
        fixed = sorted(trained & set(run.frozen))
        if fixed:
            raise NotReplayable(f"the optimizer updates {fixed[:3]}, the shared block a Case 1 link keeps fixed; "
                                "leave them out of the optimizer, or finetune them: Link.finetune(shared) (no proximal "
                                "term), or Link(..., case=2, alpha=α) with run.penalty() added to the loss.")
        missing = sorted(set(run.trained) - trained)
        if missing:
            raise NotReplayable(f"a Case 2 link finetunes the shared block {missing[:3]}, but the optimizer does not "
                                "hold it; pass those parameters to the optimizer.")
        self.model, self.optimizer, self.loader, self.groups = model, optimizer, loader, groups
        self.record, self.run = record, run
        self.devices = ["cpu"] + sorted({str(p.device) for p in model.parameters() if p.device.type == "cuda"})
        self._named = dict(model.named_parameters())
        self._queue: collections.deque = collections.deque()
        self._pending: list[tuple[torch.Tensor, dict, object]] = []
        self._clip: tuple[float, float] | None = None
        self._handles: list = []
        self._sampler = None
        self._start = 0.0
        self._open = False
        self._checking = False  # the first step's check runs the model itself
        self._hyper = [tuple(group[k] for k in HYPER if k in group) for group in optimizer.param_groups]
        self._modules = list(model.modules())
        self._modes: list[bool] | None = None
        self._examples = len(stage)

    # ------------------------------------------------------------------------------------------- the user's calls
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters, recorded for the coming step; returns
        the total norm. Gradients are scaled by min(max_norm / (‖g‖ + 10⁻⁶), 1)."""
        if self._clip is not None:
            raise InputError("clip_grad_norm_ was already called for this step; clip once per optimizer.step().")
        self._clip = (float(max_norm), float(norm_type))
        params = [self._named[n] for n in self.groups.order]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def penalty(self) -> torch.Tensor:
        """α Σ_{s∈S} ‖S_s − S̄_s‖² at the model's current parameters: add it to the loop's loss under a Case 2 link
        (the proximal term replay adds to every micro-batch's objective)."""
        if not self.run.alpha:
            raise InputError("penalty() is the proximal term of a Case 2 link with alpha > 0; this stage has none (a "
                             "plain finetuning link, Link.finetune, adds nothing to the loss).")
        return self.run.plan.proximal_term(self._named, self.run.anchors)

    # ---------------------------------------------------------------------------------------------------- hooks
    def _forward(self, module, args, kwargs) -> None:
        if self._checking or not torch.is_grad_enabled():
            return
        self._precision(autocast_state())
        if not self._queue:
            raise NotReplayable("a forward pass that builds gradients ran on data that did not come from the "
                                "watched loader (or before its iterator was created inside the `with` block); "
                                "evaluate under torch.no_grad() and iterate the loader inside the block.")
        self._pending.append((self._queue.popleft(), {d: generator_state(d) for d in self.devices},
                              self._captured(args, kwargs)))

    def _precision(self, state: tuple[str, torch.dtype] | None) -> None:
        """Record the autocast of the run's forwards (the first one's; every later one must match)."""
        run = self.run
        reason = precision_refusal(state)
        if reason is not None:
            raise NotReplayable(reason)
        if run.steps == 0 and not self._pending:
            run.autocast = state
        elif state != run.autocast:
            raise NotReplayable(f"the loop's forwards ran under autocast {run.autocast} and then {state}: replay "
                                "repeats one precision for the whole stage; keep the autocast the same throughout.")

    def _captured(self, args, kwargs):
        """What else a forward pass records (nothing here; a Trainer's batch as its collator made it)."""
        return None

    def _record_step(self, extras: list) -> None:
        """Record what the step's forwards captured besides indices and generator states (nothing here)."""

    def _before_step(self, optimizer, args, kwargs) -> None:
        run = self.run
        if not self._pending:
            raise NotReplayable("optimizer.step() without a forward pass on a batch of the watched loader.")
        unused = [n for n in self.groups.order if self._named[n].grad is None]
        if unused:
            raise NotReplayable(f"parameters {unused[:3]} have no gradient at step {run.steps + 1}: torch.optim skips "
                                "them, replay would not; leave them out of the optimizer or let the loss reach them.")
        hyper = [tuple(group[k] for k in HYPER if k in group) for group in optimizer.param_groups]
        if hyper != self._hyper:
            raise NotReplayable(f"the param groups' hyper-parameters changed during training ({hyper} vs "
                                f"{self._hyper}): only the learning rate is recorded per step; turn off momentum "
                                "cycling (OneCycleLR / CyclicLR cycle_momentum=False).")
        modes = [m.training for m in self._modules]
        if run.modes is None:
            run.modes = {n: m.training for n, m in self.model.named_modules()}
            self._modes = modes
        elif modes != self._modes:
            raise NotReplayable("a module switched between train and eval mode during the run; keep the modes fixed "
                                "while watching (evaluate outside the `with` block, or under a copy of the model).")
        t = run.steps
        idx = torch.cat([i for i, _, _ in self._pending])
        if int(idx.max()) >= self._examples:
            raise NotReplayable("the loader yielded indices beyond the dataset; replay takes examples by index.")
        run.batches.append(idx)
        run.parts.append([len(i) for i, _, _ in self._pending] if len(self._pending) > 1 else None)
        run.rngs.append([rng for _, rng, _ in self._pending])
        self._record_step([extra for _, _, extra in self._pending])
        run.clips.append(self._clip)
        run.lrs.append(tuple(float(group["lr"]) for group in optimizer.param_groups))
        self._pending, self._clip = [], None
        if t == 0 or (t == 1 and run.alpha):  # a proximal term's gradient is 0 at step 1 (S = S̄): check step 2 too
            self._check_gradient(t)

    def _after_step(self, optimizer, args, kwargs) -> None:
        run = self.run
        if run.steps % run.every == 0:
            run.checkpoints[run.steps] = self._checkpoint()

    def _checkpoint(self):
        theta = {n: self._named[n].detach().clone() for n in self.run.trained}
        state = torch_state(self.optimizer, self.groups, {id(p): n for n, p in self._named.items()})
        return theta, state

    def _check_gradient(self, t: int) -> None:
        """Step t's gradient (at the model's current θ_t) recomputed the replay's way must equal the loop's bit for
        bit."""
        run = self.run
        theta = {n: self._named[n].detach().clone() for n in run.trained}
        _, x, y = run.batch(t)
        w = torch.ones(x.shape[0], dtype=theta[run.trained[0]].dtype, device=run.stage.device)
        self._checking = True
        try:
            with torch.enable_grad():
                grads = run.gradient(t, theta, run.anchors, (x, y, w))
        finally:
            self._checking = False
        if run.clips[t] is not None:
            grads = self.groups.clip(grads, *run.clips[t], order=run.clip_order)
        gap = max(float((grads[n] - self._named[n].grad).abs().max()) for n in run.trained)
        if gap > 0 or not all(torch.equal(grads[n], self._named[n].grad) for n in run.trained):
            proximal = (" Under this Case 2 link the loop must add run.penalty() to its loss: its gradient is 0 at "
                        "step 1, where the block still equals the previous stage's values, so a loop without it "
                        "first differs at step 2. For finetuning without a proximal term use "
                        "Link.finetune(shared).") if run.alpha else ""
            raise NotReplayable(
                f"the loop's gradient at step {t + 1} differs from replay's by up to {gap:.3g}: replay computes "
                "Σ_j ∇[loss_fn(model(x_j), y_j).mean()" + (" + run.penalty()" if run.alpha else "") +
                "]" + (f" / {run.accumulate}" if run.accumulate != 1 else "") + " over the step's micro-batches. "
                "Make the loop's loss exactly that (divide by `accumulate` when accumulating; clip only through "
                "run.clip_grad_norm_; no other terms), or pass the loss_fn the loop uses per example." + proximal)

    # ---------------------------------------------------------------------------------------------- the block
    def __enter__(self) -> "Watch":
        if self._open:
            raise InputError("this watch is already open.")
        run = self.run
        theta = {n: self._named[n].detach().clone() for n in run.trained}
        run.checkpoints[0] = (theta, self.groups.init(theta))
        self._sampler = self.loader.batch_sampler
        object.__setattr__(self.loader, "batch_sampler", _Indices(self._sampler, self._queue))
        self._handles = [self.model.register_forward_pre_hook(self._forward, with_kwargs=True),
                         self.optimizer.register_step_pre_hook(self._before_step),
                         self.optimizer.register_step_post_hook(self._after_step)]
        self._start, self._open = time.perf_counter(), True
        return self

    def __exit__(self, kind, value, traceback) -> None:
        for handle in self._handles:
            handle.remove()
        object.__setattr__(self.loader, "batch_sampler", self._sampler)
        self._open = False
        if kind is not None:
            return
        run = self.run
        if run.steps == 0:
            raise InputError("no optimizer.step() ran inside the `with` block; nothing was recorded.")
        run.checkpoints[run.steps] = self._checkpoint()
        run.seconds = time.perf_counter() - self._start
        self.record.runs.append(run)
