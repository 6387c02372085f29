"""SMEAR on a bitsandbytes-quantized base (4-bit NF4 and FP4, 8-bit LLM.int8), on the CPU (bitsandbytes >= 0.50).

The reference for "right" is SMEAR with the same adapter weights on the *dequantized* base: the base model in fp32
whose quantized weights are replaced by what bitsandbytes dequantizes them to. The quantized kernels still differ from
that dense model (the 4-bit CPU inference kernel computes in bf16, LLM.int8 also quantizes the activations), so the
tolerance is derived from the base model alone: how far the quantized base's own logits are from the dequantized
base's. Skipped where bitsandbytes is not installed.
"""

from __future__ import annotations

import pytest
import torch
from peft import IA3Model, LoraModel, PeftModel, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer

import peft_smear
from conftest import assert_loss_fell, lm_data, logged_losses, pad_collator, random_batch, tiny_llama, training_args
from peft_smear import SmearLinear


bnb = pytest.importorskip("bitsandbytes")

QUANTIZATIONS = {
    "nf4": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": torch.float32},
    "fp4": {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "bnb_4bit_compute_dtype": torch.float32},
    "int8": {"load_in_8bit": True},
}
QUANTIZED_LAYERS = {"nf4": "Linear4bit", "fp4": "Linear4bit", "int8": "Linear8bitLt"}
KIND_OPTIONS = {
    "lora": {"expert_type": "lora", "r": 4},
    "adapter": {"expert_type": "adapter", "adapter_width": 8},
    "ia3": {"expert_type": "ia3"},
}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny Llama saved to disk, to be loaded quantized as users do. Widths are multiples of 64, bitsandbytes' 4-bit
    block size: its CPU inference kernel cannot repack a weight with fewer input features than one block.
    ``initializer_range=0.2`` gives the frozen LM head logits wide enough for training to move the loss."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(hidden_size=64, intermediate_size=128, initializer_range=0.2).save_pretrained(path)
    return path


def quantized(base_dir, quantization: str, **kwargs) -> torch.nn.Module:
    config = BitsAndBytesConfig(**QUANTIZATIONS[quantization])
    return AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=config, device_map="cpu", **kwargs)


def dequantized_weight(layer: torch.nn.Module) -> torch.Tensor:
    weight = layer.weight
    if isinstance(layer, bnb.nn.Linear4bit):
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float()
    return bnb.functional.int8_vectorwise_dequant(weight.data, weight.SCB).float()


def dequantized_copy(base_dir, quantized_model: torch.nn.Module) -> torch.nn.Module:
    """The fp32 base model whose linear weights are what ``quantized_model``'s quantized ones dequantize to. Call it
    before the quantized model's first inference step: bitsandbytes then repacks 4-bit weights for its CPU kernel."""
    dense = AutoModelForCausalLM.from_pretrained(base_dir)
    dense_modules = dict(dense.named_modules())
    replaced = 0
    with torch.no_grad():
        for name, module in quantized_model.named_modules():
            if isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
                dense_modules[name].weight.copy_(dequantized_weight(module))
                replaced += 1
    assert replaced == 14  # 7 linear layers in each of the 2 decoder layers; the LM head stays unquantized
    return dense


def smear_config(kind: str = "lora", **overrides) -> peft_smear.SmearConfig:
    # init_weights=False: every expert random, so the adapter changes the outputs and the comparisons are not vacuous.
    options = {"num_experts": 4, "init_weights": False, "task_type": "CAUSAL_LM", **KIND_OPTIONS[kind], **overrides}
    return peft_smear.SmearConfig(**options)


def smear_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in model.state_dict().items() if ".smear_" in name}


def copy_smear_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    state = smear_state(source)
    assert state.keys() == smear_state(target).keys()
    target.load_state_dict(state, strict=False)


def batch_with_prompt() -> dict[str, torch.Tensor]:
    """Three right-padded examples whose first three tokens are the prompt (labels -100 there and on padding)."""
    batch = random_batch(3, 10, seed=1, lengths=[10, 7, 5])
    labels = batch["input_ids"].clone()
    labels[:, :3] = -100
    labels[batch["attention_mask"] == 0] = -100
    return {**batch, "labels": labels}


def real_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).logits[batch["attention_mask"].bool()]


@pytest.mark.parametrize("quantization", list(QUANTIZATIONS))
def test_smear_wraps_the_quantized_layers_without_touching_them(base_dir, quantization):
    model = quantized(base_dir, quantization)
    weights = {name: (type(p), p.dtype) for name, p in model.named_parameters()}
    peft_model = get_peft_model(model, smear_config("lora", target_modules="all-linear"))
    layers = [module for module in peft_model.modules() if isinstance(module, SmearLinear)]
    assert len(layers) == 14
    for layer in layers:
        base = layer.get_base_layer()
        assert type(base).__name__ == QUANTIZED_LAYERS[quantization]
        assert (layer.in_features, layer.out_features) == (base.in_features, base.out_features)
        # The experts are fp32 however the base weight is packed; nothing was cast to the packed dtype.
        assert all(param.dtype == torch.float32 for param in smear_state(layer).values())
    for name, param in peft_model.base_model.model.named_parameters():
        if ".smear_" not in name:
            assert (type(param), param.dtype) == weights[name.replace(".base_layer", "")], name


def smear_on_both_bases(base_dir, quantization: str, kind: str, **overrides):
    """SMEAR with identical weights on the quantized base and on its dequantized copy. The weights are copied before
    either model runs: bitsandbytes 0.50.2 corrupts 4-bit weights that its CPU inference kernel has repacked when
    ``state_dict()`` is called afterwards (see docs/llm.md, Quantized base models)."""
    quantized_base = quantized(base_dir, quantization)
    dense_base = dequantized_copy(base_dir, quantized_base)
    torch.manual_seed(0)
    dense = get_peft_model(dense_base, smear_config(kind, **overrides))
    smear = get_peft_model(quantized_base, smear_config(kind, **overrides))
    copy_smear_weights(dense, smear)
    return smear, dense


@pytest.mark.parametrize("mode", ["training", "inference"])
@pytest.mark.parametrize("kind", list(KIND_OPTIONS))
@pytest.mark.parametrize("quantization", list(QUANTIZATIONS))
def test_outputs_match_smear_on_the_dequantized_base(base_dir, quantization, kind, mode):
    """In training mode bitsandbytes computes in fp32 with the dequantized weight on the CPU (4-bit and 8-bit), so the
    base gap is 0 (4-bit) or 5e-6 (8-bit) and SMEAR must match as closely; in inference its kernels round (4-bit: bf16
    activations, 8-bit: LLM.int8's int8 activations), by up to 2-4% of the logits here."""
    smear, dense = smear_on_both_bases(base_dir, quantization, kind, expert_dropout=0.0)
    batch = batch_with_prompt()
    with torch.set_grad_enabled(mode == "training"):
        for model in (smear, dense):
            model.train(mode == "training")
        expected, actual = real_logits(dense, batch), real_logits(smear, batch)
        with dense.disable_adapter(), smear.disable_adapter():
            dense_base_logits = real_logits(dense, batch)
            base_gap = (real_logits(smear, batch) - dense_base_logits).abs().max().item()
    tolerance = 2 * base_gap + 1e-5  # the quantised base's own deviation, doubled, plus fp32 rounding
    assert tolerance < 0.1 * dense_base_logits.abs().max()  # a few percent of the logits' scale
    # Not vacuous: an adapter left out on the quantized base would miss by more than the tolerance.
    assert (expected - dense_base_logits).abs().max() > 1.5 * tolerance
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize("quantization", list(QUANTIZATIONS))
def test_gradients_match_smear_on_the_dequantized_base(base_dir, quantization):
    """Training-mode forward and backward through the quantized layers, which bitsandbytes computes in fp32 from the
    dequantized weight on the CPU: the gradients of every expert and router are the dense model's."""
    quantized_base = quantized(base_dir, quantization)
    dense_base = dequantized_copy(base_dir, quantized_base)
    torch.manual_seed(0)
    dense = get_peft_model(dense_base, smear_config("lora", expert_dropout=0.0))
    smear = get_peft_model(quantized_base, smear_config("lora", expert_dropout=0.0))
    copy_smear_weights(dense, smear)
    batch = batch_with_prompt()
    losses = {}
    for name, model in (("dense", dense), ("quantized", smear)):
        model.train()
        losses[name] = model(**batch).loss
        losses[name].backward()
    assert losses["quantized"].item() == pytest.approx(losses["dense"].item(), abs=1e-5)
    dense_grads = {name: p.grad for name, p in dense.named_parameters() if p.requires_grad}
    grads = {name: p.grad for name, p in smear.named_parameters() if p.requires_grad}
    assert grads.keys() == dense_grads.keys()
    for name, grad in grads.items():
        scale = dense_grads[name].abs().max()
        assert scale > 0, name
        assert (grad - dense_grads[name]).abs().max() <= 1e-4 * scale, name


@pytest.mark.parametrize("quantization", list(QUANTIZATIONS))
def test_trainer_with_kbit_preparation_and_gradient_checkpointing_lowers_the_loss(base_dir, tmp_path, quantization):
    model = prepare_model_for_kbit_training(quantized(base_dir, quantization), use_gradient_checkpointing=True)
    assert model.is_gradient_checkpointing
    torch.manual_seed(0)
    model = get_peft_model(model, smear_config("lora", init_weights=True, routing_prefix_length=2))
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trainable and all(".smear_" in name for name in trainable)
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}

    args = training_args(tmp_path, num_train_epochs=6, gradient_checkpointing=True)
    trainer = Trainer(model=model, args=args, train_dataset=lm_data(n=32), data_collator=pad_collator)
    trainer.train()

    assert_loss_fell(logged_losses(trainer), window=3, factor=0.8)
    for name, param in model.named_parameters():
        if name in frozen:
            assert torch.equal(param, frozen[name]), name  # the quantized base is left exactly as it was


@pytest.mark.parametrize("quantization", list(QUANTIZATIONS))
def test_gradient_checkpointing_gives_the_same_gradients_on_a_quantized_base(base_dir, quantization):
    grads = {}
    for checkpointing in (False, True):
        model = prepare_model_for_kbit_training(quantized(base_dir, quantization), use_gradient_checkpointing=False)
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": True})
            model.enable_input_require_grads()
        torch.manual_seed(0)
        # Reentrant checkpointing (PEFT's recipe) computes the load-balancing loss without autograd in the forward;
        # it trains when the layers are recomputed, so the gradients are the same.
        model = get_peft_model(model, smear_config("lora", expert_dropout=0.0))
        model.train()
        model(**batch_with_prompt()).loss.backward()
        grads[checkpointing] = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    assert grads[True].keys() == grads[False].keys()
    for name, grad in grads[True].items():
        torch.testing.assert_close(grad, grads[False][name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("quantization", "kind"), [("nf4", "lora"), ("fp4", "lora"), ("int8", "lora"), ("nf4", "adapter"), ("nf4", "ia3")]
)
def test_save_and_reload_on_a_fresh_quantized_base_is_exact(base_dir, tmp_path, quantization, kind):
    torch.manual_seed(0)
    model = get_peft_model(quantized(base_dir, quantization), smear_config(kind))
    batch = batch_with_prompt()
    model.eval()
    with torch.no_grad():
        expected = real_logits(model, batch)
    model.save_pretrained(tmp_path / "adapter")

    reloaded = PeftModel.from_pretrained(quantized(base_dir, quantization), tmp_path / "adapter")
    assert isinstance(reloaded.base_model, peft_smear.SmearModel)
    for name, tensor in smear_state(model).items():
        assert torch.equal(smear_state(reloaded)[name], tensor), name
    with torch.no_grad():
        assert torch.equal(real_logits(reloaded, batch), expected)


@pytest.mark.parametrize(
    ("quantization", "kind"), [("nf4", "lora"), ("fp4", "lora"), ("int8", "lora"), ("nf4", "ia3"), ("int8", "ia3")]
)
def test_exported_adapter_loads_on_the_quantized_base_as_a_plain_peft_adapter(base_dir, tmp_path, quantization, kind):
    """One example's merged expert exported, then loaded by PEFT alone (its own bitsandbytes LoRA / IA3 layers) on a
    fresh quantized base: that example's logits are SMEAR's."""
    torch.manual_seed(0)
    model = get_peft_model(quantized(base_dir, quantization), smear_config(kind))
    example = {name: tensor[:1] for name, tensor in batch_with_prompt().items()}
    routing = peft_smear.get_routing_weights(model, **example)
    with torch.no_grad():
        expected = real_logits(model.eval(), example)
    config = peft_smear.export_merged_adapter(model, tmp_path / "exported", routing=routing)
    assert config.peft_type.value == {"lora": "LORA", "ia3": "IA3"}[kind]

    exported = PeftModel.from_pretrained(quantized(base_dir, quantization), tmp_path / "exported")
    assert isinstance(exported.base_model, {"lora": LoraModel, "ia3": IA3Model}[kind])
    peft_layers = [m for m in exported.modules() if type(m).__module__.endswith(".bnb")]
    assert len(peft_layers) == len(routing) and all(
        type(m).__name__ == QUANTIZED_LAYERS[quantization] for m in peft_layers
    )
    with torch.no_grad():
        torch.testing.assert_close(real_logits(exported, example), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_activations_on_a_4bit_base(base_dir, dtype):
    """A 4-bit base loaded in half precision, with that compute dtype: the experts stay fp32, are merged into the
    activations' dtype, and SMEAR's output matches the dequantized base in the same dtype."""
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    quantized_base = AutoModelForCausalLM.from_pretrained(
        base_dir, quantization_config=config, device_map="cpu", dtype=dtype
    )
    dense_base = dequantized_copy(base_dir, quantized_base).to(dtype)
    torch.manual_seed(0)
    dense = get_peft_model(dense_base, smear_config("lora"))
    smear = get_peft_model(quantized_base, smear_config("lora"))
    copy_smear_weights(dense, smear)
    assert all(tensor.dtype == torch.float32 for tensor in smear_state(smear).values() if tensor.is_floating_point())
    batch = batch_with_prompt()
    with torch.no_grad():
        actual, expected = real_logits(smear, batch), real_logits(dense, batch).float()
        with dense.disable_adapter(), smear.disable_adapter():
            dense_base_logits = real_logits(dense, batch).float()
            tolerance = 2 * (real_logits(smear, batch).float() - dense_base_logits).abs().max().item()
    assert actual.dtype == dtype and torch.isfinite(actual).all()
    actual = actual.float()
    assert (expected - dense_base_logits).abs().max() > 1.5 * tolerance
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=0)


def test_8bit_inference_kernel_with_gradients_enabled(base_dir):
    """LLM.int8's inference kernel (also its training kernel on GPUs) returns a view of its autograd Function's output,
    which autograd forbids changing in place while recording: SMEAR must not add its experts into it in place."""
    torch.manual_seed(0)
    model = get_peft_model(quantized(base_dir, "int8"), smear_config("lora"))
    batch = batch_with_prompt()
    with torch.no_grad():
        expected = real_logits(model, batch)
    logits = real_logits(model, batch)  # eval mode, gradients recorded (e.g. for attributions)
    torch.testing.assert_close(logits, expected, atol=0, rtol=0)
    logits.sum().backward()
    grads = [p.grad for name, p in model.named_parameters() if "smear_lora_B" in name]
    assert grads and all(grad is not None and grad.abs().sum() > 0 for grad in grads)
