"""Per-token scores (influkit.per_token, influkit.hf.tokens) on tiny float64 GPT-2 and BERT: in the chain, the exact
unrolled metagradient and the gradient index, the tokens of a training sequence sum to its sequence-level score, the
tokens of a query sum to the query's, and the unrolled per-token scores equal central differences of the re-run
training with that token's loss weight perturbed."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import influkit as ik  # noqa: E402
from influkit import hf  # noqa: E402
from influkit.index import GradientIndex, IndexConfig  # noqa: E402

import test_hf  # noqa: E402
import test_hf_lm  # noqa: E402

TOL = 1e-10  # relative to the largest |score|


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= TOL * float(b.abs().max())


def gpt2_stage(n: int = 6) -> ik.Stage:
    return test_hf_lm.pretrain_stage("gpt2", n)


def bert_stage(n: int = 6) -> ik.Stage:
    return test_hf.pretrain_stage(0, n)


def gpt2_test():
    return hf.pack(test_hf_lm.completions(3, 5))


def bert_test(stage: ik.Stage):
    model = stage.model.hf_model
    batch = hf.masked_lm_batch(test_hf.tokens(3, 9), mask_token_id=test_hf.MASK_ID, vocab_size=model.config.vocab_size,
                               special_token_ids=test_hf.SPECIALS, seed=3, mask_prob=0.5)
    return hf.pack(batch)


CASES = {"gpt2": (gpt2_stage, lambda stage: gpt2_test(), True), "bert": (bert_stage, bert_test, False)}


def chain_of(stage: ik.Stage) -> ik.Chain:
    return ik.Chain([stage], solve=ik.SolveConfig(solver="direct", damping=0.1), progress=False)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    make_stage, make_test, causal = CASES[request.param]
    stage = make_stage()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ik.StationarityWarning)
        chain = chain_of(stage).fit()  # fitted once per model: every test's queries reuse its solver
    return request.param, stage, make_test(stage), causal, chain


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")
@pytest.mark.parametrize("per_test", [False, True])
def test_chain_tokens_sum_to_the_sequence_scores(case, per_test):
    name, stage, test, causal, chain = case
    query = chain.query(test, per_test=per_test)
    tokens = query.token_scores(chunk_size=4)
    sequence = query.scores().values
    assert tokens.values.shape == (len(stage), test[1].shape[1], *((3,) if per_test else ()))
    assert close(tokens.sequence, sequence)
    labels = stage.data.take(torch.arange(len(stage)))[1]
    unscored = labels == -100  # no loss there: no score
    if causal:
        unscored[:, 0] = True
    assert (tokens.values[unscored] == 0).all() and (tokens.values[~unscored] != 0).any()


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")
def test_query_tokens_sum_to_the_query_scores_in_the_chain(case):
    name, stage, test, causal, chain = case
    split = hf.token_queries(test, causal=causal)
    per_query = chain.query(test, per_test=True).scores().values
    per_token = split.split(chain.query(split.test, per_test=True).scores().values)
    assert per_token.shape == (len(stage), 3, test[1].shape[1])
    assert close(per_token.sum(-1), per_query)
    # training tokens × query tokens: both splits at once sum to the sequence × query scores
    both = split.split(chain.query(split.test, per_test=True).token_scores().values)
    assert close(both.sum((1, 3)), per_query)


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")
@pytest.mark.parametrize("projection", ["identity", "random"])
def test_index_tokens_sum_to_the_index_scores(case, projection, tmp_path):
    name, stage, test, causal, chain = case
    index = GradientIndex.build(stage, tmp_path / "index", IndexConfig(projection=projection, whiten=False, dim=40,
                                                                        dtype="float64"))
    for per_test in (False, True):
        query = chain.query(test, per_test=per_test)
        tokens = index.token_scores(query, chunk_size=4)
        assert close(tokens.sequence, index.scores(query).values)
        if projection == "identity":  # exact rows: the chain's own per-token scores
            assert close(tokens.values, query.token_scores().values)
    split = hf.token_queries(test, causal=causal)
    per_token = split.split(index.scores(chain.query(split.test, per_test=True)).values)
    assert close(per_token.sum(-1), index.scores(chain.query(test, per_test=True)).values)
    some = torch.tensor([4, 1])
    assert close(index.token_scores(chain.query(test), some).values, index.token_scores(chain.query(test)).values[some])


def recorded(stage: ik.Stage):
    record = ik.unrolled.Record()
    record.train(stage, ik.unrolled.Adam(lr=1e-2), steps=4, batch_size=3, checkpoint_every=2)
    return record


@pytest.fixture(scope="module")
def record_case(case):
    name, _, test, causal, _ = case
    return name, recorded(CASES[name][0]()), test, causal  # a fresh model: recording trains it in place


def test_unrolled_tokens_sum_to_the_example_scores(record_case):
    name, record, test, causal = record_case
    for per_test in (False, True):
        sequence = ik.unrolled.metagradients(record, test, per_test=per_test)[0].values
        tokens = ik.unrolled.metagradients(record, test, per_test=per_test, per_token=True)[0]
        assert isinstance(tokens, ik.TokenScores) and tokens.values.shape[:2] == (len(record.runs[0].stage), 8)
        assert close(tokens.sequence, sequence)


def test_unrolled_tokens_equal_central_differences_of_token_weights(record_case):
    """d f / d w_{z,t} against (f(w + h e_{z,t}) − f(w − h e_{z,t})) / 2h, f the test loss after re-running the
    recorded training with token t of sequence z weighted w_{z,t} in every step that draws z."""
    name, record, test, causal = record_case
    run = record.runs[0]
    tokens = ik.unrolled.metagradients(record, test, per_token=True)[0].values
    n, length = tokens.shape
    order = tokens.abs().reshape(-1).argsort(descending=True)
    picked = [divmod(int(i), length) for i in order[:3]]
    h = 1e-5

    def measure(z, t, eps):
        w = torch.ones(n, length, dtype=torch.float64)
        w[z, t] += eps
        return run.stage.losses(ik.unrolled.replay(record, [w])[-1], *test).sum()

    for z, t in picked:
        difference = float((measure(z, t, h) - measure(z, t, -h)) / (2 * h))
        assert abs(difference - float(tokens[z, t])) <= 1e-6 * max(abs(difference), 1e-3), (z, t)


def test_unrolled_query_tokens_sum_to_the_query_scores(record_case):
    name, record, test, causal = record_case
    split = hf.token_queries(test, causal=causal)
    per_query = ik.unrolled.metagradients(record, test, per_test=True)[0].values
    per_token = split.split(ik.unrolled.metagradients(record, split.test, per_test=True)[0].values)
    assert close(per_token.sum(-1), per_query)


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")
def test_per_token_refusals(tmp_path):
    stage = gpt2_stage(4)
    record = recorded(stage)
    with pytest.raises(ik.InputError, match="out="):
        ik.unrolled.metagradients(record, gpt2_test(), per_token=True, out=tmp_path / "journal")
    labels = test_hf_lm.completions(2, 1)["labels"]
    with pytest.raises(ik.InputError, match="no labelled token"):
        hf.token_queries((hf.pack(test_hf_lm.completions(2, 1))[0], torch.full_like(labels, -100)))
    with pytest.raises(ik.InputError, match="weights"):
        ik.unrolled.replay(record, [torch.ones(4, 3, dtype=torch.float64)])
    x = torch.randn(6, 3, dtype=torch.float64)
    linear = ik.Stage(torch.nn.Linear(3, 1).double(), lambda out, y: ((out[:, 0] - y) ** 2), (x, x[:, 0]))
    query = chain_of(linear).query((x[:2], x[:2, 0]))
    with pytest.raises(ik.LossError, match="per-token split"):
        query.token_scores()
