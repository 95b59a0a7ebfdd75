"""The studies in their CI-sized ``--quick`` form: each runs end to end and writes finite, consistent results.

They need the vaderSentiment sdist (its corpus and rated tweets; skipped where it is not available offline)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("transformers")


@pytest.fixture
def one_thread():
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)


@pytest.fixture(scope="module")
def vader_archive():
    from influkit.elmo import corpora

    try:
        return corpora.vader_archive()
    except corpora.DataUnavailable as exc:
        pytest.skip(f"the vaderSentiment sdist (corpus and rated tweets) is not available offline: {exc}")


# --- the experiment, CI-sized ---------------------------------------------------------------------------


def _run_example(*args: str) -> object:
    from studies import bert_pretrain_finetune as module

    threads = torch.get_num_threads()
    try:
        assert module.main(["--quick", "--no-progress", *args]) == 0
    finally:
        torch.set_num_threads(threads)
    return module


@pytest.fixture(scope="module")
def example_run(tmp_path_factory):
    """``studies/bert_pretrain_finetune.py --quick`` once: pretraining, both cases, Table 1, leave-out."""
    from influkit.elmo import corpora

    try:
        corpora.vader_archive()
    except corpora.DataUnavailable as exc:
        pytest.skip(f"vaderSentiment sdist unavailable: {exc}")
    out = tmp_path_factory.mktemp("bert")
    return _run_example("--out", str(out)), out


@pytest.mark.slow
def test_bert_example_quick_runs_end_to_end(example_run):
    module, out = example_run
    summary = json.loads((out / "summary.json").read_text())
    scores = pd.read_csv(out / "scores.csv")
    assert len(scores) == module.QUICK.n_pretrain and np.isfinite(scores.filter(like="I_").to_numpy()).all()
    assert scores["I_set_case1"].abs().max() > 0 and scores["I_set_case2"].abs().max() > 0
    # removal = −I/m, the convention the leave-out check compares with
    np.testing.assert_allclose(scores["removal_set_case1"], -scores["I_set_case1"] / len(scores), rtol=1e-5, atol=1e-9)
    for case in (1, 2):
        assert summary[f"case{case}"]["seconds_per_sentence_set"] > 0
        assert [s["stage"] for s in summary[f"case{case}"]["solves_set"]] == [0, 1]
    leave = pd.read_csv(out / "leaveout.csv")
    assert len(leave) == 4 + module.QUICK.n_random_groups + 2
    assert (out / "pretrained" / "tokenizer.json").exists()


@pytest.mark.slow
def test_bert_example_lds_resumes_from_the_saved_model(example_run):
    pytest.importorskip("influkit.apps.lds")
    _, out = example_run
    _run_example("--out", str(out), "--reuse", "--lds", "3")
    lds = json.loads((out / "lds_summary.json").read_text())
    assert lds["M_finished"] == 3 and len(list((out / "lds" / "outputs").iterdir())) == 3


# --- the example, CI-sized ------------------------------------------------------------------------------


@pytest.mark.slow
def test_lm_example_quick_runs_end_to_end(tmp_path):
    """``studies/lm_pretrain_lora.py --quick``: pretraining, LoRA, three solves, leave-out, plot (~15 s)."""
    import json

    import numpy as np
    import pandas as pd

    from influkit.elmo import corpora

    try:
        corpora.vader_archive()
    except corpora.DataUnavailable as exc:
        pytest.skip(f"vaderSentiment sdist unavailable: {exc}")
    from studies import lm_pretrain_lora as module
    threads = torch.get_num_threads()
    try:
        assert module.main(["--quick", "--no-progress", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    scores = pd.read_csv(tmp_path / "scores.csv")
    assert len(scores) == module.QUICK.n_pretrain
    for method in ("exact", "gauss-newton", "identity", "ekfac"):
        assert np.isfinite(scores[f"I_{method}"]).all() and scores[f"I_{method}"].abs().max() > 0
        np.testing.assert_allclose(scores[f"removal_{method}"], -scores[f"I_{method}"] / len(scores), rtol=1e-5)
    leave = pd.read_csv(tmp_path / "leaveout.csv")
    assert len(leave) == 2 * module.QUICK.n_ranked_groups + module.QUICK.n_random_groups + 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["leave_out"]["correlation"]) == {"exact", "gauss-newton", "identity", "ekfac"}
    assert (tmp_path / "leaveout_scatter.png").stat().st_size > 0
    top = pd.read_csv(tmp_path / "top_documents.csv")
    assert top["text"].isin(scores["document"]).all()


@pytest.mark.slow
def test_elmo_study_quick_writes_finite_results(vader_archive, tmp_path, one_thread):
    pytest.importorskip("h5py")  # influkit.elmo (influkit[elmo])
    from studies import elmo_influence as example

    assert example.main(["--quick", "--out", str(tmp_path)]) == 0
    for name in ("summary.json", "scores.csv", "table1_top_bottom.csv", "loo.csv", "loo_scatter.png",
                 "elmo_options.json", "elmo_weights.hdf5"):  # fmt: skip
        assert (tmp_path / name).exists(), name
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["pretraining"]["reload_identical"]
    assert math.isfinite(summary["pretraining"]["perplexity_heldout"])
    assert summary["influence_test_set"]["finite"] and summary["influence_test_sentence"]["finite"]
    assert summary["loo"]["noise_rerun_same_seed"] == 0.0
    scores = pd.read_csv(tmp_path / "scores.csv")
    assert len(scores) == summary["data"]["pretrain_sentences"]
    assert scores[["influence_test_set", "influence_test_sentence"]].notna().all().all()
    table = pd.read_csv(tmp_path / "table1_top_bottom.csv")
    assert set(table["test"].str.startswith("tweet")) == {True, False}
    loo = pd.read_csv(tmp_path / "loo.csv")
    assert len(loo) == 4 and loo["actual_change"].notna().all()
