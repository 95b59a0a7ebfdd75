"""Scoring by contraction (influkit.contraction) equals per-example-gradient scoring, in float64, on a tiny BERT
masked-LM (tied decoder, LayerNorm, position and token-type embeddings) and a tiny GPT-2 (Conv1D layers, position
ids shared by the batch), for one summed direction and for k per-test directions; a parameter used outside its
module's forward is caught by the first-batch check and falls back to per-example gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import influkit as ik  # noqa: E402
from influkit import hf  # noqa: E402
from influkit.contraction import ContractionWarning, Contractor, plan_contraction  # noqa: E402
from influkit.gradients import per_example_grads  # noqa: E402

VOCAB, LENGTH = 24, 8


def sentences(n: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (n, LENGTH), generator=gen)
    lengths = torch.randint(4, LENGTH + 1, (n,), generator=gen)
    mask = (torch.arange(LENGTH) < lengths[:, None]).long()
    return {"input_ids": torch.where(mask.bool(), ids, 0), "attention_mask": mask}


def causal_lm_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B,) token-summed next-token negative log-likelihood; labels −100 where no loss."""
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    target = labels[:, 1:]
    keep = (target != -100).to(logits.dtype)
    return -(logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * keep).sum(1)


def bert_stage() -> ik.Stage:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=12, max_position_embeddings=LENGTH, attn_implementation="eager",
                                     initializer_range=0.5)
    model = transformers.BertForMaskedLM(config).double().eval()
    return hf.masked_lm_stage(model, sentences(10, 1), mask_token_id=4, special_token_ids=(0, 1, 2, 3, 4), seed=3)


def gpt2_stage() -> ik.Stage:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=8, n_layer=2, n_head=2,
                                     attn_implementation="eager", bos_token_id=1, eos_token_id=1, initializer_range=0.5)
    model = hf.HFModel(transformers.GPT2LMHeadModel(config).double().eval())
    batch = sentences(10, 2)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return ik.Stage(model, causal_lm_losses, hf.pack(batch | {"labels": labels}))


STAGES = {"bert": bert_stage, "gpt2": gpt2_stage}


@pytest.mark.parametrize("model", list(STAGES))
@pytest.mark.parametrize("k", [1, 3])
def test_contraction_equals_per_example_gradients(model, k):
    stage = STAGES[model]()
    x, y = stage.data.take(torch.arange(len(stage)))
    directions = torch.randn(stage.num_trained, k, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
    contractor = Contractor(stage)
    got = contractor(x, y, directions)
    expected = per_example_grads(stage, x, y) @ directions
    assert contractor.describe()["per_example_fallback"] is False and contractor.verified
    assert contractor.plan.fallback == []  # every parameter (tied decoder, positions, LayerNorms) contracted
    assert expected.std(0).min() > 1e-3  # examples differ: the comparison can fail
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10 * float(expected.abs().max()))
    # a second batch reuses the verified plan
    torch.testing.assert_close(contractor(x[:4], y[:4], directions), expected[:4], rtol=1e-10,
                               atol=1e-10 * float(expected.abs().max()))


def test_tied_decoder_is_one_parameter_with_two_uses():
    stage = bert_stage()
    plan = plan_contraction(stage.model, stage.param_names)
    users = [m.name for m in plan.modules if m.weight == "bert.embeddings.word_embeddings.weight"]
    assert len(users) == 2 and any("decoder" in u for u in users)


def test_query_scores_use_contraction_and_match_per_example_chain():
    stage = bert_stage()
    chain = ik.Chain([stage], solve=ik.SolveConfig(solver="direct", damping=0.5))
    q = chain.query(torch.arange(3), per_test=True)
    res = q.scores()
    expected = -(per_example_grads(stage, *stage.data.take(torch.arange(len(stage)))) @ q.s)
    assert res.diagnostics["scoring"]["gradients"] == "contraction"
    torch.testing.assert_close(res.values, expected, rtol=1e-10, atol=1e-10 * float(expected.abs().max()))


class _Untracked(nn.Module):
    """A linear layer whose weight is also used through F.linear outside its forward, and a free parameter."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(3, 4)
        self.scale = nn.Parameter(torch.tensor([1.5, -0.5]))
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.inner(x) + nn.functional.linear(x, self.inner.weight))
        return self.out(h) * self.scale


def _small_stage(model):
    torch.manual_seed(0)
    x = torch.randn(12, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (12,))
    return ik.Stage(model.double().eval(), nn.CrossEntropyLoss(reduction="none"), (x, y))


def test_parameter_used_outside_forward_falls_back_with_a_warning():
    torch.manual_seed(0)
    stage = _small_stage(_Untracked())
    x, y = stage.data.take(torch.arange(len(stage)))
    directions = torch.randn(stage.num_trained, 2, dtype=torch.float64)
    contractor = Contractor(stage)
    assert contractor.plan.fallback == ["scale"]  # no hooked module owns it: per-example gradients for it alone
    with pytest.warns(ContractionWarning, match="outside its module"):
        got = contractor(x, y, directions)
    assert contractor.fallback_all
    torch.testing.assert_close(got, per_example_grads(stage, x, y) @ directions, rtol=1e-12, atol=1e-12)


def test_free_parameter_is_scored_by_the_per_example_fallback():
    class Free(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.shift = nn.Parameter(torch.tensor([0.3, -0.2]))

        def forward(self, x):
            return self.lin(x) + self.shift

    stage = _small_stage(Free())
    x, y = stage.data.take(torch.arange(len(stage)))
    directions = torch.randn(stage.num_trained, 2, dtype=torch.float64)
    contractor = Contractor(stage)
    got = contractor(x, y, directions)
    assert contractor.plan.fallback == ["shift"] and not contractor.fallback_all
    torch.testing.assert_close(got, per_example_grads(stage, x, y) @ directions, rtol=1e-12, atol=1e-12)
    probing = Contractor(stage)  # the probe's kept scores include the fallback parameters' part
    probing.probe(x[:2], y[:2], directions)
    torch.testing.assert_close(probing.probed, got[:2], rtol=1e-12, atol=1e-12)


def test_autocast_scores_are_close_to_float32():
    stage = gpt2_stage()
    stage.model.float()
    stage = ik.Stage(stage.model, stage.loss, stage.data.take(torch.arange(len(stage))))
    x, y = stage.data.take(torch.arange(len(stage)))
    directions = torch.randn(stage.num_trained, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    full = Contractor(stage)(x, y, directions)
    half = Contractor(stage, autocast=torch.bfloat16)(x, y, directions)
    assert half.dtype == torch.float32
    assert torch.corrcoef(torch.stack([full[:, 0], half[:, 0]]))[0, 1] > 0.98
