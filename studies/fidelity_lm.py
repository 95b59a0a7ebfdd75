"""Fidelity on the transformer task: the LDS of influkit's pretraining solves on the LoRA language model (Case 1).

The task is ``studies/lm_pretrain_lora.py`` (imported, not copied): a 210k-parameter Llama-style decoder
pretrained on 400 vaderSentiment sentences, LoRA adapters (q_proj, v_proj) finetuned on 300 sentiment-conditioned
completions, 20 held-out test completions; the base is the shared block, only the adapters are trained (Case 1).

Warm-start protocol (the example's): for each of M random halves S_j of the 400 documents (α = 0.5,
``fidelity_tasks.random_halves``, seed 0), pretraining continues from the trained weights for 3 epochs of SGD over
the fixed full-set batch order with the documents outside S_j dropped, the new base goes into the LoRA model and
the adapters are refit (40 L-BFGS iterations from their solution); each test completion's NLL is recorded.

    LDS(t) = Spearman_j( Σ_{i∈S_j} score_i(t), NLL_t(S_j) ),  mean_t ± sem_t over the 20 test completions
    (``influkit.validation.lds_per_query``; scores in influkit's sign, positive = up-weighting raises the NLL).

Methods: the example's pretraining solves (``SOLVES``: exact, gauss-newton, ekfac, identity) and
``exact-sgd-damped``, the exact solve damped by 1/(η·T) to match the warm start's short SGD continuation, all with
the example's finetuning solve (``LMTask.chain``); ``default`` and ``default-training``, every solve setting of
both stages at its default (``DEFAULTS``; the second told the continuation's η and T).

Replay protocol (``replay``; issue 26's third protocol, as ``fidelity_replay.py`` runs it on digits and
Fashion-MNIST): the warm protocol's full-data continuation is recorded (``record_continuation``: 39 SGD steps over
the fixed batch order), and for each drop fraction f ∈ {1 %, 5 %, 10 %, 50 %} and each of M seeded random drop sets
D_j of ⌊f·400⌋ documents (``fidelity_replay.drop_sets``) the record is replayed with w_z = 0 for z ∈ D_j
(``ik.unrolled.replay``: same start, batches and learning rates), the replayed base set into the LoRA model and the
adapters refit exactly as the warm protocol does; deterministic (replaying with w = 1 reproduces the recorded base,
and one drop set replayed twice gives the same NLLs — both checked and reported), so the noise ceiling is 1. Every
cached ``scores_<method>.npz`` of the trained model ranks those NLLs (kept masks, as ``method_row`` takes them), and
the exact metagradient at each fraction's mean midpoint w = 1 − f/2 (``unrolled_scores(at=)``, cached under
``cache/lm-case1/replay`` with the re-trainings). Writes results/fidelity/replay_lm-case1.{md,json} and the replay
plot with ``fidelity_replay.write``.

Replay protocol with both stages recorded (``replay-recorded``; issue 26's point: differentiate the training that
actually ran across the pretrain → finetune boundary). The refit above is not recorded training: the exact
metagradient reaches it only through a Case 1 implicit adjoint at an optimum 40 L-BFGS iterations do not reach, and
``replay-linearity`` shows the refit is what responds nonlinearly. Here both stages are recorded in one
``ik.unrolled.Record`` (``record_both``): the continuation as above, then the adapters finetuned from their trained
values on the continued base (Case 1 LoRA link ``hf.lora_link``) by ``ik.unrolled.SGD`` (SGD so the approximate
unrolling can linearize it) over 30 seeded mini-batches of 32 of the 300 completions — the continuation at lr 0.01
and the adapters at lr 0.001 without momentum, below the edge of stability (``RECORDED_CONTINUE_LR``: why; the
example's rates, 0.05 and 0.003 + momentum 0.9, with ``--continue-lr 0.05 --finetune 0.003 0.9``). For
each f and each of M drop sets the record is replayed with the dropped documents weighted 0 (the completions 1) and
the test NLLs of the final LoRA model ranked by: the exact metagradient through both stages
(``ik.unrolled.metagradients(record, test, per_test=True)``: the adjoint on the fixed base accumulated over every
finetuning step is handed to the continuation), the same at each fraction's midpoint (``at=[1 − f/2, None]``: the
documents at 1 − f/2, the completions as recorded), the approximate unrolling across both stages
(``ik.unrolled.approximate``, 3 segments per stage, EK-FAC fitted at each segment's end from the empirical Fisher —
the example's EK-FAC setting — and from the sampled Fisher, the library default), and every cached
``scores_<method>.npz`` of the trained model. The same pass gives the completions' own scores, checked by replaying
with dropped completions (20 drop sets per fraction). Writes results/fidelity/replay_lm-case1_recorded_lr0.01_ft0.001m0
.{md,json} (the rates in the name, ``recorded_task``) and its panel of the replay plot; cached under
``results/fidelity/cache/lm-case1/replay-recorded``. ``replay-recorded-linearity`` replays the first M 1 % drop sets
at a tenth and a hundredth of the drop and doubled (w = 1 − t·1_D), ranked by the same metagradient:
results/fidelity/<the same name>_linearity.md.

Noise ceiling: the same subsets re-trained under another batch order (seed + 1); its LDS is the Spearman, per test
completion, between the two re-trainings' NLLs.

Resumable: the trained models, every re-training and every score matrix are cached under
``results/fidelity/cache/lm-case1`` (git-ignored). Steps (run ``train`` first; the others can run side by side):

    python -m studies.fidelity_lm train
    python -m studies.fidelity_lm retrain --subsets 40 --order 0     # order 1: the noise ceiling
    python -m studies.fidelity_lm score     # exact, ekfac, identity, gauss-newton, exact-sgd-damped
    python -m studies.fidelity_lm table --subsets 40
    python -m studies.fidelity_lm unrolled  # record the continuation: unrolled exact + segments (EK-FAC)
    python -m studies.fidelity_lm unrolled-table --subsets 100   # every cached method, one trained model
    python -m studies.fidelity_lm restore   # the committed M = 100 outputs of lm-case1_warm_unrolled
    python -m studies.fidelity_lm unrolled --finetuning default  # exact, adjoint from the default solve
    python -m studies.fidelity_lm unrolled --finetuning default --at mean  # ... at the mean weights
    python -m studies.fidelity_lm unrolled --at midpoint  # exact at continuation weights 0.75 (midpoint rule)
    python -m studies.fidelity_lm unrolled --at mean      # exact at the halves' mean weights 0.5 (mean rule)
    python -m studies.fidelity_lm unrolled --at mean --orders 4   # ... averaged over 4 batch orders
    python -m studies.fidelity_lm unrolled --top 20 [--at mean]   # EK-FAC segments + 20 Hessian pairs
    python -m studies.fidelity_lm unrolled --top 20 --top-curvature gauss-newton   # ... Gauss-Newton pairs
    python -m studies.fidelity_lm defaults-table --subsets 100   # cached rows + committed rows + ceiling
    python -m studies.fidelity_lm replay --subsets 20   # replay protocol: cached rows + midpoint per fraction
    python -m studies.fidelity_lm replay-linearity --subsets 5   # 1 % drops: linear in w with/without refit?
    python -m studies.fidelity_lm replay-recorded --subsets 50   # replay, both stages recorded (~15 min)
    python -m studies.fidelity_lm replay-recorded-linearity --subsets 20   # is that run linear in w?
    python -m studies.fidelity_lm replay-recorded-check --subsets 4   # float64: derivative right? how far?
    python -m studies.fidelity_lm curvature-check   # EK-FAC's top eigenvalue vs Gauss-Newton's, Hessian's
    python -m studies.fidelity_lm replay-recorded --subsets 50 --continue-lr 0.05 --finetune 0.003 0.9
    python -m studies.fidelity_lm replay-recorded --subsets 50 --continue-lr 0.02 --finetune 0.003 0.9
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy.stats import spearmanr
from tqdm.auto import tqdm

import influkit as ik
from benchmarks.common import machine_info, study
from studies.fidelity_tasks import random_halves
from influkit import hf
from influkit.chain import Query
from influkit.params import ParamSpace
from influkit.validation import lds_per_query

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "studies" / "results" / "fidelity"
CACHE = RESULTS / "cache" / "lm-case1"
TASK = "lm-case1"
SUBSET_SEED = 0
METHODS = ("exact", "ekfac", "identity", "gauss-newton", "exact-sgd-damped", "default", "default-training")
# methods whose finetuning (adapters) solve is at its defaults too, every solve setting of the chain at its default
DEFAULTS = ("default", "default-training")
FINETUNE_ITERATIONS, FINETUNE_SAMPLES = 30, 64


def example():
    """The study module ``studies/lm_pretrain_lora.py`` (studies/ is not a package)."""
    return study("lm_pretrain_lora")


class LMTask:
    """The example's data, trained pretraining stage, LoRA stage and link, trained once and cached."""

    def __init__(self, progress: bool = True):
        self.ex = ex = example()
        self.cfg = cfg = ex.Config()
        self.data = data = ex.load_data(cfg)
        torch.manual_seed(cfg.seed)
        pre_model = ex.LlamaForCausalLM(ex.model_config(cfg, len(data["tokenizer"]))).eval()
        self.pre = hf.causal_lm_stage(pre_model, data["documents"], regularizer=ex.l2(cfg.pre_decay))
        self.test = hf.pack(data["test"])
        trained = CACHE / "trained.pt"
        if trained.exists():
            state = torch.load(trained)
            pre_model.load_state_dict(state["pre"])
            self.fin = self.lora_stage(pre_model)
            self.fin.model.load_state_dict(state["fin"])
            self.info = state["info"]
        else:
            start = time.perf_counter()
            ex.pretrain(self.pre, cfg, progress)
            self.fin = self.lora_stage(pre_model)
            grad_norm = ex.fit_adapters(self.fin, max_iter=200, rounds=2)
            self.info = {"lora_grad_norm": grad_norm, "test_nll_sum": ex.test_loss_sum(self.fin, self.test),
                         "train_seconds": time.perf_counter() - start}  # fmt: skip
            CACHE.mkdir(parents=True, exist_ok=True)
            torch.save({"pre": pre_model.state_dict(), "fin": self.fin.model.state_dict(), "info": self.info}, trained)
        self.link = hf.lora_link(self.pre, self.fin, case=1)
        self.n = len(self.pre)

    def lora_stage(self, pre_model) -> ik.Stage:
        ex, cfg = self.ex, self.cfg
        return hf.causal_lm_stage(ex.lora_model(pre_model, cfg), self.data["train"], regularizer=ex.l2(cfg.fin_decay))

    @contextlib.contextmanager
    def restored(self):
        """The trained models as they were, restored on leaving the block whatever it changed."""
        pre_state = {k: v.clone() for k, v in self.pre.model.state_dict().items()}
        fin_state = {k: v.clone() for k, v in self.fin.model.state_dict().items()}
        try:
            yield
        finally:
            self.pre.model.load_state_dict(pre_state)
            self.fin.model.load_state_dict(fin_state)

    def test_nll(self) -> np.ndarray:
        """(q,) the test completions' NLLs under the LoRA model as it is now."""
        with torch.no_grad():
            return self.fin.losses(self.fin.trained(), *self.test).double().numpy()

    def retrain(self, kept: torch.Tensor, order: int) -> np.ndarray:
        """(q,) test-completion NLLs after the warm-start re-training on the documents ``kept`` (bool, (n,)),
        batch order ``cfg.seed + 7 + order`` (order 0 is the example's); the trained models are restored after."""
        ex, cfg = self.ex, self.cfg
        with self.restored():
            ex.continue_pretraining(self.pre, cfg, torch.nonzero(~kept).flatten(), cfg.seed + 7 + order)
            ex.set_base(self.fin, self.pre, self.link)
            ex.fit_adapters(self.fin, max_iter=cfg.refit_iter, rounds=1)
            return self.test_nll()

    def chain(self, method: str, finetuning: str = "example") -> ik.Chain:
        """The Case 1 chain with the example's pretraining solve ``method``. The finetuning solve: ``"example"``,
        the example's MINRES on H_F with fewer iterations and a sampled Hessian (FINETUNE_ITERATIONS,
        FINETUNE_SAMPLES: with 20 right-hand sides the example's, 100 iterations on all 300 completions, costs ~13 s
        an iteration here, 22 min in all); ``"default"``, every setting at its default (``auto``)."""
        ex, cfg = self.ex, self.cfg
        pre_solve, pre_curvature = solve_settings(ex, cfg, method)
        if finetuning == "default":
            fin_solve, fin_curvature = ik.SolveConfig(), ik.CurvatureConfig()
        else:
            fin_solve = ik.SolveConfig(solver="minres", damping=cfg.damping[1], max_iter=FINETUNE_ITERATIONS)
            fin_curvature = ik.CurvatureConfig(hessian_samples=FINETUNE_SAMPLES, seed=cfg.seed)
        return ik.Chain([self.pre, self.fin], [self.link], solve=[pre_solve, fin_solve],
                        curvature=[pre_curvature, fin_curvature])

    def pretraining_rhs(self, progress: bool = True, finetuning: str = "example") -> tuple[torch.Tensor, dict, float]:
        """(rhs, finetuning solve summary, seconds): the per-test right-hand sides b_t − H_WΘ H_F⁻¹ a_t of the
        pretraining solve. They do not depend on the pretraining solver, so the per-test finetuning solve (20
        right-hand sides, the costly part) is done once per ``finetuning`` setting (``chain``): the identity
        chain's s is its right-hand side. The summary carries where the LoRA stage stands."""
        start = time.perf_counter()
        query = self.chain("identity", finetuning).query(self.test, per_test=True, progress=progress)
        return query.s, query.solves[1] | {"stage_position": query.stages[1]}, time.perf_counter() - start

    def scores(self, method: str, rhs: torch.Tensor, finetuning_solve: dict, progress: bool = True):
        """((n, q) per-test-completion scores, seconds of the pretraining solve and the scoring, the pretraining
        solve's summary with where the pretraining stage stands) of ``method``."""
        start = time.perf_counter()
        chain = self.chain(method, finetuning_of(method))
        solution = chain.solver(0).solve(rhs, progress=progress)
        query = Query(chain, solution.x, True, self.test[0].shape[0], [solution, finetuning_solve], {}, "lm-test")
        res = query.scores(progress=progress)
        values = res.values.double().numpy()
        return values.reshape(self.n, -1), time.perf_counter() - start, query.solves[0] | {
            "stage_position": chain.positions[0].summary()}


def finetuning_of(method: str) -> str:
    """The finetuning solve setting (``LMTask.chain``) a method is scored with: the defaults' own, or the example's."""
    return "default" if method in DEFAULTS else "example"


def rhs_path(finetuning: str) -> Path:
    return CACHE / ("pretraining_rhs.pt" if finetuning == "example" else f"pretraining_rhs_{finetuning}.pt")


UNROLLED = ("unrolled-exact", "unrolled-segments-ekfac")
# the exact unrolling at the mean midpoint of the protocol's removals: continuation weights 1 − α/2 (α = 0.5)
UNROLLED_MIDPOINT = "unrolled-exact-midpoint"
MIDPOINT_WEIGHT = 0.75
# the exact unrolling at the subsets' mean weights: continuation weights α = 0.5 (fidelity_replay.mean_weight)
UNROLLED_MEAN = "unrolled-exact-mean"
MEAN_WEIGHT = 0.5
AT_METHODS = {UNROLLED_MIDPOINT: MIDPOINT_WEIGHT, UNROLLED_MEAN: MEAN_WEIGHT}  # method: continuation weight
SEGMENTS = 3  # pieces of the 39-step continuation for the approximate unrolling (one per epoch)


def record_continuation(task: LMTask, progress: bool = True, order: int = 0) -> ik.unrolled.Record:
    """The warm protocol's SGD continuation on all documents, recorded (``ik.unrolled``); updates task.pre in place.

    Same batches (``batch_order``, seed cfg.seed + 7 + ``order``; the protocol's is order 0) and learning rate as
    ``continue_pretraining``. There a step's loss is Σ_{kept} ℓ / B with B = cfg.pre_batch fixed, so dropping a document is exactly weighting it 0
    in its fixed batch — the record's w_z. The record averages over the batch actually given (1/|B_t|); the last
    batch of each epoch has 400 − 12·32 = 16 documents, so it is recorded with lr·16/32, which makes its data term
    the protocol's exactly and halves only its L2 term's step (pre_decay = 1e-4, 3 of 39 steps).
    """
    ex, cfg = task.ex, task.cfg
    batches = ex.batch_order(task.n, cfg.pre_batch, cfg.continue_epochs, cfg.seed + 7 + order)
    record = ik.unrolled.Record()
    every = int(np.ceil(np.sqrt(len(batches))))
    with record.recorder(task.pre, ik.unrolled.SGD(lr=cfg.continue_lr), checkpoint_every=every) as rec:
        for b in tqdm(batches, desc="continuation (recorded)", disable=not progress, leave=False):
            rec.step(b, cfg.continue_lr * len(b) / cfg.pre_batch)
    return record


@dataclass
class WarmAdjoint:
    """The warm protocol's continuation recorded (and re-run at w = ``at``), the adapters refit on its final base,
    and the finetuning stage's adjoint on that base (``warm_adjoint``), with what it took (``info``)."""

    record: ik.unrolled.Record
    adjoint: ik.unrolled.Adjoint
    seconds: dict  # of the shared steps: recording, re-run, refit + finetuning adjoint
    retrain_seconds: float  # one protocol re-training timed beside them
    info: dict


def protocol_retraining(task: LMTask, order: int) -> tuple[float, dict]:
    """(seconds, final base): one protocol re-training with nothing dropped (continuation + refit), timed; the
    trained models are restored after."""
    ex, cfg = task.ex, task.cfg
    with task.restored():
        start = time.perf_counter()
        ex.continue_pretraining(task.pre, cfg, None, cfg.seed + 7 + order)
        base = {k: v.clone() for k, v in task.pre.model.state_dict().items()}
        ex.set_base(task.fin, task.pre, task.link)
        ex.fit_adapters(task.fin, max_iter=cfg.refit_iter, rounds=1)
        return time.perf_counter() - start, base


def warm_adjoint(task: LMTask, progress: bool, finetuning: str, at: float | None, order: int) -> WarmAdjoint:
    """The start of every unrolled row of the warm protocol; leaves the re-run base in task.pre and the refit
    adapters in task.fin (call inside ``task.restored()``).

    After the recorded full-data continuation (re-run with every document weighted ``at`` when given:
    ``ik.unrolled.reweighted``) the base goes into the LoRA model and the adapters are refit (as the protocol does,
    cfg.refit_iter L-BFGS iterations); the adapters being (near) their optimum Θ*(W), the test NLL's derivative with
    respect to the final base is the Case 1 chain's df/dW = b − H_WΘ H_F⁻¹ a (the identity chain's pretraining
    right-hand side, with the finetuning solve ``finetuning``: ``LMTask.chain``), handed into the continuation's
    reverse pass as ``ik.unrolled.Adjoint``. ``order``: the continuation recorded under batch order ``order``
    (the protocol's is 0). Also times one protocol re-training and compares its base with the record's."""
    cfg = task.cfg
    retrain_seconds, protocol_base = protocol_retraining(task, order)
    start = time.perf_counter()
    record = record_continuation(task, progress, order)
    record_seconds = time.perf_counter() - start
    final = record.runs[0].final
    info = {"record_vs_protocol_max_abs": max(float((final[n] - protocol_base[n]).abs().max()) for n in final),
            "base_max_abs": max(float(protocol_base[n].abs().max()) for n in final), "steps": record.runs[0].steps}
    seconds = {"record (the continuation, recorded)": record_seconds}
    if at is not None:  # the continuation re-run at w = at; its final base goes into the pretrained model
        start = time.perf_counter()
        record = ik.unrolled.reweighted(record, torch.full((task.n,), at, dtype=torch.float64), progress=progress)
        final = record.runs[0].final
        base_into(task, final)
        seconds["re-run at w = at (reweighted)"] = time.perf_counter() - start
    start = time.perf_counter()
    task.ex.set_base(task.fin, task.pre, task.link)
    info["refit_grad_norm"] = task.ex.fit_adapters(task.fin, max_iter=cfg.refit_iter, rounds=1)
    query = task.chain("identity", finetuning).query(task.test, per_test=True, progress=progress)
    seconds["refit + finetuning adjoint"] = time.perf_counter() - start
    info["finetuning_solve"] = query.solves[1] | {"stage_position": query.stages[1]}
    names = query.chain.plans[0].trained
    adjoint = ik.unrolled.Adjoint(ParamSpace({n: final[n] for n in names}).unflatten(query.s), batched=True)
    return WarmAdjoint(record, adjoint, seconds, retrain_seconds, info | {"at": at})


def exact_row(task: LMTask, warm: WarmAdjoint, progress: bool) -> tuple[np.ndarray, dict]:
    """((n, q), info): the exact metagradient, reverse mode through the (re-run) continuation from the adjoint."""
    start = time.perf_counter()
    exact = ik.unrolled.metagradients(warm.record, warm.adjoint, per_test=True, progress=progress)[0]
    return exact.values.double().numpy(), {"pass": ("reverse pass", time.perf_counter() - start),
                                           "replay": exact.diagnostics["replay"], "memory": exact.diagnostics["memory"]}


def segments_row(task: LMTask, warm: WarmAdjoint, progress: bool, top: int,
                 top_curvature: str = "hessian") -> tuple[np.ndarray, dict]:
    """((n, q), info): the approximate unrolling (SOURCE) of the same adjoint through SEGMENTS pieces with EK-FAC
    fitted at each piece's end (the example's EK-FAC settings), completed by the continuation's ``top`` largest
    eigenpairs of its Hessian or Gauss-Newton matrix (``approximate(top=, top_curvature=)``; at w = ``at``, a uniform
    weight, the factored curvature is rescaled)."""
    start = time.perf_counter()
    approx = ik.unrolled.approximate(warm.record, warm.adjoint, segments=SEGMENTS, per_test=True, curvature="ekfac",
                                     config=task.ex.SOLVES["ekfac"](task.cfg)[1], top=top, top_curvature=top_curvature,
                                     progress=progress)[0]
    label = "segments (EK-FAC per piece" + (" + top directions)" if top else ")")
    diagnostics = approx.diagnostics
    return approx.values.double().numpy(), {"pass": (label, time.perf_counter() - start), "top": diagnostics["top"],
                                            "settings": diagnostics["settings"], "stability": diagnostics["stability"]}


def exact_name(finetuning: str, at: float | None) -> str:
    """The row of the exact unrolling from the finetuning solve ``finetuning``'s adjoint at continuation weight
    ``at`` (None: as recorded)."""
    name = UNROLLED[0] if at is None else next((m for m, w in AT_METHODS.items() if w == at), f"{UNROLLED[0]}-at{at:g}")
    return name + ("" if finetuning == "example" else f"-{finetuning}-adjoint")


def segments_name(top: int, at: float | None, top_curvature: str = "hessian") -> str:
    """The row of the approximate unrolling with ``top`` directions of ``top_curvature``, at continuation weight
    ``at``."""
    if not top and at is None:
        return UNROLLED[1]
    return (f"{UNROLLED[1]}-top{top}" + ("" if top_curvature == "hessian" else f"-{top_curvature}")
            + ("" if at is None else f"-at{at:g}"))


def unrolled_scores(task: LMTask, progress: bool = True, finetuning: str = "example", at: float | None = None,
                    order: int = 0, rows: tuple[str, ...] = ("exact", "segments"), top: int = 0,
                    top_curvature: str = "hessian") -> dict:
    """{row name: ((n, q) scores, info)}: the warm protocol's unrolled rows from one ``warm_adjoint`` — "exact"
    (``exact_row``, named by ``exact_name``) and "segments" (``segments_row`` with ``top`` directions of
    ``top_curvature``, ``segments_name``). score_z = d NLL_t / d w_z; removal predicts −score. Each info carries its
    seconds (the shared record, re-run and adjoint, its own pass, and one protocol re-training timed beside them)
    and their total without the re-training."""
    kinds = {"exact": lambda warm: (exact_name(finetuning, at), *exact_row(task, warm, progress)),
             "segments": lambda warm: (segments_name(top, at, top_curvature),
                                       *segments_row(task, warm, progress, top, top_curvature))}
    out = {}
    with task.restored():
        warm = warm_adjoint(task, progress, finetuning, at, order)
        for kind in rows:
            name, values, info = kinds[kind](warm)
            label, seconds = info.pop("pass")
            spent = warm.seconds | {label: seconds}
            out[name] = (values, warm.info | info | {
                "seconds": spent | {"one protocol re-training": warm.retrain_seconds},
                "total_seconds": sum(spent.values())})
    return out


def orders_name(at: float, orders: int) -> str:
    """The row of the exact unrolling at continuation weight ``at`` averaged over ``orders`` batch orders."""
    return f"{exact_name('example', at)}-{orders}-orders"


def orders_scores(task: LMTask, progress: bool, at: float, orders: int) -> None:
    """scores_<orders_name>.npz: the exact metagradient at continuation weight ``at`` (``unrolled_scores(at=)``)
    averaged over the continuation recorded under batch orders 0 … orders − 1 — d E_order[NLL_t] / d w_z, the
    expected response, which the noise ceiling (0.86) says dominates a re-training. At lr 0.05 the continuation sits
    at its edge of stability (``ik.unrolled.sharpness``), where one run's derivative carries order-specific
    oscillations that the average removes. Measured (AMD EPYC, M = 100, 4 orders): 0.516 against order 0's own
    0.529 (the others 0.482–0.486) — the protocol re-trains under order 0, whose own derivative ranks best. Each
    order's scores are cached: order 0's as its own row (``unrolled --at``), the others under
    ``cache/lm-case1/orders``; seconds are summed over the orders."""
    directory = CACHE / "orders"
    directory.mkdir(parents=True, exist_ok=True)
    single = exact_name("example", at)
    values, infos = [], []
    for order in range(orders):
        path = CACHE / f"scores_{single}.npz" if order == 0 else directory / f"{single}_order{order}.npz"
        if not path.exists():
            (value, info), = unrolled_scores(task, progress, at=at, order=order, rows=("exact",)).values()
            np.savez(path, values=value, info=json.dumps(info, default=str))
        cached = np.load(path)
        values.append(cached["values"])
        infos.append(json.loads(str(cached["info"])))
    info = {"at": at, "orders": orders, "total_seconds": sum(i["total_seconds"] for i in infos),
            "seconds": {"one protocol re-training": infos[0]["seconds"]["one protocol re-training"]},
            "finetuning_solve": infos[0].get("finetuning_solve"),
            "per order": [{"total_seconds": i["total_seconds"], "refit_grad_norm": i["refit_grad_norm"]} for i in infos]}
    np.savez(CACHE / f"scores_{orders_name(at, orders)}.npz", values=np.mean(values, axis=0),
             info=json.dumps(info, default=str))


def unrolled_scores_cached(task: LMTask, progress: bool, finetuning: str = "example", at: float | None = None,
                           top: int = 0, top_curvature: str = "hessian") -> None:
    """Score the unrolled rows once (cached as ``scores_<row>.npz`` with their ``info``): with ``top``, only the
    approximate unrolling with that many directions of ``top_curvature``; at another finetuning solve than the
    example's or at a continuation weight ``at``, only the exact unrolling (the plain approximate one linearizes at
    w = 1 with the example's adjoint); else both."""
    rows = ("segments",) if top else ("exact",) if finetuning != "example" or at is not None else ("exact", "segments")
    names = {"exact": exact_name(finetuning, at), "segments": segments_name(top, at, top_curvature)}
    if not all((CACHE / f"scores_{names[row]}.npz").exists() for row in rows):
        for method, (values, info) in unrolled_scores(task, progress, finetuning, at, rows=rows, top=top,
                                                      top_curvature=top_curvature).items():
            np.savez(CACHE / f"scores_{method}.npz", values=values, info=json.dumps(info, default=str))


WARM_UNROLLED = f"{TASK}_warm_unrolled"


def write_unrolled_table(m: int, name: str = WARM_UNROLLED) -> None:
    """<name>.{csv,json,md} (default lm-case1_warm_unrolled) and its outputs: every cached method's LDS on the
    re-trainings cached under order 0 — all from the trained model in the cache, so scores and re-trainings belong
    to one model. Another ``name`` (another machine's trained model) gets its own section of lm_README_results.md.

    Seconds: influence rows, their pretraining solve and scoring + the shared finetuning solve; unrolled rows,
    recording the continuation + refit and finetuning adjoint + their pass, and their ratio to one protocol
    re-training (continuation + refit) timed in the same run.
    """
    outputs, m0 = cached_outputs(m, 0)
    if m0 < 3:
        raise SystemExit(f"only {m0} re-trainings cached: run `retrain` first")
    subsets = random_halves(example().Config().n_pretrain, m0, SUBSET_SEED).numpy()
    rows = [method_row(path, subsets, outputs) for path in sorted(CACHE.glob("scores_*.npz"))]
    details = {path.stem.removeprefix("scores_"): json.loads(str(np.load(path)["info"]))
               for path in sorted(CACHE.glob("scores_*.npz")) if "info" in np.load(path)}
    frame = pd.DataFrame(rows).sort_values("lds", ascending=False)
    frame.to_csv(RESULTS / f"{name}.csv", index=False)
    long = [{"subset": j, "order": 0, "test": t, "nll": float(v)} for j in range(m0) for t, v in enumerate(outputs[j])]
    with gzip.GzipFile(RESULTS / f"{name}_outputs.csv.gz", "wb", mtime=0) as fh:
        fh.write(pd.DataFrame(long).to_csv(index=False).encode())
    info = torch.load(CACHE / "trained.pt")["info"]
    summary = {"M": m0, "trained": info, "load": os.getloadavg(), "table": rows, "unrolled": details,
               "torch": torch.__version__, "python": platform.python_version()}
    (RESULTS / f"{name}.json").write_text(json.dumps(summary, indent=2, default=str))
    table = markdown(frame, summary).split("\n\n")[2]
    heading = "## LDS of the unrolled methods on the transformer task, warm protocol (studies/fidelity_lm.py)"
    section = (
        heading + ("" if name == WARM_UNROLLED else f", {name}") + "\n\n"
        f"All rows scored on one trained model (LoRA ‖∇‖ {info['lora_grad_norm']:.4f}, test NLL sum "
        f"{info['test_nll_sum']:.3f}: what `train` gives with today's code), against M = {m0} warm re-trainings of "
        "that model (order 0; no noise ceiling re-run). " + (
            "The M = 100 outputs of lm_README_results.md (its first table) come from an "
            "earlier trained model (‖∇‖ 0.0548, NLL 125.435) that today's code no longer reproduces; scored on today's "
            "model, EK-FAC ranks those at LDS 0.09, so they cannot rank today's scores. " if name == WARM_UNROLLED else
            f"Measured on {machine_info()}: `train` on this CPU gives another trained model than "
            f"{WARM_UNROLLED}'s (float rounding through 20 Adam epochs), so its re-trainings were run again here. ")
        + "Load average at table time "
        f"{', '.join(f'{v:.1f}' for v in summary['load'])} (2 shared cores, 1 torch thread).\n\n" + table + "\n")
    (RESULTS / f"{name}.md").write_text(section.replace("## ", "# ", 1))
    replace_section(RESULTS / "lm_README_results.md", section)
    print(frame.to_string(index=False))


def write_defaults_table(m: int) -> None:
    """lm-case1_warm_defaults.{csv,json,md}: the rows cached here (the defaults, the exact unrolling from the
    defaults' finetuning adjoint) on the committed order-0 re-trainings of today's trained model
    (lm-case1_warm_unrolled_outputs.csv.gz, copied into the cache), beside that table's committed rows (same model,
    same subsets) and the noise ceiling: per test completion, Spearman over the subsets re-trained under both batch
    orders between their two NLLs (order-1 outputs in lm-case1_warm_ceiling_outputs.csv.gz). With EK-FAC scored here
    too (a cached row replaces the committed one), each cached row's LDS − EK-FAC's, paired over the test completions."""
    outputs, m0 = cached_outputs(m, 0)
    if m0 < 3:
        raise SystemExit(f"only {m0} re-trainings cached: copy the committed outputs or run `retrain` first")
    subsets = random_halves(example().Config().n_pretrain, m0, SUBSET_SEED).numpy()
    rows = [method_row(path, subsets, outputs) | {"source": "this run"} for path in sorted(CACHE.glob("scores_*.npz"))]
    reference = CACHE / "scores_ekfac.npz"
    if reference.exists():  # paired over the test completions: LDS_t(method) − LDS_t(ekfac)
        ekfac = lds_per_query(np.load(reference)["values"], subsets, outputs)
        for row, path in zip(rows, sorted(CACHE.glob("scores_*.npz"))):
            diff = mean_sem(lds_per_query(np.load(path)["values"], subsets, outputs) - ekfac)
            row["minus_ekfac"], row["minus_ekfac_sem"] = diff[0], diff[1]
    committed = pd.read_csv(RESULTS / f"{TASK}_warm_unrolled.csv")
    rows += [row | {"source": f"{TASK}_warm_unrolled (committed)"} for row in committed.to_dict("records")
             if row["method"] not in {r["method"] for r in rows}]
    second, m1 = cached_outputs(m0, 1)
    if m1 >= 3:
        mean, sem, q = mean_sem(columnwise_spearman(outputs[:m1], second))
        rows.append({"method": "noise ceiling (another batch order)", "K": 1, "lds": mean, "sem": sem, "queries": q,
                     "M": m1, "seconds": float("nan"), "source": "this run"})
        long = [{"subset": j, "order": 1, "test": t, "nll": float(v)} for j in range(m1) for t, v in enumerate(second[j])]
        with gzip.GzipFile(RESULTS / f"{TASK}_warm_ceiling_outputs.csv.gz", "wb", mtime=0) as fh:
            fh.write(pd.DataFrame(long).to_csv(index=False).encode())
    frame = pd.DataFrame(rows).sort_values("lds", ascending=False)
    name = f"{TASK}_warm_defaults"
    frame.to_csv(RESULTS / f"{name}.csv", index=False)
    details = {}
    for path in sorted(CACHE.glob("scores_*.npz")):
        cached = np.load(path)
        details[path.stem.removeprefix("scores_")] = {key: json.loads(str(cached[key])) for key in
                                                      ("info", "solve", "finetuning_solve") if key in cached}
    info = torch.load(CACHE / "trained.pt")["info"]
    summary = {"M": m0, "M_ceiling": m1, "trained": info, "load": os.getloadavg(), "table": rows, "details": details,
               "torch": torch.__version__, "python": platform.python_version()}
    (RESULTS / f"{name}.json").write_text(json.dumps(summary, indent=2, default=str))
    lines = ["| method | LDS ± sem (q = 20) | − EK-FAC, paired | M | seconds | × one re-training | pretraining solve: "
             "residual, converged | finetuning solve: residual, converged | source |", "|---|---|---|---|---|---|---|---|---|"]
    for row in frame.to_dict("records"):
        paired = "—" if pd.isna(row.get("minus_ekfac", np.nan)) else f"{row['minus_ekfac']:+.3f} ± {row['minus_ekfac_sem']:.3f}"
        lines.append(f"| {row['method']} | {row['lds']:.3f} ± {row['sem']:.3f} | {paired} | {row['M']} | {cell(row.get('seconds'), '.0f')} "
                     f"| {cell(row.get('ratio_to_retraining'), '.1f')} | {cell(row.get('pretraining_residual'), '.2g')}, "
                     f"{cell(row.get('pretraining_converged'))} | {cell(row.get('finetuning_residual'), '.2g')}, "
                     f"{cell(row.get('finetuning_converged'))} | {row['source']} |")
    choices = [f"- {method}: pretraining — {d['solve'].get('choice') or '(as configured)'}; finetuning — "
               f"{d['finetuning_solve'].get('choice') or '(as configured)'}"
               for method, d in details.items() if "solve" in d and "finetuning_solve" in d]
    choices += [f"- {method}: finetuning adjoint — {d['info']['finetuning_solve'].get('choice') or '(as configured)'}"
                for method, d in details.items() if "info" in d]
    section = (
        "## LDS of the default settings on the transformer task, warm protocol (studies/fidelity_lm.py)\n\n"
        f"Scored on today's trained model (LoRA ‖∇‖ {info['lora_grad_norm']:.4f}, test NLL sum "
        f"{info['test_nll_sum']:.3f}, re-trained by `train` here) against the M = {m0} committed warm re-trainings of "
        f"that model ({TASK}_warm_unrolled_outputs.csv.gz), beside that table's rows. `default`/`default-training`: "
        "every solve setting of both stages at its default (`default-training` told the continuation's η, T); "
        "the committed rows use the example's finetuning solve (30 MINRES iterations on H_F + 0.001·I sampled on 64 "
        "completions: residual 0.54, not converged; lm-case1_warm_unrolled.json). Noise ceiling: "
        f"{m1} subsets re-trained under a second batch order. Load average at table time "
        f"{', '.join(f'{v:.1f}' for v in summary['load'])} (2 shared cores, 1 torch thread).\n\n"
        + "\n".join(lines) + "\n" + ("\nWhat auto chose:\n\n" + "\n".join(choices) + "\n" if choices else ""))
    (RESULTS / f"{name}.md").write_text(section.replace("## ", "# ", 1))
    replace_section(RESULTS / "lm_README_results.md", section)
    print(frame.drop(columns=["pretraining_choice", "finetuning_choice"], errors="ignore").to_string(index=False))


def replace_section(readme: Path, section: str) -> None:
    """Put ``section`` (a "## " heading and its text) into ``readme`` in place of the section with the same heading,
    or at its end; the other sections are kept."""
    heading = section.split("\n", 1)[0]
    parts = ("\n" + readme.read_text()).split("\n## ")
    sections = [parts[0].strip("\n")] + ["## " + part.strip("\n") for part in parts[1:]]
    replaced = [section.strip("\n") if part.split("\n", 1)[0] == heading else part for part in sections]
    if heading not in (part.split("\n", 1)[0] for part in sections):
        replaced.append(section.strip("\n"))
    readme.write_text("\n\n".join(replaced) + "\n")


def cell(value, spec: str = "") -> str:
    """A table cell: — for a missing value (None, NaN), else ``value`` formatted by ``spec``."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return "—"
    return format(value, spec)


def solve_settings(ex, cfg, method: str) -> tuple[ik.SolveConfig, ik.CurvatureConfig]:
    """The example's pretraining (solve, curvature) settings of ``method``, or ``exact-sgd-damped``: the exact solve with damping 1/(η·T),
    T the continuation's SGD steps. T steps of size η on a quadratic move θ by −[I − (I − ηH)^T] H⁻¹ ∇,
    i.e. H⁻¹ for curvatures ≫ 1/(ηT) and ηT·I below: the warm-start response is H⁻¹ damped by about 1/(ηT).
    ``default``: every pretraining solve setting at its default (``solver="auto"`` decides from where the stage
    stands); ``default-training``: the same, told the continuation's η and T (``ik.Training``)."""
    steps = cfg.continue_epochs * -(-cfg.n_pretrain // cfg.pre_batch)
    if method == "default":
        return ik.SolveConfig(), ik.CurvatureConfig()
    if method == "default-training":
        return ik.SolveConfig(training=ik.Training(lr=cfg.continue_lr, steps=steps)), ik.CurvatureConfig()
    if method != "exact-sgd-damped":
        return ex.SOLVES[method](cfg)
    solve, curvature = ex.SOLVES["exact"](cfg)
    return replace(solve, damping=1 / (cfg.continue_lr * steps)), curvature


def retrain_path(j: int, order: int) -> Path:
    return CACHE / f"retrain_order{order}_subset{j:04d}.npy"


def retrain_all(task: LMTask, m: int, order: int, progress: bool) -> None:
    subsets = random_halves(task.n, m, SUBSET_SEED)
    for j in tqdm(range(m), desc=f"re-training (order {order})", disable=not progress):
        path = retrain_path(j, order)
        if path.exists():
            continue
        start = time.perf_counter()
        losses = task.retrain(subsets[j], order)
        np.save(path, losses)
        print(f"subset {j} order {order}: {time.perf_counter() - start:.1f} s, NLL sum {losses.sum():.3f}", flush=True)


def restore_outputs(name: str) -> None:
    """Copy committed re-training outputs (``<name>_outputs.csv.gz``: subset, order, test, nll) into the cache, so
    new scores are ranked against them; cached re-trainings are kept. They belong to the trained model they were
    re-trained from: check ``train``'s test NLL sum against the one the committed table states."""
    frame = pd.read_csv(RESULTS / f"{name}_outputs.csv.gz")
    CACHE.mkdir(parents=True, exist_ok=True)
    for (order, j), group in frame.groupby(["order", "subset"]):
        if not retrain_path(j, order).exists():
            np.save(retrain_path(j, order), group.sort_values("test")["nll"].to_numpy(np.float64))
    print(f"{name}: {frame.groupby(['order', 'subset']).ngroups} re-trainings in {CACHE}")


def cached_outputs(m: int, order: int) -> tuple[np.ndarray, int]:
    """((M', q) NLLs, M') of the first M' ≤ m subsets re-trained under ``order`` (consecutive from 0)."""
    rows = []
    for j in range(m):
        if not retrain_path(j, order).exists():
            break
        rows.append(np.load(retrain_path(j, order)))
    return np.stack(rows) if rows else np.zeros((0, 0)), len(rows)


def shared_rhs(task: LMTask, finetuning: str, progress: bool) -> dict:
    """The pretraining right-hand sides of one finetuning setting, solved once and cached."""
    path = rhs_path(finetuning)
    if not path.exists():
        torch.save(dict(zip(("rhs", "finetuning_solve", "seconds"), task.pretraining_rhs(progress, finetuning))), path)
    shared = torch.load(path)
    print(f"finetuning solve ({finetuning}, shared): {shared['seconds']:.1f} s, {shared['finetuning_solve']}", flush=True)
    return shared


def score_all(task: LMTask, methods: list[str], progress: bool) -> None:
    """Every method's (n, q) scores; seconds = its pretraining solve + scoring + the shared finetuning solve."""
    for method in methods:
        path = CACHE / f"scores_{method}.npz"
        if path.exists():
            continue
        shared = shared_rhs(task, finetuning_of(method), progress)
        values, seconds, solve = task.scores(method, shared["rhs"], shared["finetuning_solve"], progress)
        np.savez(path, values=values, seconds=seconds + shared["seconds"], solve=json.dumps(solve, default=str),
                 finetuning_solve=json.dumps(shared["finetuning_solve"], default=str))
        print(f"{method}: {seconds:.1f} s + {shared['seconds']:.1f} s shared, solve {solve}", flush=True)


def mean_sem(per_query: np.ndarray) -> tuple[float, float, int]:
    valid = per_query[np.isfinite(per_query)]
    return float(valid.mean()), float(valid.std(ddof=1) / np.sqrt(len(valid))), len(valid)


def columnwise_spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.array([spearmanr(a[:, t], b[:, t])[0] for t in range(a.shape[1])])


def method_row(path: Path, subsets: np.ndarray, outputs: np.ndarray) -> dict:
    """One table row from a cached ``scores_<method>.npz``: LDS ± sem over the test completions, seconds, and for
    the unrolled methods (cached with ``info``) the ratio of their seconds to one protocol re-training."""
    method = path.stem.removeprefix("scores_")
    cached = np.load(path)
    mean, sem, q = mean_sem(lds_per_query(cached["values"], subsets, outputs))
    pretraining, finetuning = {}, {}
    if "info" in cached:
        info = json.loads(str(cached["info"]))
        seconds, ratio = info["total_seconds"], info["total_seconds"] / info["seconds"]["one protocol re-training"]
        finetuning = info.get("finetuning_solve") or {}
    else:
        seconds, ratio = float(cached["seconds"]), float("nan")
        pretraining = json.loads(str(cached["solve"]))
        if "finetuning_solve" in cached:
            finetuning = json.loads(str(cached["finetuning_solve"]))
    return {"method": f"influkit {method}", "K": 1, "lds": mean, "sem": sem, "queries": q, "M": len(outputs),
            "seconds": seconds, "pretraining_residual": pretraining.get("residual"), "ratio_to_retraining": ratio,
            "pretraining_converged": pretraining.get("converged"), "pretraining_choice": pretraining.get("choice"),
            "finetuning_residual": finetuning.get("residual"), "finetuning_converged": finetuning.get("converged"),
            "finetuning_choice": finetuning.get("choice")}


def write_table(m: int) -> None:
    """lm-case1_warm.csv/.json, the outputs as gzip CSV, and lm_README_results.md from the cached runs."""
    outputs, m0 = cached_outputs(m, 0)
    if m0 < 3:
        raise SystemExit(f"only {m0} re-trainings cached: run `retrain` first")
    subsets = random_halves(example().Config().n_pretrain, m0, SUBSET_SEED).numpy()
    rows = [method_row(path, subsets, outputs) for path in sorted(CACHE.glob("scores_*.npz"))]
    second, m1 = cached_outputs(m0, 1)
    ceiling = None
    if m1 >= 3:
        per_query = columnwise_spearman(outputs[:m1], second)
        mean, sem, q = mean_sem(per_query)
        ceiling = {"lds": mean, "sem": sem, "queries": q, "M": m1}
        rows.append({"method": "noise ceiling (another batch order)", "K": 1, "lds": mean, "sem": sem, "queries": q,
                     "M": m1, "seconds": float("nan"), "pretraining_residual": None})  # fmt: skip
    frame = pd.DataFrame(rows)
    frame.to_csv(RESULTS / f"{TASK}_warm.csv", index=False)
    long = [{"subset": j, "order": order, "test": t, "nll": float(v)}
            for order, out in ((0, outputs), (1, second if m1 else np.zeros((0, 0))))
            for j in range(out.shape[0]) for t, v in enumerate(out[j])]  # fmt: skip
    with gzip.GzipFile(RESULTS / f"{TASK}_warm_outputs.csv.gz", "wb", mtime=0) as fh:
        fh.write(pd.DataFrame(long).to_csv(index=False).encode())
    info = torch.load(CACHE / "trained.pt")["info"]
    shared = torch.load(CACHE / "pretraining_rhs.pt")
    summary = {"M": m0, "M_ceiling": m1, "ceiling": ceiling, "trained": info, "load": os.getloadavg(),
               "finetuning_solve": shared["finetuning_solve"], "finetuning_solve_seconds": shared["seconds"],
               "table": rows, "torch": torch.__version__, "python": platform.python_version()}  # fmt: skip
    (RESULTS / f"{TASK}_warm.json").write_text(json.dumps(summary, indent=2))
    (RESULTS / "lm_README_results.md").write_text(markdown(frame, summary))
    print(frame.to_string(index=False))


def markdown(frame: pd.DataFrame, summary: dict) -> str:
    """The table of lm_README_results.md: LDS ± sem, M, seconds per method, the noise ceiling last."""
    q = int(frame["queries"].max())
    lines = [f"| method | LDS ± sem (q = {q}) | M | seconds | × one re-training | pretraining solve ‖Hx − b‖/‖b‖ |",
             "|---|---|---|---|---|---|"]
    for row in frame.itertuples():
        seconds = "—" if np.isnan(row.seconds) else f"{row.seconds:.0f}"
        residual = row.pretraining_residual
        residual = "—" if residual is None or np.isnan(residual) else f"{residual:.2f}"
        ratio = getattr(row, "ratio_to_retraining", float("nan"))
        ratio = "—" if ratio is None or np.isnan(ratio) else f"{ratio:.1f}"
        lines.append(f"| {row.method} | {row.lds:.3f} ± {row.sem:.3f} | {row.M} | {seconds} | {ratio} | {residual} |")
    load = ", ".join(f"{v:.1f}" for v in summary["load"])
    return (
        "# LDS on the transformer task (studies/fidelity_lm.py)\n\n"
        "LoRA language model of studies/lm_pretrain_lora.py, Case 1 (the pretrained base is the shared block, the "
        "adapters are trained), warm-start re-training on M random halves of the 400 pretraining documents; LDS per "
        "test completion (Spearman over the subsets of the summed scores vs the re-trained completion NLL), mean ± "
        "standard error over the 20 test completions. Seconds: the method's pretraining solve and scoring plus the "
        "finetuning solve shared by all (1 torch thread, 2 shared cores; load average at table time "
        f"{load}).\n\n" + "\n".join(lines) + "\n\nWhat the numbers show: benchmarks/README.md, bench_fidelity, "
        "'Transformer task'.\n"
    )


REPLAY = CACHE / "replay"  # the replay protocol's re-trainings and midpoint scores (outside scores_*: not warm rows)


def base_into(task: LMTask, values: dict) -> None:
    """Copy continuation-final base values (``{name: tensor}`` of the pretraining model) into ``task.pre``."""
    named = dict(task.pre.model.named_parameters())
    with torch.no_grad():
        for n, value in values.items():
            named[n].copy_(value)


def replayed_nll(task: LMTask, record: ik.unrolled.Record, weights: torch.Tensor | None,
                 refit: bool = True) -> np.ndarray:
    """(q,) test NLLs of the replay protocol: the recorded continuation replayed with per-document ``weights``
    (0 = dropped; None = as recorded), its base set into the LoRA model, the adapters refit from their trained
    solution as the warm protocol does (cfg.refit_iter L-BFGS iterations; ``refit=False``: kept as trained); the
    trained models are restored after."""
    ex, cfg = task.ex, task.cfg
    with task.restored():
        base_into(task, ik.unrolled.replay(record, weights)[0])
        ex.set_base(task.fin, task.pre, task.link)
        if refit:
            ex.fit_adapters(task.fin, max_iter=cfg.refit_iter, rounds=1)
        return task.test_nll()


def replay_outputs(task: LMTask, record: ik.unrolled.Record, keep: torch.Tensor, fraction: float,
                   progress: bool) -> tuple[np.ndarray, list[float]]:
    """((M, q) replayed test NLLs, seconds of each one computed here) for the kept masks ``keep`` (cached)."""
    REPLAY.mkdir(parents=True, exist_ok=True)
    rows, seconds = [], []
    for j in tqdm(range(keep.shape[0]), desc=f"{TASK} replay {fraction:g}", disable=not progress):
        path = REPLAY / f"drop{fraction:g}_{j:04d}_{hashlib.sha256(keep[j].numpy().tobytes()).hexdigest()[:8]}.npy"
        if not path.exists():
            start = time.perf_counter()
            np.save(path, replayed_nll(task, record, keep[j].float()))
            seconds.append(time.perf_counter() - start)
        rows.append(np.load(path))
    return np.stack(rows), seconds


def refit_linearity(sets: int, progress: bool) -> None:
    """Why small drops rank poorly here: for the first ``sets`` drop sets D of 1 % (``drop_sets``), the replayed
    response Δ_t = (NLL(w = 1 − t·1_D) − NLL(w = 1)) / t at t = 1 and 0.1, with the adapters refit (the protocol)
    and with the adapters as trained; a response linear in w has cos(Δ_1, Δ_0.1) = 1. Also cos(Δ_1, p) with the
    exact metagradient's prediction p = −Σ_{z∈D} score_z. Cosines over the q test completions; writes
    results/fidelity/replay_lm-case1_refit.md."""
    from studies.fidelity_replay import drop_sets

    task = LMTask(progress)
    pre_state = {k: v.clone() for k, v in task.pre.model.state_dict().items()}
    record = record_continuation(task, progress)
    task.pre.model.load_state_dict(pre_state)
    score = np.load(CACHE / f"scores_{UNROLLED[0]}.npz")["values"]
    measures = {"refit": lambda w: replayed_nll(task, record, w),
                "fixed": lambda w: replayed_nll(task, record, w, refit=False)}
    base = {k: f(None) for k, f in measures.items()}
    cos = lambda a, b: float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))  # noqa: E731
    lines = ["| set | refit: cos(Δ_1, Δ_0.1) | refit: cos(Δ_1, p) | refit: ‖Δ_1‖ | fixed adapters: cos(Δ_1, Δ_0.1) "
             "| fixed adapters: ‖Δ_1‖ | ‖p‖ |", "|---|---|---|---|---|---|---|"]
    dropped = ~drop_sets(task.n, 0.01, sets)
    for j in tqdm(range(sets), desc="refit linearity", disable=not progress):
        p = -(dropped[j].double().numpy() @ score)
        d = {(k, t): (f(1.0 - t * dropped[j].float()) - base[k]) / t for k, f in measures.items() for t in (1.0, 0.1)}
        lines.append(f"| {j} | {cos(d['refit', 1.0], d['refit', 0.1]):.3f} | {cos(d['refit', 1.0], p):.3f} "
                     f"| {np.linalg.norm(d['refit', 1.0]):.3g} | {cos(d['fixed', 1.0], d['fixed', 0.1]):.3f} "
                     f"| {np.linalg.norm(d['fixed', 1.0]):.3g} | {np.linalg.norm(p):.3g} |")
    text = (f"# {TASK}, replay: is the response to a 1 % drop linear in w? (bench_fidelity_lm.py replay-linearity)\n\n"
            + " ".join(refit_linearity.__doc__.split()) + "\n\n" + "\n".join(lines) +
            "\n\nLoad average " + ", ".join(f"{v:.1f}" for v in os.getloadavg()) + ".\n")
    (RESULTS / f"replay_{TASK}_refit.md").write_text(text)
    print(text, flush=True)


def replay_midpoint(task: LMTask, fraction: float, progress: bool) -> tuple[np.ndarray, dict]:
    """((n, q) exact metagradient at continuation weights 1 − f/2, info) — ``unrolled_scores(at=)``: the adjoint
    taken at the re-run base with the adapters refit there (cached; at f = 50 % it is UNROLLED_MIDPOINT's)."""
    path = REPLAY / f"midpoint_f{fraction:g}.npz"
    if 1 - fraction / 2 == MIDPOINT_WEIGHT:  # the warm protocol's midpoint (halves) is this one: same record, same w
        path = CACHE / f"scores_{UNROLLED_MIDPOINT}.npz"
    if not path.exists():
        REPLAY.mkdir(parents=True, exist_ok=True)
        (values, info), = unrolled_scores(task, progress, "example", 1 - fraction / 2, rows=("exact",)).values()
        np.savez(path, values=values, info=json.dumps(info, default=str))
    cached = np.load(path)
    return cached["values"], json.loads(str(cached["info"]))


def replay_table(m: int, progress: bool, midpoint: bool = True) -> None:
    """The replay LDS protocol on the LM task (module docstring): results/fidelity/replay_lm-case1.{md,json}."""
    from studies.fidelity_replay import EXACT, FRACTIONS, MIDPOINT, drop_sets, write

    task = LMTask(progress)
    pre_state = {k: v.clone() for k, v in task.pre.model.state_dict().items()}
    record = record_continuation(task, progress)
    task.pre.model.load_state_dict(pre_state)
    verify_error = ik.unrolled.verify(record)
    final = record.runs[0].final
    start = time.perf_counter()
    replayed = ik.unrolled.replay(record, torch.ones(task.n))[0]
    replay_seconds = time.perf_counter() - start
    base_error = max(float((replayed[n] - final[n]).abs().max()) for n in final)
    start = time.perf_counter()
    full = replayed_nll(task, record, None)
    training = time.perf_counter() - start  # one training run: replay (continuation) + refit
    facts = {"task": TASK, "M": m, "n": task.n, "q": len(full),
             "one training run, seconds (continuation replayed + adapters refit, this run)": training,
             "of which the continuation's replay (39 SGD steps)": replay_seconds,
             "replay error (verify, max |Δ| over every checkpoint)": verify_error,
             "replay with all weights 1 vs the recorded final base, max |Δ|": base_error,
             "test NLL (recorded run, refit, summed)": float(full.sum()),
             "trained model (cache/lm-case1/trained.pt)": task.info}
    methods = {path.stem.removeprefix("scores_"): path for path in sorted(CACHE.glob("scores_*.npz"))}
    table, seconds, divisor, details, timings = {}, {}, {}, {}, {}
    for fraction in FRACTIONS:
        keep = drop_sets(task.n, fraction, m)
        outputs, timings[f"{fraction:g}"] = replay_outputs(task, record, keep, fraction, progress)
        for method, path in methods.items():
            row = method_row(path, keep.numpy(), outputs)
            name = EXACT if method == UNROLLED[0] else row["method"]  # the other tasks' row name
            if method in AT_METHODS:  # the warm protocol's midpoint or mean, the same scores at every fraction
                name += f" (at w = {AT_METHODS[method]}, every fraction)"
            table[name, fraction] = (row["lds"], row["sem"])
            seconds[name] = row["seconds"]
            ratio = row["ratio_to_retraining"]
            divisor[name] = row["seconds"] / ratio if np.isfinite(ratio) else training
        if midpoint:
            values, info = replay_midpoint(task, fraction, progress)
            mean, sem, _ = mean_sem(lds_per_query(values, keep.numpy(), outputs))
            table[MIDPOINT, fraction] = (mean, sem)
            details.setdefault(MIDPOINT, {})[f"f = {fraction:g}: seconds, replay"] = [info["seconds"], info["replay"]]
            seconds.setdefault(MIDPOINT, []).append(info["total_seconds"])
            divisor.setdefault(MIDPOINT, []).append(info["seconds"]["one protocol re-training"])
        print(f"drop {fraction:g}: " + ", ".join(f"{k[0]} {v[0]:.3f}" for k, v in table.items() if k[1] == fraction),
              flush=True)
    if midpoint:  # one pass per fraction: mean seconds, over the mean of the re-trainings timed beside them
        seconds[MIDPOINT], divisor[MIDPOINT] = float(np.mean(seconds[MIDPOINT])), float(np.mean(divisor[MIDPOINT]))
    # determinism: the first drop set of the smallest fraction replayed again, uncached
    again = replayed_nll(task, record, drop_sets(task.n, FRACTIONS[0], 1)[0].float())
    first = replay_outputs(task, record, drop_sets(task.n, FRACTIONS[0], 1), FRACTIONS[0], False)[0][0]
    facts["same drop set replayed twice (f = 1 %, j = 0), max |Δ NLL|"] = float(np.abs(again - first).max())
    computed = {f: round(float(np.mean(s)), 2) for f, s in timings.items() if s}
    if computed:  # absent when every drop set came from the cache
        facts["replay seconds per drop set computed here (mean per fraction)"] = computed
    facts["seconds and × training of the cached rows"] = (
        "scores_<method>.npz from the warm-protocol runs (same trained model); unrolled rows over the protocol "
        "re-training timed in their own run, influence rows over this run's training run")
    facts["load average"] = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    names = [name for name in dict.fromkeys(k[0] for k in table)]
    names.sort(key=lambda name: -table[name, FRACTIONS[0]][0])
    write(TASK, table, seconds, divisor, names, details, facts, RESULTS, FRACTIONS)


# ------------------------------------------------------------------ replay with both stages recorded (issue 26)

RECORDED = CACHE / "replay-recorded"  # its replayed outputs and score matrices (not warm rows: outside scores_*)
RECORDED_TASK = f"{TASK}_recorded"
EXAMPLE_FINETUNE = (0.003, 0.9)  # (lr, momentum) of SGD for the adapters, the example's scale
RECORDED_CONTINUE_LR, RECORDED_FINETUNE = 0.01, (0.001, 0.0)
"""The protocol's recorded run: the continuation at lr 0.01 and the adapters by SGD at lr 0.001 without momentum —
below the edge of stability at every checkpoint (``ik.unrolled.sharpness``: η·λ_max 0.70–0.71 of 2 and 0.69–1.47 of
2). At the example's own rates (continuation 0.05, adapters 0.003 + momentum 0.9) the continuation starts past its
edge (3.50 > 2) and then sits at it (1.91–1.97), and the run answers its own data weights linearly only for weight
changes ≲ 0.01 (``replay-recorded-check``): no first-order method ranks its drops (exact metagradient −0.07 to 0.03
on an AMD EPYC, 0.42–0.70 on an Intel Xeon, whose float rounding trains another model). Lowering only the
continuation's rate (0.02) leaves the adapters' first steps past theirs (4.09 > 3.8). The same choice as
``fidelity_replay.PRETRAIN_LR`` for Fashion-MNIST; ``--continue-lr 0.05 --finetune 0.003 0.9`` records the example's
rates."""
FINETUNE_STEPS, FINETUNE_BATCH, FINETUNE_SEED = 30, 32, 11  # 960 completions drawn: 3.2 passes over the 300
RECORDED_SEGMENTS = 3  # pieces per stage of the approximate unrolling (the continuation: one per epoch)
FINETUNE_DROP_SETS = 20  # drop sets per fraction of the finetuning completions' own scores


def record_both(task: LMTask, progress: bool = True) -> ik.unrolled.Record:
    """The two-stage record of the recorded replay protocol: the warm protocol's continuation (``record_continuation``)
    and then the adapters finetuned from their trained values by ``finetune_optimizer(task)`` (SGD, which the
    approximate unrolling can linearize) for FINETUNE_STEPS seeded mini-batches of FINETUNE_BATCH completions, the
    continued base fixed (``task.link``: Case 1, LoRA). The trained models are restored after."""
    with task.restored():
        record = record_continuation(task, progress)
        record.train(task.fin, finetune_optimizer(task), steps=FINETUNE_STEPS, batch_size=FINETUNE_BATCH,
                     seed=task.cfg.seed + FINETUNE_SEED, link=task.link, progress=progress)
    return record


def finetune_optimizer(task: LMTask) -> ik.unrolled.SGD:
    """The recorded finetuning's SGD: ``task.finetune`` (lr, momentum), set by ``recorded_task``, else the example's."""
    lr, momentum = getattr(task, "finetune", EXAMPLE_FINETUNE)
    return ik.unrolled.SGD(lr=lr, momentum=momentum)


def recorded_digest(task: LMTask) -> str:
    """8 hex characters naming the trained model and both recorded stages' settings (cache keys carry it)."""
    cfg = task.cfg
    text = json.dumps({"trained": task.info, "continuation": [cfg.continue_lr, cfg.continue_epochs, cfg.pre_batch],
                       "finetune": [repr(finetune_optimizer(task)), FINETUNE_STEPS, FINETUNE_BATCH, FINETUNE_SEED]},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def finetune_position(stage: ik.Stage, adapters: dict) -> dict:
    """F (mean completion NLL + L2 on the adapters) and ‖∇F‖ over the adapters at ``adapters``, base as in the model."""
    theta = {n: v.detach().clone().requires_grad_(True) for n, v in adapters.items()}
    x, y = stage.data.take(torch.arange(len(stage)))
    value = stage.losses(theta, x, y).mean() + stage.regularization(theta)
    gradient = torch.autograd.grad(value, list(theta.values()))
    return {"F": float(value), "grad_norm": float(torch.cat([g.reshape(-1) for g in gradient]).norm())}


def finetune_movement(task: LMTask, record: ik.unrolled.Record) -> dict:
    """Does the recorded finetuning move the adapters? F and ‖∇F‖ on the continued base before (the trained
    adapters) and after (the recorded final ones), ‖Δ adapters‖ / ‖adapters‖, and the summed test NLL both ways."""
    run = record.runs[1]
    before, after = run.checkpoints[0][0], run.checkpoints[run.steps][0]
    out = {}
    with task.restored():
        base_into(task, record.runs[0].final)
        task.ex.set_base(task.fin, task.pre, task.link)
        for name, adapters in (("before", before), ("after", after)):
            out[name] = finetune_position(task.fin, adapters)
            with torch.no_grad():
                out[name]["test_nll_sum"] = float(task.fin.losses(adapters, *task.test).sum())
    change = torch.cat([(after[n] - before[n]).reshape(-1) for n in before]).norm()
    out["relative_change"] = float(change / torch.cat([v.reshape(-1) for v in before.values()]).norm())
    return out


def recorded_outputs(task: LMTask, record: ik.unrolled.Record, keep: torch.Tensor, stage: int, fraction: float,
                     progress: bool) -> tuple[np.ndarray, list[float]]:
    """((M, q) test NLLs of the two-stage record replayed with each kept mask's dropped examples of ``stage`` weighted
    0 and the other stage's weights 1, seconds of each replay computed here) — cached."""
    RECORDED.mkdir(parents=True, exist_ok=True)
    rows, seconds, digest = [], [], recorded_digest(task)
    for j in tqdm(range(keep.shape[0]), desc=f"{RECORDED_TASK} stage {stage} {fraction:g}", disable=not progress):
        mask = hashlib.sha256(keep[j].numpy().tobytes()).hexdigest()[:8]
        path = RECORDED / f"stage{stage}_drop{fraction:g}_{j:04d}_{digest}_{mask}.npy"
        if not path.exists():
            weights = [None, None]
            weights[stage] = keep[j].float()
            start = time.perf_counter()
            np.save(path, ik.unrolled.outputs(record, task.test, weights).double().numpy())
            seconds.append(time.perf_counter() - start)
        rows.append(np.load(path))
    return np.stack(rows), seconds


def recorded_scores(task: LMTask, record: ik.unrolled.Record, name: str, compute) -> tuple[dict, dict]:
    """({key: values}, info) of a score computation ``compute() -> (arrays, info)``, cached under RECORDED."""
    path = RECORDED / f"{name}_{recorded_digest(task)}.npz"
    if not path.exists():
        RECORDED.mkdir(parents=True, exist_ok=True)
        arrays, info = compute()
        np.savez(path, info=json.dumps(info, default=str), **arrays)
    cached = np.load(path)
    return {k: cached[k] for k in cached.files if k != "info"}, json.loads(str(cached["info"]))


def exact_both_stages(task: LMTask, record: ik.unrolled.Record, progress: bool) -> tuple[dict, dict]:
    """The exact metagradient through both recorded stages, per test completion (pretraining (n, q), finetuning
    (n_fin, q), one pass), and the summed test NLL's (q = 1, MAGIC's setting) timed apart."""
    start = time.perf_counter()
    pre, fin = ik.unrolled.metagradients(record, task.test, per_test=True, progress=progress)
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    summed = ik.unrolled.metagradients(record, task.test, progress=progress)
    seconds_one = time.perf_counter() - start
    diag = pre.diagnostics
    info = {"seconds": seconds, "seconds, summed measure (q = 1)": seconds_one,
            "check: per-test columns sum to the q = 1 pass (pretraining, finetuning), max |Δ|": [
                float((pre.values.sum(1) - summed[0].values).abs().max()),
                float((fin.values.sum(1) - summed[1].values).abs().max())],
            "replay": diag["replay"], "memory": diag["memory"]}
    return {"pretraining": pre.values.double().numpy(), "finetuning": fin.values.double().numpy()}, info


def exact_at_both_stages(task: LMTask, record: ik.unrolled.Record, weight: float, progress: bool):
    """The exact metagradient at continuation weights ``weight`` (the midpoint 1 − f/2 or the mean 1 − f of dropping
    a fraction f of the documents), the finetuning stage at its recorded weights 1 (``at=[weight, None]``)."""
    start = time.perf_counter()
    pre = ik.unrolled.metagradients(record, task.test, per_test=True, at=[weight, None], progress=progress)[0]
    return {"pretraining": pre.values.double().numpy()}, {
        "seconds": time.perf_counter() - start, "at": pre.diagnostics["settings"]["at"],
        "replay": pre.diagnostics["replay"]}


def approximate_both_stages(task: LMTask, record: ik.unrolled.Record, fisher: str, progress: bool, top: int = 0,
                            top_curvature: str = "hessian"):
    """SOURCE-style unrolling across both stages: RECORDED_SEGMENTS pieces per stage, EK-FAC fitted at each piece's
    end (a dense Hessian is out of reach for the 210k-parameter continuation) from the ``fisher`` Fisher: "empirical"
    (the example's EK-FAC setting, per-document gradient covariance) or "sampled" (labels drawn from the model per
    token, ``CurvatureConfig()``'s default: the Gauss-Newton matrix in expectation, what a segment's closed form
    wants in place of the Hessian); ``top``: each stage's top eigenpairs of its Hessian or Gauss-Newton matrix
    (``top_curvature``) put in exactly (``approximate``'s ``top``)."""
    start = time.perf_counter()
    config = ik.CurvatureConfig(fisher=fisher, seed=task.cfg.seed)
    pre, fin = ik.unrolled.approximate(record, task.test, segments=RECORDED_SEGMENTS, per_test=True,
                                       curvature="ekfac", config=config, top=top, top_curvature=top_curvature,
                                       progress=progress)
    return {"pretraining": pre.values.double().numpy(), "finetuning": fin.values.double().numpy()}, {
        "seconds": time.perf_counter() - start, "settings": pre.diagnostics.get("settings"),
        "stability (pretraining, finetuning)": [pre.diagnostics["stability"], fin.diagnostics["stability"]],
        "top directions (pretraining, finetuning)": [pre.diagnostics["top"], fin.diagnostics["top"]]}


APPROXIMATE_FISHERS = {"empirical": "approximate-ekfac", "sampled": "approximate-ekfac-sampled"}  # fisher: cache name
TOP = 20  # eigenpairs per stage in the approximate rows that complete EK-FAC with them
TOP_CURVATURES = {"hessian": "Hessian", "gauss-newton": "Gauss-Newton"}  # approximate(top_curvature=): row label


def recorded_task(progress: bool, continue_lr: float = RECORDED_CONTINUE_LR,
                  finetune: tuple[float, float] = RECORDED_FINETUNE) -> tuple[LMTask, str]:
    """(the task, its results name) of the recorded replay protocol: the continuation recorded at ``continue_lr`` and
    the adapters by SGD at ``finetune`` = (lr, momentum) — by default the protocol's run below the edge of stability
    (RECORDED_CONTINUE_LR, RECORDED_FINETUNE). Each setting has its own caches, through ``recorded_digest``, and
    results replay_lm-case1_recorded[_lr<η>][_ft<η>m<μ>].*, a suffix for each rate that is not the example's."""
    task, name = LMTask(progress), RECORDED_TASK
    if continue_lr != task.cfg.continue_lr:
        task.cfg = replace(task.cfg, continue_lr=continue_lr)
        name += f"_lr{continue_lr:g}"
    task.finetune = tuple(finetune)
    if task.finetune != EXAMPLE_FINETUNE:
        name += f"_ft{finetune[0]:g}m{finetune[1]:g}"
    return task, name


def recorded_table(m: int, progress: bool, midpoint: bool = True, continue_lr: float = RECORDED_CONTINUE_LR,
                   finetune: tuple[float, float] = RECORDED_FINETUNE) -> None:
    """The replay protocol with both stages recorded (module docstring): results/fidelity/replay_lm-case1_recorded.*"""
    from studies.fidelity_replay import EXACT, FRACTIONS, MEAN, MIDPOINT, drop_sets, mean_weight, midpoint_weight, write

    rules = {MIDPOINT: ("midpoint", midpoint_weight), MEAN: ("mean", mean_weight)} if midpoint else {}
    task, results_name = recorded_task(progress, continue_lr, finetune)
    record = record_both(task, progress)
    runs = record.runs
    verify_error = ik.unrolled.verify(record)
    start = time.perf_counter()
    replayed = ik.unrolled.replay(record, [torch.ones(task.n), torch.ones(len(task.fin))])
    training = time.perf_counter() - start  # one training run of both stages (a replay at w = 1, warm)
    final_error = max(float((r[n] - run.final[n]).abs().max()) for r, run in zip(replayed, runs) for n in run.final)
    with torch.no_grad():
        full = task.fin.losses(replayed[-1], *task.test).double().numpy()
    movement = finetune_movement(task, record)
    exact, exact_info = recorded_scores(task, record, "exact", lambda: exact_both_stages(task, record, progress))
    approximations = {  # row name: (scores, info)
        f"unrolled approximate ({RECORDED_SEGMENTS} segments per stage, EK-FAC, {fisher} Fisher)": recorded_scores(
            task, record, cache, lambda fisher=fisher: approximate_both_stages(task, record, fisher, progress))
        for fisher, cache in APPROXIMATE_FISHERS.items()}
    for curvature, label in TOP_CURVATURES.items():
        approximations[f"unrolled approximate ({RECORDED_SEGMENTS} segments per stage, EK-FAC + top {TOP} {label} "
                       "directions, sampled Fisher)"] = recorded_scores(
            task, record, f"approximate-ekfac-top{TOP}-{curvature}", lambda c=curvature: approximate_both_stages(
                task, record, "sampled", progress, TOP, c))
    sharp = recorded_sharpness(task, record, progress)
    facts = {"task": results_name, "M": m, "n": task.n, "q": len(full),
             "stages recorded": [repr(run) for run in runs],
             "finetuning (recorded)": f"{finetune_optimizer(task)}, {FINETUNE_STEPS} steps of {FINETUNE_BATCH} completions "
                                      f"(seed cfg.seed + {FINETUNE_SEED}) from the trained adapters",
             "finetuning moves the adapters (F, ‖∇F‖ and summed test NLL on the continued base, before → after)": (
                 f"F {movement['before']['F']:.4f} → {movement['after']['F']:.4f}, ‖∇F‖ "
                 f"{movement['before']['grad_norm']:.3f} → {movement['after']['grad_norm']:.3f}, test NLL "
                 f"{movement['before']['test_nll_sum']:.3f} → {movement['after']['test_nll_sum']:.3f}, "
                 f"‖Δ adapters‖ / ‖adapters‖ {movement['relative_change']:.4f}"),
             "one training run of both stages, seconds (a replay at w = 1, this run)": training,
             "replay error (verify, max |Δ| over every checkpoint of both stages)": verify_error,
             "replay with all weights 1 vs the recorded final parameters (both stages), max |Δ|": final_error,
             "test NLL (recorded run, summed)": float(full.sum()),
             "sharpness (ik.unrolled.sharpness: η·λ_max per checkpoint vs the edge of stability; stage: values)": sharp}
    start = time.perf_counter()  # timed here, beside the training run it is compared with (not from the cache)
    ik.unrolled.metagradients(record, task.test)
    one = time.perf_counter() - start
    facts["exact metagradient: one summed measure (q = 1, MAGIC's setting), timed in this run"] = \
        f"{one:.2f} s = {one / training:.2f}× one training run of both stages"
    facts["exact metagradient: per-test columns vs the q = 1 pass, max |Δ| (pretraining, finetuning)"] = \
        exact_info["check: per-test columns sum to the q = 1 pass (pretraining, finetuning), max |Δ|"]
    cached = {path.stem.removeprefix("scores_"): path for path in sorted(CACHE.glob("scores_*.npz"))}
    table, seconds, divisor, details, timings = {}, {EXACT: exact_info["seconds"]}, {}, {}, {}
    seconds |= {name: info["seconds"] for name, (_, info) in approximations.items()}
    for fraction in FRACTIONS:
        keep = drop_sets(task.n, fraction, m)
        outputs, timings[f"{fraction:g}"] = recorded_outputs(task, record, keep, 0, fraction, progress)
        rows = {EXACT: exact["pretraining"]} | {name: values["pretraining"]
                                                 for name, (values, _) in approximations.items()}
        for rule, (cache, weight_of) in rules.items():
            values, info = recorded_scores(task, record, f"{cache}{fraction:g}", lambda: exact_at_both_stages(
                task, record, weight_of(fraction), progress))
            rows[rule] = values["pretraining"]
            seconds.setdefault(rule, []).append(info["seconds"])
            details.setdefault(rule, {})[f"f = {fraction:g}: at, replay check"] = [info["at"], info["replay"]]
        for name, values in rows.items():
            table[name, fraction] = mean_sem(lds_per_query(values, keep.numpy(), outputs))[:2]
        for method, path in cached.items():
            row = method_row(path, keep.numpy(), outputs)
            name = row["method"]  # as the replay_lm-case1 panel names it (one color per method in the plot)
            table[name, fraction] = (row["lds"], row["sem"])
            seconds[name] = row["seconds"]
            ratio = row["ratio_to_retraining"]
            divisor[name] = row["seconds"] / ratio if np.isfinite(ratio) else training
        print(f"drop {fraction:g}: " + ", ".join(f"{k[0]} {v[0]:.3f}" for k, v in table.items() if k[1] == fraction),
              flush=True)
    for rule in rules:
        seconds[rule] = float(np.mean(seconds[rule]))
    for name in (EXACT, *rules, *approximations):
        divisor.setdefault(name, training)
    # determinism: the first drop set of the smallest fraction replayed again, uncached
    keep = drop_sets(task.n, FRACTIONS[0], 1)
    again = ik.unrolled.outputs(record, task.test, [keep[0].float(), None]).double().numpy()
    first = recorded_outputs(task, record, keep, 0, FRACTIONS[0], False)[0][0]
    facts["same drop set replayed twice (f = 1 %, j = 0), max |Δ NLL|"] = float(np.abs(again - first).max())
    computed = {f: round(float(np.mean(s)), 2) for f, s in timings.items() if s}
    if computed:
        facts["replay seconds per drop set computed here (mean per fraction)"] = computed
    facts["finetuning completions' own scores (same pass as the exact row)"] = finetune_own_scores(
        task, record, {"exact": exact["finetuning"]} | {name.removeprefix("unrolled "): values["finetuning"]
                                                          for name, (values, _) in approximations.items()},
        min(m, FINETUNE_DROP_SETS), progress)
    facts["seconds of the unrolled rows"] = (
        "those of the run that computed them (cached under cache/lm-case1/replay-recorded, with its info), over this "
        "run's training run; the q = 1 pass above is timed beside that training run")
    facts["the rows named influkit <method>"] = (
        "the cached scores_<method>.npz of the warm-protocol runs on the same trained model: influence functions, "
        "and (influkit unrolled-*) the replay_lm-case1 protocol's unrolled rows through the continuation alone, "
        "from the refit's implicit adjoint; seconds as cached; × training: unrolled rows over their own protocol "
        "re-training, influence rows over this run's training run of both stages")
    facts["load average"] = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    details[EXACT] = {"replay check of the reverse pass": exact_info["replay"],
                      "memory": {k: v for k, v in exact_info["memory"].items() if "bytes" in k}}
    details |= {name: {"settings": info["settings"], "stability (pretraining, finetuning)": info.get(
        "stability (pretraining, finetuning)")} for name, (_, info) in approximations.items()}
    names = list(dict.fromkeys(k[0] for k in table))
    names.sort(key=lambda name: -table[name, FRACTIONS[0]][0])
    write(results_name, table, seconds, divisor, names, details, facts, RESULTS, FRACTIONS)


def recorded_sharpness(task: LMTask, record: ik.unrolled.Record, progress: bool) -> dict:
    """{stage: "η·λ_max at each checkpoint (edge e)"} from ``ik.unrolled.sharpness`` (20 Lanczos steps each), cached
    with the recorded scores."""
    def compute():
        table = ik.unrolled.sharpness(record, progress=progress)
        return {"table": table[["stage", "lr_times_eigenvalue", "edge"]].to_numpy(float)}, {}

    table = recorded_scores(task, record, "sharpness", compute)[0]["table"]
    return {int(k): ", ".join(f"{v:.2f}" for v in table[table[:, 0] == k, 1])
            + f" (edge {table[table[:, 0] == k, 2][0]:g})" for k in np.unique(table[:, 0])}


def finetune_own_scores(task: LMTask, record: ik.unrolled.Record, scores: dict[str, np.ndarray], m: int,
                        progress: bool) -> dict:
    """The finetuning completions' own scores (d test NLL / d w_x from the same passes: ``scores`` {row: (300, q)})
    checked the same way: m drop sets of the 300 completions per fraction, the record replayed with them weighted 0
    in the finetuning stage (documents weighted 1); LDS ± sem per fraction and row."""
    from studies.fidelity_replay import FRACTIONS, drop_sets

    exact = scores["exact"]
    out = {"shape": list(exact.shape), "exact, summed over the test completions: min / max": [
        float(exact.sum(1).min()), float(exact.sum(1).max())], "M": m, "rows": list(scores)}
    for fraction in FRACTIONS:
        keep = drop_sets(len(task.fin), fraction, m)
        outputs = recorded_outputs(task, record, keep, 1, fraction, progress)[0]
        cells = [mean_sem(lds_per_query(values, keep.numpy(), outputs))[:2] for values in scores.values()]
        out[f"LDS at drop {fraction:.0%}"] = " / ".join(f"{mean:.3f} ± {sem:.3f}" for mean, sem in cells)
    return out


LINEARITY_STEPS = (1.0, 0.1, 0.01, -1.0)  # t of w = 1 − t·1_D along a drop set D (1: the drop; −1: D doubled)


def recorded_linearity(m: int, progress: bool, continue_lr: float = RECORDED_CONTINUE_LR,
                       finetune: tuple[float, float] = RECORDED_FINETUNE) -> None:
    """Is the two-stage replayed run linear in the document weights at a 1 % drop? For the first m drop sets D_j of
    1 % (``drop_sets``) the record is replayed at w = 1 − t·1_{D_j} (completions at 1) for t in LINEARITY_STEPS;
    Δ_t = (NLL(w) − NLL(1)) / t per test completion, p_j = −Σ_{z∈D_j} score_z with the exact metagradient through
    both stages. A run linear in w has Δ_t = p for every t. Reported per t: LDS(p, Δ_t) (the protocol's LDS when
    t = 1; as t → 0 it tends to 1 if the metagradient is right), the median over sets of cos(Δ_t, p) and of
    cos(Δ_t, Δ_1) (cosines over the q completions), and the median ‖Δ_t‖ / ‖p‖. The response's second-order term
    along D, measured by replaying D doubled (t = −1): NLL(1 − t·1_D) − NLL(1) = t·Δ + t²·Q + O(t³) gives
    Q ≈ (Δ_1 − Δ_{−1}) / 2; the last row ranks the drop's response Δ_1 by p + Q (how much of the miss at t = 1 a
    second-order term explains). Writes results/fidelity/<the run's results name>_linearity.md (``recorded_task``)."""
    from studies.fidelity_replay import FRACTIONS, drop_sets

    task, results_name = recorded_task(progress, continue_lr, finetune)
    record = record_both(task, progress)
    exact, _ = recorded_scores(task, record, "exact", lambda: exact_both_stages(task, record, progress))
    keep = drop_sets(task.n, FRACTIONS[0], m)
    dropped = (~keep).double().numpy()
    predicted = -(dropped @ exact["pretraining"])  # (m, q)
    base = ik.unrolled.outputs(record, task.test).double().numpy()
    cos = lambda a, b: float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))  # noqa: E731
    delta = {}
    for t in LINEARITY_STEPS:
        if t == 1.0:
            outputs = recorded_outputs(task, record, keep, 0, FRACTIONS[0], progress)[0]
        else:
            outputs = np.stack([recorded_outputs(task, record, 1.0 - t * (~keep[j:j + 1]).float(), 0,
                                                 FRACTIONS[0] * t, False)[0][0]
                                for j in tqdm(range(m), desc=f"t = {t:g}", disable=not progress)])
        delta[t] = (outputs - base) / t
    lines = ["| t | LDS(p, Δ_t) | median cos(Δ_t, p) | median cos(Δ_t, Δ_1) | median ‖Δ_t‖ / ‖p‖ |",
             "|---|---|---|---|---|"]
    rows = {}
    for t, d in delta.items():
        lds, sem, _ = mean_sem(columnwise_spearman(predicted, d))
        rows[t] = {"lds": lds, "sem": sem, "cos_p": float(np.median([cos(d[j], predicted[j]) for j in range(m)])),
                   "cos_1": float(np.median([cos(d[j], delta[1.0][j]) for j in range(m)])),
                   "ratio": float(np.median(np.linalg.norm(d, axis=1) / np.linalg.norm(predicted, axis=1)))}
        r = rows[t]
        lines.append(f"| {t:g} | {lds:.3f} ± {sem:.3f} | {r['cos_p']:.3f} | {r['cos_1']:.3f} | {r['ratio']:.3f} |")
    second = predicted + (delta[1.0] - delta[-1.0]) / 2  # p + Q
    lds, sem, _ = mean_sem(columnwise_spearman(second, delta[1.0]))
    lines.append(f"| 1, ranked by p + Q | {lds:.3f} ± {sem:.3f} "
                 f"| {np.median([cos(delta[1.0][j], second[j]) for j in range(m)]):.3f} | — | — |")
    text = (f"# {results_name}: is the two-stage replayed run linear in the document weights at a 1 % drop? "
            f"(bench_fidelity_lm.py replay-recorded-linearity, M = {m})\n\n"
            + " ".join(recorded_linearity.__doc__.split()) + "\n\n" + "\n".join(lines) +
            "\n\nLoad average " + ", ".join(f"{v:.1f}" for v in os.getloadavg()) + ".\n")
    (RESULTS / f"replay_{results_name}_linearity.md").write_text(text)
    print(text, flush=True)


def curvature_check(progress: bool, continue_lr: float = RECORDED_CONTINUE_LR,
                    finetune: tuple[float, float] = RECORDED_FINETUNE) -> None:
    """Why the EK-FAC segments miss the exact metagradient on this decoder: the largest eigenvalue of the trained
    continuation's Hessian, Gauss-Newton matrix and EK-FAC curvatures (sampled and empirical Fisher) by 15 power
    iterations each, their Rayleigh quotients on two seeded random directions, and the approximate unrolling's
    (3 segments per stage, EK-FAC, sampled Fisher) Pearson correlation and norm ratio with the exact metagradient of
    the summed test NLL on the recorded run (``recorded_task``). Writes results/fidelity/lm-case1_curvature_check.md."""
    from influkit.curvature import HessianOperator
    from influkit.factored import fit_curvature

    task, results_name = recorded_task(progress, continue_lr, finetune)
    stage, names = task.pre, list(task.pre.param_names)
    gen = torch.Generator().manual_seed(0)
    operators = {"Hessian": HessianOperator(stage, names), "Gauss-Newton": HessianOperator(stage, names,
                                                                                           curvature="gauss-newton")}
    operators |= {f"EK-FAC, {f} Fisher": fit_curvature(stage, names, fisher=f, seed=0) for f in ("sampled", "empirical")}
    dim, dtype = operators["EK-FAC, sampled Fisher"].dim, next(stage.model.parameters()).dtype
    probes = torch.randn(dim, 2, generator=gen, dtype=torch.float64).to(dtype)
    lines = ["| curvature | largest eigenvalue (power iteration) | Rayleigh quotients, 2 random directions |", "|---|---|---|"]
    for label, op in operators.items():
        v = torch.randn(dim, generator=gen, dtype=torch.float64).to(dtype)
        v /= v.norm()
        for _ in range(15):
            w = op.matvec(v)
            largest, v = float(v @ w), w / w.norm()
        rayleigh = (probes * op.matvec(probes)).sum(0) / (probes**2).sum(0)
        lines.append(f"| {label} | {largest:.2f} | " + ", ".join(f"{r:.4f}" for r in rayleigh.tolist()) + " |")
    record = record_both(task, progress)
    exact = ik.unrolled.metagradients(record, task.test)[0].values.double().numpy()
    approx = ik.unrolled.approximate(record, task.test, segments=RECORDED_SEGMENTS, curvature="ekfac", top=0,
                                     config=ik.CurvatureConfig(seed=task.cfg.seed))[0].values.double().numpy()
    text = (f"# {TASK}: the trained continuation's curvature and the EK-FAC segments (bench_fidelity_lm.py "
            "curvature-check)\n\n" + " ".join(curvature_check.__doc__.split()) + "\n\n" + "\n".join(lines)
            + f"\n\nRecorded run {results_name}: approximate vs exact metagradient of the summed test NLL, Pearson "
            f"{np.corrcoef(exact, approx)[0, 1]:.3f}, norm ratio {np.linalg.norm(approx) / np.linalg.norm(exact):.2f}."
            "\n\nLoad average " + ", ".join(f"{v:.1f}" for v in os.getloadavg()) + ".\n")
    (RESULTS / f"{TASK}_curvature_check.md").write_text(text)
    print(text, flush=True)


CHECK_STEPS = (1.0, 0.1, 0.01, 1e-3, 1e-4)  # t of w = 1 − t·1_D in ``recorded_check``


def recorded_check(sets: int, progress: bool, continue_lr: float = RECORDED_CONTINUE_LR,
                   finetune: tuple[float, float] = RECORDED_FINETUNE) -> None:
    """Is the recorded two-stage run's derivative right, and how far does it reach? The trained models cast to
    float64 (no float32 rounding in the replays), both stages recorded as ``record_both`` does, the exact
    metagradient of the q test NLLs, and ``ik.unrolled.linearity`` on ``sets`` seeded 1 % drop sets at every t of
    CHECK_STEPS: cos(Δ_t, p) → 1 as t → 0 says the metagradient is the run's derivative; the t at which the cosine and
    the ratio ‖Δ_t‖/‖p‖ leave 1 says how large a change the run still answers linearly. Writes
    results/fidelity/replay_lm-case1_recorded[_lr<η>]_float64_check.md."""
    task, results_name = recorded_task(progress, continue_lr, finetune)
    task.pre.model.double()
    task.fin.model.double()
    record = record_both(task, progress)
    start = time.perf_counter()
    pre = ik.unrolled.metagradients(record, task.test, per_test=True, progress=progress)[0]
    table = ik.unrolled.linearity(record, task.test, pre, fraction=0.01, sets=sets, steps=CHECK_STEPS)
    summary = table.groupby("t")[["cosine", "ratio"]].agg(["min", "median", "max"]).sort_index(ascending=False)
    lines = ["| t | cosine min / median / max | ratio min / median / max |", "|---|---|---|"]
    lines += [f"| {t:g} | " + " / ".join(f"{v:.4f}" for v in row[:3]) + " | " + " / ".join(f"{v:.4f}" for v in row[3:])
              + " |" for t, row in zip(summary.index, summary.to_numpy())]
    lines += ["", "Every set (set, t, cosine, ratio): " + "; ".join(
        f"{r.set}, {r.t:g}, {r.cosine:.4f}, {r.ratio:.4f}" for r in table.itertuples())]
    text = (f"# {results_name} in float64: the metagradient against replayed 1 % drops scaled by t "
            f"(bench_fidelity_lm.py replay-recorded-check, {sets} sets)\n\n" + " ".join(recorded_check.__doc__.split())
            + "\n\n" + "\n".join(lines) + f"\n\nSeconds {time.perf_counter() - start:.0f}; load average "
            + ", ".join(f"{v:.1f}" for v in os.getloadavg()) + f"; {platform.processor() or platform.machine()}.\n")
    (RESULTS / f"replay_{results_name}_float64_check.md").write_text(text)
    print(text, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["train", "retrain", "score", "unrolled", "table", "unrolled-table",
                                         "defaults-table", "restore", "replay",
                                         "replay-linearity", "replay-recorded",
                                         "replay-recorded-linearity", "replay-recorded-check",
                                         "curvature-check"])
    parser.add_argument("--subsets", type=int, default=40)
    parser.add_argument("--order", type=int, default=0, help="batch order of the re-trainings (1: noise ceiling)")
    parser.add_argument("--methods", nargs="+", default=[*METHODS])
    parser.add_argument("--finetuning", choices=["example", "default"], default="example",
                        help="unrolled: the finetuning solve giving the adjoint (default: every setting at its default)")
    parser.add_argument("--outputs", default=f"{TASK}_warm_unrolled", help="restore: the committed outputs' table")
    parser.add_argument("--at", choices=["midpoint", "mean"], default=None,
                        help=f"unrolled: only the exact metagradient at continuation weights {MIDPOINT_WEIGHT} (midpoint: "
                             f"the mean midpoint of dropping half) or {MEAN_WEIGHT} (mean: the halves' mean weights)")
    parser.add_argument("--name", default=WARM_UNROLLED, help="unrolled-table: the results' name")
    parser.add_argument("--orders", type=int, default=1,
                        help="unrolled --at: average the exact unrolling over the continuation under this many batch "
                             "orders (orders_scores)")
    parser.add_argument("--top", type=int, default=0,
                        help="unrolled: only the approximate unrolling, EK-FAC pieces + this many eigenpairs "
                             "(--top-curvature; with --at: at that continuation weight)")
    parser.add_argument("--top-curvature", choices=list(TOP_CURVATURES), default="hessian",
                        help="unrolled --top: whose eigenpairs complete the EK-FAC pieces (approximate(top_curvature=))")
    parser.add_argument("--no-midpoint", action="store_true",
                        help="replay, replay-recorded: skip the exact metagradient at each fraction's midpoint and mean "
                             "weights (~2 min per fraction each)")
    parser.add_argument("--continue-lr", type=float, default=RECORDED_CONTINUE_LR,
                        help="replay-recorded*, curvature-check: the recorded continuation's learning rate (default "
                             f"{RECORDED_CONTINUE_LR}, below the edge of stability; the example's 0.05 is past it at "
                             "its start: RECORDED_CONTINUE_LR)")
    parser.add_argument("--finetune", type=float, nargs=2, default=RECORDED_FINETUNE, metavar=("LR", "MOMENTUM"),
                        help="replay-recorded*, curvature-check: the recorded finetuning's SGD (default "
                             f"{RECORDED_FINETUNE[0]:g} {RECORDED_FINETUNE[1]:g}; the example's scale "
                             f"{EXAMPLE_FINETUNE[0]:g} {EXAMPLE_FINETUNE[1]:g})")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    progress = not args.no_progress
    steps_without_task = {  # steps that load what they need themselves
        "table": lambda: write_table(args.subsets),
        "unrolled-table": lambda: write_unrolled_table(args.subsets, args.name),
        "restore": lambda: restore_outputs(args.outputs),
        "defaults-table": lambda: write_defaults_table(args.subsets),
        "replay": lambda: replay_table(args.subsets, progress, not args.no_midpoint),
        "replay-linearity": lambda: refit_linearity(args.subsets, progress),
        "replay-recorded": lambda: recorded_table(args.subsets, progress, not args.no_midpoint, args.continue_lr,
                                                  args.finetune),
        "replay-recorded-linearity": lambda: recorded_linearity(args.subsets, progress, args.continue_lr,
                                                                args.finetune),
        "replay-recorded-check": lambda: recorded_check(args.subsets, progress, args.continue_lr, args.finetune),
        "curvature-check": lambda: curvature_check(progress, args.continue_lr, args.finetune),
    }
    if args.step in steps_without_task:
        steps_without_task[args.step]()
        return
    task = LMTask(progress)
    print(f"trained: {task.info}", flush=True)
    if args.step == "retrain":
        retrain_all(task, args.subsets, args.order, progress)
    elif args.step == "score":
        score_all(task, args.methods, progress)
    elif args.step == "unrolled":
        at = {"midpoint": MIDPOINT_WEIGHT, "mean": MEAN_WEIGHT, None: None}[args.at]
        if args.orders > 1:
            if at is None:
                raise SystemExit("--orders averages the exact unrolling at --at midpoint or --at mean")
            orders_scores(task, progress, at, args.orders)
        else:
            unrolled_scores_cached(task, progress, args.finetuning, at, args.top, args.top_curvature)

if __name__ == "__main__":
    main()
