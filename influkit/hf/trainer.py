"""Recording a Hugging Face ``Trainer`` run for exact replay: one callback, the Trainer otherwise as it is.

    record = ik.unrolled.Record()
    trainer = Trainer(model, args, train_dataset=data, data_collator=DataCollatorForLanguageModeling(tokenizer),
                      callbacks=[hf.RecordCallback(record)])                     # the one added argument
    trainer.train()
    scores = ik.unrolled.metagradients(record, test)[0]

What is captured (from ``on_train_begin``, through hooks on the Trainer's own objects): the example indices of
every batch from the train DataLoader's batch sampler, each batch as the model received it — ``input_ids`` after the
collator's random masking, ``attention_mask``, ``token_type_ids``, ``labels`` — and the random-number generator state
its forward pass started from (dropout), the learning rate of every parameter group at each optimizer step (the
Trainer's scheduler: warmup and decay), and the Trainer's clipping by ``max_grad_norm`` (over the model's parameters
in their order). Replay calls the model as the Trainer does and takes the loss the model takes: a masked-LM batch's
mean cross-entropy over its predicted tokens (z's term: the sum over z's tokens / the batch's number of predicted
tokens), a classification batch's mean cross-entropy. The first step checks it: its gradient recomputed the
replay's way must equal the Trainer's bit for bit, else the run is refused before the optimizer moves.

A collator's random replacement may feed the padding token at an attended position; the embedding gives that row no
gradient there while a tied decoder (or weight decay) moves it, and the reverse pass differentiates through the fed
row as an input of its own (:mod:`influkit.unrolled.padding`), so the metagradient stays exact.

The stage's own data (``record.runs[k].stage``) holds the training examples as the dataset gives them, padded to one
length (masked-LM: every token a target), for influkit's other tools; the replay uses the batches as they were fed.

Transformers' defaults are recorded as they are: the fused AdamW (``optim="adamw_torch_fused"``, replayed by the
same fused kernel), sdpa attention (its composite MATH backend forced around every forward of the recorded run and
of replay, so the run repeats bit for bit and is differentiable twice; it rounds otherwise than the default kernel,
so the recorded run agrees with an unrecorded one to rounding, not bit for bit), ``gradient_accumulation_steps`` > 1
(each micro-batch's collated batch, generator state and loss divisors — its model's loss divisor, read from the
model's loss, and the Trainer's accumulation divisor, read from the gradient its backward sends into that loss).
Links: Case 1 (the shared block frozen, ``requires_grad_(False)``), plain finetuning of every weight
(``link=ik.Link.finetune(shared)``: the stage starts from the previous stage's values) and LoRA (peft adapters on a
frozen base, ``link=hf.lora_link(pretrained, peft_model, shared=...)``; plain LoRA, a variant such as DoRA refused).
Mixed precision ``bf16=True`` (accelerate's autocast inside the model's forward): the run is recorded with its
autocast and replayed under it bit for bit; the metagradient is the float32 derivative along that trajectory
(:mod:`influkit.unrolled.metagradient`), replay calling the model's own forward where accelerate wrapped it.

Refused before the first step, every reason in one :class:`~influkit.errors.NotReplayable`: ``fp16`` (its
GradScaler's loss scale and skipped steps are not recorded), more than one process, label smoothing, a Case 2 link with α > 0 (the Trainer adds no proximal term), an attention
implementation other than ``"eager"`` or ``"sdpa"``, an iterable train dataset, and what
:func:`~influkit.unrolled.watch.check_replayable` refuses in the model and optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import TrainerCallback

from ..errors import InputError, NotReplayable
from ..links import Link
from ..stage import Stage
from ..unrolled.watch import Watch, check_replayable, eval_stage
from .batches import FIELDS, pack
from .masking import IGNORE
from .model import HFModel


def trainer_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B,) per-example summed cross-entropies: over z's predicted tokens for token labels (B, L) (−100: none), of its
    class for labels (B,). A batch's mean loss is their sum over its number of predicted tokens (its rows for
    classification), the loss a transformers model returns."""
    if labels.dim() == 2:
        tokens = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE,
                                 reduction="none")
        return tokens.reshape(labels.shape).sum(1)
    return F.cross_entropy(logits, labels, reduction="none")


def predicted(labels: torch.Tensor) -> int:
    """The number of predicted tokens of a batch's labels (its rows for class labels): the divisor of its mean loss."""
    return int((labels != IGNORE).sum()) if labels.dim() == 2 else labels.shape[0]


class TrainerModel(HFModel):
    """The transformers model called on packed inputs exactly as the Trainer calls it (the token fields as keyword
    arguments, the model's own attention implementation, sdpa on its composite MATH backend as the recording forced
    it); returns its logits.

    Inside ``torch.func.vmap`` (per-example gradients, factored fits) the model's own 2-D → 4-D mask conversion
    cannot run (it branches on ``mask.all()``), so there the ready 4-D mask of :class:`HFModel` is passed instead,
    causal when the model's attention modules are (``is_causal``): the same logits, not the recorded bits, which
    only replay needs."""

    def __init__(self, model: nn.Module, fields):
        super().__init__(model, fields, causal=any(getattr(m, "is_causal", False) for m in model.modules()))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        with own_forward(self.hf_model):
            if under_vmap(inputs):
                return super().forward(inputs)
            with sdpa_kernel([SDPBackend.MATH]):
                return self.hf_model(**{f: inputs[:, c] for c, f in enumerate(self.fields)}).logits


def under_vmap(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is batched by an enclosing ``torch.func.vmap`` (under any other transforms' wrappers)."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(tensor):
        if functorch.is_batchedtensor(tensor):
            return True
        tensor = functorch.get_unwrapped(tensor)
    return False


@contextmanager
def own_forward(model: nn.Module):
    """The model's own forward for the block, where a mixed-precision Trainer left accelerate's autocast wrapper on
    it (``model._original_forward``): replay sets the run's precision itself, and the float32 derivative along a
    bf16 run needs the forward without autocast."""
    original = model.__dict__.get("_original_forward")
    wrapped = model.__dict__.get("forward")
    if original is None or wrapped is None:
        yield
        return
    model.forward = original
    try:
        yield
    finally:
        model.forward = wrapped


ATTENTION = ("eager", "sdpa")  # attention implementations a recorded run replays (sdpa on its MATH backend)


def dataset_tensors(dataset, fields: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed inputs, targets) of every example of a Trainer's dataset of token dicts, padded to the longest (0,
    attention 0, label −100): targets are the examples' ``labels``, or their tokens (masked-LM data carries none)."""
    items = [dataset[i] for i in range(len(dataset))]
    if not items or not isinstance(items[0], Mapping) or "input_ids" not in items[0]:
        raise InputError("the Trainer's train_dataset must give dicts with 'input_ids' (a tokenizer's output).")
    length = max(len(item["input_ids"]) for item in items)

    def padded(key, fill):
        rows = [torch.as_tensor(item[key]).reshape(-1) for item in items]
        return torch.stack([F.pad(r, (0, length - len(r)), value=fill) for r in rows])

    batch = {f: padded(f, 0) for f in fields if f in items[0] or f == "input_ids"}
    if "labels" in items[0] and torch.as_tensor(items[0]["labels"]).dim() == 0:
        labels = torch.stack([torch.as_tensor(item["labels"]) for item in items])
    elif "labels" in items[0]:
        labels = padded("labels", IGNORE)
    else:
        mask = padded("attention_mask", 0) if "attention_mask" in items[0] else torch.ones_like(batch["input_ids"])
        labels = batch["input_ids"].masked_fill(mask == 0, IGNORE)
    return pack(batch, [f for f in FIELDS if f in batch], labels)


class _TrainerWatch(Watch):
    """A :class:`~influkit.unrolled.watch.Watch` of one ``Trainer.train()``: the batches come from the model's
    keyword arguments, the clipping from the Trainer's ``max_grad_norm``, each micro-batch's loss divisors from the
    model's loss and from the gradient the Trainer sends into it."""

    def __init__(self, record, args, model: nn.Module, optimizer, loader, *, link: Link | None, checkpoint_every: int):
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        loader = getattr(loader, "base_dataloader", loader)  # accelerate's DataLoaderShard iterates this one
        groups = check_replayable(model, optimizer, tuple(trainer_refusals(args, model, loader, link)))
        fields = tuple(f for f in FIELDS if f in loader.dataset[0] or f == "input_ids")
        data = dataset_tensors(loader.dataset, fields)
        trained = set(groups.order)
        stage = eval_stage(model, lambda: Stage(TrainerModel(model, fields), trainer_losses, data, params=[
            n for n, _ in model.named_parameters() if n in trained]))
        self.fields, self.max_grad_norm = fields, args.max_grad_norm
        self.mixed = (args.device.type, torch.bfloat16) if args.bf16 else None  # accelerate's autocast
        self._setup(record, model, optimizer, groups, stage, loader, link=link, checkpoint_every=checkpoint_every)
        self.run.inputs = []
        self.run.widths = []
        self.run.clip_order = [n for n, p in model.named_parameters() if n in trained]
        self._math = None  # the MATH backend forced around each forward of the Trainer (sdpa, module docstring)
        self.__enter__()
        self._handles += [model.register_forward_pre_hook(self._enter_math),
                          model.register_forward_hook(self._loss_of, with_kwargs=True, always_call=True)]

    def _forward(self, module, args, kwargs) -> None:
        with self._closing_on_error():
            super()._forward(module, args, kwargs)

    def _precision(self, state) -> None:
        """The run's autocast: a bf16 Trainer's (accelerate enters it inside the model's forward, after this hook)."""
        super()._precision(state or self.mixed)

    def _before_step(self, optimizer, args, kwargs) -> None:
        with self._closing_on_error():
            super()._before_step(optimizer, args, kwargs)

    @contextmanager
    def _closing_on_error(self):
        """An error inside the Trainer's loop removes the hooks (no ``with`` block closes them; on_train_end does not
        come)."""
        try:
            yield
        except BaseException as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise

    def _enter_math(self, module, args) -> None:
        if self._math is None:
            self._math = sdpa_kernel([SDPBackend.MATH])
            self._math.__enter__()

    def _loss_of(self, module, args, kwargs, output) -> None:
        """After a forward: leave the MATH backend; for a recorded micro-batch, the divisor of its summed loss that
        the model's loss shows and a hook for the factor the Trainer's backward sends into that loss."""
        if self._math is not None:
            self._math.__exit__(None, None, None)
            self._math = None
        if output is None or self._checking or not self._pending or not torch.is_grad_enabled():
            return
        extra = self._pending[-1][2]
        if "divisor" in extra:
            return
        loss, logits = getattr(output, "loss", None), getattr(output, "logits", None)
        if loss is None or logits is None or not loss.requires_grad:
            return
        with torch.no_grad():
            total = float(trainer_losses(logits.detach(), extra["y"]).sum())
        candidates = [predicted(extra["y"])] + ([extra["items"]] if extra["items"] is not None else [])
        value = float(loss.detach())
        extra["divisor"] = min(candidates, key=lambda d: abs(total / d - value) if d else float("inf"))
        extra["scale"] = None
        loss.register_hook(lambda g: extra.__setitem__("scale", float(g)))

    def _captured(self, args, kwargs):
        missing = [f for f in ("input_ids", "labels") if f not in kwargs]
        if missing:
            raise NotReplayable(f"the Trainer called the model without {missing}; replay needs the batch as keyword "
                                "arguments with labels (a collator that adds them).")
        unknown = [k for k in kwargs if k not in (*FIELDS, "labels", "num_items_in_batch", "return_dict")]
        if unknown:
            raise NotReplayable(f"the Trainer passed the model {unknown}, which replay does not feed; keep the "
                                f"batch to {FIELDS} and labels.")
        batch = {f: kwargs[f].detach().clone() for f in self.fields if f in kwargs}
        x, y = pack(batch, self.fields, kwargs["labels"].detach().clone())
        items = kwargs.get("num_items_in_batch")
        return {"x": x, "y": y, "items": None if items is None else int(items)}

    def _record_step(self, extras: list) -> None:
        undivided = [i for i, extra in enumerate(extras) if extra.get("scale") is None]
        if undivided:
            raise NotReplayable("the Trainer did not backpropagate the loss its model returned (a compute_loss_func, "
                                "label smoothing or an overridden compute_loss?); replay takes the model's own loss: "
                                "leave them at their defaults.")
        width = max(extra["x"].shape[-1] for extra in extras)
        xs = [F.pad(extra["x"], (0, width - extra["x"].shape[-1])) for extra in extras]
        ys = [F.pad(extra["y"], (0, width - extra["y"].shape[-1]), value=IGNORE) if extra["y"].dim() == 2 else
              extra["y"] for extra in extras]
        self.run.inputs.append((torch.cat(xs), torch.cat(ys)))
        widths = [extra["x"].shape[-1] for extra in extras]
        self.run.widths.append(widths if len(set(widths)) > 1 else None)
        self.run.divisors.append([extra["divisor"] if round(1 / extra["scale"]) == 1 else
                                  (extra["divisor"], round(1 / extra["scale"])) for extra in extras])
        if self.max_grad_norm is not None and self.max_grad_norm > 0:
            self._clip = (float(self.max_grad_norm), 2.0)

    def finish(self) -> None:
        self.__exit__(None, None, None)


def trainer_refusals(args, model: nn.Module, loader, link: Link | None) -> list[str]:
    """Every reason the Trainer's settings keep its run from being replayed, each naming its fix (module
    docstring); the model and optimizer are checked by :func:`~influkit.unrolled.watch.check_replayable`."""
    reasons = []
    if getattr(args, "fp16", False):
        reasons.append("the Trainer trains in fp16: its GradScaler multiplies the loss by a scale that it halves and "
                       "doubles as gradients overflow, and skips the steps whose gradients overflowed, none of which "
                       "the record holds; train in bf16 (bf16=True, replayed at its own precision) or float32 "
                       "(fp16=False).")
    if args.world_size > 1:
        reasons.append(
            f"the Trainer runs on {args.world_size} processes (torchrun / DDP): each step's gradient is averaged over "
            "every rank's batch, and replay repeats one process's steps. Record the training in one process (python "
            "train.py, or torchrun --nproc_per_node=1); the metagradient itself then runs sharded under torchrun "
            "(ik.unrolled.metagradients splits each recorded batch over the ranks).")
    if getattr(args, "label_smoothing_factor", 0.0):
        reasons.append("label smoothing changes the loss the Trainer backpropagates from the model's own; set "
                       "label_smoothing_factor=0.")
    if link is not None and link.case == 2 and not link.plain:
        reasons.append("a Case 2 link with alpha > 0 needs the proximal term α‖S − S̄‖² in the loss, which the "
                       "Trainer does not add; record plain finetuning (link=ik.Link.finetune(shared): the block "
                       "trained from the pretrained values, no proximal term), Case 1 (freeze the shared block) or a "
                       "torch.optim loop with record.watch and run.penalty().")
    attention = getattr(getattr(model, "config", None), "_attn_implementation", "eager")
    if attention not in ATTENTION:
        reasons.append(f"the model computes attention with {attention!r}, whose kernel's backward is not "
                       "differentiable again (the exact metagradient needs it); build the model with "
                       "attn_implementation='sdpa' (recorded on its MATH backend) or 'eager' "
                       "(from_pretrained(..., attn_implementation=...) or in its config).")
    if loader.batch_sampler is None:
        reasons.append("the Trainer's train dataloader has no batch sampler (an iterable dataset?); replay takes the "
                       "examples by index: give the Trainer a map-style train_dataset.")
    return reasons


class RecordCallback(TrainerCallback):
    """Records each ``Trainer.train()`` as the next stage of ``record`` (module docstring): pass it in the Trainer's
    ``callbacks``. link: how this stage inherits from the record's previous one (Case 1, plain finetuning or LoRA), as in ``ik.Chain``.
    After training, ``record.runs[-1]`` replays the Trainer's run bit for bit (``ik.unrolled.verify``)."""

    def __init__(self, record, *, link: Link | None = None, checkpoint_every: int = 16):
        self.record, self.link, self.checkpoint_every = record, link, checkpoint_every
        self.watch: _TrainerWatch | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs):
        if model is None or optimizer is None or train_dataloader is None:
            raise NotReplayable("the Trainer gave the callback no model, optimizer or train dataloader at "
                                "on_train_begin; pass RecordCallback in Trainer(callbacks=[...]).")
        self.watch = _TrainerWatch(self.record, args, model, optimizer, train_dataloader, link=self.link,
                                   checkpoint_every=self.checkpoint_every)

    def on_train_end(self, args, state, control, **kwargs):
        if self.watch is not None:
            watch, self.watch = self.watch, None
            watch.finish()
