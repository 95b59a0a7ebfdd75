"""The memory budget (influkit.memory): sizes chosen from measured bytes per example, the phases stay inside it
(resident memory sampled while scoring, in a fresh process), and a budget too small for one example is refused
with the bytes one example needs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import influkit as ik
from influkit import memory
from influkit.curvature import HessianOperator
from influkit.factored import fit_curvature
from influkit.gradients import per_example_grads, total_grad
from influkit.memory import MemoryBudgetError, SavedBytes

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def mlp_stage(n: int = 40) -> ik.Stage:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)).double().eval()
    x = torch.randn(n, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (n,))
    return ik.Stage(model, nn.CrossEntropyLoss(reduction="none"), (x, y))


def test_saved_bytes_counts_activations_not_parameters():
    lin = nn.Linear(100, 50)
    x = torch.randn(8, 100, requires_grad=False)
    with SavedBytes(list(lin.parameters())) as saved:
        torch.tanh(lin(x)).sum()
    # Linear saves its input (8·100 floats; the weight is excluded), tanh its output (8·50)
    assert saved.total == (8 * 100 + 8 * 50) * x.element_size()


def test_resolve_default_explicit_and_bad():
    assert 0 < memory.resolve(None) <= memory.available_bytes()
    assert memory.resolve(12345) == 12345
    for bad in (0, -5, "1G", True):
        with pytest.raises(MemoryBudgetError, match="positive number of bytes"):
            memory.resolve(bad)


def test_the_budget_is_an_argument_of_each_phase():
    """No hidden budget: a phase sizes its chunks from the memory= it is given (here too small for one example)."""
    stage = mlp_stage()
    x, y = stage.data.take(torch.arange(4))
    for phase, call in (("the test gradient", total_grad), ("per-example gradients", per_example_grads)):
        with pytest.raises(MemoryBudgetError, match=phase):
            call(stage, x, y, memory=64)
        assert call(stage, x, y, memory=10**9).shape[-1] == sum(p.numel() for p in stage.model.parameters())


def test_too_small_budget_says_what_one_example_needs():
    stage = mlp_stage()
    chain = ik.Chain([stage], solve=ik.SolveConfig(solver="direct", damping=0.1), memory=10**9)
    q = chain.query(torch.arange(3))
    tiny = ik.Chain([stage], solve=ik.SolveConfig(solver="direct", damping=0.1), memory=64)
    tiny._solvers, tiny.fit_seconds = chain._solvers, 0.0
    with pytest.raises(MemoryBudgetError, match=r"needs about [\d,]+ bytes .* for one example") as err:
        tiny.query(torch.arange(3))
    assert isinstance(err.value, ik.InfluenceError)
    with pytest.raises(MemoryBudgetError, match="Hessian-vector products needs about"):
        HessianOperator(stage, memory=64)
    with pytest.raises(MemoryBudgetError, match="factor fitting needs about"), pytest.warns(UserWarning, match="diagonal"):
        fit_curvature(stage, memory=64)
    assert q.scores().values.shape == (len(stage),)


def test_sizes_follow_the_budget_and_are_recorded():
    stage = mlp_stage(200)
    per = memory.probe_bytes(lambda k: None, stage.model)  # nothing saved: 0 bytes
    assert per == 0
    small = HessianOperator(stage, memory=40_000)
    large = HessianOperator(stage, memory=10**9)
    assert large.memory["cache_graph"] and not small.memory["cache_graph"]
    assert small.batch_size == small.memory["batch"] < len(stage)
    plan = small.memory
    assert small.batch_size == (40_000 - plan["fixed_bytes"]) // int(memory.SAFETY * plan["bytes_per_example"])
    v = torch.randn(small.dim, dtype=torch.float64)
    torch.testing.assert_close(small.matvec(v), large.matvec(v), rtol=1e-12, atol=1e-14)  # streamed == cached
    chain = ik.Chain([stage], solve=ik.SolveConfig(solver="direct", damping=0.1), memory=60_000)
    res = chain.query(torch.arange(5)).scores()
    plans = res.diagnostics["memory"]
    scoring = plans[-1]
    assert scoring["phase"] == "scoring" and 1 <= scoring["batch"] < len(stage)
    assert res.diagnostics["chunks"]["chunk_size"] == scoring["batch"]
    whole = chain.query(torch.arange(5)).scores(chunk_size=len(stage))
    torch.testing.assert_close(res.values, whole.values, rtol=1e-12, atol=1e-14)


def test_wide_layer_gets_a_diagonal_block_with_a_warning():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 3)).double().eval()
    stage = ik.Stage(model, nn.CrossEntropyLoss(reduction="none"),
                     (torch.randn(30, 6, dtype=torch.float64), torch.randint(0, 3, (30,))))
    with pytest.warns(UserWarning, match="diagonal Gauss-Newton block"):
        curvature = fit_curvature(stage, kind="ekfac", max_factor_bytes=10_000)
    assert curvature.info["memory"]["diagonal_layers"] == ["0", "2"]  # 64² floats each side; "4" (8 × 9) is factored
    reference = fit_curvature(stage, kind="diagonal").dense()  # the same sampled labels: the same squares
    dense = curvature.dense()
    wide = torch.arange(6 * 64 + 64 + 64 * 8 + 8)  # layers 0 and 2 come first in the flat order
    torch.testing.assert_close(dense[wide][:, wide], reference[wide][:, wide], rtol=1e-10, atol=1e-14)
    assert torch.count_nonzero(dense[wide][:, wide] - torch.diag(torch.diagonal(dense[wide][:, wide]))) == 0
    rest = torch.arange(wide.shape[0], dense.shape[0])
    assert torch.count_nonzero(dense[rest][:, rest] - torch.diag(torch.diagonal(dense[rest][:, rest]))) > 0


SCRIPT = textwrap.dedent(
    """
    import json, sys, threading, time
    import torch, transformers
    import influkit as ik
    from influkit import hf
    from influkit.scoring import release_freed_memory
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=3000, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64, attn_implementation="eager")
    model = transformers.BertForMaskedLM(config).eval()
    ids = torch.randint(5, 3000, (48, 64))
    stage = hf.masked_lm_stage(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, mask_token_id=4,
                               special_token_ids=(0, 1, 2, 3, 4), mask_prob=0.5)
    budget = int(sys.argv[1])
    chain = ik.Chain([stage], solve=ik.SolveConfig(solver="identity"), memory=budget)
    query = chain.query(torch.arange(2))
    query.scores(torch.arange(2), chunk_size=2)  # warm-up: code paths, thread pools
    page = 4096
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page
    def growth(chunk):
        release_freed_memory()
        base, peak, done = rss(), [0], [False]
        def sample():
            while not done[0]:
                peak[0] = max(peak[0], rss())
                time.sleep(0.0005)
        thread = threading.Thread(target=sample)
        thread.start()
        res = query.scores(chunk_size=chunk)
        done[0] = True
        thread.join()
        return {"growth": peak[0] - base, "chunk": res.diagnostics["chunks"]["chunk_size"]}
    # the budgeted run first, then all rows in one chunk, each from the same released state
    print(json.dumps({str(chunk): growth(chunk) for chunk in (None, 48)}))
    """
)


def test_scoring_stays_inside_the_budget_measured_resident_memory():
    budget = 24 * 2**20
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(budget)], capture_output=True, text=True, cwd=ROOT,
                         timeout=300, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    bounded, unbounded = measured["None"], measured["48"]
    assert 1 <= bounded["chunk"] < 48  # the budget, not the row count, decided the chunk
    assert bounded["growth"] <= budget, bounded
    assert unbounded["chunk"] == 48 and unbounded["growth"] > budget, unbounded  # the same measurement, one chunk


def test_default_budget_caps_batches_and_memory_lifts_the_cap(monkeypatch):
    """Without memory=, a batch holds at most max(DEFAULT_EXAMPLES, DEFAULT_WORKING / (SAFETY · bytes per example))
    examples however much is free (here DEFAULT_WORKING is made tiny: DEFAULT_EXAMPLES); memory= fills its budget.
    The scores do not depend on the batches."""
    monkeypatch.setattr(memory, "DEFAULT_WORKING", 1)
    stage = mlp_stage()
    assert len(stage) > memory.DEFAULT_EXAMPLES and memory.default_count(10**6) == memory.DEFAULT_EXAMPLES
    default = ik.Chain([stage], solve=ik.SolveConfig(solver="ekfac", damping=0.1))
    res = default.query(torch.arange(3)).scores()
    plans = {p["phase"]: p for p in res.diagnostics["memory"]}
    assert plans["scoring"]["batch"] == memory.DEFAULT_EXAMPLES and plans["scoring"]["default"]
    assert plans["factor fitting"]["batch"] == memory.DEFAULT_EXAMPLES
    given = ik.Chain([stage], solve=ik.SolveConfig(solver="ekfac", damping=0.1), memory=10**9)
    full = given.query(torch.arange(3)).scores()
    plans = {p["phase"]: p for p in full.diagnostics["memory"]}
    assert plans["scoring"]["batch"] == len(stage) and not plans["scoring"]["default"]
    torch.testing.assert_close(full.values, res.values, rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")
def test_the_gradient_pass_and_the_cross_product_stream_in_capped_batches(monkeypatch):
    """Without memory=, the objective's gradient and the Case 1 cross product ∂²F/∂S∂θ·v (sized from its own cost
    × the right-hand sides, not from the head's products) hold at most DEFAULT_EXAMPLES examples at a time
    (DEFAULT_WORKING made tiny); the numbers equal those of one batch holding everything (memory=10**9)."""
    from influkit import adjoint
    from influkit.curvature import gradient

    monkeypatch.setattr(memory, "DEFAULT_WORKING", 1)
    stage = mlp_stage()
    seen = []
    batches = stage.data.batches
    monkeypatch.setattr(stage.data, "batches", lambda idx=None, size=None: seen.append(size) or batches(idx, size))
    names = list(stage.param_names)
    streamed = gradient(stage, names)
    assert seen and all(s is not None and s <= memory.DEFAULT_EXAMPLES for s in seen)
    whole = gradient(stage, names, memory=10**9)
    assert seen[-1] >= len(stage)
    for n in names:
        torch.testing.assert_close(streamed[n], whole[n], rtol=1e-12, atol=1e-15)

    head = mlp_stage(30)
    fin = ik.Stage(head.model, head.loss, head._data, params="2")
    sizes = []
    hvp = adjoint.hvp
    monkeypatch.setattr(adjoint, "hvp", lambda *a, **k: sizes.append(k["batch_size"]) or hvp(*a, **k))
    solve = [ik.SolveConfig(solver="direct", damping=0.1)] * 2
    test = fin.data.take(torch.arange(3))
    capped = ik.Chain([mlp_stage(), fin], [ik.Link("0", case=1)], solve=solve).query(test, per_test=True)
    assert sizes == [memory.DEFAULT_EXAMPLES]
    full = ik.Chain([mlp_stage(), fin], [ik.Link("0", case=1)], solve=solve, memory=10**9).query(test, per_test=True)
    assert sizes[-1] >= len(fin)
    torch.testing.assert_close(capped.s, full.s, rtol=1e-10, atol=1e-13)


def test_held_state_counts_each_storage_once_and_takes_it_off_a_given_budget():
    """memory.Held: the bytes a computation keeps across its phases, each storage once (a view adds nothing), never
    the tensors that existed before it began; remaining() takes them off a given budget, leaves the default (a
    share of what is free, which already excludes them) alone, and refuses a budget they use up."""
    record = torch.zeros(100, dtype=torch.float64)
    held = memory.Held(before=[{"checkpoint": record}])
    kept = torch.zeros(10, 20, dtype=torch.float32)
    held.hold({"u": kept, "view": kept[3], "transposed": kept.T}, [record, record[:5]])
    assert held.bytes == 10 * 20 * 4
    other = torch.zeros(7, dtype=torch.float64)
    held.hold(other)
    assert held.bytes == 800 + 56 and held.left(10**4, "a phase") == 10**4 - 856
    held.drop(kept.T)
    assert held.bytes == 56 and held.left(None, "a phase") is None
    with pytest.raises(MemoryBudgetError, match="already holds 56 bytes"):
        held.left(50, "the example terms")
