"""SMEAR behaves like a built-in PEFT method: registration, adapters, save/load, gradient checkpointing."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from peft import (
    AutoPeftModelForCausalLM,
    AutoPeftModelForSequenceClassification,
    PeftConfig,
    PeftModel,
    get_peft_model,
)
from peft import mapping as peft_mapping
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import peft_smear
from conftest import random_batch, tiny_bert, tiny_llama, tiny_t5
from peft_smear import SmearConfig, SmearLinear, SmearModel


def smear_llama(**overrides):
    config = {"num_experts": 3, "r": 2, "init_weights": False, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    return get_peft_model(tiny_llama(), SmearConfig(**{**config, **overrides}))


def logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits


# --- registration ------------------------------------------------------------------------------------------------


def test_import_registers_the_smear_peft_type():
    assert peft_mapping.PEFT_TYPE_TO_CONFIG_MAPPING["SMEAR"] is SmearConfig
    assert peft_mapping.PEFT_TYPE_TO_TUNER_MAPPING["SMEAR"] is SmearModel
    assert peft_mapping.PEFT_TYPE_TO_PREFIX_MAPPING["SMEAR"] == "smear_"
    assert isinstance(smear_llama().base_model, SmearModel)


@pytest.mark.parametrize("version", ["0.20.1", "0.22.0", "1.0.0"])
def test_unsupported_peft_version_is_refused_with_the_range(version):
    with pytest.raises(ImportError, match=rf"supports peft>=0\.21,<0\.22, but peft {version} is installed"):
        peft_smear.core.registration.check_peft_version(version)


def test_supported_peft_versions_pass():
    for version in ["0.21.0", "0.21.2", "0.21.3.dev0"]:
        peft_smear.core.registration.check_peft_version(version)


def test_import_fails_loudly_under_an_unsupported_peft():
    code = "import peft; peft.__version__ = '0.19.0'; import peft_smear"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "peft-smear supports peft>=0.21,<0.22, but peft 0.19.0 is installed" in result.stderr


# --- adapters ----------------------------------------------------------------------------------------------------


def test_print_trainable_parameters_counts_experts_and_routers(capsys):
    model = smear_llama()
    expected = 0
    for layer in (m for m in model.modules() if isinstance(m, SmearLinear)):
        n, r, d_in, d_out = 3, 2, layer.in_features, layer.out_features
        expected += n * r * (d_in + d_out) + n * d_in + 3 * d_in  # experts, router rows, row gain, input LayerNorm
    trainable, _ = model.get_nb_trainable_parameters()
    assert trainable == expected
    model.print_trainable_parameters()
    assert f"trainable params: {expected:,}" in capsys.readouterr().out


def test_add_set_and_delete_adapters():
    model = smear_llama()
    batch = random_batch(2, 5)
    default_logits = logits(model, batch)
    model.add_adapter("other", SmearConfig(num_experts=2, r=4, init_weights=False, target_modules=["q_proj"]))
    assert torch.equal(logits(model, batch), default_logits), "adding an adapter must not activate it"
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".other" in n)
    model.set_adapter("other")
    other_logits = logits(model, batch)
    assert not torch.allclose(other_logits, default_logits)
    assert all(p.requires_grad for n, p in model.named_parameters() if ".other" in n)
    other_routing = peft_smear.get_routing_weights(model, **batch)
    assert sorted(other_routing) == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert all(weights.shape == (2, 2) for weights in other_routing.values())
    model.set_adapter("default")
    assert torch.equal(logits(model, batch), default_logits)
    with pytest.raises(ValueError, match="Adapter 'other' is not active"):
        peft_smear.get_routing_weights(model, adapter_name="other", **batch)
    model.delete_adapter("other")
    assert not any(".other" in n for n, _ in model.named_parameters())
    assert torch.equal(logits(model, batch), default_logits)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_an_adapter_deleted_and_added_again_on_fewer_modules_routes_those_alone(mode):
    """q, k and v route together. Deleted and added again under its name on q and k only, the adapter's v layer left
    the group: the layers it kept route, train and drop experts on their own rows (it was a KeyError)."""
    kwargs = {"num_experts": 3, "r": 2, "router_input": "self", "expert_dropout": 0.5}
    model = smear_llama(target_modules=["q_proj", "k_proj", "v_proj"], **kwargs)
    model.add_adapter("other", SmearConfig(target_modules=["q_proj", "k_proj", "v_proj"], **kwargs))
    model.delete_adapter("other")
    model.add_adapter("other", SmearConfig(target_modules=["q_proj", "k_proj"], **kwargs))
    model.set_adapter("other")
    getattr(model, mode)()
    groups = model.base_model.routing_context.groups
    assert sorted(len(group) for (_, name), group in groups.items() if name == "other") == [2, 2, 2, 2]
    batch = random_batch(2, 5)
    output = model(**batch, labels=batch["input_ids"])
    assert torch.isfinite(output.loss)
    routing = peft_smear.get_routing_weights(model, **batch)
    assert sorted(routing) == [f"model.layers.{i}.self_attn.{m}_proj" for i in (0, 1) for m in ("k", "q")]


def test_disable_adapter_gives_the_base_model():
    base_logits = logits(tiny_llama(), random_batch(2, 5))
    model = smear_llama()
    with model.disable_adapter():
        assert torch.equal(logits(model, random_batch(2, 5)), base_logits)
    assert not torch.allclose(logits(model, random_batch(2, 5)), base_logits)


def test_unload_returns_the_untouched_base_model():
    batch = random_batch(2, 5)
    base_logits = logits(tiny_llama(), batch)
    base = smear_llama().unload()
    assert not any(isinstance(m, SmearLinear) for m in base.modules())
    assert not base._forward_pre_hooks, "routing hooks must be removed with the adapter"
    assert "generate" not in vars(base), "the generate wrapper must be removed with the adapter"
    assert torch.equal(logits(base, batch), base_logits)


def test_merge_and_unload_explains_why_it_cannot_merge():
    model = smear_llama()
    for merge in (model.merge_and_unload, model.merge_adapter):
        with pytest.raises(TypeError, match="input-dependent router") as error:
            merge()
        assert "unload()" in str(error.value)


# --- save and load -----------------------------------------------------------------------------------------------


def test_adapter_config_records_the_peft_type(tmp_path):
    model = smear_llama(expert_dropout=0.2)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["peft_type"] == "SMEAR" and saved["expert_dropout"] == 0.2
    config = PeftConfig.from_pretrained(tmp_path)
    assert isinstance(config, SmearConfig) and config.num_experts == 3 and config.r == 2
    keys = load_file(tmp_path / "adapter_model.safetensors")
    assert keys and all(".smear_" in k and not k.endswith(".default") for k in keys)


FRESH_PROCESS_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    import peft_smear  # registers SMEAR
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base_dir, adapter_dir, batch_file, out_file = sys.argv[1:]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
    with torch.no_grad():
        torch.save(model(**torch.load(batch_file)).logits, out_file)
    """
)


def test_save_then_load_in_a_fresh_process_gives_identical_logits(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "base")
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
        SmearConfig(num_experts=3, r=2, init_weights=False, target_modules="all-linear"),
    ).eval()
    model.save_pretrained(tmp_path / "adapter")
    batch = random_batch(3, 6, lengths=[6, 4, 2])
    torch.save(batch, tmp_path / "batch.pt")
    script = tmp_path / "load.py"
    script.write_text(FRESH_PROCESS_SCRIPT)
    args = [tmp_path / "base", tmp_path / "adapter", tmp_path / "batch.pt", tmp_path / "out.pt"]
    subprocess.run([sys.executable, script, *map(str, args)], check=True, capture_output=True)
    assert torch.equal(torch.load(tmp_path / "out.pt"), logits(model, batch))


def test_auto_peft_models_load_smear_adapters(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "llama")
    causal = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tmp_path / "llama"),
        SmearConfig(num_experts=2, r=2, init_weights=False, task_type="CAUSAL_LM"),
    ).eval()
    causal.save_pretrained(tmp_path / "causal-adapter")
    batch = random_batch(2, 5)
    loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "causal-adapter").eval()
    assert isinstance(loaded.base_model, SmearModel)
    assert torch.equal(logits(loaded, batch), logits(causal, batch))

    tiny_bert().save_pretrained(tmp_path / "bert")
    from transformers import AutoModelForSequenceClassification

    classifier = get_peft_model(
        AutoModelForSequenceClassification.from_pretrained(tmp_path / "bert"),
        SmearConfig(num_experts=2, r=2, init_weights=False, task_type="SEQ_CLS"),
    ).eval()
    with torch.no_grad():  # make the (saved, modules_to_save) head differ from the base checkpoint's
        classifier.base_model.model.classifier.modules_to_save["default"].weight.add_(1.0)
    classifier.save_pretrained(tmp_path / "cls-adapter")
    loaded_cls = AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "cls-adapter").eval()
    assert torch.equal(logits(loaded_cls, batch), logits(classifier, batch))


def test_loading_under_a_second_adapter_name(tmp_path):
    model = smear_llama().eval()
    model.save_pretrained(tmp_path)
    batch = random_batch(2, 5)
    expected = logits(model, batch)
    fresh = get_peft_model(tiny_llama(), SmearConfig(num_experts=3, r=2, target_modules=["q_proj"])).eval()
    fresh.load_adapter(tmp_path, adapter_name="second")
    fresh.set_adapter("second")
    assert not any(p.is_meta for p in fresh.parameters())
    assert torch.equal(logits(fresh, batch), expected)


def test_low_cpu_mem_usage_loading_materialises_every_weight(tmp_path):
    model = smear_llama().eval()
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path, low_cpu_mem_usage=True).eval()
    assert not any(p.is_meta for p in loaded.parameters())
    batch = random_batch(2, 5)
    assert torch.equal(logits(loaded, batch), logits(model, batch))


def test_loading_onto_a_mismatched_base_model_fails_clearly(tmp_path):
    smear_llama().save_pretrained(tmp_path)
    wider = tiny_llama(hidden_size=48)
    with pytest.raises(ValueError, match="shapes differ") as error:
        PeftModel.from_pretrained(wider, tmp_path)
    assert "layers.0.self_attn.q_proj.smear_lora_A.default: checkpoint (3, 2, 32), model (3, 2, 48)" in str(
        error.value
    )
    assert "more" in str(error.value)  # long listings are cut short


def test_loading_onto_a_head_of_another_size_fails_clearly(tmp_path):
    get_peft_model(tiny_bert(), SmearConfig(num_experts=3, r=2, task_type="SEQ_CLS")).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="shapes differ") as error:
        PeftModel.from_pretrained(tiny_bert(num_labels=5), tmp_path)
    assert "classifier.modules_to_save.default.weight: checkpoint (3, 32), model (5, 32)" in str(error.value)


def test_missing_adapter_weight_is_an_error(tmp_path):
    smear_llama().save_pretrained(tmp_path)
    weights = load_file(tmp_path / "adapter_model.safetensors")
    dropped = "base_model.model.model.layers.1.self_attn.v_proj.smear_router.weight"
    del weights[dropped]
    save_file(weights, tmp_path / "adapter_model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"missing from the checkpoint:\n  .*layers\.1\.self_attn\.v_proj\.smear_router\.default\.weight",
    ):
        PeftModel.from_pretrained(tiny_llama(), tmp_path)


def test_unexpected_adapter_weight_is_an_error(tmp_path):
    smear_llama().save_pretrained(tmp_path)
    weights = load_file(tmp_path / "adapter_model.safetensors")
    weights["base_model.model.model.layers.0.self_attn.k_proj.smear_lora_A"] = torch.zeros(3, 2, 32)
    save_file(weights, tmp_path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"in the checkpoint but not in the model:\n  .*k_proj\.smear_lora_A"):
        PeftModel.from_pretrained(tiny_llama(), tmp_path)


# --- copies ------------------------------------------------------------------------------------------------------


def copy_case(architecture: str) -> tuple[torch.nn.Module, dict, dict, dict]:
    """A SMEAR model, two batches that route differently (prompt masks for Llama; paddings for T5, whose encoder's
    hook records them), and generate's arguments for the second."""
    if architecture == "llama":
        model = smear_llama(router_input="prompt").eval()
        batch = random_batch(2, 6)
        prompts = [torch.arange(6).expand(2, 6) < length for length in (2, 5)]
        first, second = ({**batch, "smear_routing_mask": prompt.long()} for prompt in prompts)
        return model, first, second, {**second, "max_new_tokens": 3, "do_sample": False}
    model = get_peft_model(tiny_t5(), SmearConfig(num_experts=3, r=2, init_weights=False)).eval()
    first, second = random_batch(2, 6, lengths=[6, 2]), random_batch(2, 6, lengths=[3, 6])
    start = torch.zeros(2, 2, dtype=torch.long)
    generation = {**second, "max_new_tokens": 3, "do_sample": False}
    return model, {**first, "decoder_input_ids": start}, {**second, "decoder_input_ids": start}, generation


@pytest.mark.parametrize("architecture", ["llama", "t5"])
def test_a_deep_copy_routes_and_generates_on_its_own(architecture):
    """``copy.deepcopy`` gives a model whose hooks and ``generate`` serve the copy: it routes each call on that call's
    inputs whatever the original ran last, generates what the original generates, and unloading it leaves the
    original whole. (Closures over the original's tuner made a copy route on the original's last call.)"""
    model, first, second, generation = copy_case(architecture)
    expected = [logits(model, first), logits(model, second)]
    generated = model.generate(**generation)
    twin = copy.deepcopy(model)  # made after the original's last call, on the second batch
    for batch, logits_of_batch in ((first, expected[0]), (second, expected[1]), (first, expected[0])):
        torch.testing.assert_close(logits(twin, batch), logits_of_batch, rtol=0, atol=0)
        torch.testing.assert_close(logits(model, second), expected[1], rtol=0, atol=0)
    assert torch.equal(twin.generate(**generation), generated)
    twin.unload()
    torch.testing.assert_close(logits(model, first), expected[0], rtol=0, atol=0)
    assert torch.equal(model.generate(**generation), generated)


# --- gradient checkpointing --------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("options", [{}, {"routing": "dselect_k"}], ids=["smear_balanced", "dselect_k"])
@pytest.mark.parametrize("loss_scale", [1.0, 0.25], ids=["loss", "scaled_loss"])
def test_gradient_checkpointing_gives_the_same_gradients(use_reentrant, options, loss_scale):
    """With either kind of checkpointing the gradients equal those without, the routers' auxiliary losses included
    (SMEAR's load balancing, DSelect-k's entropy), also when the loss is scaled before backward (gradient
    accumulation, a mixed-precision loss scale): under reentrant checkpointing those losses train when the layers
    are recomputed (peft_smear.core.context.AuxLosses)."""
    batch = random_batch(3, 6, lengths=[6, 4, 2])
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    labels[:, :2] = -100

    def gradients(checkpointing: bool) -> dict[str, torch.Tensor]:
        dropout = {} if options.get("routing") == "dselect_k" else {"expert_dropout": 0.3}
        model = smear_llama(**dropout, **options)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
            model.enable_input_require_grads()
        model.train()
        torch.manual_seed(123)  # same expert-dropout draws in both runs
        output = model(**batch, labels=labels)
        assert output.smear_aux_losses, "an auxiliary loss takes part"
        (output.loss * loss_scale).backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    plain, checkpointed = gradients(False), gradients(True)
    assert plain.keys() == checkpointed.keys() and plain
    assert any("router" in name and grad.abs().sum() > 0 for name, grad in plain.items())
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_reentrant_checkpointing_refuses_reinforce_whose_policy_steps_would_not_train():
    """REINFORCE's losses need the reward, known only after the output: computed without autograd (reentrant
    checkpointing), its policy steps could train nothing, so a training call refuses them."""
    model = smear_llama(routing="reinforce")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()
    model.train()
    batch = random_batch(2, 6)
    labels = batch["input_ids"].clone()
    labels[:, :2] = -100  # a two-token prompt to route on
    with pytest.raises(RuntimeError, match=r"routing reinforce recorded its training signal with autograd disabled"):
        model(**batch, labels=labels)
    with torch.no_grad():  # an evaluation-style call in training mode has nothing to train: no error
        model(**batch, labels=labels)
