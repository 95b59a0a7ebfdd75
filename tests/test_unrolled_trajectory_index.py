"""The trajectory index (``ik.unrolled.TrajectoryIndex``): float64, tiny models.

The exact index answers two different finetunes of one pretraining record (full and LoRA) with the first-order
scores of the pretraining stage — the finetune carried by first order, or by its own exact replay (then equal to
first order through the pretraining from the exact adjoint it hands back) — and a new test set on the pretrained
model; an append equals a rebuild; a killed build or append resumes to the same index; the compressed index's
error stays within the variance bound of its random projection; a record or directory of another run is refused;
a stage without a regularizer is indexed in one pass over its examples, equal to the column sweeps (SGD, Adam, AdamW,
a clipped torch.optim loop); two ranks under torchrun build the single-process index, both ways, and a failing rank
fails the other.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import influkit as ik
from influkit.unrolled import SGD, Adam, AdamW, Record, TrajectoryIndex
from influkit.unrolled import trajectory_index as module
from influkit.unrolled.boundary import measure_adjoint
from influkit.unrolled.metagradient import exact_down_to

from conftest import assert_a_failing_rank_fails_the_others, cross_entropy, l2, run_a_rank_that_may_fail
from test_unrolled import TEST, Net, data, finetune, pretrain

TESTS = Path(__file__).parent
TORCHRUN = Path(sys.executable).with_name("torchrun")


def pretrained() -> Record:
    record = Record()
    pretrain(record, AdamW(lr=0.05, weight_decay=0.1))
    return record


def finetunes(pre: Record) -> dict[str, Record]:
    """Two finetunes of the same pretraining record: the whole model (plain finetuning) and a LoRA adapter."""
    full, lora = pre.branch(), pre.branch()
    finetune(full, "finetune", SGD(lr=0.1, momentum=0.9))
    finetune(lora, "lora", Adam(lr=0.1, weight_decay=1e-3))
    return {"full": full, "lora": lora}


def continued(pre: Record) -> Record:
    """The pretraining continued on new examples: a second stage of the same model from the first one's weights."""
    record = pre.branch()
    torch.manual_seed(3)
    stage = ik.Stage(Net(3).eval(), cross_entropy, data(9, 3, seed=4), regularizer=l2(1e-2))
    record.train(stage, SGD(lr=0.1, momentum=0.8), steps=6, batch_size=4, checkpoint_every=3,
                 link=ik.Link.finetune({"embedding": "embedding", "head": "head"}))
    return record


def unregularized(optimizer=None) -> Record:
    """A pretraining stage without a regularizer (the first-order carry acts coordinate by coordinate): the recorded
    rule, or (None) a watched torch.optim.AdamW loop that clips every step."""
    torch.manual_seed(0)
    record, x = Record(), data(12, 3, seed=1)
    if optimizer is not None:
        record.train(ik.Stage(Net(3).eval(), cross_entropy, x), optimizer, steps=9, batch_size=4, checkpoint_every=4)
        return record
    model = Net(3).eval()
    loader = DataLoader(TensorDataset(*x), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    adamw = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    with record.watch(model, adamw, loader, cross_entropy, checkpoint_every=4) as run:
        for _ in range(3):
            for xb, yb in loader:
                cross_entropy(model(xb), yb).mean().backward()
                assert float(run.clip_grad_norm_(0.1)) > 0.1  # clips
                adamw.step()
                adamw.zero_grad()
    return record


@pytest.fixture(scope="module")
def pre() -> Record:
    return pretrained()


@pytest.fixture(scope="module")
def exact(pre, tmp_path_factory) -> TrajectoryIndex:
    return TrajectoryIndex.build(pre, tmp_path_factory.mktemp("exact"), progress=False)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert b.abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_the_exact_index_gives_each_finetunes_first_order_scores(pre, exact, kind):
    record = finetunes(pre)[kind]
    first_order = ik.unrolled.first_order(record, TEST, per_test=True, progress=False)
    carried = exact.scores(record, TEST, per_test=True, finetune="first-order", progress=False)
    for got, want in zip(carried, first_order):
        close(got.values, want.values)
    adjoint, q, _ = measure_adjoint(record, TEST, True)
    handed = exact_down_to(record, adjoint, q, 1, False)[1]  # the finetune's exact adjoint on the pretrained model
    through = ik.unrolled.first_order(pre, ik.unrolled.Adjoint(handed, batched=True), per_test=True, progress=False)
    replayed = exact.scores(record, TEST, per_test=True, progress=False)
    close(replayed[0].values, through[0].values)
    close(replayed[1].values, ik.unrolled.metagradients(record, TEST, per_test=True)[1].values)  # pulls may differ
    assert torch.equal(replayed[0].removal, -replayed[0].values)


def test_a_new_test_set_on_the_pretrained_model_needs_the_adjoint_alone(pre, exact):
    other = data(5, 3, seed=11)
    close(exact.scores(pre, other, progress=False)[0].values,
          ik.unrolled.first_order(pre, other, progress=False)[0].values)


def test_append_equals_rebuild(pre, tmp_path):
    longer = continued(pre)
    appended = TrajectoryIndex.build(pre, tmp_path / "appended", progress=False).append(longer,
                                                                                                  progress=False)
    rebuilt = TrajectoryIndex.build(longer, tmp_path / "rebuilt", progress=False)
    assert appended.manifest == rebuilt.manifest | {"generation": 1}
    for a, r in zip(appended.entries(), rebuilt.entries()):
        close(a, r)
    assert sorted(p.name[:3] for p in (tmp_path / "appended").glob("g*")) == ["g1-"]  # the old blocks removed
    record = longer.branch()
    finetune(record, "lora", Adam(lr=0.1))
    for got, want in zip(appended.scores(record, TEST, finetune="first-order", progress=False),
                         ik.unrolled.first_order(record, TEST, progress=False)):
        close(got.values, want.values)


class Interrupt(RuntimeError):
    pass


def test_a_killed_build_resumes_to_the_same_index(pre, exact, tmp_path, monkeypatch):
    calls, real = [], module.carry

    def dies_on_the_third_block(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise Interrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "carry", dies_on_the_third_block)
    with pytest.raises(Interrupt):
        TrajectoryIndex.build(pre, tmp_path, block=8, progress=False)
    with pytest.raises(ik.InputError, match="unfinished"):
        TrajectoryIndex(tmp_path).entries()
    monkeypatch.setattr(module, "carry", real)
    resumed = TrajectoryIndex.build(pre, tmp_path, block=8, progress=False)
    assert resumed.blocks == {"computed": 3, "reused": 2}  # 39 columns in blocks of 8
    for a, b in zip(resumed.entries(), exact.entries()):
        close(a, b)


def test_a_killed_append_resumes_to_the_same_index(pre, tmp_path, monkeypatch):
    longer = continued(pre)
    index = TrajectoryIndex.build(pre, tmp_path / "index", block=16, progress=False)
    real = module.carry

    def dies_after_two_new_blocks(*args, **kwargs):
        if len(list((tmp_path / "index").glob("g1-*"))) == 2:
            raise Interrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "carry", dies_after_two_new_blocks)
    with pytest.raises(Interrupt):
        index.append(longer, progress=False)
    assert TrajectoryIndex(tmp_path / "index").manifest == index.manifest  # the old index stands until the end
    monkeypatch.setattr(module, "carry", real)
    assert index.append(longer, progress=False).blocks == {"computed": 1, "reused": 2}
    for a, r in zip(index.entries(), TrajectoryIndex.build(longer, tmp_path / "rebuilt", progress=False).entries()):
        close(a, r)


def variance_bound(index: TrajectoryIndex, exact_rows: torch.Tensor, adjoint: torch.Tensor) -> torch.Tensor:
    """Per example, Σ_n (‖λ_n‖²‖v_{z,n}‖² + ⟨λ_n, v_{z,n}⟩²)/k_n over the compressed tensors n (the module's bound)."""
    c = index.compression()
    total, offset = torch.zeros(exact_rows.shape[0], dtype=exact_rows.dtype), 0
    for n, p in c.projections.items():
        size = math.prod(c.shapes[n])
        v, lam = exact_rows[:, offset:offset + size], adjoint[offset:offset + size]
        if p is not None:
            total += ((lam @ lam) * (v * v).sum(1) + (v @ lam) ** 2) / p.shape[0]
        offset += size
    return total


def test_the_compressed_index_errs_within_its_projections_variance_bound(pre, exact, tmp_path):
    record = finetunes(pre)["full"]
    truth = exact.scores(record, TEST, progress=False)[0].values
    adjoint, q, _ = measure_adjoint(record, TEST, False)
    handed = exact.compression().apply(exact_down_to(record, adjoint, q, 1, False)[1])[0]
    ratios = []
    for seed in range(4):
        small = TrajectoryIndex.build(pre, tmp_path / f"seed{seed}", dim=32, seed=seed, progress=False)
        assert small.width < exact.width and small.bytes_per_example == 8 * small.width
        error = small.scores(record, TEST, progress=False)[0].values - truth
        bound = variance_bound(small, exact.entries()[0], handed).sum()
        ratios.append(float((error ** 2).sum() / bound))
    # E[Σ err²] ≤ Σ bound: by Markov each ratio exceeds 10 with probability ≤ 0.1, their mean exceeds 3 with ≤ 1/3
    assert max(ratios) <= 10 and sum(ratios) / len(ratios) <= 3, ratios
    whole = TrajectoryIndex.build(pre, tmp_path / "whole", dim=80, progress=False)  # 20 a tensor: each kept whole
    assert variance_bound(whole, exact.entries()[0], handed).sum() == 0
    close(whole.scores(record, TEST, progress=False)[0].values, truth)


@pytest.mark.parametrize("optimizer", [SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
                                       Adam(lr=0.05, weight_decay=1e-2), AdamW(lr=0.05), None],
                         ids=["SGD + nesterov", "Adam", "AdamW", "torch.optim.AdamW, clipped"])
def test_a_stage_without_a_regularizer_is_indexed_in_one_pass_equal_to_the_column_sweeps(optimizer, tmp_path,
                                                                                         monkeypatch):
    record = unregularized(optimizer)
    assert module.by_examples(record) and not module.by_examples(pretrained())
    passes = {d: TrajectoryIndex.build(record, tmp_path / f"pass{d}", dim=d, progress=False) for d in (None, 20)}
    monkeypatch.setattr(module, "by_examples", lambda indexed: False)
    for d, index in passes.items():
        swept = TrajectoryIndex.build(record, tmp_path / f"sweeps{d}", dim=d, block=8, progress=False)
        assert index.manifest == swept.manifest | {"block": 64}
        close(index.entries()[0], swept.entries()[0])
    close(passes[None].scores(record, TEST, per_test=True, progress=False)[0].values,
          ik.unrolled.first_order(record, TEST, per_test=True, progress=False)[0].values)


def test_a_one_pass_index_bounds_its_projection_noise_and_warns_where_it_swamps_the_scores(tmp_path, monkeypatch):
    """The noise bound σ_z of a compressed one-pass index holds on average over seeds (E[err²] ≤ σ², Markov over 4
    seeds), warns where the bound is the scores' size and names the exact index, which has none; a sweep-built one
    says its noise is unchecked."""
    record = unregularized(AdamW(lr=0.05))
    exact = TrajectoryIndex.build(record, tmp_path / "exact", progress=False)
    truth = exact.scores(record, TEST, per_test=True, progress=False)[0]
    assert truth.diagnostics["index"]["noise"] == {"bound": "exact"}
    assert truth.diagnostics["index"]["replay"]["max_error"] == 0.0
    ratios = []
    for seed in range(4):
        small = TrajectoryIndex.build(record, tmp_path / f"seed{seed}", dim=8, seed=seed, progress=False)
        with pytest.warns(ik.ProjectionNoiseWarning, match="dim=None"):
            got = small.scores(record, TEST, per_test=True, progress=False)[0]
        noise = got.diagnostics["index"]["noise"]
        assert noise["bound"] == "checked" and noise["share"] > module.NOISE_SHARE
        adjoint, q, _ = measure_adjoint(record, TEST, True)
        c = small.compression()
        lam = {n: adjoint[n].reshape(q, -1).double().pow(2).sum(1) for n in adjoint}
        rows, offset, bound = exact.entries()[0], 0, torch.zeros(rows_count := len(record.runs[0].stage), q)
        for n, projection in c.projections.items():
            size = math.prod(c.shapes[n])
            if projection is not None:
                bound += 2 * rows[:, offset:offset + size].pow(2).sum(1, keepdim=True) * lam[n][None] / projection.shape[0]
            offset += size
        assert rows_count == got.values.shape[0]
        ratios.append(float(((got.values - truth.values) ** 2).sum() / bound.sum()))
    assert sum(ratios) / len(ratios) <= 3, ratios
    wide = TrajectoryIndex.build(record, tmp_path / "wide", dim=10**4, progress=False)  # every tensor kept whole
    assert wide.scores(record, TEST, progress=False)[0].diagnostics["index"]["noise"]["share"] == 0.0
    monkeypatch.setattr(module, "by_examples", lambda indexed: False)
    swept = TrajectoryIndex.build(record, tmp_path / "swept", dim=8, progress=False)
    assert swept.scores(record, TEST, progress=False)[0].diagnostics["index"]["noise"]["bound"] == "unchecked"


def test_a_record_that_does_not_replay_says_so_in_every_query(tmp_path):
    """A checkpoint that the recorded steps do not reach (here: moved by 1e-3 after recording) shows in the one-pass
    build's replay check, reported by each query; a sweep-built index says it kept none."""
    record = unregularized(AdamW(lr=0.05))
    run = record.runs[0]
    name = next(iter(run.checkpoints[4][0]))
    run.checkpoints[4][0][name] = run.checkpoints[4][0][name] + 1e-3
    index = TrajectoryIndex.build(record, tmp_path / "moved", progress=False)
    replay = index.scores(record, TEST, progress=False)[0].diagnostics["index"]["replay"]
    assert replay["max_error"] >= 1e-3 * (1 - 1e-9)  # the segment that ends there, and the one that starts there
    swept = TrajectoryIndex.build(pretrained(), tmp_path / "swept", progress=False)
    assert swept.replay()["max_error"] is None


def test_a_trainer_run_is_indexed_in_one_pass_as_first_order_scores_it(tmp_path):
    """A Trainer's masked-LM run at its defaults but for the accumulation (2 micro-batches a step), with dropout, a
    collator that masks every batch anew, clipping at 0.5 and two epochs: the one-pass index (each example's
    gradient from its micro-batch as fed, twice) gives first order's scores."""
    pytest.importorskip("transformers")
    from influkit import hf
    from test_hf_trainer_record import VOCAB
    from test_hf_trainer_record import pretrain as trainer_pretrain

    record = Record()
    trainer_pretrain(hf.wordpiece_tokenizer(VOCAB), [hf.RecordCallback(record)], gradient_accumulation_steps=2)
    run = record.runs[0]
    assert len(run.parts[0]) == 2 and run.steps == 4 and run.clips[0] == (0.5, 2.0) and module.by_examples(record)
    index = TrajectoryIndex.build(record, tmp_path, block=1024, progress=False)
    test = run.stage.data.take(torch.tensor([0, 5]))
    close(index.scores(record, test, per_test=True, progress=False)[0].values,
          ik.unrolled.first_order(record, test, per_test=True, progress=False)[0].values)


def test_another_run_is_refused_by_name(pre, exact, tmp_path):
    other = Record()
    pretrain(other, AdamW(lr=0.04, weight_decay=0.1))
    finetune(other, "finetune", SGD(lr=0.1))
    with pytest.raises(ik.IndexMismatchError, match="stage 0 of the record is not the run"):
        exact.scores(other, TEST, progress=False)
    with pytest.raises(ik.IndexMismatchError, match="covers 2 recorded stages"):
        TrajectoryIndex.build(continued(pre), tmp_path, progress=False).scores(pre, TEST, progress=False)
    with pytest.raises(ik.IndexMismatchError, match="another record or other settings .*the recorded stages"):
        TrajectoryIndex.build(other, tmp_path, stages=1, progress=False)
    with pytest.raises(ik.InputError, match="no stage after the indexed ones"):
        exact.append(pre)
    with pytest.raises(ik.InputError, match="finetune must be one of"):
        exact.scores(pre, TEST, finetune="approximate")


BUILD_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    torch.set_default_dtype(torch.float64); torch.set_num_threads(1)
    from influkit import distributed
    assert distributed.initialize(timeout_seconds=60)
    import test_unrolled_trajectory_index as t
    index = t.TrajectoryIndex.build(t.pretrained(), {out!r}, block=8, progress=False)
    assert index.complete and index.blocks["computed"] in (2, 3)
    index = t.TrajectoryIndex.build(t.unregularized(), {out!r} + "-examples", block=8, progress=False)
    assert index.complete and index.blocks["computed"] in (2, 3)  # each rank's share of steps, summed
    distributed.shutdown()
    """
)


def test_two_ranks_under_torchrun_build_the_single_process_index(pre, exact, tmp_path):
    script = tmp_path / "build.py"
    script.write_text(BUILD_SCRIPT.format(tests=str(TESTS), out=str(tmp_path / "ranks")))
    done = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node", "2", str(script)], capture_output=True,
                          text=True, timeout=240, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = TrajectoryIndex(tmp_path / "ranks")
    assert ranks.manifest == exact.manifest | {"block": 8}
    for a, b in zip(ranks.entries(), exact.entries()):
        close(a, b)
    single = TrajectoryIndex.build(unregularized(), tmp_path / "single", block=8, progress=False)
    close(TrajectoryIndex(tmp_path / "ranks-examples").entries()[0], single.entries()[0])


def _build_in_a_group() -> None:
    TrajectoryIndex.build(pretrained(), Path(os.environ["TRAJECTORY_INDEX_TEST_DIR"]), block=8, progress=False)


def _failing_worker(rank: int, world: int, init_file: str, out: str) -> None:
    os.environ["TRAJECTORY_INDEX_TEST_DIR"] = str(Path(out) / "index")
    torch.set_default_dtype(torch.float64)
    run_a_rank_that_may_fail(rank, world, init_file, out, _build_in_a_group)


def test_a_failing_rank_fails_the_others(tmp_path):
    assert_a_failing_rank_fails_the_others(_failing_worker, tmp_path)
