"""benchmarks/bergson_checkpoints.py writes what Bergson's TrackStar and SOURCE pipelines read from a recorded run: the
training and test texts as datasets whose rows are the stage's order, and each chosen checkpoint as a model directory
(weights and tokenizer) that loads back to the record's θ_c; the stage's model holds the run's final weights again on
exit, an error inside included. Needs transformers and datasets, not Bergson, so it runs in the main suite."""
import pytest
import torch


def weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_the_checkpoints_and_texts_load_back_as_recorded(recorded):
    from datasets import load_from_disk
    from transformers import AutoTokenizer, GPT2LMHeadModel

    from benchmarks.bergson_checkpoints import bergson_inputs

    record, tokenizer, train, test = recorded
    run = record.runs[0]
    final = weights(run.stage.model)
    steps = [2, 4]
    moved = "transformer.h.0.attn.c_attn.weight"
    assert all(not torch.equal(run.checkpoints[c][0][moved], final[moved]) for c in steps)  # distinct checkpoints
    with bergson_inputs(record, tokenizer, train, test, steps) as (root, dirs):
        assert load_from_disk(str(root / "train"))["text"] == train
        assert load_from_disk(str(root / "test"))["text"] == test
        assert len(dirs) == len(steps)
        for c, directory in zip(steps, dirs):
            loaded = GPT2LMHeadModel.from_pretrained(directory)
            saved = dict(loaded.named_parameters())
            for n, value in run.checkpoints[c][0].items():
                torch.testing.assert_close(saved[n], value, rtol=0, atol=0)
            again = AutoTokenizer.from_pretrained(directory)
            assert again(test)["input_ids"] == tokenizer(test)["input_ids"]
    for n, value in weights(run.stage.model).items():
        assert torch.equal(value, final[n]), n


def test_the_final_weights_come_back_after_an_error_and_a_missing_checkpoint_is_refused(recorded):
    from benchmarks.bergson_checkpoints import bergson_inputs

    record, tokenizer, train, test = recorded
    model = record.runs[0].stage.model
    final = weights(model)
    with pytest.raises(RuntimeError, match="inside"):
        with bergson_inputs(record, tokenizer, train, test, [2]):
            raise RuntimeError("an error inside the pipeline")
    assert all(torch.equal(value, final[n]) for n, value in weights(model).items())
    with pytest.raises(ValueError, match="no checkpoint at steps \\[3\\]"):
        with bergson_inputs(record, tokenizer, train, test, [2, 3]):
            pass
