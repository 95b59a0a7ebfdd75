"""The peers of bench_index (issue 40), on its model and data: kronfluence's pairwise scores, TRAK's featurize +
score and Bergson's index build + query, each a query for a new finetune of the pretrained encoder.

None of the three is multi-stage, so each gets :class:`CrossStage`: one copy of the pretrained BERT encoder under
the masked-LM head (mode ``"pre"``: the corpus) and under each finetune (mode ``"head"``: the classification head;
mode ``"lora"``: the LoRA finetune's classifier, its adapters added to the query/value layers). A peer takes the
corpus examples' gradients in mode ``"pre"`` and the test examples' gradients in the finetune's mode, both with
respect to the encoder's ``nn.Linear`` layers (weights and biases; Bergson: weights) — what a single-stage tool can
do for a new finetune. The models' outputs are those of bench_index's models (:func:`check_cross_stage`).

Each peer reports, per query, the seconds a new finetune costs it, and where it keeps a store the build and the
query apart:

- :func:`kronfluence_peer` (kronfluence 1.0.1): EK-FAC factors fitted once (``fit_s``, on the fit sample, as
  influkit's stage-1 EK-FAC), then ``compute_pairwise_scores`` of the test set against the corpus — it stores no
  corpus gradients, so every query is a pass over the corpus (``query_s``, on the distinct sequences; scaled by
  the caller).
- :func:`trak_peer` (traker 0.3.2, CPU ``BasicProjector``): ``featurize`` of the corpus (``build_s``, the distinct
  sequences; scaled by the caller) into a store of ``train_set_size`` = the full corpus, the distinct rows copied to
  the repeats, then ``finalize_features`` over every row (``finalize_s``); a query is ``start_scoring_checkpoint`` +
  ``score`` + ``finalize_scores`` over every row (``query_s``).
- :func:`bergson_peer` (bergson 2.5.1): ``collect_gradients`` of the corpus (``build_s``, distinct; scaled), the
  rows copied into a ``gradients.bin`` of the full corpus, ``Attributor`` loading it (``load_s``), a query its
  ``trace`` of the test loss's backward (``query_s``).

Output functions: kronfluence and Bergson take the losses as bench_index's stages do (token-summed masked-LM
cross-entropy; the test examples' classification cross-entropy, summed or per test); TRAK takes its own kind, a
model output and Q: for a corpus sequence the sum over its masked tokens of log p/(1 − p) of the true token, Q the
mean of 1 − p; for a test example the classification margin, Q = 1 − p.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from benchmarks.resident import Peak
from benchmarks.bench_transformer import IGNORE, classification_losses, token_summed_losses


class Output:
    """What a Hugging Face model returns, as far as the peers read it: ``.logits``."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits


class Adapted(nn.Module):
    """A linear layer y = W x + b, plus s · B A x (the LoRA finetune's adapter) while the mode is ``"lora"``."""

    def __init__(self, base: nn.Linear, a: torch.Tensor, b: torch.Tensor, scale: float, modes: dict):
        super().__init__()
        self.base = base
        self.register_buffer("lora_a", a.detach().clone())
        self.register_buffer("lora_b", b.detach().clone())
        self.scale = scale
        self.modes = modes

    def forward(self, x):
        out = self.base(x)
        if self.modes["mode"] == "lora":
            out = out + self.scale * (x @ self.lora_a.T) @ self.lora_b.T
        return out


class CrossStage(nn.Module):
    """One copy of the pretrained BERT (``bert``: embeddings and encoder) under the masked-LM head and under each
    finetune's head; ``modes["mode"]`` ("pre", "head", "lora") picks the output. Input: packed (B, 2, T) ids and
    attention mask, or (B, T) ids."""

    def __init__(self, mlm: nn.Module, head: nn.Module, lora: nn.Module):
        super().__init__()
        self.modes = {"mode": "pre"}
        self.bert = copy.deepcopy(mlm.bert)
        self.cls = copy.deepcopy(mlm.cls)
        self.head_pooler, self.head_classifier = copy.deepcopy(head.bert.pooler), copy.deepcopy(head.classifier)
        inner = lora.base_model.model
        classifier = inner.classifier
        if hasattr(classifier, "modules_to_save"):  # peft's copy of the trained classifier
            classifier = classifier.modules_to_save["default"]
        self.lora_pooler, self.lora_classifier = copy.deepcopy(inner.bert.pooler), copy.deepcopy(classifier)
        encoder = dict(self.bert.encoder.named_modules())
        for name, module in inner.bert.encoder.named_modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                parent, _, child = name.rpartition(".")
                setattr(encoder[parent], child, Adapted(encoder[name], module.lora_A["default"].weight,
                                                        module.lora_B["default"].weight,
                                                        float(module.scaling["default"]), self.modes))
        self.eval()

    @property
    def base_model(self) -> nn.Module:
        return self.bert

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def forward(self, inputs: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Output:
        if inputs.dim() == 3:
            inputs, attention_mask = inputs[:, 0], inputs[:, 1]
        hidden = self.bert(input_ids=inputs, attention_mask=attention_mask).last_hidden_state
        mode = self.modes["mode"]
        if mode == "pre":
            return Output(self.cls(hidden))
        if mode == "head":
            return Output(self.head_classifier(self.head_pooler(hidden)))
        return Output(self.lora_classifier(self.lora_pooler(hidden)))


def tracked(model: CrossStage) -> list[str]:
    """The encoder's nn.Linear layers (each Adapted layer's base): what every peer takes gradients of."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.startswith("bert.encoder.")]


def check_cross_stage(model: CrossStage, mlm: nn.Module, head: nn.Module, lora: nn.Module, x: torch.Tensor) -> float:
    """The largest |difference| between :class:`CrossStage`'s outputs in each mode and the models it was built from,
    on packed inputs ``x`` (raises when one exceeds 1e-4)."""
    ids, mask = x[:, 0], x[:, 1]
    worst = 0.0
    with torch.no_grad():
        for mode, reference in (("pre", mlm), ("head", head), ("lora", lora)):
            model.modes["mode"] = mode
            worst = max(worst, float((model(x).logits - reference(input_ids=ids, attention_mask=mask).logits).abs().max()))
    model.modes["mode"] = "pre"
    if worst > 1e-4:
        raise RuntimeError(f"CrossStage differs from the models it was built from by {worst:.2e}")
    return worst


def _test_loss(model: CrossStage, mode: str, test) -> torch.Tensor:
    """(q,) the test examples' classification cross-entropy through the finetune ``mode``."""
    model.modes["mode"] = mode
    tx, ty = test
    return classification_losses(model(tx).logits, ty)


# ---------------------------------------------------------------------------------------------------- kronfluence
def kronfluence_peer(model: CrossStage, corpus, fit: torch.Tensor, queries: dict, *, batch: int = 16) -> dict:
    """kronfluence's EK-FAC on the encoder's linear layers: {"fit_s", "fit_peak_rss", "version", queries: {label:
    {"query_s", "peak_rss", "working_rss"}}}, each query ``compute_pairwise_scores`` of its test set (summed over the test examples
    unless per test) against every corpus sequence given. queries: {label: (mode, (tx, ty), per_test)}; fit: the
    corpus indices the factors are fitted on. Damping: kronfluence's own (0.1 × the mean eigenvalue)."""
    import kronfluence
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task
    from torch.utils.data import TensorDataset

    model = copy.deepcopy(model)
    modes, names = model.modes, tracked(model)

    class CrossStageTask(Task):
        query_mode = "head"

        def compute_train_loss(self, batch, model, sample=False):
            inputs, targets = batch
            modes["mode"] = "pre"
            logits = model(inputs).logits
            if sample:  # labels drawn from the model's own distribution at the masked positions (the Fisher)
                with torch.no_grad():
                    drawn = torch.multinomial(torch.softmax(logits.detach().reshape(-1, logits.shape[-1]), -1), 1)
                targets = torch.where(targets != IGNORE, drawn.reshape(targets.shape), targets)
            return token_summed_losses(logits, targets).sum()

        def compute_measurement(self, batch, model):
            return _test_loss(model, self.query_mode, batch).sum()

        def get_influence_tracked_modules(self):
            return names

    task = CrossStageTask()
    x, y = corpus
    out = {"version": kronfluence.__version__, "queries": {}}
    with tempfile.TemporaryDirectory(prefix="bench-index-kronfluence-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = prepare_model(model, task)
        analyzer = Analyzer("bench_index", model=model, task=task, cpu=True, disable_tqdm=True, output_dir=tmp)
        with Peak() as fitting:
            analyzer.fit_all_factors("ekfac", dataset=TensorDataset(x[fit], y[fit]), per_device_batch_size=batch,
                                     factor_args=FactorArguments(strategy="ekfac"), overwrite_output_dir=True)
        out |= {"fit_s": fitting.seconds, "fit_peak_rss": fitting.peak, "fit_working_rss": fitting.working}
        for label, (mode, test, per_test) in queries.items():
            task.query_mode = mode
            with Peak() as query:
                analyzer.compute_pairwise_scores(
                    label.replace(" ", "_"), "ekfac", query_dataset=TensorDataset(*test),
                    train_dataset=TensorDataset(x, y), per_device_query_batch_size=len(test[0]),
                    per_device_train_batch_size=batch,
                    score_args=ScoreArguments(aggregate_query_gradients=not per_test), overwrite_output_dir=True)
            scores = analyzer.load_pairwise_scores(label.replace(" ", "_"))["all_modules"]
            out["queries"][label] = {"query_s": query.seconds, "peak_rss": query.peak,
                                     "working_rss": query.working,
                                     "finite": bool(torch.isfinite(scores).all()), "shape": list(scores.shape)}
    return out


# ---------------------------------------------------------------------------------------------------- TRAK
def trak_output(modes: dict):
    """TRAK's model output for :class:`CrossStage` (module docstring), the attention mask left out (transformers'
    mask check is data-dependent, which vmap refuses; :func:`trak_peer` requires masks of ones)."""
    from trak.modelout_functions import AbstractModelOutput

    def margins(logits, labels):
        keep = labels != IGNORE
        logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        return (logp - torch.log1p(-logp.exp().clamp(max=1 - 1e-6))) * keep, (1 - logp.exp()) * keep, keep

    class CrossStageOutput(AbstractModelOutput):
        def __init__(self):
            super().__init__()

        def get_output(self, model, weights, buffers, ids, mask, labels):
            logits = torch.func.functional_call(model, (weights, buffers), (ids[None],)).logits
            if modes["mode"] == "pre":
                return margins(logits, labels[None])[0].sum()
            correct = logits.gather(-1, labels[None, None])[:, 0]
            others = logits.masked_fill(torch.arange(logits.shape[-1]) == labels, float("-inf")).logsumexp(-1)
            return (correct - others).sum()

        def get_out_to_loss_grad(self, model, weights, buffers, batch):
            ids, mask, labels = batch
            logits = torch.func.functional_call(model, (weights, buffers), (ids,)).logits
            if modes["mode"] == "pre":
                _, one_minus_p, keep = margins(logits, labels)
                return (one_minus_p.sum(-1) / keep.sum(-1).clamp(min=1)).detach()[:, None]
            return (1 - torch.softmax(logits, -1).gather(-1, labels[:, None])).detach()

    return CrossStageOutput()


def trak_peer(model: CrossStage, corpus, tile: int, queries: dict, *, proj_dim: int = 1024, batch: int = 50,
              workdir: Path | None = None) -> dict:
    """TRAK on the encoder's linear layers: {"build_s" (featurize of the given corpus), "build_peak_rss",
    "finalize_s" (every row of the corpus repeated ``tile`` times), "bytes_per_example" (the features),
    queries: {label: {"query_s", "peak_rss", "working_rss"}}} (module docstring)."""
    import trak
    from trak import TRAKer

    model = copy.deepcopy(model)
    names = [f"{m}.{p}" for m in tracked(model) for p in ("weight", "bias")]
    x, y = corpus
    if not (bool(x[:, 1].all()) and all(bool(q[1][0][:, 1].all()) for q in queries.values())):
        raise ValueError("trak_peer leaves the attention mask out: every mask must be ones (no padding).")
    n = len(x)
    total = n * tile
    work = Path(tempfile.mkdtemp(prefix="bench-index-trak-", dir=workdir))
    out = {"version": getattr(trak, "__version__", "0.3.2"), "proj_dim": proj_dim, "queries": {}}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traker = TRAKer(model=model, task=trak_output(model.modes), train_set_size=total, save_dir=str(work),
                            device="cpu", proj_dim=proj_dim, use_half_precision=False, projector_seed=0,
                            grad_wrt=names, logging_level=logging.WARNING)
            traker.load_checkpoint(model.state_dict(), model_id=0)
            model.modes["mode"] = "pre"
            with Peak() as build:
                for b in torch.arange(n).split(batch):
                    traker.featurize(batch=(x[b, 0], x[b, 1], y[b]), inds=b.numpy())
            store = traker.saver.current_store
            for j in range(1, tile):  # the repeats' rows are the distinct sequences' rows
                store["grads"][j * n:(j + 1) * n] = store["grads"][:n]
                store["out_to_loss"][j * n:(j + 1) * n] = store["out_to_loss"][:n]
            store["is_featurized"][:] = 1
            traker.saver.serialize_current_model_id_metadata()
            with Peak() as finalize:
                traker.finalize_features()
            out |= {"build_s": build.seconds, "build_peak_rss": build.peak, "build_working_rss": build.working,
                    "finalize_s": finalize.seconds,
                    "finalize_peak_rss": finalize.peak,
                    "bytes_per_example": store["features"].dtype.itemsize * store["features"].shape[1]}
            for label, (mode, (tx, ty), per_test) in queries.items():
                model.modes["mode"] = mode
                exp = label.replace(" ", "_")
                with Peak() as query:
                    traker.start_scoring_checkpoint(exp_name=exp, checkpoint=model.state_dict(), model_id=0,
                                                    num_targets=len(tx))
                    traker.score(batch=(tx[:, 0], tx[:, 1], ty), num_samples=len(tx))
                    scores = torch.as_tensor(np.asarray(traker.finalize_scores(exp_name=exp)))
                    if not per_test:
                        scores = scores.sum(1)
                out["queries"][label] = {"query_s": query.seconds, "peak_rss": query.peak,
                                     "working_rss": query.working,
                                         "finite": bool(torch.isfinite(scores).all()), "shape": list(scores.shape)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------------------- Bergson
def bergson_peer(model: CrossStage, corpus, tile: int, queries: dict, *, projection_dim: int = 8,
                 workdir: Path | None = None) -> dict:
    """Bergson's gradient index of the corpus (its causal-label convention, :func:`benchmarks.bergson_peer.causal_labels`)
    queried by each finetune's test loss: {"build_s" (the given corpus), "build_peak_rss", "bytes_per_example",
    "load_s" (``Attributor`` over the corpus repeated ``tile`` times), queries: {label: {"query_s", "peak_rss", "working_rss"}}}."""
    import bergson
    from bergson.query.attributor import Attributor

    from benchmarks.bergson_peer import build_index, causal_labels

    model = copy.deepcopy(model)
    model.modes["mode"] = "pre"
    x, y = corpus
    n = len(x)
    work = Path(tempfile.mkdtemp(prefix="bench-index-bergson-", dir=workdir))
    out = {"version": getattr(bergson, "__version__", "2.5.1"), "projection_dim": projection_dim, "queries": {}}
    try:
        built = work / "built"
        with Peak() as build:
            build_index(model, (x[:, 0], causal_labels(y)), built, projection_dim=projection_dim)
        full = work / "full"
        shutil.copytree(built, full, ignore=shutil.ignore_patterns("gradients.bin"))
        info = json.loads((built / "info.json").read_text())
        rows = np.fromfile(built / "gradients.bin", dtype=np.dtype(info["base_dtype"]))
        with open(full / "gradients.bin", "wb") as f:
            for _ in range(tile):
                rows.tofile(f)
        info["num_items"] = info["num_grads"] = n * tile
        (full / "info.json").write_text(json.dumps(info, indent=2))
        out |= {"build_s": build.seconds, "build_peak_rss": build.peak, "build_working_rss": build.working,
                "bytes_per_example": (built / "gradients.bin").stat().st_size / n}
        with Peak() as load:
            attributor = Attributor(str(full), device="cpu", unit_norm=False)
        out |= {"load_s": load.seconds, "load_peak_rss": load.peak, "rows": attributor.N}
        for label, (mode, test, per_test) in queries.items():
            with Peak() as query:
                with attributor.trace(model.base_model, k=None) as result:
                    _test_loss(model, mode, test).sum().backward()
                model.zero_grad()
                scores = result.scores if per_test else result.scores.sum(0)
            out["queries"][label] = {"query_s": query.seconds, "peak_rss": query.peak,
                                     "working_rss": query.working,
                                     "finite": bool(torch.isfinite(scores).all()), "shape": list(scores.shape)}
    finally:
        model.modes["mode"] = "pre"
        shutil.rmtree(work, ignore_errors=True)
    return out


def run_peer(name: str, fn, say=print) -> dict:
    """``fn()``, or {"error": the exception, named} where the peer does not run (reported, not fatal)."""
    start = time.perf_counter()
    try:
        return fn()
    except Exception as exc:  # a peer that cannot run here is reported with its reason
        import traceback

        traceback.print_exc()
        message = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
        say(f"{name} did not run ({time.perf_counter() - start:.1f} s): {message}")
        return {"error": message}
