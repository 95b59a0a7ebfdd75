"""The methods of the fidelity benchmark: influkit's solvers and the single-stage peers applied to two stages.

Every method returns an (n, q) score matrix in **influkit's sign** (positive = up-weighting pretraining example z
raises the test loss of t), computed on the same trained members (``fidelity_tasks.Task.member``), and the
seconds it took. K = 1 uses member 0; K = 5 averages members 0..4 (influkit: ``influkit.ensemble.Ensemble``;
kronfluence: the mean of its per-member scores; TRAK and dattri: their own multi-checkpoint ensembling).

How a single-stage peer meets the two-stage problem (the strongest reading we found that its public API allows):
the peer sees one model, :class:`CrossStageModel`, whose **trainable parameters are the pretraining model's**
(embedding W and pretraining head U) and whose finetuned head Θ* (and, in Case 2, the finetuning shift
W* − W̄ of the embedding) are frozen buffers. Its training objective is the pretraining loss on Z (the peer fits
its curvature — Hessian, EK-FAC factors, TRAK kernel — there), and its query/target function is the finetuned
model's test loss (or margin) on T, whose gradient lives on W only (U does not reach the finetuned model).
That is exactly the Case 1 term I_{z,W} = −[H_G⁻¹ ∇g(z)]_W · ∇_W f(t) of the multi-stage influence; what a
peer cannot represent is the finetuning stage's response to the change of W (−H_ΘΘ⁻¹ H_ΘW I_{z,W}, and in
Case 2 the proximal coupling), which influkit's chain adds.
"""

from __future__ import annotations

import copy
import hashlib
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from studies.fidelity_tasks import Task
from influkit import CurvatureConfig, SolveConfig
from influkit.ensemble import Ensemble

INFLUKIT = {  # name: (solve settings, curvature settings); a list: one SolveConfig per stage
    "influkit default (auto from where each stage stands)": (SolveConfig(), CurvatureConfig()),
    "influkit exact (auto: direct on H)": (SolveConfig(solver="direct"), CurvatureConfig()),  # auto's choice before positions
    "influkit exact GN (auto on G)": (SolveConfig(solver="direct"), CurvatureConfig(matrix="gauss-newton")),
    # one config per stage: a config shared by all stages solves the small ones exactly instead (influkit.auto)
    "influkit EK-FAC": ([SolveConfig(solver="ekfac")] * 2, CurvatureConfig()),
    "influkit Arnoldi": ([SolveConfig(solver="arnoldi")] * 2, CurvatureConfig()),
    "influkit identity": (SolveConfig(solver="identity"), CurvatureConfig()),
}
PEERS = ("TRAK (traker)", "kronfluence EK-FAC", "dattri IF (explicit)", "dattri TracIn", "dattri TRAK")
TRAK_PROJ_DIM = 128
TRAK_DAMPING = 0.1
"""TRAK's kernel ΦᵀΦ + λI gets λ = 0.1·n·wd in units of the unprojected, summed-loss curvature (traker:
``lambda_reg`` = 0.1·n·wd·p, its N(0, 1) projection scales ΦᵀΦ by ≈ p; dattri divides gradients by √p, so
``regularization`` = 0.1·n·wd). The best of λ/(n·wd) ∈ {0, 0.01, 0.1, 1} on digits Case 1 warm (TRAK K = 1:
LDS 0.039, 0.179, 0.183, 0.115): TRAK's default λ = 0 leaves the weight decay out of its curvature."""


# ------------------------------------------------------------------------------------------ the peers' model
class _Shift(nn.Module):
    """A parametrization W ↦ W + shift, active only while the owning CrossStageModel is in ``mode="fin"``."""

    def __init__(self, shift: torch.Tensor, owner: dict):
        super().__init__()
        self.register_buffer("shift", shift)
        self.owner = owner

    def forward(self, value):
        return value + self.shift if self.owner["mode"] == "fin" else value


class CrossStageModel(nn.Module):
    """One module for a single-stage tool: pretraining logits in ``mode="pre"``, finetuned logits in ``"fin"``.

    Parameters: the pretraining model (``pre.embedding`` = W, ``pre.head`` = U). Buffers: the finetuned head Θ*
    and, in Case 2, ``shift`` = W* − W̄ on every embedding weight (a parametrization, so the embedding's own
    modules — which kronfluence hooks — compute with W + shift in ``"fin"`` mode): the finetuned logits are
    Θ*(embedding(x; W + shift)), at W = W̄ the finetuned model's own output, and their gradient in W is the
    finetuned model's gradient in W*.
    """

    def __init__(self, pre_model: nn.Module, fin_model: nn.Module, shift: bool = True):
        super().__init__()
        self.pre = copy.deepcopy(pre_model)
        if not shift:  # one embedding for both modes: the finetuned W* (for tools that hook the layers themselves)
            self.pre.embedding.load_state_dict(fin_model.embedding.state_dict())
        self.register_buffer("fin_weight", fin_model.head.weight.detach().clone())
        self.register_buffer("fin_bias", fin_model.head.bias.detach().clone())
        self._state = {"mode": "pre"}
        after = dict(fin_model.embedding.named_parameters())
        if any(not torch.equal(p, after[n]) for n, p in self.pre.embedding.named_parameters()):
            from torch.nn.utils import parametrize

            for prefix, module in list(self.pre.embedding.named_modules()):
                for name, value in list(module.named_parameters(recurse=False)):
                    delta = after[f"{prefix}.{name}" if prefix else name].detach() - value.detach()
                    parametrize.register_parametrization(module, name, _Shift(delta.clone(), self._state))

    @property
    def mode(self) -> str:
        return self._state["mode"]

    @mode.setter
    def mode(self, value: str) -> None:
        self._state["mode"] = value

    def forward(self, x):
        if self.mode == "pre":
            return self.pre(x)
        return F.linear(self.pre.embedding(x), self.fin_weight, self.fin_bias)


def cross_models(task: Task, members: list[int], dtype=torch.float64, shift: bool = True) -> list[CrossStageModel]:
    """The members as :class:`CrossStageModel` (eval mode, ``dtype``; ``shift=False``: both modes at W*)."""
    out = []
    for k in members:
        pre, fin = task.member(k)
        out.append(CrossStageModel(pre.model, fin.model, shift).to(dtype).eval())
    return out


def _margin(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """TRAK's model output log(p/(1 − p)) of the correct class, per row."""
    correct = logits.gather(-1, labels[..., None])[..., 0]
    is_correct = torch.arange(logits.shape[-1], device=logits.device) == labels[..., None]
    others = logits.masked_fill(is_correct, float("-inf"))
    return correct - others.logsumexp(-1)


# --------------------------------------------------------------------------------------------------- influkit
def influkit_scores(task: Task, name: str, members: list[int]) -> np.ndarray:
    """(n, q) influkit scores of ``name`` (a key of INFLUKIT), averaged over ``members`` (influkit.Ensemble)."""
    chains = [task.chain(k, *INFLUKIT[name]) for k in members]
    result = Ensemble(chains).scores(x_test=task.split.test, per_test=True, progress=False)
    order = torch.argsort(result.index)
    return result.values[order].double().numpy()


# ------------------------------------------------------------------------------------------------------ TRAK
def trak_scores(task: Task, members: list[int]) -> np.ndarray:
    """TRAK (traker, BasicProjector on CPU, proj_dim 128, λ = TRAK_DAMPING): features = projected ∇_{W,U} of the
    pretraining margin of z; target = projected ∇_W of the finetuned margin of t; TRAK's kernel and Q from the
    pretraining data.
    TRAK's score is positive when z raises t's margin (helpful): influkit sign = −score."""
    from trak import TRAKer
    from trak.modelout_functions import AbstractModelOutput

    class CrossStageMargin(AbstractModelOutput):
        def __init__(self):  # AbstractModelOutput declares __init__ abstract
            super().__init__()

        def get_output(self, model, weights, buffers, image, label):
            logits = torch.func.functional_call(model, (weights, buffers), image.unsqueeze(0))
            return _margin(logits, label.unsqueeze(0)).sum()

        def get_out_to_loss_grad(self, model, weights, buffers, batch):
            images, labels = batch
            logits = torch.func.functional_call(model, (weights, buffers), images)
            p = torch.softmax(logits, -1).gather(-1, labels[:, None])
            return (1 - p).detach()

    models = cross_models(task, members, torch.float32)
    zx, zy = task.split.pretrain
    tx, ty = task.split.test
    zx, tx = zx.float(), tx.float()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = sum(v.numel() for v in models[0].parameters())
        traker = TRAKer(model=models[0], task=CrossStageMargin(), train_set_size=len(zx), save_dir=tmp,
                        device="cpu", proj_dim=TRAK_PROJ_DIM, use_half_precision=False, projector_seed=0,
                        lambda_reg=TRAK_DAMPING * len(zx) * task.config.weight_decay * p)
        for k, model in enumerate(models):
            traker.model.mode = "pre"
            traker.load_checkpoint(model.state_dict(), model_id=k)
            traker.featurize(batch=(zx, zy), num_samples=len(zx))
        traker.finalize_features()
        for k, model in enumerate(models):
            traker.start_scoring_checkpoint(exp_name="test", checkpoint=model.state_dict(), model_id=k,
                                            num_targets=len(tx))
            traker.model.mode = "fin"
            traker.score(batch=(tx, ty), num_samples=len(tx))
        scores = traker.finalize_scores(exp_name="test")
    return -np.asarray(scores, dtype=np.float64)


# ------------------------------------------------------------------------------------------------ kronfluence
def kronfluence_scores(task: Task, members: list[int]) -> np.ndarray:
    """kronfluence 1.0.1 EK-FAC, per member, averaged: factors fitted on the pretraining loss of Z (sampled-label
    Fisher, one block per Conv2d of the shared embedding W — EK-FAC is block-diagonal, so U's block would not
    change W's), damping λ = the weight decay (the regularizer's Hessian), query
    gradient = ∇_W of the finetuned test loss. In Case 2 kronfluence cannot hook a re-parametrized layer, so the
    pretraining loss, its factors and the query are all taken at the finetuned embedding W* (and U): the query
    gradient is exact, the pretraining curvature is taken at W* instead of W̄. kronfluence's score
    ∇f(t)ᵀ(F + λI)⁻¹∇ℓ(z) is −influence."""
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task as KronTask

    models = cross_models(task, members, torch.float32, shift=False)  # kronfluence wraps only plain Conv2d/Linear
    layers = enumerate(models[0].pre.embedding)
    shared = [f"pre.embedding.{i}" for i, m in layers if isinstance(m, (nn.Conv2d, nn.Linear))]

    class CrossStage(KronTask):
        def get_influence_tracked_modules(self):  # the shared block W: EK-FAC is block-diagonal, U's block is inert
            return shared

        def compute_train_loss(self, batch, model, sample=False):
            inputs, labels = batch
            model.mode = "pre"
            logits = model(inputs)
            if sample:
                with torch.no_grad():
                    labels = torch.multinomial(torch.softmax(logits.detach(), -1), 1).reshape(-1)
            return F.cross_entropy(logits, labels, reduction="sum")

        def compute_measurement(self, batch, model):
            inputs, labels = batch
            model.mode = "fin"
            return F.cross_entropy(model(inputs), labels, reduction="sum")

    zx, zy = task.split.pretrain
    tx, ty = task.split.test
    train = torch.utils.data.TensorDataset(zx.float(), zy)
    test = torch.utils.data.TensorDataset(tx.float(), ty)
    values = []
    for model in models:
        kron_task = CrossStage()
        model = prepare_model(model, kron_task)
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            analyzer = Analyzer("fidelity", model=model, task=kron_task, cpu=True, disable_tqdm=True, output_dir=tmp)
            analyzer.fit_all_factors("ekfac", dataset=train, per_device_batch_size=len(train),
                                     factor_args=FactorArguments(strategy="ekfac"), overwrite_output_dir=True)
            analyzer.compute_pairwise_scores(
                "scores", "ekfac", query_dataset=test, train_dataset=train, per_device_query_batch_size=len(test),
                per_device_train_batch_size=len(train),
                score_args=ScoreArguments(damping_factor=task.config.weight_decay), overwrite_output_dir=True)
            scores = analyzer.load_pairwise_scores("scores")["all_modules"]  # (q, n)
        values.append(-scores.double().T.numpy())
    return np.mean(values, axis=0)


# ----------------------------------------------------------------------------------------------------- dattri
def _dattri_task(task: Task, members: list[int], target: str):
    """A dattri AttributionTask on CrossStageModel: loss = pretraining objective (mean CE + (wd/2)‖θ‖², or the
    pretraining margin for TRAK), target = the finetuned test loss (or margin), checkpoints = the members."""
    from dattri.task import AttributionTask

    models = cross_models(task, members)
    model = models[0]
    wd = task.config.weight_decay

    def logits_of(params, x, mode):  # x: a batch (IF) or one example (TracIn, TRAK vmap over examples)
        model.mode = mode
        return torch.func.functional_call(model, params, x.reshape(-1, x.shape[-1]))

    if target == "loss":
        def loss_func(params, data):
            x, y = data
            y = y.reshape(-1)
            reg = 0.5 * wd * sum((p**2).sum() for p in params.values())
            return F.cross_entropy(logits_of(params, x, "pre"), y) + reg

        def target_func(params, data):
            x, y = data
            return F.cross_entropy(logits_of(params, x, "fin"), y.reshape(-1))
    else:
        def loss_func(params, data):
            x, y = data
            return _margin(logits_of(params, x, "pre"), y.reshape(-1)).sum()

        def target_func(params, data):
            x, y = data
            return _margin(logits_of(params, x, "fin"), y.reshape(-1)).sum()

    checkpoints = [m.state_dict() for m in models]
    return AttributionTask(loss_func=loss_func, model=model, checkpoints=checkpoints, target_func=target_func), model


def _loader(pair, batch_size: int):
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*pair), batch_size=batch_size, shuffle=False)


def dattri_scores(task: Task, members: list[int], attributor: str) -> np.ndarray:
    """dattri 0.3: ``IFAttributorExplicit`` (the explicit Hessian of the pretraining objective over W and U, no
    extra damping), ``TracInAttributor`` (one checkpoint per member, weight 1, raw gradients) or
    ``TRAKAttributor`` (margins, CPU projector, proj_dim 128, Q from the pretraining probabilities). dattri's
    scores are positive for helpful examples: influkit sign = −score."""
    zx, zy = task.split.pretrain
    tx, ty = task.split.test
    n, q = len(zx), len(tx)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if attributor == "if":
            from dattri.algorithm.influence_function import IFAttributorExplicit

            attribution, _ = _dattri_task(task, members, "loss")
            method = IFAttributorExplicit(attribution, device="cpu", regularization=0.0)
            method.cache(_loader((zx, zy), n))
            scores = method.attribute(_loader((zx, zy), n), _loader((tx, ty), q))
        elif attributor == "tracin":
            from dattri.algorithm.tracin import TracInAttributor

            attribution, _ = _dattri_task(task, members, "loss")
            method = TracInAttributor(attribution, weight_list=torch.ones(len(members), dtype=torch.float64),
                                      normalized_grad=False, device="cpu")
            scores = method.attribute(_loader((zx, zy), n), _loader((tx, ty), q))
        else:
            from dattri.algorithm.trak import TRAKAttributor

            attribution, model = _dattri_task(task, members, "margin")

            def correct_probability(params, data):
                x, y = data
                model.mode = "pre"
                logits = torch.func.functional_call(model, params, x.unsqueeze(0))
                return torch.softmax(logits, -1)[0, y]

            method = TRAKAttributor(attribution, correct_probability,
                                    projector_kwargs={"proj_dim": TRAK_PROJ_DIM, "device": "cpu"}, device="cpu",
                                    regularization=TRAK_DAMPING * n * task.config.weight_decay)
            method.cache(_loader((zx, zy), n))
            scores = method.attribute(_loader((tx, ty), q))
    return -scores.detach().double().numpy()


PEER_FUNCTIONS = {
    "TRAK (traker)": trak_scores,
    "kronfluence EK-FAC": kronfluence_scores,
    "dattri IF (explicit)": lambda task, members: dattri_scores(task, members, "if"),
    "dattri TracIn": lambda task, members: dattri_scores(task, members, "tracin"),
    "dattri TRAK": lambda task, members: dattri_scores(task, members, "trak"),
}


# ----------------------------------------------------------------------------------------------------- cache
def scores_path(task: Task, method: str, k: int) -> Path:
    slug = hashlib.sha256(method.encode()).hexdigest()[:8]
    return task.directory / "scores" / f"K{k}_{slug}_{task.config.digest()}.safetensors"


def method_scores(task: Task, method: str, k: int) -> tuple[np.ndarray, float]:
    """((n, q) scores, seconds) of ``method`` with K = k members, computed once and cached."""
    path = scores_path(task, method, k)
    if path.exists():
        stored = load_file(path)
        return stored["scores"].numpy(), float(stored["seconds"])
    members = list(range(k))
    for m in members:
        task.member(m)  # training is not part of any method's time
    start = time.perf_counter()
    if method in INFLUKIT:
        scores = influkit_scores(task, method, members)
    else:
        scores = PEER_FUNCTIONS[method](task, members)
    seconds = time.perf_counter() - start
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"scores": torch.as_tensor(np.ascontiguousarray(scores)), "seconds": torch.tensor(seconds)}, str(path),
              metadata={"method": method, "K": str(k)})
    return scores, seconds


def all_methods() -> list[str]:
    return list(INFLUKIT) + list(PEERS)


def import_peers() -> None:
    """Import the peers' modules up front, so that no method's seconds include a library's import time."""
    import dattri.algorithm.influence_function  # noqa: F401
    import dattri.algorithm.tracin  # noqa: F401
    import dattri.algorithm.trak  # noqa: F401
    import kronfluence.analyzer  # noqa: F401
    import trak  # noqa: F401


def score_all(task: Task, members: int, methods=None, progress: bool = True) -> None:
    """Compute (or load) every method's scores for K = 1 and K = ``members``; print one line each."""
    import_peers()
    for k in range(members):
        task.member(k)
    for method in methods or all_methods():
        for k in sorted({1, members}):
            try:
                scores, seconds = method_scores(task, method, k)
                print(f"{task.config.name} | {method} | K={k} | {seconds:.1f} s | scores {scores.shape}", flush=True)
            except Exception as exc:  # a peer that fails is reported, the others still run
                print(f"{task.config.name} | {method} | K={k} | FAILED: {type(exc).__name__}: {exc}", flush=True)


def shared_block_term(task: Task, k: int = 0) -> np.ndarray:
    """(n, q) −(∇ℓ(z) + wd·θ)ᵀ H_G⁻¹ [∇_W f(t); 0_U] by explicit float64 Hessian of the pretraining objective over
    (W, U): what a single-stage tool on :class:`CrossStageModel` should return (dattri IF's quantity, with the
    L2 gradient in ∇ℓ(z) as dattri takes it). The check that the peers are wired to the intended quantity."""
    from torch.func import functional_call, grad, hessian

    model = cross_models(task, [k])[0]
    names = [n for n, _ in model.named_parameters()]
    values = {n: p.detach() for n, p in model.named_parameters()}
    sizes, shapes = [values[n].numel() for n in names], [values[n].shape for n in names]
    flat = torch.cat([values[n].reshape(-1) for n in names])
    wd = task.config.weight_decay

    def unflat(v):
        return {n: t.reshape(s) for n, t, s in zip(names, v.split(sizes), shapes)}

    def loss(v, x, y, mode):
        model.mode = mode
        return F.cross_entropy(functional_call(model, unflat(v), (x,)), y)

    zx, zy = task.split.pretrain
    tx, ty = task.split.test
    h = hessian(lambda v: loss(v, zx, zy, "pre") + 0.5 * wd * (v**2).sum())(flat)
    gz = torch.stack([grad(loss)(flat, zx[i : i + 1], zy[i : i + 1], "pre") for i in range(len(zx))]) + wd * flat
    gt = torch.stack([grad(loss)(flat, tx[i : i + 1], ty[i : i + 1], "fin") for i in range(len(tx))])
    return -(gz @ torch.linalg.solve(h, gt.T)).numpy()


def check_peers(task: Task) -> None:
    """Print how far dattri IF (K = 1) is from :func:`shared_block_term` (relative to its largest entry)."""
    reference = shared_block_term(task)
    scores, _ = method_scores(task, "dattri IF (explicit)", 1)
    error = np.abs(scores - reference).max() / np.abs(reference).max()
    print(f"{task.config.name}: dattri IF vs the explicit shared-block term −∇ℓ(z)ᵀ[H_G⁻¹]∇_W f(t): "
          f"max rel. diff {error:.1e}")
