"""Recording the user's own torch.optim loop (``Record.watch``): the recorded run is the plain run bit for bit, replay
repeats it bit for bit (dropout masks, schedules, clipping, accumulation, parameter groups), the exact metagradient
equals central finite differences of the re-run training (SGD + momentum, Adam, AdamW with warmup; one stage,
Case 1, Case 2, plain finetuning of every weight, LoRA), the record and a Chain share one StagePlan and one measure, and whatever replay cannot
repeat is refused before the first step."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

import influkit as ik
from influkit.unrolled import Record
from influkit.unrolled.optimizers import from_torch

from conftest import cross_entropy, l2
from test_unrolled import LoRALinear, data

EPS = 1e-5


class DropNet(nn.Module):
    """``head(dropout(tanh(embedding(x))))``; with ``lora`` the embedding's linear layer is a LoRA layer."""

    def __init__(self, classes: int, lora: bool = False, width: int = 4):
        super().__init__()
        self.embedding = nn.Sequential(LoRALinear(5, width) if lora else nn.Linear(5, width), nn.Tanh(),
                                       nn.Dropout(0.25))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.embedding(x))


def loader_of(n: int, classes: int, seed: int, batch_size: int) -> DataLoader:
    x, y = data(n, classes, seed)
    return DataLoader(TensorDataset(x.double(), y), batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(seed))


def train(model, optimizer, loader, *, run=None, scheduler=None, clip=None, accumulate=1, epochs=2, proximal=False):
    """The user's plain loop (``run`` given: the same loop under a watch, clipping through it)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for _ in range(epochs):
        for i, (x, y) in enumerate(loader):
            loss = cross_entropy(model(x), y).mean()
            if proximal:
                loss = loss + run.penalty()
            (loss / accumulate if accumulate > 1 else loss).backward()
            if (i + 1) % accumulate:
                continue
            if clip is not None:
                run.clip_grad_norm_(clip) if run is not None else torch.nn.utils.clip_grad_norm_(params, clip)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad()


def warmup(optimizer, steps: int = 3):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / steps))


PRE = {  # name: (optimizer factory, scheduler factory, clip, accumulate)
    "sgd": (lambda m: torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9, nesterov=True, weight_decay=1e-3),
            lambda o: torch.optim.lr_scheduler.StepLR(o, 3, gamma=0.5), 1.0, 1),
    "adam": (lambda m: torch.optim.Adam(m.parameters(), lr=0.05, weight_decay=1e-3), warmup, None, 2),
    "adam fused": (lambda m: torch.optim.Adam(m.parameters(), lr=0.05, weight_decay=1e-3, fused=True), warmup, 0.5, 2),
    "adamw": (lambda m: torch.optim.AdamW([{"params": m.embedding.parameters(), "lr": 0.03},
                                          {"params": m.head.parameters()}], lr=0.05, weight_decay=0.1),
              warmup, 0.5, 1),
}


def pretrain(record: Record | None, kind: str, *, epochs: int = 2):
    torch.manual_seed(0)
    model = DropNet(3).double()
    make, schedule, clip, accumulate = PRE[kind]
    optimizer = make(model)
    scheduler = schedule(optimizer)
    loader = loader_of(12, 3, seed=1, batch_size=4)
    if record is None:
        train(model, optimizer, loader, scheduler=scheduler, clip=clip, accumulate=accumulate, epochs=epochs)
        return model
    with record.watch(model, optimizer, loader, cross_entropy, accumulate=accumulate, checkpoint_every=3) as run:
        train(model, optimizer, loader, run=run, scheduler=scheduler, clip=clip, accumulate=accumulate, epochs=epochs)
    return model


def finetune(record: Record, case: str, pretrained: nn.Module):
    torch.manual_seed(1)
    model = DropNet(2, lora=case == "lora").double()
    if case == "lora":
        link = ik.Link({"embedding.0.base": "embedding.0"}, case=1)
        optimizer = torch.optim.Adam([model.embedding[0].lora_A, model.embedding[0].lora_B,
                                      *model.head.parameters()], lr=0.1, weight_decay=1e-3)
    elif case == "case1":
        link, optimizer = ik.Link("embedding", case=1), torch.optim.SGD(model.head.parameters(), lr=0.1, momentum=0.9)
    elif case == "finetune":
        link, optimizer = ik.Link.finetune("embedding"), torch.optim.AdamW(model.parameters(), lr=0.05)
    else:
        link, optimizer = ik.Link("embedding", case=2, alpha=0.05), torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = warmup(optimizer)
    loader = loader_of(10, 2, seed=2, batch_size=3)
    with record.watch(model, optimizer, loader, cross_entropy, link=link, checkpoint_every=3) as run:
        train(model, optimizer, loader, run=run, scheduler=scheduler, proximal=case == "case2", epochs=2)
    return model


SCENARIOS = {
    "SGD + momentum (Nesterov, step decay, clipping)": ("sgd", None),
    "Adam (warmup, accumulation)": ("adam", None),
    "AdamW (warmup, groups, clipping)": ("adamw", None),
    "fused Adam (warmup, clipping, accumulation)": ("adam fused", None),
    "case 1: AdamW -> SGD + momentum": ("adamw", "case1"),
    "case 2: SGD + momentum -> AdamW + proximal": ("sgd", "case2"),
    "plain finetuning: Adam -> AdamW (accumulation, dropout, warmup)": ("adam", "finetune"),
    "LoRA: AdamW -> Adam": ("adamw", "lora"),
}


def recorded(name: str) -> tuple[Record, list[nn.Module]]:
    kind, case = SCENARIOS[name]
    record = Record()
    models = [pretrain(record, kind)]
    if case is not None:
        models.append(finetune(record, case, models[0]))
    return record, models


TEST = tuple(t.double() if t.is_floating_point() else t for t in data(4, 2, seed=9))


@pytest.mark.parametrize("kind", sorted(PRE))
def test_the_watched_run_is_the_plain_run_and_replay_repeats_it_bit_for_bit(kind):
    record = Record()
    watched, plain = pretrain(record, kind), pretrain(None, kind)
    for (n, a), b in zip(watched.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), n
    run = record.runs[0]
    assert run.steps == (6 if PRE[kind][3] == 1 else 2)  # accumulating: 3 micro-batches an epoch, one carried over
    assert ik.unrolled.verify(record) == 0.0
    final = ik.unrolled.replay(record)[0]
    assert all(torch.equal(final[n], p) for n, p in watched.named_parameters())
    assert len({tuple(r[0]["cpu"][:64].tolist()) for r in run.rngs}) == run.steps  # a fresh generator state per step
    dropped = torch.ones(12, dtype=torch.float64)
    dropped[0] = 0
    assert not torch.equal(ik.unrolled.replay(record, dropped)[0]["head.weight"], final["head.weight"])


def test_replay_regenerates_the_dropout_masks_and_leaves_the_callers_generator_alone():
    record = Record()
    pretrain(record, "adam")
    state = torch.get_rng_state()
    assert ik.unrolled.verify(record) == 0.0
    assert torch.equal(torch.get_rng_state(), state)
    run = record.runs[0]
    run.rngs = [[{"cpu": torch.Generator().manual_seed(5).get_state()} for _ in r] for r in run.rngs]
    assert ik.unrolled.verify(record) > 0  # other masks: another run


def replayed(record: Record, stage: int, z: int, eps: float, measure=None) -> float:
    weights = [torch.ones(len(run.stage), dtype=torch.float64) for run in record.runs]
    weights[stage][z] += eps
    return float(ik.unrolled.outputs(record, TEST, weights, measure=measure).sum())


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_metagradient_equals_central_differences_of_the_rerun_training(name):
    record, models = recorded(name)
    assert all(m.training for m in models)  # dropout stayed on through training
    results = ik.unrolled.metagradients(record, TEST)
    assert results[0].diagnostics["replay"]["max_error"] == 0.0
    for k, result in enumerate(results):
        for z in (0, 4, 9):
            fd = (replayed(record, k, z, EPS) - replayed(record, k, z, -EPS)) / (2 * EPS)
            assert float(result.values[z]) == pytest.approx(fd, rel=1e-6, abs=1e-9), (k, z)


def test_the_record_decides_inheritance_through_the_chains_stage_plan():
    record, models = recorded("case 1: AdamW -> SGD + momentum")
    run = record.runs[1]
    chain = ik.Chain([ik.Stage(models[0].eval(), cross_entropy, record.runs[0].stage._data),
                      ik.Stage(models[1].eval(), cross_entropy, run.stage._data)], [run.link])
    assert isinstance(run.plan, ik.links.StagePlan)
    assert run.trained == chain.plans[1].trained == ["head.weight", "head.bias"]
    assert run.inherited == chain.plans[1].inherited and run.frozen == chain.plans[1].fixed
    for n, m in run.inherited.items():  # the watched model trained on the pretrained block
        assert torch.equal(dict(models[1].named_parameters())[n], dict(models[0].named_parameters())[m])


def margin(outputs, targets):
    """A measure that is not a loss: the logit of the true class minus the other's."""
    picked = outputs.gather(1, targets[:, None])[:, 0]
    return 2 * picked - outputs.sum(1)


def test_one_measure_object_serves_the_record_and_the_chain():
    """Full-batch gradient descent to convergence: the metagradient of ``margin`` tends to the influence function of
    the same ``margin`` over m (DESIGN §1), and equals central differences of the re-run training."""
    torch.manual_seed(0)
    x, y = data(20, 2, seed=4)
    model = nn.Linear(5, 2).double()
    loader = DataLoader(TensorDataset(x.double(), y), batch_size=20)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, weight_decay=0.1)
    record = Record()
    with record.watch(model, optimizer, loader, cross_entropy, checkpoint_every=50):
        for _ in range(400):
            for xb, yb in loader:
                optimizer.zero_grad()
                cross_entropy(model(xb), yb).mean().backward()
                optimizer.step()
    scores = ik.unrolled.metagradients(record, TEST, measure=margin)[0].values
    stage = ik.Stage(model.eval(), cross_entropy, (x.double(), y), regularizer=l2(0.1))
    influence = ik.influence(stage, torch.arange(20), TEST, measure=margin).values
    torch.testing.assert_close(scores, influence / 20, rtol=1e-7, atol=1e-12)
    fd = (replayed(record, 0, 3, EPS, margin) - replayed(record, 0, 3, -EPS, margin)) / (2 * EPS)
    assert float(scores[3]) == pytest.approx(fd, rel=1e-6)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("make", [
    lambda p, f: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, foreach=f),
    lambda p, f: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, maximize=True, foreach=f),
    lambda p, f: torch.optim.Adam(p, lr=0.01, weight_decay=0.1, foreach=f),
    lambda p, f: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, betas=(0.8, 0.99), foreach=f),
])
def test_the_pure_rules_and_clipping_are_torch_optims_bits(make, foreach):
    """float32 (where rounding differs most): a warmup schedule, clipping by the global norm, the single-tensor and
    (on the CPU) the foreach kernels — each step's parameters equal to the bit."""
    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(3, 4, generator=gen, dtype=torch.float32).requires_grad_(),
              torch.randn(4, generator=gen, dtype=torch.float32).requires_grad_()]
    names = {id(p): n for n, p in zip("ab", leaves)}
    optimizer = make(leaves, foreach)
    groups = from_torch(optimizer, names)
    scheduler = warmup(optimizer)
    theta = {n: p.detach().clone() for n, p in zip("ab", leaves)}
    state = groups.init(theta)
    for t in range(6):
        grads = {n: torch.randn(p.shape, generator=gen, dtype=torch.float32) for n, p in zip("ab", leaves)}
        for n, p in zip("ab", leaves):
            p.grad = grads[n].clone()
        lrs = tuple(group["lr"] for group in optimizer.param_groups)
        torch.nn.utils.clip_grad_norm_(leaves, 1.5)
        optimizer.step()
        scheduler.step()
        theta, state = groups.update(theta, state, groups.clip(grads, 1.5, 2.0), lrs, t + 1)
        assert all(torch.equal(theta[n], p.detach()) for n, p in zip("ab", leaves)), t


def fresh():
    torch.manual_seed(0)
    model = DropNet(3).double()
    return model, loader_of(12, 3, seed=1, batch_size=4)


def refused_at_watch(make_optimizer=None, loader=None, model=None, **kwargs):
    record = Record()
    base_model, base_loader = fresh()
    model = model or base_model
    optimizer = (make_optimizer or (lambda m: torch.optim.SGD(m.parameters(), lr=0.1)))(model)
    with pytest.raises(ik.NotReplayable) as info:
        record.watch(model, optimizer, loader or base_loader, cross_entropy, **kwargs)
    return str(info.value)


def test_what_replay_cannot_repeat_is_refused_when_the_watch_is_made():
    assert "RMSprop" in refused_at_watch(lambda m: torch.optim.RMSprop(m.parameters()))
    assert "amsgrad=False" in refused_at_watch(lambda m: torch.optim.Adam(m.parameters(), amsgrad=True))
    assert "fused=False" in refused_at_watch(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, fused=True))
    assert "cycle_momentum=False" in refused_at_watch(lambda m: torch.optim.lr_scheduler.OneCycleLR(
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), max_lr=0.5, total_steps=10).optimizer)

    def stepped(m):
        optimizer = torch.optim.Adam(m.parameters())
        m(torch.randn(2, 5, dtype=torch.float64)).sum().backward()
        optimizer.step()
        return optimizer

    assert "fresh optimizer" in refused_at_watch(stepped)
    x, y = data(12, 3, seed=1)
    dataset = TensorDataset(x.double(), y)
    assert "collate_fn" in refused_at_watch(loader=DataLoader(dataset, batch_size=4,
                                                              collate_fn=lambda b: default_collate(b)))
    assert "batch sampler" in refused_at_watch(loader=DataLoader(dataset, batch_size=None))
    batchnorm = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)).double()
    assert "batch-norm" in refused_at_watch(model=batchnorm)


def test_every_reason_a_watch_is_refused_comes_in_one_message():
    x, y = data(12, 3, seed=1)
    batchnorm = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)).double()
    message = refused_at_watch(lambda m: torch.optim.Adam(m.parameters(), amsgrad=True), model=batchnorm,
                               loader=DataLoader(TensorDataset(x.double(), y), batch_size=4,
                                                 collate_fn=lambda b: default_collate(b)))
    assert message.startswith("3 things keep this run from being replayed")
    assert all(fix in message for fix in ("collate_fn", "batch-norm", "amsgrad=False"))


def test_a_case_1_block_in_the_optimizer_is_refused():
    record = Record()
    pretrain(record, "sgd", epochs=1)
    model = DropNet(2).double()
    with pytest.raises(ik.NotReplayable, match="case=2"):
        record.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), loader_of(10, 2, 2, 3), cross_entropy,
                     link=ik.Link("embedding", case=1))


def autocast_run(record: Record | None, dtype: torch.dtype | None):
    """AdamW with warmup on a float32 DropNet (dropout off) for 3 epochs, its forwards under autocast to ``dtype``."""
    torch.manual_seed(0)
    model = DropNet(3).float()
    model.embedding[2].p = 0.0  # dropout draws its masks per dtype: off, so both precisions see the same network
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    scheduler, loader = warmup(optimizer), loader_of(12, 3, seed=1, batch_size=4)
    loader.dataset.tensors = (loader.dataset.tensors[0].float(), loader.dataset.tensors[1])
    with record.watch(model, optimizer, loader, cross_entropy) if record is not None else nullcontext():
        for _ in range(3):
            for x, y in loader:
                optimizer.zero_grad()
                with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                    loss = cross_entropy(model(x), y).mean()
                loss.backward()
                optimizer.step()
                scheduler.step()
    return model


def test_a_bf16_run_replays_bit_for_bit_and_its_float32_derivative_is_the_float32_runs_to_bf16_precision():
    """bf16 autocast: the record repeats the run bit for bit (the watched run is the plain one); the metagradient,
    taken in float32 along the bf16 trajectory, equals the float32 run's exact metagradient to bf16's precision:
    the two trajectories differ by a few units of bf16's roundoff u = 2⁻⁸ per step, so their derivatives differ by
    a few u relatively — measured 0.58 %, asserted below 3 % (≈ 8u). (Central differences of the bf16 re-run do not
    resolve the derivative: each replayed step rounds its gradient to 8 bits, so a weight change of 10⁻² moves the
    measure by steps of that rounding — measured 60 % off the float32 run's metagradient as well.)"""
    record, plain = Record(), autocast_run(None, torch.bfloat16)
    watched = autocast_run(record, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(watched.parameters(), plain.parameters()))
    assert record.runs[0].autocast == ("cpu", torch.bfloat16) and ik.unrolled.verify(record) == 0.0
    test = tuple(t.float() if t.is_floating_point() else t for t in TEST)
    mixed = ik.unrolled.metagradients(record, test)[0].values
    exact = Record()
    autocast_run(exact, None)
    reference = ik.unrolled.metagradients(exact, test)[0].values
    assert mixed.dtype == torch.float32 and not torch.equal(mixed, reference)
    assert float((mixed - reference).norm() / reference.norm()) < 0.03


def test_a_case_2_loop_without_the_proximal_term_is_refused_not_scored():
    """The silent case: a Case 2 link (alpha > 0) whose loop leaves run.penalty() out of its loss. At step 1 the
    block equals its pretrained values, so the penalty's gradient is 0 and the first step's check sees nothing;
    the run trained is not the one replay computes, and no score may come of it."""
    record = Record()
    pretrain(record, "sgd", epochs=1)
    torch.manual_seed(1)
    model = DropNet(2).double()
    optimizer, loader = torch.optim.AdamW(model.parameters(), lr=0.05), loader_of(10, 2, seed=2, batch_size=3)
    with pytest.raises(ik.NotReplayable, match=r"differs from replay's(.|\n)*must add run\.penalty\(\)"):
        with record.watch(model, optimizer, loader, cross_entropy, link=ik.Link("embedding", case=2, alpha=0.05)) \
                as run:
            train(model, optimizer, loader, run=run, proximal=False)
        ik.unrolled.metagradients(record, TEST)
    assert len(record) == 1  # the finetuning was not recorded


def test_a_run_that_replay_does_not_reproduce_gets_no_score():
    """Parameters changed outside the optimizer (here scaled in place after every step): the checkpoints hold a run
    replay does not repeat, so the metagradient refuses before returning a result, and says what to look for."""
    record = Record()
    model, loader = fresh()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with record.watch(model, optimizer, loader, cross_entropy, checkpoint_every=2):
        for x, y in loader:
            optimizer.zero_grad()
            cross_entropy(model(x), y).mean().backward()
            optimizer.step()
            with torch.no_grad():
                model.head.weight.mul_(0.99)
    assert ik.unrolled.verify(record) > 0
    with pytest.raises(ik.NotReplayable, match="does not reproduce the recorded run") as refused:
        ik.unrolled.metagradients(record, TEST)
    assert "outside the optimizer" in str(refused.value)


def loop_error(body, **kwargs) -> str:
    """Run ``body(model, optimizer, loader, run)`` under a fresh watch; the error it raises, checked to come before
    the first update."""
    model, loader = fresh()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    record = Record()
    with pytest.raises(ik.NotReplayable) as info:
        with record.watch(model, optimizer, loader, cross_entropy, **kwargs) as run:
            body(model, optimizer, loader, run)
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())
    assert not len(record)
    return str(info.value)


def one_step(loss=lambda out, y: cross_entropy(out, y).mean(), clip=None, extra=None):
    def body(model, optimizer, loader, run):
        x, y = next(iter(loader))
        loss(model(x), y).backward()
        if extra is not None:
            extra(model)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return body


def test_what_the_loop_does_differently_from_replay_is_refused_before_the_first_update():
    assert "differs from replay" in loop_error(one_step(loss=lambda out, y: cross_entropy(out, y).sum()))
    assert "run.clip_grad_norm_" in loop_error(one_step(clip=1e-3))
    assert "differs from replay" in loop_error(one_step(), accumulate=2)

    def extra_forward(model, optimizer, loader, run):
        model(torch.randn(3, 5, dtype=torch.float64)).sum().backward()

    assert "did not come from the watched loader" in loop_error(extra_forward)

    def half(model, optimizer, loader, run):
        x, _ = next(iter(loader))
        with torch.autocast("cpu", dtype=torch.float16):
            model(x)

    assert "only bfloat16 autocast" in loop_error(half)

    def no_gradient(model, optimizer, loader, run):
        x, y = next(iter(loader))
        model.embedding[0].weight.requires_grad_(False)  # an optimized parameter left without a gradient
        cross_entropy(model(x), y).mean().backward()
        optimizer.step()

    assert "no gradient" in loop_error(no_gradient)


def test_out_of_range_step_indices_are_refused_when_stepped():
    stage = ik.Stage(nn.Linear(5, 3).double().eval(), cross_entropy, tuple(
        t.double() if t.is_floating_point() else t for t in data(12, 3, seed=1)))
    with ik.unrolled.Record().recorder(stage, ik.unrolled.SGD(lr=0.1)) as rec:
        for bad in ([0, 1, -1], [0, 12]):
            with pytest.raises(ik.InputError, match=r"\[0, 12\)"):
                rec.step(bad)
        rec.step([0, 1, 11])
    assert rec.run.steps == 1


def test_the_approximate_unrolling_refuses_a_watched_nesterov_run():
    record = Record()
    pretrain(record, "sgd", epochs=1)
    with pytest.raises(ik.InputError, match="metagradients"):
        ik.unrolled.approximate(record, TEST)


@pytest.mark.parametrize("pull", ["looped", "batched", "vmapped"])
def test_several_measures_of_a_dropout_run_are_each_measures_own_metagradient(pull):
    """q = 4 per-test losses pulled either way through steps with dropout: column j equals the one-measure
    metagradient of test point j alone (checked against finite differences above)."""
    record, _ = recorded("case 1: AdamW -> SGD + momentum")
    x, y = TEST
    per_test = ik.unrolled.metagradients(record, TEST, per_test=True, pull=pull)
    assert per_test[0].diagnostics["replay"]["max_error"] == 0.0
    for j in range(len(x)):
        alone = ik.unrolled.metagradients(record, (x[j:j + 1], y[j:j + 1]))
        for a, b in zip(alone, per_test):
            torch.testing.assert_close(b.values[:, j], a.values, rtol=1e-10, atol=1e-13)
