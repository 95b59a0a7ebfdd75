"""influkit.hf.layers: transformers' GPT-2 ``Conv1D`` (weight stored (in, out)) is a registered layer — contracted
when scoring and given full EK-FAC Kronecker blocks, equal in float64 to influkit's EK-FAC of the same model with
every Conv1D swapped for the equivalent ``nn.Linear``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import influkit as ik  # noqa: E402
from influkit import hf  # noqa: E402
from influkit.contraction import Contractor  # noqa: E402
from influkit.factored import fit_curvature, plan_layers  # noqa: E402
from influkit.params import ParamSpace  # noqa: E402

VOCAB, LENGTH = 24, 8
Conv1D = transformers.pytorch_utils.Conv1D


def token_summed_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B,) Σ_t −log softmax(logits_t)[labels_t] over positions with a label (−100: none); the next-token labels
    are shifted in the data, so the sampled Fisher recognises the loss as a cross-entropy."""
    logp = torch.log_softmax(logits, dim=-1)
    keep = (labels != -100).to(logits.dtype)
    return -(logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * keep).sum(1)


def linearized(model: nn.Module) -> nn.Module:
    """The same model with every Conv1D (y = a W + b, W: in × out) replaced by nn.Linear (weight Wᵀ)."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                lin = nn.Linear(*child.weight.shape, dtype=child.weight.dtype)
                with torch.no_grad():
                    lin.weight.copy_(child.weight.T)
                    lin.bias.copy_(child.bias)
                setattr(module, child_name, lin)
    return model


def gpt2_stages(n: int = 12):
    """(Conv1D stage, Linear-swapped stage) of one tiny float64 GPT-2 and the same token data."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=8, n_layer=2, n_head=2,
                                     attn_implementation="eager", bos_token_id=1, eos_token_id=1, initializer_range=0.5)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    swapped = linearized(transformers.GPT2LMHeadModel(config).double().eval())
    swapped.load_state_dict({k: v.T if k in _conv1d_weights(model) else v for k, v in model.state_dict().items()})
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (n, LENGTH), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.full((n, 1), -100)], dim=1)
    data = hf.pack({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return (ik.Stage(hf.HFModel(model), token_summed_losses, data),
            ik.Stage(hf.HFModel(swapped), token_summed_losses, data))


def _conv1d_weights(model: nn.Module) -> set[str]:
    return {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, Conv1D)}


def to_linear_layout(stage: ik.Stage, vec: torch.Tensor) -> torch.Tensor:
    """A (p, k) vector over the Conv1D stage's parameters in the Linear-swapped stage's layout (weights transposed)."""
    space = ParamSpace(stage.trained())
    transposed = _conv1d_weights(stage.model)
    rows, start = [], 0
    for name, shape, size in zip(space.names, space.shapes, space.sizes):
        part = vec[start : start + size].reshape(*shape, -1)
        rows.append((part.transpose(0, 1) if name in transposed else part).reshape(size, -1))
        start += size
    return torch.cat(rows)


def test_the_registry_gives_conv1d_full_kronecker_blocks():
    stage, _ = gpt2_stages(2)
    layers, reasons = plan_layers(stage.model, stage.param_names)
    conv = [layer for layer in layers if isinstance(layer.module, Conv1D)]
    assert len(conv) == 8 and {layer.kind for layer in conv} == {"conv1d-transposed"}
    assert not any(".c_" in name for name in reasons)  # no Conv1D parameter left to a diagonal block
    c_attn = next(layer for layer in conv if layer.name.endswith("h.0.attn.c_attn"))
    assert c_attn.shape == (8 + 1, 24)  # M = [W; bᵀ]: (in + 1) × out
    contractor = Contractor(stage)
    assert "conv1d-transposed" in contractor.describe()["modules"] and contractor.plan.fallback == []


@pytest.mark.parametrize("kind", ["ekfac", "kfac"])
def test_conv1d_factors_equal_the_linear_swapped_models(kind):
    conv, lin = gpt2_stages()
    torch.testing.assert_close(conv.outputs(conv.trained(), conv.data.take(torch.arange(3))[0]),
                               lin.outputs(lin.trained(), lin.data.take(torch.arange(3))[0]), rtol=1e-12, atol=1e-12)
    a, b = fit_curvature(conv, kind=kind, seed=3), fit_curvature(lin, kind=kind, seed=3)
    assert a.info["diagonal"].keys() == b.info["diagonal"].keys()
    assert len(a.info["layers"]) == len(b.info["layers"]) == 9  # 8 Conv1D / Linear and wpe (wte is tied: diagonal)
    space = ParamSpace(conv.trained())
    eye = torch.eye(space.dim, dtype=torch.float64)
    perm = to_linear_layout(conv, eye).argmax(0)  # column j of the Conv1D layout is row perm[j] of the Linear one
    dense_a, dense_b = a.dense(), b.dense()[perm][:, perm]
    assert dense_a.abs().max() > 0
    torch.testing.assert_close(dense_a, dense_b, rtol=1e-10, atol=1e-10 * float(dense_a.abs().max()))
    rhs = torch.randn(space.dim, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(to_linear_layout(conv, a.solve(rhs, 1e-3)), b.solve(to_linear_layout(conv, rhs), 1e-3),
                               rtol=1e-10, atol=1e-10 * float(a.solve(rhs, 1e-3).abs().max()))


def test_ekfac_scores_equal_the_linear_swapped_models():
    conv, lin = gpt2_stages()
    solve = ik.SolveConfig(solver="ekfac", damping=1e-3, residual=False)
    test = conv.data.take(torch.arange(3))
    a = ik.Chain([conv], solve=solve).query(test).scores()
    b = ik.Chain([lin], solve=solve).query(test).scores()
    assert a.diagnostics["scoring"]["fallback"] == {} and a.values.std() > 0
    torch.testing.assert_close(a.values, b.values, rtol=1e-10, atol=1e-10 * float(a.values.abs().max()))

