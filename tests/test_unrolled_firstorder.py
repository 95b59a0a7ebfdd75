"""First-order trajectory attribution (``ik.unrolled.first_order``): with per-example losses linear in the trained
parameters (zero loss curvature) it equals the exact metagradient for SGD + momentum, Adam, AdamW with clipping and
across Case 1, Case 2 and plain-finetuning links; where the loss curves, its correction's error against the exact
metagradient falls as the segments shorten (and vanishes at one full-batch step per segment); and the record's
diagnostic says when first order is enough."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import influkit as ik
from influkit.unrolled import SGD, Adam, AdamW, Record
from influkit.unrolled import firstorder

from conftest import cross_entropy, l2


class Linear2(nn.Module):
    """head(embedding(x)), both linear: a loss linear in the outputs is linear in whichever block alone is trained."""

    def __init__(self, d_in: int = 5, width: int = 4, out: int = 3):
        super().__init__()
        self.embedding = nn.Linear(d_in, width)
        self.head = nn.Linear(width, out)

    def forward(self, x):
        return self.head(self.embedding(x))


def linear_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """ℓ = ⟨outputs, targets⟩ per example: zero curvature in the outputs."""
    return (outputs * targets).sum(1)


def vectors(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=gen, dtype=torch.float64), torch.randn(n, 3, generator=gen,
                                                                               dtype=torch.float64)


TEST = vectors(3, seed=9)


def linear_stage(seed: int, params: str, n: int = 10, regularizer=None) -> ik.Stage:
    torch.manual_seed(seed)
    return ik.Stage(Linear2().double().eval(), linear_loss, vectors(n, seed), params=params,
                    regularizer=regularizer)


def linear_record(pre, link: str | None = None, fin=None) -> Record:
    record = Record()
    record.train(linear_stage(0, "embedding", regularizer=l2(1e-2)), pre, steps=9, batch_size=4,
                 checkpoint_every=4)
    if link is not None:
        params, kind = {"case1": ("head", ik.Link("embedding", case=1)),
                        "case2": ("embedding", ik.Link("embedding", case=2, alpha=0.05)),
                        "finetune": ("embedding", ik.Link.finetune("embedding"))}[link]
        record.train(linear_stage(1, params, n=8), fin, steps=7, batch_size=3, link=kind,
                     schedule=lambda t: 0.05 * (1 - t / 10), checkpoint_every=3)
    return record


def watched_adamw_with_clipping() -> Record:
    """A torch.optim.AdamW loop with warmup and gradient clipping, recorded by ``record.watch``; every step clips."""
    torch.manual_seed(0)
    model = Linear2().double()
    x, y = vectors(12, seed=3)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    model.head.requires_grad_(False)  # the embedding alone trained: the loss is linear in it
    optimizer = torch.optim.AdamW(model.embedding.parameters(), lr=0.05, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / 3))
    record = Record()
    with record.watch(model, optimizer, loader, linear_loss, checkpoint_every=4) as run:
        for _ in range(3):
            for xb, yb in loader:
                linear_loss(model(xb), yb).mean().backward()
                run.clip_grad_norm_(0.5)  # clips: the linear loss's gradient norm is well above 0.5
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    return record


ZERO_CURVATURE = {
    "SGD + momentum": lambda: linear_record(SGD(lr=0.1, momentum=0.9, weight_decay=1e-3)),
    "Adam": lambda: linear_record(Adam(lr=0.05, weight_decay=1e-3)),
    "AdamW, clipped (watched torch.optim loop)": watched_adamw_with_clipping,
    "case 1: Adam -> SGD + momentum": lambda: linear_record(Adam(lr=0.05), "case1", SGD(lr=0.1, momentum=0.9)),
    "case 2: SGD + momentum -> AdamW": lambda: linear_record(SGD(lr=0.1, momentum=0.8), "case2",
                                                             AdamW(lr=0.05, weight_decay=0.1)),
    "plain finetuning: AdamW -> AdamW": lambda: linear_record(AdamW(lr=0.05), "finetune",
                                                              AdamW(lr=0.05, weight_decay=0.01)),
}


@pytest.mark.parametrize("name", list(ZERO_CURVATURE))
@pytest.mark.parametrize("budget", [firstorder.EXAMPLE_GRADIENT_BYTES, 0], ids=["example gradients", "jvps"])
def test_first_order_equals_the_exact_metagradient_where_the_loss_has_no_curvature(name, budget, monkeypatch):
    """Losses linear in the trained block: H_t = 0, so dropping it is exact, and everything left — the optimizer's
    Jacobians (Adam's second moment's response, clipping's dependence on the norm, decay), the regularizer's and
    the proximal term's Hessians, the Case 1 mixed derivative — must reproduce the exact metagradient, per test point
    (q = 3: each example's gradient times the columns, or with no room for those one jvp per column batched by vmap)
    and summed (q = 1)."""
    monkeypatch.setattr(firstorder, "EXAMPLE_GRADIENT_BYTES", budget)
    record = ZERO_CURVATURE[name]()
    for per_test in (True, False):
        exact = ik.unrolled.metagradients(record, TEST, per_test=per_test, progress=False)
        ours = ik.unrolled.first_order(record, TEST, per_test=per_test, progress=False)
        assert len(ours) == len(exact)
        for a, b in zip(ours, exact):
            assert b.values.abs().max() > 1e-3  # a real signal
            torch.testing.assert_close(a.values, b.values, rtol=1e-9, atol=1e-12)
            assert a.removal_eps == -1.0 and torch.equal(a.removal, -a.values)
        assert ours[0].diagnostics["replay"]["max_error"] == 0.0


class Tanh(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Sequential(nn.Linear(5, 4), nn.Tanh())
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.embedding(x))


def curved_record(optimizer) -> Record:
    """Full-batch training of a tanh network under cross-entropy: the loss curves."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(4)
    data = torch.randn(12, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, (12,), generator=gen)
    stage = ik.Stage(Tanh().double().eval(), cross_entropy, data, regularizer=l2(1e-2))
    record = Record()
    record.train(stage, optimizer, steps=8, batch_size=12, checkpoint_every=4)
    return record


@pytest.mark.parametrize("optimizer", [SGD(lr=0.5, momentum=0.5), AdamW(lr=0.05, weight_decay=0.1)],
                         ids=["SGD + momentum", "AdamW"])
def test_the_corrections_error_falls_as_segments_shorten(optimizer):
    """With the dense Hessian at each segment's start, the correction's error against the exact metagradient falls
    as the segments shorten; at one full-batch step per segment the Hessian is H_t itself, so it is exact. (One
    Hessian for the whole run can err more than none: under AdamW it is taken where the run starts.)"""
    record = curved_record(optimizer)
    test = (torch.randn(4, 5, generator=torch.Generator().manual_seed(8), dtype=torch.float64),
            torch.tensor([0, 1, 2, 0]))
    exact = ik.unrolled.metagradients(record, test, progress=False)[0].values

    def error(**kw):
        ours = ik.unrolled.first_order(record, test, progress=False, **kw)[0].values
        return float((ours - exact).norm() / exact.norm())

    plain = error()
    corrected = [error(correction="dense", segments=s) for s in (1, 2, 4, 8)]
    assert plain > 1e-3  # the curvature matters here
    assert corrected[0] > corrected[1] > corrected[2] > corrected[3]
    assert corrected[3] < 1e-9 and corrected[2] < plain


def test_the_correction_reports_its_eigenpairs_and_low_rank_lies_between():
    record = curved_record(SGD(lr=0.5, momentum=0.5))
    test = (torch.randn(4, 5, generator=torch.Generator().manual_seed(8), dtype=torch.float64),
            torch.tensor([0, 1, 2, 0]))
    exact = ik.unrolled.metagradients(record, test, progress=False)[0].values
    results = {k: ik.unrolled.first_order(record, test, correction=k, segments=8, progress=False)[0]
               for k in (0, 3, "dense")}
    errors = {k: float((r.values - exact).norm() / exact.norm()) for k, r in results.items()}
    assert errors[0] > errors[3] > errors["dense"]
    notes = results[3].diagnostics["correction"]
    assert [n["piece_start"] for n in notes] == list(range(7, -1, -1)) and {n["directions"] for n in notes} == {3}


def test_first_order_check_reads_the_run_and_names_what_to_do():
    """A short run at a small learning rate is first order; at a larger one it needs the correction (with enough
    segments to keep each under the per-segment exposure); larger still, exact replay — for its exposure, and for a
    step past the edge of stability."""
    rows = []
    for lr in (0.01, 0.2, 2.0, 8.0):
        record = curved_record(SGD(lr=lr))
        rows.append(ik.unrolled.first_order_check(record, ik.unrolled.sharpness(record)).loc[0])
    assert [r["verdict"] for r in rows] == ["first order", "add the correction", "exact replay", "exact replay"]
    exposures = [r["exposure"] for r in rows]
    assert exposures == sorted(exposures) and exposures[0] > 0
    assert rows[1]["segments"] == math.ceil(rows[1]["exposure"])
    assert "exposure" in rows[2]["why"] and rows[2]["largest_share_of_edge"] < 1 < rows[3]["largest_share_of_edge"]


def test_bad_settings_are_refused_with_the_fix():
    record = curved_record(SGD(lr=0.1))
    with pytest.raises(ik.InputError, match="correction must be"):  # neither a count nor a curvature
        ik.unrolled.first_order(record, (torch.randn(2, 5, dtype=torch.float64), torch.tensor([0, 1])),
                                correction=-1)
    with pytest.raises(ik.InputError, match="segments must be"):
        ik.unrolled.first_order(record, (torch.randn(2, 5, dtype=torch.float64), torch.tensor([0, 1])),
                                correction=2, segments=0)
    with pytest.raises(ik.InputError, match="sharpness table has no row"):
        ik.unrolled.first_order_check(record, ik.unrolled.sharpness(record).iloc[0:0])


def test_the_ekfac_correction_puts_back_the_bulk_of_the_curvature():
    """On the full-batch SGD run, where first order's error is large, EK-FAC's whole-spectrum Gauss-Newton
    approximation fitted at each segment's start recovers a good part of the dropped curvature (measured: the
    relative error 0.79 → 0.42); it is fitted once per segment and reported in the diagnostics."""
    record = curved_record(SGD(lr=0.5, momentum=0.5))
    test = (torch.randn(4, 5, generator=torch.Generator().manual_seed(8), dtype=torch.float64),
            torch.tensor([0, 1, 2, 0]))
    exact = ik.unrolled.metagradients(record, test, progress=False)[0].values
    plain = ik.unrolled.first_order(record, test, progress=False)[0]
    corrected = ik.unrolled.first_order(record, test, correction="ekfac", segments=4, progress=False)[0]
    error = {name: float((r.values - exact).norm() / exact.norm()) for name, r in (("plain", plain),
                                                                                   ("ekfac", corrected))}
    assert error["ekfac"] < 0.7 * error["plain"]
    assert [n["piece_start"] for n in corrected.diagnostics["correction"]] == [6, 4, 2, 0]


def test_a_watched_torch_optim_run_has_a_sharpness_and_a_first_order_check():
    """A watched ``torch.optim.AdamW`` (its one parameter group read as ``Groups``) is measured with the group's own
    rule: λ_max of P⁻¹H at the final checkpoint equals the dense P^{-1/2} H P^{-1/2} built from the same P; groups that
    differ in more than their learning rates (and AdamW's decoupled decay) are refused by name."""
    from influkit.curvature import HessianOperator
    from influkit.unrolled.optimizers import Groups
    from influkit.unrolled.stability import preconditioner, stage_rule

    torch.manual_seed(0)
    x, y = torch.randn(32, 4, dtype=torch.float64), torch.randint(0, 3, (32,))
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    record = Record()
    with record.watch(model, optimizer, loader, loss_fn):
        for xb, yb in loader:
            optimizer.zero_grad()
            loss_fn(model(xb), yb).mean().backward()
            optimizer.step()
    run = record.runs[0]
    assert isinstance(run.optimizer, Groups) and isinstance(stage_rule(run.optimizer), AdamW)
    table = ik.unrolled.sharpness(record, steps=40)
    last = table[table["step"] == run.steps].iloc[0]
    theta, state = run.checkpoints[run.steps]
    p = preconditioner(run, run.steps, theta, state)
    h = HessianOperator(run.stage, list(run.trained), at=theta).dense()
    scale = torch.cat([p[n].reshape(-1) for n in run.trained]) ** -0.5
    expected = torch.linalg.eigvalsh(scale[:, None] * h * scale[None, :]).max()
    assert math.isclose(float(last["max_eigenvalue"]), float(expected), rel_tol=1e-6)
    assert ik.unrolled.first_order_check(record, table)["verdict"].notna().all()

    decayed = Groups((AdamW(lr=1e-2), AdamW(lr=1e-2, weight_decay=0.0)), (("0.weight",), ("0.bias",)))
    assert stage_rule(decayed) == AdamW(lr=1e-2)  # a Trainer's groups: decoupled decay is no part of the sharpness
    coupled = Groups((Adam(lr=1e-2, weight_decay=1e-2), Adam(lr=1e-2)), (("0.weight",), ("0.bias",)))
    with pytest.raises(ik.InputError, match="differ in more than their learning rates"):
        stage_rule(coupled)


def test_a_trainer_runs_correction_takes_its_batches_as_fed_and_is_exact_at_one_step_per_segment():
    """A Trainer's masked-LM run (full batches, a collator that masks the same positions every step, no dropout:
    every step's objective is the same mean over its predicted tokens): the correction's curvature is that of the
    batches as fed, times the examples per predicted token, so at one step per segment the dense correction equals
    the exact metagradient; first order alone does not. The sharpness is that objective's (its dense Hessian's
    largest eigenvalue, preconditioned by Adam's P at the final checkpoint), or a seeded sample of its rows'; Adam's P
    between checkpoints is the one its step took (the clipped gradient of the batch as fed)."""
    pytest.importorskip("transformers")
    import copy

    from transformers import BertConfig, BertForMaskedLM, Trainer

    from influkit import hf
    from influkit.curvature import HessianOperator
    from influkit.unrolled.stability import preconditioner
    from test_hf_trainer_record import TEXTS, VOCAB, arguments, examples

    tokenizer = hf.wordpiece_tokenizer(VOCAB)

    def collate(items):  # every third attended token predicted, shown as [MASK]: the same batch at every step
        batch = tokenizer.pad(items, return_tensors="pt")
        chosen = (torch.arange(batch["input_ids"].shape[1]) % 3 == 1) & (batch["attention_mask"] == 1)
        batch["labels"] = batch["input_ids"].masked_fill(~chosen, -100)
        batch["input_ids"] = batch["input_ids"].masked_fill(chosen, tokenizer.mask_token_id)
        return batch

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=len(tokenizer), hidden_size=8, num_hidden_layers=1,
                                       num_attention_heads=2, intermediate_size=16, max_position_embeddings=16,
                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                       attn_implementation="eager")).double()
    for name, p in model.named_parameters():  # a dense Hessian of a few hundred parameters
        p.requires_grad_(".layer." in name)
    record = ik.unrolled.Record()
    Trainer(model, arguments(per_device_train_batch_size=8, num_train_epochs=4), train_dataset=examples(tokenizer, TEXTS),
            data_collator=collate, callbacks=[hf.RecordCallback(record, checkpoint_every=1)]).train()
    run = record.runs[0]
    assert run.steps == 4 and run.data_scale(0) == pytest.approx(8 / int((run.inputs[0][1] != -100).sum()))
    test = run.stage.data.take(torch.tensor([0, 3]))
    exact = ik.unrolled.metagradients(record, test, progress=False)[0].values
    p = sum(run.checkpoints[0][0][n].numel() for n in run.trained)

    def error(**kw):
        ours = ik.unrolled.first_order(record, test, progress=False, **kw)[0].values
        return float((ours - exact).norm() / exact.norm())

    assert error() > 1e-3
    assert error(correction=p, segments=4) < 1e-8

    theta, state = run.checkpoints[run.steps]
    model.eval()
    fed = run.stage.with_(data=tuple(torch.cat(v) for v in zip(*run.inputs)))
    scale = torch.cat([preconditioner(run, run.steps, theta, state)[n].reshape(-1) for n in run.trained]) ** -0.5
    recorded = preconditioner(run, 1, *run.checkpoints[1])  # the step's v as the Trainer's AdamW kept it
    between = copy.copy(run)
    between.checkpoints = {t: v for t, v in run.checkpoints.items() if t != 2}
    computed = preconditioner(between, 1, *run.checkpoints[1])  # from the step's clipped gradient, as fed
    assert all(torch.allclose(computed[n], recorded[n], rtol=1e-10, atol=0) for n in run.trained)
    for samples in (None, 12):  # every fed row, and a seeded sample of them
        h = HessianOperator(fed, list(run.trained), at=theta, data_weight=run.data_scale(0), samples=samples).dense()
        expected = float(torch.linalg.eigvalsh(scale[:, None] * h * scale[None, :]).max())
        table = ik.unrolled.sharpness(record, steps=60, samples=samples)
        assert float(table[table["step"] == run.steps]["max_eigenvalue"].iloc[0]) == pytest.approx(expected, rel=1e-6)
