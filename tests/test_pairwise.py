"""Pairwise scores at corpus scale (influkit.pairwise): streamed query blocks equal the in-memory matrix bit for bit,
equal the whole per-test query to 1e-10, keep the true top k per test point, resume a killed run to the same files,
and run sharded over gloo ranks (a failing rank fails the others)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open
from torch import nn

import influkit as ik

from conftest import assert_a_failing_rank_fails_the_others, run_a_rank_that_may_fail, run_gloo_rank

TESTS = Path(__file__).parent
N_TRAIN, N_TEST, BLOCK, CHUNK, K = 37, 11, 4, 6, 5


def problem(damping: float = 0.1):
    """A float64 two-layer net on 37 random examples, 11 test points, solved exactly (direct)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN + N_TEST, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (N_TRAIN + N_TEST,), generator=gen)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    stage = ik.Stage(model, lambda out, t: nn.functional.cross_entropy(out, t, reduction="none"),
                     (x[:N_TRAIN], y[:N_TRAIN]))
    chain = ik.Chain([stage], solve=ik.SolveConfig(solver="direct", damping=damping), progress=False)
    return chain, (x[N_TRAIN:], y[N_TRAIN:])


def run(out=None, chunk_size=CHUNK):
    chain, test = problem()
    return ik.pairwise(chain, None, test, out=out, k=K, query_block=BLOCK, chunk_size=chunk_size, progress=False)


def outputs(directory: Path) -> dict[str, object]:
    """Every score file of a pairwise directory (the saved solves, which carry their timings, aside): the bytes of
    .npy and JSON files, and of a safetensors file its tensors' bytes and its metadata (safetensors orders its header
    differently from one process to the next)."""
    def content(path: Path):
        if path.suffix != ".safetensors":
            return path.read_bytes()
        with safe_open(str(path), "pt") as handle:
            return handle.metadata(), {k: handle.get_tensor(k).numpy().tobytes() for k in sorted(handle.keys())}

    return {str(p.relative_to(directory)): content(p) for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != "query.safetensors"}


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")
def test_streamed_blocks_equal_the_in_memory_matrix_bit_for_bit(tmp_path):
    memory, streamed = run(), run(tmp_path / "pairs")
    assert [b for b in streamed.blocks] == [(0, 4), (4, 8), (8, 11)]
    assert torch.equal(memory.matrix(), streamed.matrix())
    assert torch.equal(memory.top_values, streamed.top_values) and torch.equal(memory.top_index, streamed.top_index)
    chain, test = problem()
    whole = chain.query(test, per_test=True).scores().values
    assert float((streamed.matrix() - whole).abs().max()) <= 1e-10 * float(whole.abs().max())
    order = streamed.matrix().argsort(dim=0, descending=True, stable=True)[:K]
    assert torch.equal(streamed.top_index, order)
    assert torch.equal(streamed.top_values, streamed.matrix().gather(0, order))
    sized = run(tmp_path / "sized", chunk_size=None)  # the chunk size the memory budget gives, both ways the same
    assert torch.equal(sized.matrix(), run(chunk_size=None).matrix())
    assert float((sized.matrix() - whole).abs().max()) <= 1e-10 * float(whole.abs().max())
    again = run(tmp_path / "pairs")  # a finished run is reused: the same files, the same answers
    assert torch.equal(again.matrix(), streamed.matrix())
    other = problem(damping=0.2)[0]
    with pytest.raises(ik.InputError, match="another job"):
        ik.pairwise(other, None, test, out=tmp_path / "pairs", k=K, query_block=BLOCK, chunk_size=CHUNK, progress=False)


KILLED = textwrap.dedent(
    """
    import os, sys, torch
    sys.path.insert(0, {tests!r})
    torch.set_num_threads(1)
    from influkit import store
    import test_pairwise
    put, count = store.ScoreStore.put, [0]
    def put_then_die(self, *args, **kwargs):
        put(self, *args, **kwargs)
        count[0] += 1
        if count[0] == {after}:
            os._exit(9)   # killed between two chunk files, mid-way through the second query block
    store.ScoreStore.put = put_then_die
    test_pairwise.run({out!r})
    """
)


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")
def test_a_killed_run_resumes_to_the_same_files(tmp_path):
    clean = tmp_path / "clean"
    run(clean)
    killed = tmp_path / "killed"
    after = 9  # 7 chunks per block: the kill comes in block 1, after its second chunk
    script = KILLED.format(tests=str(TESTS), after=after, out=str(killed))
    code = subprocess.run([sys.executable, "-c", script], env=os.environ | {"OMP_NUM_THREADS": "1"}).returncode
    assert code == 9
    assert (killed / "block-000000" / "top.safetensors").exists()
    assert not (killed / "block-000001" / "top.safetensors").exists()
    assert len(list((killed / "block-000001" / "scores").glob("chunk-*.safetensors"))) == 2
    resumed = run(killed)
    assert outputs(killed) == outputs(clean)
    assert torch.equal(resumed.matrix(), run().matrix())


def _pairwise_worker(rank: int, world: int, init_file: str, out: str) -> None:
    def score():
        result = run(Path(out) / "pairs")
        torch.save(result.matrix(), Path(out) / f"matrix.rank{rank}")

    run_gloo_rank(rank, world, init_file, score)


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")
def test_sharded_over_ranks_equals_one_process(tmp_path):
    procs = [mp.get_context("spawn").Process(target=_pairwise_worker, args=(r, 2, str(tmp_path / "init"), str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        single = run().matrix()
    finally:
        torch.set_default_dtype(before)
    for r in range(2):
        sharded = torch.load(tmp_path / f"matrix.rank{r}")
        assert float((sharded - single).abs().max()) <= 1e-10 * float(single.abs().max())
    chunks = [p for p in (tmp_path / "pairs").rglob("chunk-*.safetensors")]
    assert len(chunks) == 3 * 7


def _failing_worker(rank: int, world: int, init_file: str, out: str) -> None:
    run_a_rank_that_may_fail(rank, world, init_file, out, lambda: run(Path(out) / "pairs"))


def test_a_failing_rank_fails_the_others(tmp_path):
    assert_a_failing_rank_fails_the_others(_failing_worker, tmp_path)
