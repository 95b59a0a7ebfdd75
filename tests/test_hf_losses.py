"""influkit.hf's losses as the factored curvature sees them: ``fisher="sampled"`` recognises the masked-LM and
causal-LM losses by their declaration (influkit.factored.fisher.declare_categorical), not by reading their values.

The check: the pseudo output-gradients u of each hf loss are exactly those of the plain token-summed cross-entropy
on the same logits (same draws: labels depend on (seed, example) only), times √c_i with c_i = 1/(labelled
positions) — the causal loss's position t against the label at t + 1, its last position never — and the EK-FAC
factors fitted through the declaration equal those fitted through the value-reading detection where that works
(float64). On a float32 model trained by Adam, where the losses near 0 defeat the detection, EK-FAC now runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import influkit as ik  # noqa: E402
from influkit import hf  # noqa: E402
from influkit.factored import fit_curvature  # noqa: E402
from influkit.factored.fisher import FactoredCurvatureError, PseudoGradients  # noqa: E402
from influkit.training import train_adam  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf import MASK_ID, SPECIALS, pretrain_stage, tiny_config, tokens  # noqa: E402


def token_summed_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B,) Σ_t CE(logits_t, labels_t) over labelled positions: the plain loss fisher='sampled' reads off its values."""
    return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none", ignore_index=-100).sum(1)


def logits_and_labels(seed: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(5, 7, 11, generator=gen)).to(dtype)
    labels = torch.randint(0, 11, (5, 7), generator=gen)
    labels[torch.rand(5, 7, generator=gen) < 0.4] = -100
    labels[0, 1:] = -100  # a sentence with one labelled token
    return logits, labels


def test_masked_lm_sampled_fisher_is_the_plain_cross_entropy_s_scaled():
    logits, labels = logits_and_labels(0)
    index = torch.arange(100, 105)
    u = PseudoGradients(hf.masked_lm_losses, "sampled", logits, labels, seed=3)(logits, labels, index=index)
    plain = PseudoGradients(token_summed_ce, "sampled", logits, labels, seed=3)(logits, labels, index=index)
    count = (labels != -100).sum(1).clamp(min=1).to(logits.dtype)
    torch.testing.assert_close(u, plain / count.sqrt()[None, :, None, None], rtol=1e-12, atol=1e-15)
    assert (u[0][labels == -100] == 0).all()


@pytest.mark.parametrize("fisher", ["empirical", "sampled"])
@pytest.mark.parametrize("loss", [hf.masked_lm_losses, hf.causal_lm_losses, token_summed_ce,
                                  lambda f, y: 0.5 * token_summed_ce(f, y)])
def test_a_categorical_losss_true_label_gradient_is_autograds(loss, fisher):
    """The true-label output-gradient (fisher="empirical"'s u, and the stationarity check's true-label backward) of a
    categorical loss, declared or detected by the sampled Fisher: c_i (softmax − onehot) on its labelled positions,
    equal to autograd's through the loss itself to float64 rounding (a sentence without a labelled position: zero)."""
    logits, labels = logits_and_labels(2)
    labels[1] = -100
    pseudo = PseudoGradients(loss, fisher, logits, labels)
    u = pseudo(logits, labels)[0] if fisher == "empirical" else pseudo.true_gradient(logits, labels)
    leaf = logits.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(loss(leaf, labels).sum(), leaf)
    torch.testing.assert_close(u, expected, rtol=1e-12, atol=1e-15)
    assert (u[1] == 0).all()


def test_causal_lm_sampled_fisher_predicts_the_next_token():
    logits, labels = logits_and_labels(1)
    index = torch.arange(5)
    u = PseudoGradients(hf.causal_lm_losses, "sampled", logits, labels, seed=3)(logits, labels, index=index)[0]
    shifted, targets = logits[:, :-1], labels[:, 1:]
    plain = PseudoGradients(token_summed_ce, "sampled", shifted, targets, seed=3)(shifted, targets, index=index)[0]
    count = (targets != -100).sum(1).clamp(min=1).to(logits.dtype)
    torch.testing.assert_close(u[:, :-1], plain / count.sqrt()[:, None, None], rtol=1e-12, atol=1e-15)
    assert (u[:, -1] == 0).all()  # the last position predicts nothing
    # E[u uᵀ] at a position is c·(diag(p) − p pᵀ), the loss's output Hessian there: u + √c·onehot(ŷ) = √c·p
    probs = torch.softmax(shifted, -1)
    keep = targets != -100
    drawn = (u[:, :-1] * count.sqrt()[:, None, None] - probs)[keep]
    assert torch.allclose(drawn.sum(-1), -torch.ones(int(keep.sum()), dtype=drawn.dtype))
    assert ((drawn.abs() < 1e-12) | ((drawn + 1).abs() < 1e-12)).all()


def test_ekfac_of_the_masked_lm_stage_equals_the_detected_plain_loss_s():
    """Float64 (the value-reading detection works there): declared and detected paths fit the same factors."""
    stage = pretrain_stage()
    data = stage.data.take(torch.arange(len(stage)))
    plain = ik.Stage(stage.model, lambda f, y: hf.masked_lm_losses(f, y) * 1.0, data, regularizer=stage.regularizer)
    assert not hasattr(plain.loss, "categorical")
    declared = fit_curvature(stage, kind="ekfac", fisher="sampled")
    detected = fit_curvature(plain, kind="ekfac", fisher="sampled")
    torch.testing.assert_close(declared.dense(), detected.dense(), rtol=1e-10, atol=1e-12)


def adam_trained_mlm():
    """A float32 tiny BERT trained by Adam until its masked-LM losses are near 0 (float32 ratios of them are noise)."""
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(tiny_config(initializer_range=0.02, hidden_size=16)).float().eval()
    batch = {k: v for k, v in tokens(24, 0).items()}
    stage = hf.masked_lm_stage(model, batch, mask_token_id=MASK_ID, special_token_ids=SPECIALS, seed=7)
    train_adam(stage, steps=300, lr=1e-2, batch_size=24)
    return stage


def test_ekfac_runs_on_an_adam_trained_float32_masked_lm_stage():
    stage = adam_trained_mlm()
    x, y = stage.data.take(torch.arange(len(stage)))
    with torch.no_grad():
        losses = stage.loss(stage.model(x), y)
    assert float(losses.min()) < 1e-3  # the regime where reading the family off the values fails:
    with pytest.raises(FactoredCurvatureError):
        fit_curvature(ik.Stage(stage.model, lambda f, t: hf.masked_lm_losses(f, t) * 1.0, (x, y)), kind="ekfac")
    approximate = ik.Chain([stage], solve=ik.SolveConfig(solver="ekfac", damping=1e-3)).query((x[:3], y[:3]))
    assert approximate.solves[0]["preconditioner"] == "ekfac (sampled Fisher)"
    # as a preconditioner of the Gauss-Newton system (the matrix EK-FAC approximates): still an exact solve
    config = ik.SolveConfig(solver="minres", preconditioner="ekfac", damping=1e-3, tol=1e-3)
    solved = ik.Chain([stage], solve=config, curvature=ik.CurvatureConfig(matrix="gauss-newton")).query((x[:3], y[:3])).solves[0]
    assert solved["preconditioner"] == "ekfac (sampled Fisher)" and solved["residual"] <= 1e-3
