"""The pretrain → finetune tasks of the fidelity benchmark: data, trained chains (ensemble members), re-training.

A task holds a two-task split (pretraining set Z, finetuning set X, test set T), trains **member k** of an ensemble
(both stages from the initialization seeded by k, to stationarity: float64 L-BFGS then Newton), and re-trains the
chain on a subset S of Z under one of two protocols:

- ``warm``: both stages start from member 0's trained weights (pretraining continues on S only, then finetuning
  continues with the new embedding) — deterministic, full-batch, so the data order is fixed by construction;
- ``scratch``: both stages start from a fresh initialization drawn with the re-training seed.

The output of a re-training is the per-test-example loss of the finetuned model on T (the quantity whose
change influkit's scores predict: positive score = up-weighting raises the test loss).
Case 1 keeps the embedding fixed while finetuning; Case 2 finetunes it with α‖W − W̄‖² around the re-trained W̄.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from influkit import Chain, CurvatureConfig, Link, SolveConfig, Stage
from influkit.apps.datasets import TwoTaskSplit, load_digits_tensors, load_fashion_mnist, two_task_split
from influkit.apps.models import EmbeddingClassifier, digits_classifier
from influkit.apps.objectives import cross_entropy, l2
from influkit.training import fit_lbfgs, newton_fit

PROTOCOLS = ("warm", "scratch")


@dataclass(frozen=True)
class TaskConfig:
    """What defines a task: data, model size, objective and trainer (hashed into every cache key)."""

    name: str
    case: int
    dataset: str = "digits"
    pretrain_classes: tuple[int, ...] = (0, 1, 2, 3)
    finetune_classes: tuple[int, ...] = (4, 5, 6, 7, 8, 9)
    n_pretrain: int = 200
    n_finetune: int = 200
    n_test: int = 100
    channels: tuple[int, int] = (2, 4)
    alpha: float = 0.01
    weight_decay: float = 1e-2
    split_seed: int = 0
    max_iter: int = 1000
    tol: float = 1e-9

    def digest(self) -> str:
        """16 hex characters identifying the configuration (cache keys carry it)."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


TASKS = {
    "digits-case1": TaskConfig("digits-case1", case=1),
    "digits-case2": TaskConfig("digits-case2", case=2),
    "fashion-case1": TaskConfig(
        "fashion-case1", case=1, dataset="fashion-mnist", pretrain_classes=(0, 1, 2, 3, 4),
        finetune_classes=(5, 6, 7, 8, 9), n_pretrain=200, n_finetune=200, n_test=100, channels=(2, 4),
    ),
}


def _fashion_8x8() -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST test images average-pooled from 28×28 to 7×7 and zero-padded to 8×8 (the digits CNN's input)."""
    x, y = load_fashion_mnist("test", dtype=torch.float64)
    x = torch.nn.functional.avg_pool2d(x, 4)  # (n, 1, 7, 7)
    x = torch.nn.functional.pad(x, (0, 1, 0, 1)) * 16.0  # the digits' 0..16 scale
    return x.reshape(len(x), 64), y


class Task:
    """One task: its split, its trained members (cached in ``directory``) and its re-training function."""

    def __init__(self, config: TaskConfig, directory: Path):
        self.config = config
        self.directory = Path(directory) / config.name
        self.directory.mkdir(parents=True, exist_ok=True)
        if config.dataset == "digits":
            x, y = load_digits_tensors(torch.float64)
        else:
            x, y = _fashion_8x8()
        self.split: TwoTaskSplit = two_task_split(
            x, y, config.pretrain_classes, config.finetune_classes, n_pretrain=config.n_pretrain,
            n_finetune=config.n_finetune, n_test=config.n_test, seed=config.split_seed,
        )
        self._members: dict[int, tuple[Stage, Stage]] = {}

    # ------------------------------------------------------------------------------------------ objectives
    def _model(self, n_classes: int) -> EmbeddingClassifier:
        return digits_classifier(n_classes, self.config.channels).double().eval()

    def pretrain_stage(self, model: EmbeddingClassifier, subset: torch.Tensor | None = None) -> Stage:
        """G = mean CE over the pretraining examples (those in ``subset``) + (wd/2)‖(W, U)‖²."""
        x, y = self.split.pretrain
        if subset is not None:
            x, y = x[subset], y[subset]
        return Stage(model, cross_entropy, (x, y), regularizer=l2(self.config.weight_decay), batch_size=4096)

    def finetune_stage(self, model: EmbeddingClassifier) -> Stage:
        """F = mean CE over the finetuning examples + (wd/2)‖trained‖² (Case 1 trains the head Θ only)."""
        params = "head" if self.config.case == 1 else None
        return Stage(model, cross_entropy, self.split.finetune, params=params,
                     regularizer=l2(self.config.weight_decay), batch_size=4096)

    def _proximal(self, stage: Stage, centre: dict[str, torch.Tensor]) -> Stage:
        """F + α‖W − W̄‖² (Case 2's finetuning objective; the chain adds the same term to its scores)."""
        alpha, base = self.config.alpha, l2(self.config.weight_decay)
        reg = lambda p: base(p) + alpha * sum(((p[n] - c) ** 2).sum() for n, c in centre.items())  # noqa: E731
        return stage.with_(regularizer=reg)

    def _fit(self, stage: Stage) -> float:
        fit_lbfgs(stage, max_iter=self.config.max_iter, tol=self.config.tol, restarts=0)
        return newton_fit(stage, tol=self.config.tol)

    def _train_both(self, pre_model, fin_model, subset=None) -> tuple[Stage, Stage, list[float]]:
        pre = self.pretrain_stage(pre_model, subset)
        norms = [self._fit(pre)]
        with torch.no_grad():
            fin_model.embedding.load_state_dict(pre_model.embedding.state_dict())
        fin = self.finetune_stage(fin_model)
        objective = fin
        if self.config.case == 2:
            centre = {n: p.detach().clone() for n, p in fin_model.named_parameters() if n.startswith("embedding.")}
            objective = self._proximal(fin, centre)
        norms.append(self._fit(objective))
        return pre, fin, norms

    # --------------------------------------------------------------------------------------------- members
    def member(self, k: int) -> tuple[Stage, Stage]:
        """Member k: both stages trained from the initialization seeded by k (cached as safetensors)."""
        if k in self._members:
            return self._members[k]
        path = self.directory / f"member{k}_{self.config.digest()}.safetensors"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(k)
            pre_model = self._model(len(self.config.pretrain_classes))
            fin_model = self._model(len(self.config.finetune_classes))
        if path.exists():
            state = load_file(path)
            pre_model.load_state_dict({n[4:]: v for n, v in state.items() if n.startswith("pre.")})
            fin_model.load_state_dict({n[4:]: v for n, v in state.items() if n.startswith("fin.")})
            pre, fin = self.pretrain_stage(pre_model), self.finetune_stage(fin_model)
        else:
            pre, fin, _ = self._train_both(pre_model, fin_model)
            state = {f"pre.{n}": v.contiguous() for n, v in pre_model.state_dict().items()}
            state |= {f"fin.{n}": v.contiguous() for n, v in fin_model.state_dict().items()}
            save_file(state, str(path))
        self._members[k] = (pre, fin)
        return pre, fin

    def chain(self, k: int, solve: SolveConfig = SolveConfig(), curvature: CurvatureConfig = CurvatureConfig()) -> Chain:
        """Member k as an influkit chain (Link "embedding", the task's case and α)."""
        pre, fin = self.member(k)
        return Chain([pre, fin], [Link("embedding", case=self.config.case, alpha=self.config.alpha)], solve=solve,
                     curvature=curvature)

    # ------------------------------------------------------------------------------------------ re-training
    def retrain(self, subset: torch.Tensor, protocol: str, seed: int) -> tuple[torch.Tensor, list[float]]:
        """((q,) test losses, final ‖∇‖ of both stages) after re-training both stages with pretraining on ``subset``."""
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        pre0, fin0 = self.member(0)
        if protocol == "warm":
            pre_model, fin_model = copy.deepcopy(pre0.model), copy.deepcopy(fin0.model)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(10_000 + seed)  # re-training seeds never coincide with member seeds
                pre_model = self._model(len(self.config.pretrain_classes))
                fin_model = self._model(len(self.config.finetune_classes))
        _, fin, norms = self._train_both(pre_model, fin_model, subset)
        tx, ty = self.split.test
        with torch.no_grad():
            out = fin.losses(fin.trained(), tx, ty).detach().double()
        return out, norms


def random_halves(n: int, m: int, seed: int = 0) -> torch.Tensor:
    """(m, n) bool: m seeded random subsets of exactly n // 2 examples (the TRAK paper's α = 0.5)."""
    gen = torch.Generator().manual_seed(seed)
    masks = torch.zeros(m, n, dtype=torch.bool)
    for j in range(m):
        masks[j, torch.randperm(n, generator=gen)[: n // 2]] = True
    return masks


SUBSET_SEED = 0


def subsets_for(task: Task, m: int) -> torch.Tensor:
    """The task's M subsets (α = 0.5), the same for every protocol and method."""
    return random_halves(len(task.split.pretrain[0]), m, seed=SUBSET_SEED)


def cached_retrain(task: Task, subsets: torch.Tensor, j: int, protocol: str, seed: int) -> torch.Tensor:
    """The outputs of re-training ``task`` on subset j (protocol, seed), computed once and kept on disk.

    Key: task name + config digest, protocol, subset index (and the subset's own hash), seed.
    """
    indices = subsets[j].nonzero().reshape(-1)
    subset_hash = hashlib.sha256(subsets[j].numpy().tobytes()).hexdigest()[:8]
    directory = task.directory / protocol
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"subset{j:04d}_seed{seed}_{task.config.digest()}_{subset_hash}.safetensors"
    if path.exists():
        return load_file(path)["outputs"]
    start = time.perf_counter()
    out, norms = task.retrain(indices, protocol, seed)
    meta = {"seconds": f"{time.perf_counter() - start:.3f}", "grad_norms": json.dumps(norms)}
    save_file({"outputs": out.contiguous()}, str(path), metadata=meta)
    return out
