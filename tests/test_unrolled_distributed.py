"""Unrolled results streamed, resumed and sharded like ``Query.scores`` (influkit.unrolled.terms, .journal).

Float64, tiny models: streaming to a store gives the in-memory values; a run interrupted part-way and run again
resumes (reusing the finished chunks / segments) and equals the uninterrupted one; two ranks (``torchrun
--standalone``, gloo) return the single-process result on every rank; a rank that raises makes the other fail
with a DistributedError instead of hanging.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import influkit as ik
from influkit.unrolled import SGD, AdamW, Record

from conftest import assert_a_failing_rank_fails_the_others, run_a_rank_that_may_fail
from test_unrolled import TEST, finetune, pretrain

TESTS = Path(__file__).parent
TORCHRUN = Path(sys.executable).with_name("torchrun")


def sgd_chain() -> Record:
    """Case 1: SGD + momentum pretraining (batches of 4) → SGD + momentum on the head (batches of 3)."""
    record = Record()
    pretrain(record, SGD(lr=0.2, momentum=0.9, weight_decay=1e-3))
    finetune(record, "case1", SGD(lr=0.1, momentum=0.9))
    return record


def adamw_chain() -> Record:
    """Case 2: AdamW pretraining → AdamW finetuning of the whole model with the proximal term."""
    record = Record()
    pretrain(record, AdamW(lr=0.05, weight_decay=0.1))
    finetune(record, "case2", AdamW(lr=0.1))
    return record


def results(out: Path | None = None) -> dict[str, torch.Tensor]:
    """name -> values of every unrolled result the sharded run must reproduce (streamed to ``out`` if given)."""
    values = {}
    for name, make in (("sgd", sgd_chain), ("adamw", adamw_chain)):
        exact = ik.unrolled.metagradients(make(), TEST, per_test=True, out=out and out / f"exact-{name}",
                                          pull="batched")
        values |= {f"exact.{name}.{k}": r.values for k, r in enumerate(exact)}
    for curvature, basis in (("hessian", "each"), ("ekfac", "shared")):
        approx = ik.unrolled.approximate(sgd_chain(), TEST, segments=2, per_test=True, curvature=curvature,
                                         basis=basis, chunk_size=5, out=out and out / f"approx-{curvature}")
        values |= {f"approx.{curvature}.{k}": r.values for k, r in enumerate(approx)}
    return values


@pytest.mark.parametrize("method", ["exact", "approximate"])
def test_streamed_equals_in_memory(tmp_path, method):
    if method == "exact":
        whole = ik.unrolled.metagradients(sgd_chain(), TEST, per_test=True, pull="batched")
        streamed = ik.unrolled.metagradients(sgd_chain(), TEST, per_test=True, out=tmp_path, pull="batched")
        assert streamed[0].diagnostics["segments"] == {"computed": 6, "reused": 0, "ranks": 1}  # 3 + 3 segments
        assert len(list(tmp_path.glob("chunk-*.safetensors"))) == 6
    else:
        whole = ik.unrolled.approximate(sgd_chain(), TEST, segments=3, per_test=True, chunk_size=5)
        streamed = ik.unrolled.approximate(sgd_chain(), TEST, segments=3, per_test=True, chunk_size=5, out=tmp_path)
        assert streamed[0].diagnostics["chunks"] == {"computed": 3, "reused": 0, "chunk_size": 5, "ranks": 1}
        assert (tmp_path / "stage-0" / "values.npy").exists() and (tmp_path / "stage-1" / "values.npy").exists()
    for w, s in zip(whole, streamed):
        assert torch.equal(s.values, w.values) and w.values.abs().max() > 1e-4
        assert torch.equal(s.removal, -s.values)  # a score is d measure / d w_z: removal predicts −score


class Interrupt(RuntimeError):
    pass


def interrupted(stage: ik.Stage, after: int):
    """Make the stage's loss raise from its ``after``-th call on (a crash part-way through a run); returns undo."""
    loss, calls = stage.loss, [0]

    def failing(outputs, targets):
        calls[0] += 1
        if calls[0] > after:
            raise Interrupt("killed")
        return loss(outputs, targets)

    stage.loss = failing
    return lambda: setattr(stage, "loss", loss)


def test_exact_resumed_after_interruption_equals_uninterrupted(tmp_path):
    uninterrupted = ik.unrolled.metagradients(sgd_chain(), TEST, per_test=True, pull="batched")
    record = sgd_chain()
    undo = interrupted(record.runs[0].stage, after=4)  # pretraining's segments: the pass dies inside stage 0
    with pytest.raises(Interrupt):
        ik.unrolled.metagradients(record, TEST, per_test=True, out=tmp_path, pull="batched")
    undo()
    finished = len(list(tmp_path.glob("chunk-*.safetensors")))
    assert 3 <= finished < 6  # the finetuning stage's 3 segments and part of pretraining's
    resumed = ik.unrolled.metagradients(record, TEST, per_test=True, out=tmp_path, pull="batched")
    assert resumed[0].diagnostics["segments"] == {"computed": 6 - finished, "reused": finished, "ranks": 1}
    for r, u in zip(resumed, uninterrupted):
        torch.testing.assert_close(r.values, u.values, rtol=1e-12, atol=1e-15)  # summation order only
    again = ik.unrolled.metagradients(record, TEST, per_test=True, out=tmp_path, pull="batched")
    assert again[0].diagnostics["segments"]["computed"] == 0
    with pytest.raises(ik.InputError, match="refusing to resume"):  # another measure: another job
        ik.unrolled.metagradients(record, (TEST[0][:2], TEST[1][:2]), per_test=True, out=tmp_path, pull="batched")


def test_approximate_resumed_after_interruption_equals_uninterrupted(tmp_path):
    uninterrupted = ik.unrolled.approximate(sgd_chain(), TEST, segments=2, per_test=True, chunk_size=2)
    record = sgd_chain()
    stage, calls = record.runs[0].stage, [0]
    loss = stage.loss
    stage.loss = lambda outputs, targets: calls.__setitem__(0, calls[0] + 1) or loss(outputs, targets)
    ik.unrolled.approximate(record, TEST, segments=2, per_test=True, chunk_size=2)
    stage.loss = loss
    # pretraining's example terms come last: 6 chunks of 2 rows, one loss call per chunk and piece; the run dies
    # 3 chunks before its end
    undo = interrupted(stage, after=calls[0] - 3 * 2)
    with pytest.raises(Interrupt):
        ik.unrolled.approximate(record, TEST, segments=2, per_test=True, chunk_size=2, out=tmp_path)
    undo()
    finished = len(list((tmp_path / "stage-0").glob("chunk-*.safetensors")))
    assert finished == 3
    resumed = ik.unrolled.approximate(record, TEST, segments=2, per_test=True, chunk_size=2, out=tmp_path)
    assert resumed[0].diagnostics["chunks"]["reused"] == finished
    assert resumed[0].diagnostics["chunks"]["computed"] == 6 - finished
    for r, u in zip(resumed, uninterrupted):
        assert torch.equal(r.values, u.values)


SHARDED_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from safetensors.torch import save_file
    sys.path.insert(0, {tests!r})
    torch.set_default_dtype(torch.float64); torch.set_num_threads(1)
    from influkit import distributed
    assert distributed.initialize(timeout_seconds=60)
    import test_unrolled_distributed as t
    out = Path({out!r})
    values = t.results(out / "streams")
    save_file({{k: v.contiguous() for k, v in values.items()}}, str(out / f"rank{{distributed.rank()}}.safetensors"))
    distributed.shutdown()
    """
)


def test_two_ranks_under_torchrun_return_the_single_process_result(tmp_path):
    from safetensors.torch import load_file

    script = tmp_path / "sharded.py"
    script.write_text(SHARDED_SCRIPT.format(tests=str(TESTS), out=str(tmp_path)))
    done = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node", "2", str(script)], capture_output=True,
                          text=True, timeout=240, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    expected = results()
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    assert set(ranks[0]) == set(ranks[1]) == set(expected)
    for name, value in expected.items():
        assert value.abs().max() > 1e-6, name
        for rank in ranks:
            torch.testing.assert_close(rank[name], value, rtol=1e-10, atol=1e-13, msg=name)


def _metagradients_of_a_chain() -> None:
    ik.unrolled.metagradients(sgd_chain(), TEST)


def _failing_worker(rank: int, world: int, init_file: str, out: str) -> None:
    run_a_rank_that_may_fail(rank, world, init_file, out, _metagradients_of_a_chain)


def test_a_failing_rank_fails_the_others(tmp_path):
    assert_a_failing_rank_fails_the_others(_failing_worker, tmp_path)
