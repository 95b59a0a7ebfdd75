"""benchmarks/index_peers.CrossStage gives the peers of bench_index the models bench_index scores: in each mode its
output equals that of the model it was built from (the masked-LM model, the classification head, the peft LoRA
finetune), and the gradient of a finetune's test loss with respect to the encoder layers the peers track equals the
gradient with respect to that finetune's own encoder weights (float64, explicit autograd on each side)."""
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")


def models():
    import transformers
    from peft import LoraConfig, get_peft_model

    from benchmarks.bench_transformer import classifier_model, lm_data

    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                     vocab_size=1100, max_position_embeddings=16, num_labels=2)
    torch.manual_seed(0)
    mlm = transformers.BertForMaskedLM(config).eval().double()
    head = classifier_model("bert", config, mlm).double()
    lora = get_peft_model(classifier_model("bert", config, mlm).double(),
                          LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"], lora_dropout=0.0,
                                     modules_to_save=["classifier"]))
    with torch.no_grad():  # B = 0 at initialisation would hide the adapters
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(3.0 * torch.randn(p.shape, dtype=p.dtype))
    x, _ = lm_data("bert", 5, 8, 2, config.vocab_size)
    return mlm, head, lora.eval(), x


def test_cross_stage_outputs_are_the_models_outputs():
    from benchmarks.index_peers import CrossStage, check_cross_stage

    mlm, head, lora, x = models()
    cross = CrossStage(mlm, head, lora)
    assert check_cross_stage(cross, mlm, head, lora, x) < 1e-12
    with torch.no_grad():  # the adapters change the output: LoRA mode is not the head's
        cross.modes["mode"] = "lora"
        adapted = cross(x).logits
        with lora.disable_adapter():
            plain = lora(input_ids=x[:, 0], attention_mask=x[:, 1]).logits
    assert (adapted - plain).abs().max() > 1e-3


@pytest.mark.parametrize("mode", ["head", "lora"])
def test_tracked_gradients_are_the_finetunes_encoder_gradients(mode):
    from benchmarks.index_peers import CrossStage, _test_loss, tracked

    mlm, head, lora, x = models()
    y = torch.arange(len(x)) % 2
    cross = CrossStage(mlm, head, lora)
    names = tracked(cross)
    assert len(names) == 6  # query, key, value, attention output, intermediate, output of the one layer
    modules = dict(cross.named_modules())
    ours = torch.autograd.grad(_test_loss(cross, mode, (x, y)).sum(), [modules[n].weight for n in names])

    model = head if mode == "head" else lora
    own = dict(model.named_modules())
    prefix, base = ("bert.", "") if mode == "head" else ("base_model.model.bert.", ".base_layer")
    weights = [own[prefix + n.removeprefix("bert.").removesuffix(".base") + (base if n.endswith(".base") else "")].weight
               for n in names]
    for w in weights:
        w.requires_grad_(True)
    logits = model(input_ids=x[:, 0], attention_mask=x[:, 1]).logits
    theirs = torch.autograd.grad(torch.nn.functional.cross_entropy(logits, y, reduction="sum"), weights)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
