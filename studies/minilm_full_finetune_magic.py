"""Bergson 2.5.1's MAGIC on the masked-LM stage of the realistic run (``studies.minilm_full_finetune``), against
influkit's exact metagradient of the same run.

The run is rebuilt by ``studies.minilm_full_finetune.train(cfg)`` (its final weights' fingerprint checked against
``summary.json``): 100 masked-LM steps of all-MiniLM-L6-v2 by a ``Trainer`` at its defaults, then 40 full
finetuning steps (``Link.finetune``), both recorded. The score of corpus snippet z is d(summed test sentiment loss) /
d w_z, its sign influkit's.

Bergson's MAGIC differentiates one training loop (its functional ``Trainer``: the trained parameters, one data
stream, a query gradient on that loop's final state). The row is therefore **MAGIC on the masked-LM stage with the
finetune's exact adjoint handed in**: influkit's exact reverse pass through the 40 finetuning steps (the
finetuning stage is not MAGIC's) gives d(summed test loss) / d(the masked-LM stage's final weights) — the encoder's
adjoint at the finetune's start, zero on the masked-LM head, zero on the Adam moments (the finetune starts its own
optimizer) — and Bergson's ``Trainer.backward`` carries it back through the 100 masked-LM steps, returning
d(summed test loss) / d w_z for every corpus snippet.

How the masked-LM stage is driven through Bergson's pieces (nothing of Bergson copied or changed):

- Data: :class:`RecordedSteps`, a stream of the record's steps. Step t's "batch" is the ids of its two recorded
  micro-batches (the collator's masks as recorded, each cut back to its own padded width), the data weights of
  their examples (``example_weight``, indexed from the stream's weight vector so Bergson's reverse pass reaches
  it), and a one-token ``shift_loss_mask`` per micro-batch.
- Model: :class:`RecordedMaskedLM`, the Trainer's BertForMaskedLM (dropout on, sdpa on its MATH backend as the
  recording forced it) whose forward takes one micro-batch id, restores the CPU generator state the Trainer's
  forward started from (dropout masks as trained) and returns the recorded objective of that micro-batch:
  Σ_z w_z ℓ_z / d_j (ℓ_z: z's summed masked-token cross-entropy, d_j: the micro-batch's divisor as the Trainer's loss
  took it), times 2 — Bergson's accumulation weighs micro-batch j by (its ``shift_loss_mask`` tokens) / (the step's),
  1/2 here, so the step's gradient is the Trainer's, Σ_j ∇(Σ_z w_z ℓ_z / d_j), both factors exact powers of two.
  The decoder's weight is tied to the word embedding: it is read from the embedding at call time
  (:class:`TiedDecoder`), so Bergson's state holds the tied tensor once (as one Parameter under two names it would
  hold two entries that an out-of-place step moves apart).
- Update: Bergson's ``Trainer.step`` with ``grad_accum_steps=2`` (its micro-batched, one-graph-at-a-time VJP),
  ``max_grad_norm=1`` (its clip: coef = 1 / (‖g‖ + 1e-6) clamped at 1, HF's formula) and torchopt's AdamW with the
  Trainer's betas, eps, the per-step learning rates the record holds (warmup + linear decay) and weight decay 0.01
  on the Trainer's decay group only (biases and LayerNorm weights at 0), ``eps_root`` the smallest normal float32
  (``EPS_ROOT``). torchopt's AdamW is the same update rule as
  torch's fused kernel, rounded otherwise: the trajectory agrees with the record to rounding, not bit for bit
  (``magic.json`` states the largest gap at every checkpoint both keep).
- Checkpoints: Bergson's own schedule (``save_mode="sqrt"``), written to a temporary directory under /tmp and
  removed after.

What Bergson's reverse pass does not see: a token fed at an attended position whose id is the embedding's
padding index (the collator's random replacement can draw it) makes the embedding's backward drop that row's
gradient, which autograd's double backward then also drops, while influkit differentiates through the fed row
(:mod:`influkit.unrolled.padding`); ``magic.json`` counts such tokens in the masked-LM stage.

    PYTHONPATH=$PWD .bench-venv/bin/python -m studies.minilm_full_finetune_magic [--quick]

Output: ``studies/results/minilm_full_finetune/magic.json`` (``--quick``: ``minilm_full_finetune_quick/``, whose
exact scores this module computes itself when that folder has none) and a MANIFEST.json entry. The rows' seconds
and peak RSS (sampled from /proc/self/status) cover the finetune's exact adjoint, Bergson's forward training and its
reverse pass — not the rebuild of the recorded run.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import shutil
import tempfile
import time
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import influkit as ik
from influkit.hf.trainer import trainer_losses
from influkit.unrolled.boundary import measure_adjoint
from influkit.unrolled.metagradient import exact_down_to
from influkit.unrolled.run import cropped
from studies.minilm_full_finetune import QUICK, RESULTS, Config, PeakRss, fingerprint, train

SAVE_MODE = "sqrt"  # Bergson's default checkpoint schedule
# torchopt AdamW's eps_root in √(v̂ + eps_root): the fused kernel has none, and at 0 the reverse pass is NaN where v̂ = 0
# (embedding rows no batch reached: ∞ · 0). The smallest normal float32 keeps it finite there and leaves √(v̂ + ·) = √v̂
# in float32 wherever v̂ > 2e-31; Bergson's default, 1e-17, moves the trajectory away from the record's (on --quick
# the scores' largest gap to the exact ones, relative to the largest: 3.7e-4 at 1e-17, 6.4e-6 at 1e-38).
EPS_ROOT = 1.1754944e-38
DECODER = "cls.predictions.decoder"


class TiedDecoder(nn.Module):
    """BertForMaskedLM's decoder, logits = h Eᵀ + b, reading the word embedding E and the head's bias b at call time
    (the same arithmetic as the tied nn.Linear): the tie held by one tensor of each."""

    def __init__(self, model):
        super().__init__()
        object.__setattr__(self, "owner", model)  # not a child: the tensors keep their own names

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        owner = self.owner
        return nn.functional.linear(hidden, owner.bert.embeddings.word_embeddings.weight, owner.cls.predictions.bias)


class RecordedMaskedLM(nn.Module):
    """The recorded Trainer's masked LM called on one recorded micro-batch id at a time (module docstring):
    returns 2 · Σ_z w_z ℓ_z / d_j of that micro-batch, its forward from the generator state the Trainer's did."""

    def __init__(self, mlm, micro: list[tuple[torch.Tensor, torch.Tensor, dict, object]], fields: tuple[str, ...]):
        super().__init__()
        self.mlm, self.micro, self.fields = mlm, micro, fields
        mlm.cls.predictions.decoder = TiedDecoder(mlm)

    def forward(self, micro: torch.Tensor, example_weight: torch.Tensor, shift_loss_mask: torch.Tensor) -> torch.Tensor:
        (j,), (w,) = micro.tolist(), example_weight
        x, y, rng, divisor = self.micro[j]
        torch.set_rng_state(rng["cpu"])
        with sdpa_kernel([SDPBackend.MATH]):
            logits = self.mlm(**{f: x[:, c] for c, f in enumerate(self.fields)}).logits
        value = (w * trainer_losses(logits, y)).sum()
        for d in divisor if isinstance(divisor, tuple) else (divisor,):
            value = value / d
        return value * 2.0


class RecordedSteps:
    """What Bergson's ``Trainer`` reads of a data stream (``len``, ``[t]``, ``weights``, ``requires_grad``,
    ``device``) over the record's steps: step t = its micro-batches 2t, 2t + 1 (module docstring)."""

    def __init__(self, batches: list[torch.Tensor], dtype: torch.dtype):
        self.batches, self.device = batches, torch.device("cpu")
        self.weights = nn.Parameter(torch.ones(int(torch.cat(batches).max()) + 1, dtype=dtype), requires_grad=False)

    @property
    def requires_grad(self) -> bool:
        return self.weights.requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self.weights.requires_grad = value

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, t: int) -> dict:
        if not 0 <= t < len(self):
            raise IndexError(t)
        idx = self.batches[t]
        return {"micro": torch.tensor([2 * t, 2 * t + 1]), "example_weight": self.weights[idx.reshape(2, -1)],
                "shift_loss_mask": torch.ones(2, 1, dtype=torch.bool)}


def stage_inputs(run) -> tuple[list, list[torch.Tensor]]:
    """The masked-LM stage's micro-batches [(x, y, rng, divisor)] in training order, each at its own width, and its
    steps' example indices; refuses a step that is not two equal micro-batches (what RecordedSteps assumes)."""
    micro, batches = [], []
    for t in range(run.steps):
        idx, x, y = run.batch(t)
        parts = run.micro_batches(t, x.shape[0])
        if len(parts) != 2 or parts[0][0].stop - parts[0][0].start != parts[1][0].stop - parts[1][0].start:
            raise ValueError(f"step {t}: {len(parts)} micro-batches of unequal sizes; the stream expects two equal")
        for part, rng, divisor, width in parts:
            xp, yp = cropped(x[part], y[part], width)
            micro.append((xp, yp, rng, divisor))
        batches.append(idx)
    return micro, batches


def optimizer(run):
    """torchopt's AdamW as the recorded Trainer's fused AdamW: its betas, eps, the per-step learning rates of the
    record, weight decay on the decay group's tensors only (Bergson's state names: ``mlm.`` + the record's)."""
    import torchopt

    rules, groups = run.optimizer.rules, run.optimizer.names
    first = rules[0]
    if any((r.betas, r.eps) != (first.betas, first.eps) for r in rules) or any(len(set(lr)) > 1 for lr in run.lrs):
        raise ValueError("the groups differ in betas, eps or learning rate; one torchopt AdamW cannot follow them")
    decay = {"mlm." + n: r.weight_decay for r, names in zip(rules, groups) for n in names}
    rates = sorted({r.weight_decay for r in rules} - {0.0})
    if len(rates) != 1:
        raise ValueError(f"weight decay rates {rates}: one nonzero rate expected")
    lrs = [float(lr[0]) for lr in run.lrs]
    return torchopt.adamw(lambda count: lrs[int(count)], betas=first.betas, eps=first.eps, eps_root=EPS_ROOT,
                          weight_decay=rates[0],
                          mask={"mlm." + n: decay["mlm." + n] > 0 for n in run.trained})


def largest_gap(params: dict, reference: dict, start: dict) -> dict:
    """The largest |Bergson − recorded| over the tensors (Bergson's names: ``mlm.`` + the record's): absolute,
    relative to the tensor's largest recorded value, and relative to its largest move since the stage's start."""
    gaps = [((params["mlm." + n].detach() - v).abs().max(), v.abs().max(), (v - start[n]).abs().max())
            for n, v in reference.items()]
    return {"max |Δ|": max(float(d) for d, _, _ in gaps),
            "max |Δ| / max |recorded|": max(float(d / r.clamp_min(1e-30)) for d, r, _ in gaps),
            "max |Δ| / max |recorded − start|": max(float(d / m.clamp_min(1e-30)) for d, _, m in gaps if m > 0)
            if any(m > 0 for *_, m in gaps) else 0.0}


def attended_padding(micro: list, fields: tuple[str, ...], pad: int) -> int:
    """Tokens fed at attended positions whose id is the embedding's padding index (module docstring)."""
    ids, mask = fields.index("input_ids"), fields.index("attention_mask")
    return sum(int(((x[:, ids] == pad) & (x[:, mask] == 1)).sum()) for x, *_ in micro)


def handed_adjoint(record, test, progress: bool) -> tuple[dict, np.ndarray]:
    """(d(summed test loss) / d(the masked-LM stage's final values) from influkit's exact reverse pass through the
    finetuning stage, the finetuning examples' exact scores of that pass)."""
    adjoint, q, _ = measure_adjoint(record, test, per_test=False)
    scores, handed = exact_down_to(record, adjoint, q, 1, progress)
    return {n: v[0] for n, v in handed.items()}, scores[1][:, 0].numpy()


def magic(run0, adjoint: dict, model, work: Path) -> tuple[np.ndarray, dict]:
    """Bergson's MAGIC on the masked-LM stage from ``adjoint`` on its final values: (n,) d(summed test loss) / d w_z
    and what its run checked (trajectory gaps at the checkpoints both keep, seconds)."""
    from bergson.magic.trainer import BackwardState, Trainer
    from torchopt.pytree import tree_iter

    micro, batches = stage_inputs(run0)
    fields = run0.stage.model.fields
    reference = {s: dict(run0.checkpoints[s][0]) for s in run0.checkpoints}
    dtype = next(iter(run0.final.values())).dtype
    pad = model.config.pad_token_id
    facts = {"attended padding-index tokens in the masked-LM stage": attended_padding(micro, fields, pad)}
    wrapped = RecordedMaskedLM(model, micro, fields).train()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(reference[0][n])
    trainer, state = Trainer.initialize(wrapped, optimizer(run0))
    missing = set(state.params) ^ {"mlm." + n for n in run0.trained}
    if missing:
        raise ValueError(f"Bergson's state and the record's trained tensors differ: {sorted(missing)[:5]}")
    data = RecordedSteps(batches, dtype)
    seconds = {}
    begin = time.perf_counter()
    state = trainer.train(state, data, inplace=True, save_dir=str(work), save_mode=SAVE_MODE,
                          max_grad_norm=run0.clips[0][0], grad_accum_steps=2).detach_()
    seconds["Bergson forward training (with checkpoints)"] = time.perf_counter() - begin
    gaps = {run0.steps: largest_gap(state.params, reference[run0.steps], reference[0])}
    probe = copy.deepcopy(state)
    for s in sorted(set(reference) - {run0.steps}):
        path = work / f"step_{s}.ckpt"
        if path.exists():
            probe.load(str(path))
            gaps[s] = largest_gap(probe.params, reference[s], reference[0])
    del probe
    facts["trajectory: Bergson's weights against the record's, at the steps both checkpoint"] = {
        str(s): gaps[s] for s in sorted(gaps)}
    cotangents = {k: adjoint[k.removeprefix("mlm.")].to(dtype) if k.removeprefix("mlm.") in adjoint
                  else torch.zeros_like(v) for k, v in state.params.items()}
    opt = [torch.zeros_like(t) for t in tree_iter(state.opt_state) if isinstance(t, torch.Tensor)
           and t.is_floating_point()]
    begin = time.perf_counter()
    data.requires_grad = True
    back = trainer.backward(str(work), data, BackwardState(cotangents, opt, torch.zeros_like(data.weights)),
                            copy.deepcopy(state), save_mode=SAVE_MODE, max_grad_norm=run0.clips[0][0],
                            grad_accum_steps=2)
    seconds["Bergson reverse pass"] = time.perf_counter() - begin
    facts["seconds"] = seconds
    return back.weight_grads.detach().double().numpy(), facts


def agreement(exact: np.ndarray, magic_: np.ndarray) -> dict:
    from scipy.stats import pearsonr, spearmanr

    return {"pearson": float(pearsonr(exact, magic_).statistic), "spearman": float(spearmanr(exact, magic_).statistic),
            "max |exact − MAGIC| / max |exact|": float(np.abs(exact - magic_).max() / np.abs(exact).max())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg: Config = QUICK if args.quick else Config()
    out = RESULTS / ("minilm_full_finetune_quick" if args.quick else "minilm_full_finetune")
    out.mkdir(parents=True, exist_ok=True)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    run = train(cfg)
    rebuilt = fingerprint(run.models)
    if summary and summary["final weights fingerprint"] != rebuilt:
        raise SystemExit(f"the rebuilt run ({rebuilt}) is not the recorded one ({summary['final weights fingerprint']})")
    exact_path, exact_note = out / "scores.npz", "scores.npz (the study's exact metagradient)"
    if not exact_path.exists() and args.quick:  # the quick run's exact scores, computed here (the study's own call)
        results = ik.unrolled.metagradients(run.record, run.test, progress=not args.no_progress)
        exact_path = Path(tempfile.mkdtemp()) / "scores.npz"
        np.savez(exact_path, corpus=results[0].values.numpy(), finetuning=results[1].values.numpy())
        exact_note = "ik.unrolled.metagradients(record, test) computed by this run (no scores.npz in the folder)"
    exact = np.load(exact_path)
    with PeakRss() as rss:
        begin = time.perf_counter()
        adjoint, finetuning = handed_adjoint(run.record, run.test, not args.no_progress)
        adjoint_seconds = time.perf_counter() - begin
        run0, model = run.record.runs[0], copy.deepcopy(run.models[0])
        run0.checkpoints = {s: (v[0], None) for s, v in run0.checkpoints.items()}  # moments: not compared
        del run  # the finetuning stage and the Trainers' models: not needed past the boundary
        gc.collect()
        work = Path(tempfile.mkdtemp(prefix="minilm-magic-", dir="/tmp"))
        try:
            scores, facts = magic(run0, adjoint, model, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        seconds = time.perf_counter() - begin
    facts["seconds"]["influkit exact reverse pass of the finetuning stage (the handed adjoint)"] = adjoint_seconds
    result = {
        "method": f"Bergson {version('bergson')} MAGIC (masked-LM stage; the finetune's exact adjoint handed in)",
        "seconds": seconds, "peak RSS (MiB)": rss.peak,
        "note": "MAGIC on the masked-LM stage with the finetune's exact adjoint handed in: the finetuning stage's "
                "reverse pass is influkit's exact one, not MAGIC's; Bergson's Trainer replays the recorded "
                "micro-batches and dropout states with accumulation 2, clipping at 1 and torchopt AdamW (fused "
                "AdamW's rule, rounded otherwise)",
        "config": asdict(cfg), "final weights fingerprint": rebuilt, "bergson run": facts,
        "agreement": agreement(exact["corpus"].astype(float), scores) | {"against": exact_note},
        "finetuning scores of the handed pass vs the exact row's": agreement(exact["finetuning"].astype(float),
                                                                              finetuning.astype(float)),
        "scores": [float(v) for v in scores],
    }
    (out / "magic.json").write_text(json.dumps(result, indent=1))
    from benchmarks.manifest import record

    record(out, ["magic.json"], note="bench venv (Bergson 2.5.1); 2-core CPU shared with other sessions; 1 torch thread")
    print(json.dumps({k: v for k, v in result.items() if k != "scores"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
