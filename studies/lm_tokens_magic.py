"""Bergson 2.5.1's per-token MAGIC on the worked example's run (``studies/lm_tokens_lora.py``) against influkit's
exact per-token unrolled scores of the same run.

The run: a GPT-2-architecture LM pretrained on vaderSentiment snippets (SGD with momentum, recorded), then a LoRA
instruction finetune on its frozen weights (recorded, a Case 1 link); the 20 held-out prompts' measure is the
completion's log-probability. influkit's scores: ``ik.unrolled.metagradients(record, queries, per_test=True,
per_token=True)``, d log p(completion_q) / d w_{z,t} for pretraining token t of snippet z (t the predicted token).

Bergson's MAGIC differentiates one training loop (its functional ``Trainer``: the parameters it trains, one data
stream, the query gradient at that loop's end), so the two-stage run is driven through Bergson's own pieces, each
stage by its own ``Trainer`` (nothing of Bergson copied, nothing of it changed):

1. Pretraining: Bergson's ``Trainer`` from the recorded initial weights on the recorded batches (same order), with
   Bergson's per-token data weights (``DataStream`` with a (n, L) weight table indexed by ``example_ids``, as its
   ``attribute_tokens`` mode builds it) and its ``weighted_causal_lm_ce`` at ``reduction="sum_of_means"`` (each
   snippet's mean token loss, summed over the batch) under torchopt SGD with momentum 0.9 at lr / B — the recorded
   objective (the batch mean of each snippet's mean token NLL) at lr, step for step.
2. Finetuning: a second ``Trainer`` over the LoRA model whose *base weights are trained too, with every update
   masked to zero* (a torchopt transformation in front of SGD): they stay the pretrained values, as the frozen
   base of the recorded run, but are part of Bergson's differentiable state, so its reverse pass returns
   d L_q / d (base weights at the finetune's start). Bergson's ``Trainer`` keeps frozen parameters outside its
   state, so without this it cannot carry a derivative from the finetune back into pretraining.
3. Per query q: Bergson's ``compute_query_gradients`` at the finetune's end (L_q: the completion's cross-entropy,
   = −log p), its ``Trainer.backward`` through the finetune, the base weights' gradient handed, as the query
   gradient, to its ``Trainer.backward`` through pretraining, whose weight gradient is MAGIC's per-token score
   d L_q / d w_{z,s}. Bergson's weight at input position s scales the loss of predicting token s + 1, so MAGIC's
   column s is influkit's token s + 1, with the opposite sign (L_q = −log p).

Two variants (``--head``), because of how GPT-2's LM head is tied to its input embedding: ``shared parameter``
(the model as transformers builds it: one Parameter under two names, ``transformer.wte.weight`` and
``lm_head.weight``, which Bergson's state holds as two entries; its forward updates them in place, together, but a
step taken out of place, as a traced replay takes it, moves each entry by its own share of the gradient — the run
reports how far apart one such step leaves them — so the replay differentiated is not the run trained) and ``embedding read`` (the head replaced by :class:`EmbeddingHead`, reading
the embedding's weight at call time: the same function, one entry).

What each run checks first: Bergson's two trained trajectories against the record's final weights, and its
finetune-only scores (the finetune's reverse pass, per finetuning example) against influkit's. Output
(``studies/results/lm_tokens/``): per variant ``magic_<variant>.json`` (agreement per query and overall, Pearson
and Spearman over the labelled tokens, and of the per-snippet sums; the largest difference; seconds; the checks)
and ``magic_<variant>.npz`` (both (n, L, q) token score arrays, float32, influkit's sign and alignment); influkit's
scores of the run in ``exact_scores.npz``, computed once and reused.

Run in the bench venv (Bergson there): ``PYTHONPATH=$PWD .bench-venv/bin/python -m studies.lm_tokens_magic``
(influkit's scores ~8 min, then per variant ~1 min per query on 1 core); ``--quick``: the smoke configuration
into a temporary directory (~1 min).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

import influkit as ik
from influkit.hf.texts import completion_log_probability

from torch import nn

from .lm_tokens_lora import QUICK, RESULTS, Config, build

IGNORE = -100
PEFT_PREFIX = "base_model.model."  # a PEFT model's name for its base model's parameters
SAVE_MODE = "all"  # Bergson's checkpoint schedule: every step (this model is small; no recomputation)
HEADS = {  # how the LM head's tie to the input embedding reaches Bergson's Trainer
    "shared parameter": "the model as transformers builds it: lm_head.weight is transformer.wte.weight, one Parameter "
                        "under two names, so two entries of Bergson's state",
    "embedding read": "lm_head replaced by a module reading transformer.wte.weight at call time (EmbeddingHead): "
                      "the same function, one entry of Bergson's state",
}


def masked_updates(frozen: set[str]):
    """A torchopt transformation zeroing the update of every parameter named in ``frozen`` (kept differentiable)."""
    from torchopt.base import EmptyState, GradientTransformation

    def init(params):
        return EmptyState()

    def update(updates, state, *, params=None, inplace=True):
        return {k: v * 0.0 if k in frozen else v for k, v in updates.items()}, state

    return GradientTransformation(init, update)


def stream(ids: torch.Tensor, labels: torch.Tensor, batches: list[torch.Tensor], weight_shape: tuple[int, ...]):
    """Bergson's ``DataStream`` over the recorded batches (row b·B + i = example batches[b][i]); weights (float64
    ones) of ``weight_shape``: (n, L) per token (indexed by ``example_ids``) or (n,) per example (``doc_ids``)."""
    from bergson.magic.data_stream import DataStream
    from datasets import Dataset

    order = torch.cat(batches).tolist()
    key = "example_ids" if len(weight_shape) == 2 else "doc_ids"
    data = Dataset.from_dict({"input_ids": ids[order].tolist(), "labels": labels[order].tolist(), key: order})
    out = DataStream(data, len(batches[0]), device="cpu", weight_shape=weight_shape)
    out.weights = torch.nn.Parameter(torch.ones(weight_shape, dtype=torch.float64))
    return out


def right_padded(inputs: torch.Tensor) -> None:
    """Bergson feeds input ids only (no attention mask): exact for a causal LM only when padding is on the right."""
    mask = inputs[:, 1].bool()
    if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError("left padding: Bergson's stream (no attention mask) would attend to it")


class EmbeddingHead(nn.Module):
    """The LM head as the input embedding's weight read at call time, logits = h Eᵀ: the tie held by one parameter
    (the embedding's) instead of one Parameter registered under two names."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        object.__setattr__(self, "embedding", embedding)  # not a child: its weight keeps one name

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden, self.embedding.weight)


def causal_lm(model):
    """The transformers causal LM inside ``model`` (itself, or a PEFT model's)."""
    return model.base_model.model if hasattr(model, "peft_config") else model


def prepared(model, head: str):
    """A float64 eval copy of ``model``; with ``head="embedding read"`` its tied LM head replaced by
    :class:`EmbeddingHead` (``"shared parameter"``: as transformers ties it)."""
    model = copy.deepcopy(model).double().eval()
    if head == "embedding read":
        causal = causal_lm(model)
        if causal.lm_head.weight is not causal.get_input_embeddings().weight or causal.lm_head.bias is not None:
            raise ValueError("the LM head is not the tied, bias-free embedding")
        causal.lm_head = EmbeddingHead(causal.get_input_embeddings())
    return model


def trainer_for(model, optimizer):
    from bergson.magic.trainer import Trainer
    from bergson.utils.math import weighted_causal_lm_ce

    model.set_attn_implementation("eager")  # as Bergson's prepare_trainer (double backward)
    causal_lm(model).loss_function = functools.partial(weighted_causal_lm_ce, reduction="sum_of_means")
    return Trainer.initialize(model, optimizer)


def zeros_backward(state, query_grads: dict, weights: torch.Tensor):
    from bergson.magic.trainer import BackwardState
    from torchopt.pytree import tree_iter

    opt = [torch.zeros_like(b) for b in tree_iter(state.opt_state) if isinstance(b, torch.Tensor)
           and b.is_floating_point()]
    return BackwardState(query_grads, opt, torch.zeros_like(weights))


def largest_gap(params: dict, reference: dict, names) -> float:
    """max |Bergson − recorded| / max |recorded| over ``names`` (name in Bergson's state ↦ name in the record)."""
    gaps = [float((params[a].detach() - reference[b]).abs().max() / reference[b].abs().max().clamp_min(1e-300))
            for a, b in names.items()]
    return max(gaps)


def magic_tokens(record, pre, fin, queries, config: Config, work: Path,
                 head: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(n, L, q) Bergson's per-token MAGIC d L_q / d w_{z,s} of the pretraining tokens (its alignment and sign),
    (m, q) its per-example d L_q / d w_z of the finetuning examples (the finetune's reverse pass alone), and what
    its run checked."""
    import torchopt
    from bergson.magic.cli import compute_query_gradients
    from bergson.magic.data_stream import DataStream
    from datasets import Dataset

    first, second = record.runs
    inputs, labels = pre.data.take(torch.arange(len(pre)))
    right_padded(inputs)
    n, length = labels.shape
    facts, seconds = {}, {}
    # stage 1: pretraining from the recorded initial weights, per-token weights
    model1 = prepared(pre.model.hf_model, head)
    with torch.no_grad():
        for name, p in model1.named_parameters():
            p.copy_(first.checkpoints[0][0][name])
    names1 = {name for name, _ in model1.named_parameters(remove_duplicate=False)}
    stream1 = stream(inputs[:, 0], labels, first.batches, (n, length))
    trainer1, state1 = trainer_for(model1, torchopt.sgd(config.pre_lr / config.batch, momentum=0.9))
    start = time.perf_counter()
    state1 = trainer1.train(state1, stream1, inplace=True, save_dir=str(work / "pre"), save_mode=SAVE_MODE)
    seconds["pretraining forward (Bergson Trainer)"] = time.perf_counter() - start
    facts["pretraining: max |Bergson − recorded| / max |recorded| of the final weights"] = largest_gap(
        state1.params, first.final, {k: k for k in first.trained if k in state1.params})
    tied = [k for k in state1.params if k != "transformer.wte.weight"
            and state1.params[k] is state1.params.get("transformer.wte.weight")]
    if tied:  # one out-of-place step, as a traced replay takes it, from the trained state
        probe = trainer1.step(copy.deepcopy(state1), stream1[len(stream1) - 1], inplace=False)
        facts["tied entries after one out-of-place step: max |lm_head − wte|"] = float(
            (probe.params[tied[0]] - probe.params["transformer.wte.weight"]).detach().abs().max())
    # stage 2: the LoRA finetune, base weights in the state with zero updates
    fin_inputs, fin_labels = fin.data.take(torch.arange(len(fin)))
    right_padded(fin_inputs)
    model2 = prepared(fin.model.hf_model, head)
    with torch.no_grad():
        for name, p in model2.named_parameters():
            source = second.inherited.get(name)
            p.copy_(state1.params[source] if source is not None else second.checkpoints[0][0][name])
            p.requires_grad_(True)
    frozen = {name for name, _ in model2.named_parameters(remove_duplicate=False)} - set(second.trained)
    optimizer2 = torchopt.chain(masked_updates(frozen), torchopt.sgd(config.fin_lr / config.batch, momentum=0.9))
    stream2 = stream(fin_inputs[:, 0], fin_labels, second.batches, (len(fin),))
    # the base weights' names in the pretraining state (tied ones, e.g. lm_head.weight, under each of their names)
    base = {k: second.inherited.get(k, k.removeprefix(PEFT_PREFIX)) for k in frozen}
    if not set(base.values()) <= names1:
        raise ValueError(f"finetune weights with no pretraining counterpart: {set(base.values()) - names1}")
    trainer2, state2 = trainer_for(model2, optimizer2)
    start = time.perf_counter()
    state2 = trainer2.train(state2, stream2, inplace=True, save_dir=str(work / "fin"), save_mode=SAVE_MODE)
    seconds["finetuning forward (Bergson Trainer)"] = time.perf_counter() - start
    facts["finetuning: max |Bergson − recorded| / max |recorded| of the final LoRA weights"] = largest_gap(
        state2.params, second.final, {k: k for k in second.trained})
    facts["finetuning: base weights moved (max |Δ|)"] = max(
        float((state2.params[k].detach() - state1.params[base[k]].detach()).abs().max()) for k in frozen)
    # per query: query gradient, reverse through the finetune, then through pretraining
    q_inputs, q_labels = queries
    right_padded(q_inputs)
    out = torch.zeros(n, length, len(q_labels), dtype=torch.float64)
    fin_out = torch.zeros(len(fin), len(q_labels), dtype=torch.float64)
    start = time.perf_counter()
    for q in range(len(q_labels)):
        data = Dataset.from_dict({"input_ids": q_inputs[q : q + 1, 0].tolist(), "labels": q_labels[q : q + 1].tolist(),
                                  "doc_ids": [0]})
        query = DataStream(data, 1, device="cpu")
        grads, _ = compute_query_gradients(state2, model2, query, "mean")
        stream2.requires_grad = True
        bw2 = trainer2.backward(str(work / "fin"), stream2, zeros_backward(state2, grads, stream2.weights),
                                copy.deepcopy(state2), cleanup=False, save_mode=SAVE_MODE)
        stream2.requires_grad = False
        fin_out[:, q] = bw2.weight_grads.detach().double()
        carried = {base[k]: g for k, g in bw2.param_grads.items() if k in frozen}
        carried = {k: carried.get(k, torch.zeros_like(v)) for k, v in state1.params.items()}
        stream1.requires_grad = True
        bw1 = trainer1.backward(str(work / "pre"), stream1, zeros_backward(state1, carried, stream1.weights),
                                copy.deepcopy(state1), cleanup=False, save_mode=SAVE_MODE)
        stream1.requires_grad = False
        out[:, :, q] = bw1.weight_grads.detach().double()
    seconds["MAGIC per query (query gradient + both reverse passes), mean"] = (time.perf_counter() - start) / len(
        q_labels)
    facts["seconds"] = seconds
    return out, fin_out, facts


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a, b)[0, 1])


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def agreement(exact: torch.Tensor, magic: torch.Tensor, labels: torch.Tensor) -> dict:
    """Pearson and Spearman of influkit's token scores with MAGIC's (aligned to influkit's), per query over the
    labelled tokens, overall, and of the per-snippet sums; the largest difference relative to the largest score."""
    valid = (labels != IGNORE).clone()
    valid[:, 0] = False  # token 0 is never predicted
    x, y = exact[valid].numpy(), magic[valid].numpy()  # (tokens, q)
    per_query = {"pearson": [pearson(x[:, j], y[:, j]) for j in range(x.shape[1])],
                 "spearman": [spearman(x[:, j], y[:, j]) for j in range(x.shape[1])]}
    sums_x, sums_y = exact.sum(1).numpy(), magic.sum(1).numpy()
    return {
        "labelled tokens": int(valid.sum()), "queries": int(x.shape[1]),
        "per query": per_query,
        "per query median": {k: float(np.median(v)) for k, v in per_query.items()},
        "per query min": {k: float(np.min(v)) for k, v in per_query.items()},
        "overall (all tokens × queries)": {"pearson": pearson(x.ravel(), y.ravel()),
                                           "spearman": spearman(x.ravel(), y.ravel())},
        "per-snippet sums, overall": {"pearson": pearson(sums_x.ravel(), sums_y.ravel()),
                                      "spearman": spearman(sums_x.ravel(), sums_y.ravel())},
        "max |influkit − MAGIC| / max |influkit|": float(np.abs(x - y).max() / np.abs(x).max()),
        "influkit's scores at token 0 (never predicted), max |·|": float(exact[:, 0].abs().max()),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--head", choices=list(HEADS), default=None, help="one variant only (default: both)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = QUICK if args.quick else Config()
    out = args.out or (Path(tempfile.mkdtemp()) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    record, pre, fin, queries, *_ = build(config)
    cache = out / "exact_scores.npz"  # influkit's scores of this run: computed once, then read
    start, computed = time.perf_counter(), not cache.exists()
    if computed:
        results = ik.unrolled.metagradients(record, queries, measure=completion_log_probability, per_test=True,
                                            per_token=True, progress=False)
        np.savez_compressed(cache, pretraining_tokens=results[0].values.detach().numpy(),
                            finetuning=results[1].values.detach().sum(1).numpy())
    exact = dict(np.load(cache))
    exact_seconds = time.perf_counter() - start
    tokens = torch.from_numpy(exact["pretraining_tokens"])
    labels = pre.data.take(torch.arange(len(pre)))[1]
    finetuning = exact["finetuning"]
    heads = [args.head] if args.head else list(HEADS)
    for head in heads:
        name = "magic_" + head.replace(" ", "_")
        if (out / f"{name}.json").exists() and not args.quick:
            continue  # done in an earlier run
        work = Path(tempfile.mkdtemp(prefix="lm-tokens-magic-"))
        try:
            raw, raw_fin, facts = magic_tokens(record, pre, fin, queries, config, work, head)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        magic = torch.zeros_like(raw)
        magic[:, 1:] = -raw[:, :-1]  # Bergson's position s weights the prediction of token s + 1; L_q = −log p
        summary = {
            "config": asdict(config), "bergson": _version("bergson"), "LM head": head, "what": HEADS[head],
            "alignment": "MAGIC's weight at input position s ↦ influkit's token s + 1, sign flipped "
                         "(MAGIC: d CE / d w, influkit: d log p / d w)",
            "agreement": agreement(tokens, magic, labels),
            "finetuning examples (the finetune's reverse pass alone)": {
                "pearson overall": pearson(finetuning.ravel(), -raw_fin.numpy().ravel()),
                "max |influkit − MAGIC| / max |influkit|": float(
                    np.abs(finetuning + raw_fin.numpy()).max() / np.abs(finetuning).max())},
            "bergson run": facts}
        if computed:
            summary["influkit exact scores seconds"] = exact_seconds
        (out / f"{name}.json").write_text(json.dumps(summary, indent=1))
        np.savez_compressed(out / f"{name}.npz", influkit=tokens.float().numpy(), magic=magic.float().numpy())
        if not args.quick:
            from benchmarks.manifest import record as manifest

            manifest(out, [f"{name}.json", f"{name}.npz", "exact_scores.npz"],
                     note="bench venv (Bergson 2.5.1); 1 torch thread")
        print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=1))
    return 0


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    raise SystemExit(main())
