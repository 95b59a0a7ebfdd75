"""The gradient index (influkit.index): exact when uncompressed, its compression the stated map, append, resume,
ranks, refusals, top-k re-scoring and the approximate search.

Ground truths: the chain's own contraction scores (Query.scores) and explicit per-example gradients (vmap); float64.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import influkit as ik
from influkit.factored import fit_curvature
from influkit.gradients import per_example_grads
from influkit.index import GradientIndex, IndexConfig
from influkit.index.layout import Layout
from influkit.index.shards import ShardFiles

from conftest import assert_a_failing_rank_fails_the_others, run_a_rank_that_may_fail

TESTS = Path(__file__).parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
EXACT = IndexConfig(projection="identity", whiten=False, shard_size=16, batch_size=7)
SMALL = IndexConfig(dim=64, projection="random", whiten=False, dtype="float64", shard_size=16, batch_size=7)
INT8 = dataclasses.replace(SMALL, dtype=None)  # the default storage of a compressed index: int8 rows with scales
SHARED = {n: n for n in ("emb", "norm", "mix", "scale")}


class Tiny(nn.Module):
    """Every kind of block: an embedding (one-hot inputs, a padding id), a LayerNorm (flat), linear layers (with
    bias) and a bare parameter no registered layer owns (per-example gradients)."""

    def __init__(self, classes: int = 3, vocab: int = 11, width: int = 6):
        super().__init__()
        self.emb = nn.Embedding(vocab, width, padding_idx=0, dtype=torch.float64)
        self.norm = nn.LayerNorm(width, dtype=torch.float64)
        self.mix = nn.Linear(width, width, dtype=torch.float64)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width, dtype=torch.float64))
        self.head = nn.Linear(width, classes, dtype=torch.float64)

    def forward(self, x):
        h = torch.tanh(self.mix(self.norm(self.emb(x)))) * self.scale
        return self.head(h.mean(1))


def ce(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


def corpus(n: int = 40, seed: int = 0):
    """The first n of 64 fixed examples (token ids, class targets)."""
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 11, (64, 5), generator=gen), torch.randint(0, 3, (64,), generator=gen)
    return x[:n], y[:n]


def problem(case: int = 1, n: int = 40, solve=ik.SolveConfig(solver="direct", damping=0.1)):
    """(pretraining stage, chain) of a two-stage problem: the encoder shared with a new head (Case 1 or 2)."""
    torch.manual_seed(0)
    pre, fin = Tiny().eval(), Tiny(classes=2).eval()
    fin.load_state_dict({k: v for k, v in pre.state_dict().items() if not k.startswith("head")}, strict=False)
    gen = torch.Generator().manual_seed(5)
    fx, fy = torch.randint(0, 11, (30, 5), generator=gen), torch.randint(0, 2, (30,), generator=gen)
    pre_stage = ik.Stage(pre, ce, corpus(n))
    fin_stage = ik.Stage(fin, ce, (fx, fy), params="head" if case == 1 else None)
    chain = ik.Chain([pre_stage, fin_stage], [ik.Link(SHARED, case=case, alpha=0.05)], solve=solve)
    return pre_stage, chain


@pytest.fixture(scope="module")
def case1():
    with pytest.warns(ik.StationarityWarning):
        stage, chain = problem(1)
        return stage, chain, chain.query(torch.arange(8)), chain.query(torch.arange(8), per_test=True)


@pytest.mark.parametrize("case", [1, 2])
def test_uncompressed_scores_equal_the_chains_contraction(case, tmp_path):
    with pytest.warns(ik.StationarityWarning):
        stage, chain = problem(case)
        summed, per_test = chain.query(torch.arange(8)), chain.query(torch.arange(8), per_test=True)
    index = GradientIndex.build(stage, tmp_path / "index", EXACT)
    assert index.width == sum(p.numel() for p in stage.model.parameters())
    assert len(index.manifest["shards"]) == 3 and index.complete
    for query in (summed, per_test):
        truth = query.scores()
        got = index.scores(query)
        assert got.values.shape == truth.values.shape and truth.values.abs().max() > 1e-3
        torch.testing.assert_close(got.values, truth.values, rtol=0, atol=1e-10)
        torch.testing.assert_close(got.removal, -got.values / 40, rtol=1e-15, atol=0)
    kinds = {b["kind"] for b in index.manifest["blocks"]}
    assert kinds == {"kronecker", "flat"} and any(b["layer"] is None for b in index.manifest["blocks"] if b["kind"] == "flat")


@pytest.mark.filterwarnings("ignore::influkit.StationarityWarning")
def test_a_lora_finetune_of_gpt2_is_scored_exactly_by_an_uncompressed_index(tmp_path):
    """GPT-2's Conv1D (weights stored (in, out)), its embedding tied to the decoder (one parameter, two layers), and
    a LoRA stage linked in Case 1: the index's scores are the chain's."""
    pytest.importorskip("peft")
    from influkit import hf
    from test_hf_lm import completions, lora_model, pretrain_stage

    pre = pretrain_stage("gpt2")
    fin = hf.causal_lm_stage(lora_model(pre, "gpt2"), completions(8, 5))
    chain = ik.Chain([pre, fin], [hf.lora_link(pre, fin, case=1)], solve=ik.SolveConfig(solver="direct", damping=0.1))
    query = chain.query(hf.pack(completions(3, 9)), per_test=True)
    index = GradientIndex.build(pre, tmp_path / "index", EXACT)
    assert {b["module"] for b in index.manifest["blocks"] if b["kind"] == "kronecker"} >= {"conv1d-transposed",
                                                                                         "embedding", "linear"}
    truth = query.scores().values
    assert truth.abs().max() > 1e-4
    torch.testing.assert_close(index.scores(query).values, truth, rtol=0, atol=1e-10)


def test_single_stage_and_rows_are_the_per_example_gradients(tmp_path):
    stage, _ = problem(1)
    index = GradientIndex.build(stage, tmp_path / "index", EXACT)
    with pytest.warns(ik.StationarityWarning):
        query = ik.Chain([stage], solve=ik.SolveConfig(solver="direct", damping=0.5)).query(corpus(6, seed=3))
    torch.testing.assert_close(index.scores(query).values, query.scores().values, rtol=0, atol=1e-10)
    # every row holds the example's whole gradient: its norm is the per-example gradient's
    grads = per_example_grads(stage, *corpus(40), stage.param_names)
    torch.testing.assert_close(index.matrix().norm(dim=1), grads.norm(dim=1), rtol=1e-12, atol=0)


def test_compressed_rows_are_the_kronecker_projection_of_the_gradients(case1, tmp_path):
    """c(z) = P_out ∇M P_inᵀ per Kronecker layer (P ∇θ per flat block), from explicit gradients, and the scores
    ⟨c(z), s̃⟩ with s̃ the same map of s; never formed, yet equal."""
    stage, chain, query, _ = case1
    index = GradientIndex.build(stage, tmp_path / "index", SMALL)
    assert index.width < sum(p.numel() for p in stage.model.parameters())
    layout = index.layout(stage)
    grads = per_example_grads(stage, *corpus(40), stage.param_names)  # (40, p)
    expected = layout.directions(grads.T, torch.float64).T  # the map applied to whole gradients
    torch.testing.assert_close(index.matrix(), expected, rtol=1e-10, atol=1e-12)
    s_tilde = layout.directions(query.s, torch.float64)
    torch.testing.assert_close(index.scores(query).values, -(expected @ s_tilde).reshape(-1), rtol=1e-10, atol=1e-12)
    mix = next(b for b in layout.blocks if getattr(b, "layer", None) is not None and b.layer.name == "mix")
    assert (mix.k_out, mix.k_in) == (4, 3) and mix.d_in == 7  # the dimension rule: 64 // 5 blocks = 12, k_in = ⌊√12⌋
    torch.testing.assert_close(mix.p_in @ mix.p_in.T, torch.eye(3, dtype=torch.float64) * 7 / 3)


def test_random_projections_are_unbiased(case1):
    """Averaged over 400 seeds, the compressed scores −c(z)ᵀ s̃ approach the exact ones (E[PᵀP] = I per side)."""
    stage, _, query, _ = case1
    truth = query.scores().values
    grads = per_example_grads(stage, *corpus(40), stage.param_names)
    estimates = []
    for seed in range(400):
        layout = Layout.plan(stage, stage.param_names, projection="random", dim=32, seed=seed, dtype=torch.float64)
        estimates.append(-(layout.directions(grads.T, torch.float64).T @ layout.directions(query.s, torch.float64)))
    estimates = torch.stack(estimates).reshape(400, -1)
    single = (estimates - truth).norm(dim=1).median()
    assert (estimates.mean(0) - truth).norm() < 0.1 * single
    assert torch.corrcoef(torch.stack([estimates.mean(0), truth]))[0, 1] > 0.99


def test_eigenbasis_projection_of_full_size_is_exact(case1, tmp_path):
    stage, _, query, _ = case1
    factored = fit_curvature(stage, kind="ekfac")
    full = GradientIndex.build(stage, tmp_path / "full", IndexConfig(projection="eigenbasis", dim=10**6, whiten=False,
                                                                     dtype="float64"), factored=factored)
    torch.testing.assert_close(full.scores(query).values, query.scores().values, rtol=0, atol=1e-10)
    assert {b["basis"] for b in full.manifest["blocks"] if b["kind"] == "kronecker"} == {"eigenbasis"}
    small = GradientIndex.build(stage, tmp_path / "small", IndexConfig(projection="eigenbasis", dim=64, whiten=False),
                                factored=factored)
    assert small.width < full.width
    with pytest.raises(ik.InputError, match="factored"):
        GradientIndex.build(stage, tmp_path / "none", IndexConfig(projection="eigenbasis", whiten=False))


@pytest.mark.parametrize("case", [1, 2])
def test_whitened_uncompressed_index_equals_the_chain_solved_with_the_same_ekfac(case, tmp_path):
    """Stage 1 solved by the EK-FAC approximate inverse, s = (C + λI)⁻¹ u; the index whitened by the same C and λ:
    its rows are (C + λI)^{-1/2} ∇ℓ(z) (‖row‖² = ∇ℓᵀ (C + λI)⁻¹ ∇ℓ), its query columns (C + λI)^{1/2} s
    (‖col‖² = sᵀ (C + λI) s), and the scores the chain's contraction scores."""
    lam = 0.05
    with pytest.warns(ik.StationarityWarning):
        stage, chain = problem(case, solve=[ik.SolveConfig(solver="ekfac", damping=lam),
                                            ik.SolveConfig(solver="direct", damping=0.1)])
        summed, per_test = chain.query(torch.arange(8)), chain.query(torch.arange(8), per_test=True)
    assert summed.solves[0]["solver"] == "ekfac" and summed.solves[0]["damping"] == lam
    factored = chain.curvature(0).approximation("ekfac")
    config = IndexConfig(projection="identity", whiten=True, damping=lam, shard_size=16, batch_size=7)
    index = GradientIndex.build(stage, tmp_path / "index", config, factored=factored)
    assert all(b["whitened"] for b in index.manifest["blocks"])
    for query in (summed, per_test):
        truth = query.scores()
        assert truth.values.abs().max() > 1e-3
        torch.testing.assert_close(index.scores(query).values, truth.values, rtol=0, atol=1e-10)
    grads = per_example_grads(stage, *corpus(40), stage.param_names)  # (40, p)
    rows = index.matrix()
    torch.testing.assert_close((rows**2).sum(1), (grads * factored.solve(grads.T, lam).T).sum(1), rtol=1e-10, atol=0)
    s = per_test.s
    cols = index.directions(per_test)
    torch.testing.assert_close((cols**2).sum(0), (s * (factored.matvec(s) + lam * s)).sum(0), rtol=1e-10, atol=0)


def test_whitened_compression_is_unbiased_and_its_eigenbasis_of_full_size_exact(case1, tmp_path):
    """Random projections of the whitened rows: the mean over seeds of the index's scores is the exact scores; the
    whitened eigenbasis selection at full size keeps everything (exact). Refusals: no curvature, no damping."""
    stage, _, query, _ = case1
    factored = fit_curvature(stage, kind="ekfac")
    truth = query.scores().values
    x, y = corpus(40)
    estimates = []
    for seed in range(300):
        layout = Layout.plan(stage, stage.param_names, projection="random", dim=32, seed=seed, dtype=torch.float64,
                             factored=factored, whiten=True, damping=0.05)
        estimates.append(-(layout.rows(x, y, torch.float64) @ layout.directions(query.s, torch.float64)).reshape(-1))
    estimates = torch.stack(estimates)
    single = (estimates - truth).norm(dim=1).median()
    assert (estimates.mean(0) - truth).norm() < 0.1 * single
    full = GradientIndex.build(stage, tmp_path / "full", IndexConfig(projection="eigenbasis", dim=10**6, whiten=True,
                                                                     damping=0.05, dtype="float64"), factored=factored)
    torch.testing.assert_close(full.scores(query).values, truth, rtol=0, atol=1e-10)
    with pytest.raises(ik.InputError, match="factored"):
        GradientIndex.build(stage, tmp_path / "none", IndexConfig(whiten=True, damping=0.1))
    with pytest.raises(ik.InputError, match="damping"):
        GradientIndex.build(stage, tmp_path / "no-damping", IndexConfig(), factored=factored)
    with pytest.raises(ik.InputError, match="damping"):
        IndexConfig(damping=-1.0)


def test_whitened_eigenbasis_selection_keeps_entries_of_the_whitened_gradient(case1):
    """The whitened eigenbasis selection (its rotation and selection one d × k product per token) stores, per
    Kronecker layer, exactly the kept (out, in) entries of the uncompressed whitened block (Q_outᵀ ∇M Q_in) ⊙ scale,
    and the query side the same entries of (Q_outᵀ S_M Q_in) ⊘ scale; the kept sides are those of most whitened energy."""
    stage, _, query, _ = case1
    factored = fit_curvature(stage, kind="ekfac")
    x, y = corpus(40)
    plan = dict(factored=factored, whiten=True, damping=0.05, dtype=torch.float64, seed=0)
    full = Layout.plan(stage, stage.param_names, projection="identity", dim=1, **plan)
    small = Layout.plan(stage, stage.param_names, projection="eigenbasis", dim=40, **plan)
    full_rows, small_rows = full.rows(x, y, torch.float64), small.rows(x, y, torch.float64)
    full_cols, small_cols = full.directions(query.s, torch.float64), small.directions(query.s, torch.float64)
    offsets = lambda layout: np.cumsum([0] + [b.width for b in layout.blocks])  # noqa: E731
    checked = 0
    for i, (whole, kept) in enumerate(zip(full.blocks, small.blocks)):
        if getattr(kept, "basis", None) != "eigenbasis" or kept.layer.one_hot:
            continue
        keep_out = (whole.q_out.T @ kept.q_out).abs().argmax(0) if whole.q_out is not None else \
            kept.q_out.abs().argmax(0)
        keep_in = (whole.q_in.T @ kept.q_in).abs().argmax(0)
        energy = (1 - 0.05 * whole.scale**2).clamp_min(0)
        assert set(keep_out.tolist()) == set(energy.sum(1).argsort(descending=True)[: kept.k_out].tolist())
        (a, b), (c, d) = offsets(full)[i : i + 2], offsets(small)[i : i + 2]
        for big, little in ((full_rows[:, a:b], small_rows[:, c:d]), (full_cols.T[:, a:b], small_cols.T[:, c:d])):
            entries = big.reshape(-1, whole.d_out, whole.d_in)[:, keep_out][:, :, keep_in]
            torch.testing.assert_close(little, entries.reshape(big.shape[0], -1), rtol=1e-10, atol=1e-12)
        checked += 1
    assert checked == 2 and small.width < full.width  # mix and head


def test_int8_scores_are_within_the_stated_bound_of_the_unquantized_rows(case1, tmp_path, monkeypatch):
    """The default storage of a compressed index (int8, a float32 scale σ per row, D + 4 bytes): each stored entry
    within σ/2 of the float64 row of the same layout, each score within (σ/2)‖s̃‖₁ of the float64 index's score
    (summed and per test point), the bound a small part of the scores' spread over the rows (a worst case: the
    error itself is smaller still), and the error not zero."""
    stage, _, query, per_test = case1
    factored = fit_curvature(stage, kind="ekfac")
    config = IndexConfig(dim=64, projection="eigenbasis", damping=0.05, shard_size=16, batch_size=7)
    quantized = GradientIndex.build(stage, tmp_path / "int8", config, factored=factored)
    exact = GradientIndex.build(stage, tmp_path / "float64", dataclasses.replace(config, dtype="float64"),
                                factored=factored)
    assert quantized.dtype == torch.int8 and exact.compute_dtype == quantized.compute_dtype == torch.float64
    assert quantized.width == exact.width < 147 and quantized.bytes_per_example == quantized.width + 4
    stored = np.load(quantized.directory / "shard-000000.npy", mmap_mode="r")
    assert stored.dtype == np.int8 and stored.shape == (16, quantized.width + 4)
    sigma = quantized.scales().double()
    torch.testing.assert_close(sigma, exact.matrix().abs().amax(1) / 127, rtol=1e-7, atol=0)  # float32 scales
    assert ((quantized.matrix() - exact.matrix()).abs() <= sigma[:, None] / 2 * (1 + 1e-12)).all()
    for q in (query, per_test):
        got, truth, bound = quantized.scores(q).values, exact.scores(q).values, quantized.error_bound(q)
        assert bound.shape == truth.shape
        error = (got - truth).abs()
        assert (error <= bound * (1 + 1e-9)).all() and error.max() > 0
        spread = truth.amax(0) - truth.amin(0)
        assert (bound.amax(0) < 0.05 * spread).all() and (error.amax(0) < 0.01 * spread).all()
    with pytest.raises(ik.InputError, match="not int8"):
        exact.scales()
    whole = quantized.scores(per_test).values
    monkeypatch.setattr("influkit.index.gradient_index.CHUNK_BYTES", 5 * quantized.width * 8)  # 5 rows a chunk
    assert [start for start, _ in quantized.shards()][:5] == [0, 5, 10, 15, 16]
    torch.testing.assert_close(quantized.scores(per_test).values, whole, rtol=0, atol=0)
    ids = torch.tensor([quantized.n_rows - 1, 0, 7, 3])  # the ANN path's rows: only those dequantized, any order
    torch.testing.assert_close(quantized._rows_at(ids), quantized.matrix()[ids], rtol=0, atol=0)


def test_default_index_is_int8_within_4096_bytes_and_an_old_version_is_refused(case1, tmp_path):
    """IndexConfig(): whitened eigen-pair selection, D ≤ 4000 numbers, int8 rows with a scale (≤ 4,004 bytes);
    projection="identity" keeps the parameters' dtype (exact); a manifest of format version 2 is refused."""
    stage, _, _, _ = case1
    factored = fit_curvature(stage, kind="ekfac")
    assert (IndexConfig().dim, IndexConfig().dtype, IndexConfig().projection) == (4000, None, "eigenpairs")
    assert IndexConfig().storage(torch.float32) == torch.int8
    assert IndexConfig(projection="identity").storage(torch.float64) == torch.float64
    index = GradientIndex.build(stage, tmp_path / "default", IndexConfig(damping=0.05), factored=factored)
    assert index.quantized and index.width == 147 and index.bytes_per_example == 151  # every number kept: D ≤ 4000
    assert {b["basis"] for b in index.manifest["blocks"] if b["kind"] == "kronecker"} == {"eigenpairs"}
    manifest = index.directory / "manifest.json"
    old = manifest.read_text().replace('"version": 3', '"version": 2')
    assert old != manifest.read_text()
    manifest.write_text(old)
    with pytest.raises(ik.FileFormatError, match="version 2.*build the index again"):
        GradientIndex.open(index.directory)


def test_eigenpairs_keep_the_entries_of_most_whitened_energy_over_all_layers(case1):
    """projection="eigenpairs": each whitened Kronecker block stores the kept (out, in) entries of its uncompressed
    whitened block (Q_outᵀ ∇M Q_in) ⊙ scale (the query side ⊘ scale), the kept pairs those of most whitened energy
    1 − λ·scale² among every block's candidates (a threshold over all layers), at most dim numbers in all; with
    room for every pair it is exact."""
    stage, _, query, _ = case1
    factored = fit_curvature(stage, kind="ekfac")
    x, y = corpus(40)
    plan = dict(factored=factored, whiten=True, damping=0.05, dtype=torch.float64, seed=0)
    full = Layout.plan(stage, stage.param_names, projection="identity", dim=1, **plan)
    small = Layout.plan(stage, stage.param_names, projection="eigenpairs", dim=40, **plan)
    assert small.width <= 40
    full_rows, small_rows = full.rows(x, y, torch.float64), small.rows(x, y, torch.float64)
    full_cols, small_cols = full.directions(query.s, torch.float64), small.directions(query.s, torch.float64)
    offsets = lambda layout: np.cumsum([0] + [b.width for b in layout.blocks])  # noqa: E731
    kept_energy, dropped_energy = [], []
    for i, (whole, kept) in enumerate(zip(full.blocks, small.blocks)):
        if getattr(kept, "basis", None) != "eigenpairs":
            continue
        keep_out = (whole.q_out.T @ kept.q_out).abs().argmax(0) if whole.q_out is not None else \
            kept.q_out.abs().argmax(0)
        keep_in = kept.p_in.argmax(1) if kept.layer.one_hot else (whole.q_in.T @ kept.q_in).abs().argmax(0)
        energy = (1 - 0.05 * whole.scale**2).clamp_min(0)[keep_out][:, keep_in].reshape(-1)
        chosen = torch.zeros_like(energy, dtype=torch.bool)
        chosen[kept.pairs] = True
        kept_energy.append(energy[chosen])
        dropped_energy.append(energy[~chosen])
        (a, b), (c, d) = offsets(full)[i : i + 2], offsets(small)[i : i + 2]
        for big, little in ((full_rows[:, a:b], small_rows[:, c:d]), (full_cols.T[:, a:b], small_cols.T[:, c:d])):
            entries = big.reshape(-1, whole.d_out, whole.d_in)[:, keep_out][:, :, keep_in].reshape(big.shape[0], -1)
            torch.testing.assert_close(little, entries[:, kept.pairs], rtol=1e-10, atol=1e-12)
    assert len(kept_energy) == 3  # emb, mix and head
    assert torch.cat(kept_energy).min() >= torch.cat(dropped_energy).max()
    assert len({e.numel() for e in kept_energy}) > 1  # the layers' shares follow their energy, not equal
    whole = Layout.plan(stage, stage.param_names, projection="eigenpairs", dim=10**6, **plan)
    torch.testing.assert_close(whole.rows(x, y, torch.float64) @ whole.directions(query.s, torch.float64),
                               full_rows @ full_cols, rtol=1e-10, atol=1e-10)
    with pytest.raises(ik.InputError, match="whiten=True"):
        Layout.plan(stage, stage.param_names, projection="eigenpairs", dim=40, **(plan | {"whiten": False}))


def test_append_equals_rebuild(tmp_path):
    first, _ = problem(1, n=25)
    whole, chain = problem(1, n=40)
    for config in (EXACT, SMALL, INT8):
        name = f"{config.projection}-{config.dtype}"
        index = GradientIndex.build(first, tmp_path / f"grown-{name}", config)
        assert index.n_rows == 25
        index.append(whole)
        rebuilt = GradientIndex.build(whole, tmp_path / f"rebuilt-{name}", config)
        assert index.n_rows == rebuilt.n_rows == 40
        assert [s["stop"] for s in index.manifest["shards"]] == [16, 25, 40]
        torch.testing.assert_close(index.matrix(), rebuilt.matrix(), rtol=1e-13, atol=1e-15)
    with pytest.warns(ik.StationarityWarning):
        query = chain.query(torch.arange(8))
    torch.testing.assert_close(GradientIndex.open(tmp_path / "grown-identity-None").scores(query).values,
                               query.scores().values, rtol=0, atol=1e-10)


@pytest.mark.parametrize("config", [SMALL, INT8], ids=["float64", "int8"])
def test_resumed_build_equals_uninterrupted(config, tmp_path, monkeypatch):
    stage, _ = problem(1)
    whole = GradientIndex.build(stage, tmp_path / "whole", config)
    written = []
    put = ShardFiles.put

    def crash_after_two(self, c, rows):
        if len(written) == 2:
            (self.directory / f"shard-{c:06d}.npy.partial").write_bytes(b"torn")  # a write cut short
            raise KeyboardInterrupt("killed")
        written.append(c)
        put(self, c, rows)

    monkeypatch.setattr(ShardFiles, "put", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        GradientIndex.build(stage, tmp_path / "resumed", config)
    assert not GradientIndex.open(tmp_path / "resumed").complete
    with pytest.raises(ik.IndexMismatchError, match="missing"):
        GradientIndex.open(tmp_path / "resumed").check(stage)
    written.clear()
    monkeypatch.setattr(ShardFiles, "put", lambda self, c, rows: (written.append(c), put(self, c, rows)))
    resumed = GradientIndex.build(stage, tmp_path / "resumed", config)
    assert written == [2]  # only the shard not on disk
    torch.testing.assert_close(resumed.matrix(), whole.matrix(), rtol=0, atol=0)


def test_a_mismatched_checkpoint_data_or_setting_is_refused(case1, tmp_path):
    stage, chain, query, _ = case1
    index = GradientIndex.build(stage, tmp_path / "index", SMALL)
    with pytest.raises(ik.IndexMismatchError, match="other settings"):
        GradientIndex.build(stage, tmp_path / "index", dataclasses.replace(SMALL, dim=128))
    x, y = corpus(40)
    x[30, 2] = (x[30, 2] + 1) % 11
    other_data = ik.Stage(stage.model, ce, (x, y))
    with pytest.raises(ik.IndexMismatchError, match="examples 16–31"):
        GradientIndex.build(other_data, tmp_path / "index", SMALL)
    with pytest.raises(ik.IndexMismatchError, match="append"):
        GradientIndex.build(ik.Stage(stage.model, ce, corpus(45)), tmp_path / "index", SMALL)
    with pytest.raises(ik.IndexMismatchError, match="examples 16–31"):
        index.append(ik.Stage(stage.model, ce, (torch.cat([x, x[:3]]), torch.cat([y, y[:3]]))))
    with torch.no_grad():
        stage.model.mix.bias[0] += 1e-9
    try:
        with pytest.raises(ik.IndexMismatchError, match="another checkpoint"):
            index.scores(query)
    finally:
        with torch.no_grad():
            stage.model.mix.bias[0] -= 1e-9
    assert index.scores(query).values.shape == (40,)
    with pytest.raises(ik.IndexMismatchError, match="other parameters"):
        index.check(stage, ["mix.weight"])
    with pytest.raises(ik.InputError, match="no gradient index"):
        GradientIndex.open(tmp_path / "nothing")


def test_top_k_is_re_scored_exactly(case1, tmp_path):
    stage, chain, query, per_test = case1
    truth = query.scores().values
    index = GradientIndex.build(stage, tmp_path / "index", SMALL)
    top = index.top(query, 3, candidates=40)  # every row a candidate: the exact top 3
    assert top.index.tolist() == truth.argsort(descending=True)[:3].tolist()
    torch.testing.assert_close(top.values, truth[top.index], rtol=0, atol=1e-12)
    helpful = index.top(query, 2, candidates=40, harmful=False)
    assert helpful.index.tolist() == truth.argsort()[:2].tolist()
    few = index.top(query, 3, candidates=6)
    assert set(few.index.tolist()) <= set(few.diagnostics["index"]["candidates"])
    torch.testing.assert_close(few.values, truth[few.index], rtol=0, atol=1e-12)
    exact_columns = per_test.scores().values
    column = index.top(per_test, 2, candidates=40, column=3)
    assert column.values.shape == (2, 8)
    assert column.index.tolist() == exact_columns[:, 3].argsort(descending=True)[:2].tolist()


def test_approximate_search_finds_the_top_rows(case1, tmp_path):
    pytest.importorskip("faiss")
    stage, _, query, _ = case1
    index = GradientIndex.build(stage, tmp_path / "index", EXACT)
    truth = query.scores().values
    top = index.top(query, 3, candidates=10, ann=True)
    assert top.index.tolist() == truth.argsort(descending=True)[:3].tolist()
    assert any(p.name.startswith("ann-40") for p in index.directory.iterdir())


INDEX_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    torch.set_default_dtype(torch.float64); torch.set_num_threads(1)
    from influkit import distributed
    from influkit.index import GradientIndex, IndexConfig
    assert distributed.initialize(timeout_seconds=60)
    import test_index as t
    stage, _ = t.problem(1)
    index = GradientIndex.build(stage, {out!r}, t.SMALL)
    assert index.complete
    distributed.shutdown()
    """
)


def test_two_ranks_under_torchrun_build_the_single_process_index(tmp_path):
    script = tmp_path / "build.py"
    script.write_text(INDEX_SCRIPT.format(tests=str(TESTS), out=str(tmp_path / "ranks")))
    done = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node", "2", str(script)], capture_output=True,
                          text=True, timeout=240, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    stage, _ = problem(1)
    single = GradientIndex.build(stage, tmp_path / "single", SMALL)
    ranks = GradientIndex.open(tmp_path / "ranks")
    assert ranks.manifest == single.manifest | {}
    torch.testing.assert_close(ranks.matrix(), single.matrix(), rtol=1e-12, atol=1e-14)


def _build_in_a_group() -> None:
    stage, _ = problem(1)
    GradientIndex.build(stage, Path(os.environ["INDEX_TEST_DIR"]), SMALL)


def _failing_worker(rank: int, world: int, init_file: str, out: str) -> None:
    os.environ["INDEX_TEST_DIR"] = str(Path(out) / "index")
    run_a_rank_that_may_fail(rank, world, init_file, out, _build_in_a_group)


def test_a_failing_rank_fails_the_others(tmp_path):
    assert_a_failing_rank_fails_the_others(_failing_worker, tmp_path)


JOB_FACTORY = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    import test_index as t

    def build(device):
        stage, chain = t.problem(1)
        return {{"stages": chain.stages, "links": chain.links, "test": torch.arange(8)}}
    """
)

JOB = textwrap.dedent(
    """
    factory = "index_factory:build"
    out = "scores"
    device = "cpu"
    [solve]
    solver = "direct"
    damping = 0.1
    [index]
    directory = "the-index"
    projection = "identity"
    whiten = true
    damping = 0.1
    shard_size = 16
    top = 3
    """
)


def test_cli_builds_and_queries_an_index_from_a_job_file(tmp_path, capsys):
    from influkit.cli import main

    (tmp_path / "index_factory.py").write_text(JOB_FACTORY.format(tests=str(TESTS)))
    (tmp_path / "job.toml").write_text(JOB)
    try:
        with warnings.catch_warnings():  # the chain's EK-FAC that whitens the index is fitted; nothing is solved,
            warnings.simplefilter("error", ik.StationarityWarning)  # so where the stage stands waits for a query
            assert main(["index", "build", str(tmp_path / "job.toml"), "--quiet"]) == 0
        assert "40 rows × 147" in capsys.readouterr().out
        with pytest.warns(ik.StationarityWarning):
            assert main(["index", "query", str(tmp_path / "job.toml"), "--quiet"]) == 0
        assert "top 3 re-scored exactly" in capsys.readouterr().out
    finally:
        sys.modules.pop("index_factory", None)
    with pytest.warns(ik.StationarityWarning):
        _, chain = problem(1)
        truth = chain.query(torch.arange(8)).scores().values
    import numpy as np

    torch.testing.assert_close(torch.from_numpy(np.load(tmp_path / "scores" / "values.npy")), truth, rtol=0, atol=1e-10)
    top = ik.load(tmp_path / "scores" / "top.safetensors")
    assert top.index.tolist() == truth.argsort(descending=True)[:3].tolist()
    (tmp_path / "bad.toml").write_text(JOB.replace("top = 3", "tops = 3"))
    assert main(["index", "build", str(tmp_path / "bad.toml")]) == 2
    assert "unknown [index] settings ['tops']" in capsys.readouterr().err
