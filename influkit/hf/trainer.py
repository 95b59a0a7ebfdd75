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

Refused before the first step (:class:`~influkit.errors.NotReplayable`): ``fp16`` / ``bf16``, gradient accumulation
(``gradient_accumulation_steps`` > 1: the Trainer's loss scaling then depends on the model's loss signature), an
attention implementation other than ``"eager"`` (sdpa's CPU kernel has no second derivative), more
than one process, a fused or foreach-on-GPU optimizer (``optim="adamw_torch"`` is torch.optim's AdamW, replayed
exactly; transformers' default ``adamw_torch_fused`` is not), and what :func:`~influkit.unrolled.watch.check_replayable`
refuses. A Case 2 link is refused (the Trainer adds no proximal term); Case 1 — the shared block frozen
(``requires_grad_(False)``) — and LoRA (peft adapters on a frozen base, ``link=hf.lora_link(pretrained, peft_model,
shared=...)``; plain LoRA, a variant such as DoRA refused) are recorded.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F
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
    arguments, the model's own attention implementation); returns its logits."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.hf_model(**{f: inputs[:, c] for c, f in enumerate(self.fields)}).logits


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
    keyword arguments, the clipping from the Trainer's ``max_grad_norm``."""

    def __init__(self, record, args, model: nn.Module, optimizer, loader, *, link: Link | None, checkpoint_every: int):
        if getattr(args, "fp16", False) or getattr(args, "bf16", False):
            raise NotReplayable("the Trainer trains in fp16 / bf16 (mixed precision), which is not replayed; set "
                                "fp16=False and bf16=False.")
        if args.gradient_accumulation_steps != 1:
            raise NotReplayable("gradient_accumulation_steps > 1: the Trainer's loss scaling then depends on the "
                                "model's loss signature; record with gradient_accumulation_steps=1 (a larger "
                                "per_device_train_batch_size instead).")
        if args.world_size > 1:
            raise NotReplayable(
                f"the Trainer runs on {args.world_size} processes (torchrun / DDP): each step's gradient is averaged "
                "over every rank's batch, and replay repeats one process's steps. Record the training in one process "
                "(python train.py, or torchrun --nproc_per_node=1); the metagradient itself then runs sharded under "
                "torchrun (ik.unrolled.metagradients splits each recorded batch over the ranks).")
        if link is not None and link.case == 2 and not link.plain:
            raise NotReplayable("a Case 2 link with alpha > 0 needs the proximal term α‖S − S̄‖² in the loss, which the "
                                "Trainer does not add; record plain finetuning (link=ik.Link.finetune(shared): the "
                                "block trained from the pretrained values, no proximal term), Case 1 (freeze the "
                                "shared block) or a torch.optim loop with record.watch and run.penalty().")
        attention = getattr(getattr(model, "config", None), "_attn_implementation", "eager")
        if attention != "eager":
            raise NotReplayable(f"the model computes attention with {attention!r}, whose CPU kernel's backward is not "
                                "differentiable again (the exact metagradient needs it); build the model with "
                                "attn_implementation='eager' (from_pretrained(..., attn_implementation='eager') or in "
                                "its config).")
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        if any(group.get("fused") for group in optimizer.param_groups):
            raise NotReplayable("the Trainer's optimizer is fused (transformers' default optim='adamw_torch_fused'), "
                                "which replay does not repeat; set TrainingArguments(optim='adamw_torch').")
        groups = check_replayable(model, optimizer)
        loader = getattr(loader, "base_dataloader", loader)  # accelerate's DataLoaderShard iterates this one
        if loader.batch_sampler is None:
            raise NotReplayable("the Trainer's train dataloader has no batch sampler (an iterable dataset?); replay "
                                "takes the examples by index: give the Trainer a map-style train_dataset.")
        fields = tuple(f for f in FIELDS if f in loader.dataset[0] or f == "input_ids")
        data = dataset_tensors(loader.dataset, fields)
        trained = set(groups.order)
        stage = eval_stage(model, lambda: Stage(TrainerModel(model, fields), trainer_losses, data, params=[
            n for n, _ in model.named_parameters() if n in trained]))
        self.fields, self.max_grad_norm = fields, args.max_grad_norm
        self._setup(record, model, optimizer, groups, stage, loader, link=link, checkpoint_every=checkpoint_every)
        self.run.inputs = []
        self.run.clip_order = [n for n, p in model.named_parameters() if n in trained]
        self.__enter__()

    def _forward(self, module, args, kwargs) -> None:
        with self._closing_on_error():
            super()._forward(module, args, kwargs)

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
        return pack(batch, self.fields, kwargs["labels"].detach().clone())

    def _record_step(self, extras: list) -> None:
        (x, y), = extras
        self.run.inputs.append((x, y))
        self.run.divisors.append([predicted(y)])
        if self.max_grad_norm is not None and self.max_grad_norm > 0:
            self._clip = (float(self.max_grad_norm), 2.0)

    def finish(self) -> None:
        self.__exit__(None, None, None)


class RecordCallback(TrainerCallback):
    """Records each ``Trainer.train()`` as the next stage of ``record`` (module docstring): pass it in the Trainer's
    ``callbacks``. link: how this stage inherits from the record's previous one (Case 1 or LoRA), as in ``ik.Chain``.
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
