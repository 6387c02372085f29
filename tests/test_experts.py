"""Every expert kind (LoRA, bottleneck adapter, IA3) behind SmearConfig(expert_type=...): forward and backward, the
output against an explicit per-example merge, every routing method, save and load, export, and config errors."""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
import textwrap
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Trainer

import peft_smear
from conftest import (
    VOCAB,
    assert_loss_fell,
    changed_keys,
    classification_data,
    import_script,
    logged_losses,
    logits_without_peft_smear,
    pad_collator,
    random_batch,
    reference_smear_forward,
    snapshot,
    tiny_bert,
    tiny_gpt2,
    tiny_llama,
    tiny_t5,
    tiny_tokenizer,
    training_args,
)
from peft_smear import ROUTERS, SmearConfig, SmearLinear, cli, export_merged_adapter
from peft_smear.core.routers import merged, mixed, one_expert
from peft_smear.core.smear import MergeAndApply, add_per_example_experts, merge_parameters
from peft_smear.experts import BottleneckAdapterExperts, IA3Experts


KINDS = {
    "lora": {"expert_type": "lora"},
    "adapter": {"expert_type": "adapter", "adapter_width": 4},
    "adapter_ln": {
        "expert_type": "adapter",
        "adapter_reduction_factor": 8,
        "adapter_layer_norm": True,
        "adapter_activation": "gelu",
    },
    "ia3": {"expert_type": "ia3"},
}
ARCHITECTURES = {"llama": tiny_llama, "bert": tiny_bert, "t5": tiny_t5, "gpt2": tiny_gpt2}
# The modules whose input IA3 scales by default (PEFT IA3's feedforward modules), as the reference below decides it.
IA3_INPUT_SCALED = {"llama": ("down_proj",), "bert": ("output.dense",), "t5": (".wo",), "gpt2": ("mlp.c_proj",)}
ROUTING_SETTINGS = {
    "latent_skills": {"num_tasks": 3},
    "st_gumbel": {"gumbel_temperature": 1.0},
    "glider": {"expert_embeddings": torch.eye(4).tolist()},
    "glider_merge": {"expert_embeddings": torch.eye(4).tolist()},
}


def smear(model, kind: str, **overrides):
    config = {"num_experts": 3, "init_weights": False, **KINDS[kind], **overrides}
    return get_peft_model(model, SmearConfig(**config))


def model_inputs(arch: str, batch: dict[str, torch.Tensor], labels: bool = False) -> dict[str, torch.Tensor]:
    inputs = dict(batch)
    if arch == "t5":
        generator = torch.Generator().manual_seed(1)
        decoder_ids = torch.randint(2, VOCAB, (batch["input_ids"].shape[0], 4), generator=generator)
        inputs["labels" if labels else "decoder_input_ids"] = decoder_ids
    elif labels and arch == "bert":
        inputs["labels"] = torch.arange(batch["input_ids"].shape[0]) % 3
    elif labels:
        inputs["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        inputs["labels"][:, :2] = -100  # the prompt the causal LMs route on
    return inputs


def logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits


def smear_layers(model) -> dict[str, SmearLinear]:
    return {name: m for name, m in model.base_model.model.named_modules() if isinstance(m, SmearLinear)}


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("kind", KINDS)
def test_output_equals_explicit_per_example_merge(kind, arch):
    model = smear(ARCHITECTURES[arch](), kind)
    batch = random_batch(3, 7, seed=2, lengths=[7, 4, 2])
    captured = []
    names = {module: name for name, module in smear_layers(model).items()}
    hooks = [
        layer.register_forward_hook(lambda m, args, out: captured.append((m, args[0].detach(), out.detach())))
        for layer in names
    ]
    with torch.no_grad():
        outputs = model(**model_inputs(arch, batch))
    for hook in hooks:
        hook.remove()

    encoder_summary = None
    if arch == "t5":
        states, mask = outputs.encoder_last_hidden_state.double(), batch["attention_mask"]
        encoder_summary = torch.stack([states[b][mask[b] == 1].mean(0) for b in range(states.shape[0])])
    config = model.peft_config["default"]
    assert {layer for layer, _, _ in captured} == set(names)
    for layer, x, out in captured:
        input_scaled = kind == "ia3" and names[layer].endswith(IA3_INPUT_SCALED[arch])
        expected = reference_smear_forward(layer, config, x, batch["attention_mask"], encoder_summary, input_scaled)
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "bert", "t5"])
@pytest.mark.parametrize("kind", KINDS)
def test_forward_and_backward_reach_every_expert_parameter(kind, arch):
    model = smear(ARCHITECTURES[arch](), kind)
    model.train()
    batch = random_batch(2, 6, seed=3, lengths=[6, 3])
    loss = model(**model_inputs(arch, batch, labels=True)).loss
    loss.backward()
    assert torch.isfinite(loss)
    adapter_params = {n: p for n, p in model.named_parameters() if ".smear_" in n}
    expected_names = {"lora": "smear_lora_", "adapter": "smear_adapter_", "adapter_ln": "smear_adapter_norm_"}
    expected_names["ia3"] = "smear_ia3_l"
    assert any(expected_names[kind] in n for n in adapter_params)
    without_grad = [n for n, p in adapter_params.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert without_grad == []
    frozen_with_grad = [n for n, p in model.named_parameters() if ".smear_" not in n and p.grad is not None]
    assert frozen_with_grad == []


@pytest.mark.parametrize("kind", KINDS)
def test_single_experts_add_up_to_mixtures_and_scaled_outputs(kind):
    """The mixture paths (dense over the concatenated experts) and Top-k's scaled output against one expert at a
    time: a mixture is the base output plus each expert's contribution times its weight."""
    input_scaled = {"ia3_feedforward_modules": ["down_proj", "o_proj"]} if kind == "ia3" else {}
    model = smear(tiny_llama(), kind, target_modules="all-linear", **input_scaled)
    generator = torch.Generator().manual_seed(0)
    for layer in smear_layers(model).values():
        experts = layer.expert_kind["default"]
        x = torch.randn(2, 5, layer.in_features, generator=generator)
        y = layer.get_base_layer()(x)
        start = x if experts.scales_input else y  # compare in the space the expert acts on

        def run(decision, layer=layer, x=x, start=start):
            return layer.apply_experts("default", decision, x, start.clone())  # a kind may add into y in place

        singles = [run(one_expert(torch.full((2,), n), 3)) - start for n in range(3)]
        weights = torch.rand(2, 3, generator=generator)  # need not sum to one (Top-k with k > 1 does not)
        expected = start + sum(weights[:, n, None, None] * singles[n] for n in range(3))
        torch.testing.assert_close(run(mixed(weights)), expected, atol=1e-5, rtol=1e-5)
        scale = torch.tensor([0.3, 0.8])
        scaled = run(one_expert(torch.tensor([2, 0]), 3, output_scale=scale))
        expected = start + scale[:, None, None] * torch.stack([singles[2][0], singles[0][1]])
        torch.testing.assert_close(scaled, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            run(merged(torch.eye(3)[[1, 2]])), start + torch.stack([singles[1][0], singles[2][1]])
        )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("routing", tuple(ROUTERS))
def test_every_routing_method_trains_with_every_kind(kind, routing):
    supported = ROUTERS[routing].expert_types
    if supported is not None and KINDS[kind]["expert_type"] not in supported:
        with pytest.raises(ValueError, match=f"routing={routing!r} works with expert_type in"):
            smear(tiny_bert(), kind, routing=routing)
        return
    settings = {**ROUTING_SETTINGS.get(routing, {}), "init_weights": "smear", "task_type": "SEQ_CLS"}
    settings["num_experts"] = None if routing == "single" else 4
    model = smear(tiny_bert(), kind, routing=routing, **settings)
    model.train()
    batch = model_inputs("bert", random_batch(4, 6, seed=4, lengths=[6, 5, 3, 2]), labels=True)
    batch["smear_query_embeddings"] = torch.ones(4, 4)  # GLIDER: no close match (cos 0.5), so local scores decide
    outputs = model(**batch, smear_task_ids=torch.tensor([0, 1, 2, 0]))
    outputs.loss.backward()
    assert torch.isfinite(outputs.loss)
    grads = {n: p.grad for n, p in model.named_parameters() if ".smear_" in n}
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "router" not in n and "skill" not in n)
    learned = [
        n
        for n in grads
        if n.endswith(
            (".smear_router.default.weight", ".smear_router.default.skill_logits", ".smear_router.default.gate")
        )
    ]
    assert all(grads[n] is not None and grads[n].abs().sum() > 0 for n in learned), "every router must learn"
    weights = peft_smear.get_routing_weights(model, **batch, smear_task_ids=torch.tensor([0, 1, 2, 0]))
    assert all(torch.allclose(w.sum(-1), torch.ones(w.shape[:-1])) for w in weights.values())  # per token too


# --- initialisation ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["adapter", "adapter_ln", "ia3"])
def test_default_initialisation_starts_as_the_base_model(kind):
    batch = random_batch(2, 6, seed=5)
    model = smear(tiny_llama(), kind, init_weights=True)
    # IA3's merged ones are ones up to the rounding of the routing distribution's sum.
    torch.testing.assert_close(logits(model, batch), logits(tiny_llama(), batch), atol=1e-6, rtol=1e-5)
    layer = next(iter(smear_layers(model).values()))
    if kind == "ia3":
        assert torch.equal(layer.smear_ia3_l["default"], torch.ones_like(layer.smear_ia3_l["default"]))
        smear_init = next(iter(smear_layers(smear(tiny_llama(), kind, init_weights="smear")).values()))
        vectors = smear_init.smear_ia3_l["default"]
        assert not torch.allclose(vectors[0], vectors[1]) and (vectors - 1).abs().max() < 0.1
    else:
        down = layer.smear_adapter_down["default"]
        assert not torch.allclose(down[0], down[1]), "experts must differ to break SMEAR's symmetry"
        assert torch.count_nonzero(layer.smear_adapter_up["default"]) == 0


def test_adapter_width_and_parameter_count():
    model = smear(tiny_llama(), "adapter_ln", target_modules=["o_proj"])  # out_features 32, factor 8: width 4
    layer = model.base_model.model.model.layers[0].self_attn.o_proj
    assert layer.smear_adapter_down["default"].shape == (3, 32, 4)
    assert layer.smear_adapter_up["default"].shape == (3, 4, 32)
    n, d, width = 3, 32, 4
    per_layer = n * (2 * d * width + width + d + 2 * d) + n * d + 3 * d  # experts with LayerNorm, router
    assert model.get_nb_trainable_parameters()[0] == 2 * per_layer


# --- save and load -----------------------------------------------------------------------------------------------


FRESH_PROCESS_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    import peft_smear  # registers SMEAR
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, Trainer
    base_dir, adapter_dir, batch_file, out_file = sys.argv[1:]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
    with torch.no_grad():
        torch.save(model(**torch.load(batch_file)).logits, out_file)
    """
)


@pytest.mark.parametrize("kind", ["adapter_ln", "ia3"])
def test_save_then_load_in_a_fresh_process_gives_identical_logits(kind, tmp_path):
    tiny_llama().save_pretrained(tmp_path / "base")
    model = smear(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), kind).eval()
    model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["expert_type"] == KINDS[kind]["expert_type"]
    batch = random_batch(3, 6, lengths=[6, 4, 2])
    torch.save(batch, tmp_path / "batch.pt")
    (tmp_path / "load.py").write_text(FRESH_PROCESS_SCRIPT)
    args = [tmp_path / "base", tmp_path / "adapter", tmp_path / "batch.pt", tmp_path / "out.pt"]
    result = subprocess.run([sys.executable, tmp_path / "load.py", *map(str, args)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert torch.equal(torch.load(tmp_path / "out.pt"), logits(model, batch))


@pytest.mark.parametrize("kind", ["adapter_ln", "ia3"])
def test_loading_under_a_second_adapter_name(kind, tmp_path):
    model = smear(tiny_llama(), kind).eval()
    model.save_pretrained(tmp_path)
    batch = random_batch(2, 5)
    fresh = get_peft_model(tiny_llama(), SmearConfig(num_experts=2, target_modules=["q_proj"])).eval()
    fresh.load_adapter(tmp_path, adapter_name="second")
    fresh.set_adapter("second")
    assert not any(p.is_meta for p in fresh.parameters())
    assert torch.equal(logits(fresh, batch), logits(model, batch))


def test_adapters_of_different_kinds_live_side_by_side():
    model = smear(tiny_llama(), "lora")
    batch = random_batch(2, 5)
    lora_logits = logits(model, batch)
    model.add_adapter("vectors", SmearConfig(num_experts=2, init_weights=False, **KINDS["ia3"]))
    model.set_adapter("vectors")
    assert not torch.allclose(logits(model, batch), lora_logits)
    model.set_adapter("default")
    assert torch.equal(logits(model, batch), lora_logits)
    model.delete_adapter("vectors")
    assert not any(".vectors" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("kind", ["adapter_ln", "ia3"])
def test_gradient_checkpointing_gives_the_same_gradients(kind):
    batch = model_inputs("llama", random_batch(3, 6, lengths=[6, 4, 2]), labels=True)

    def gradients(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = smear(tiny_llama(), kind, expert_dropout=0.3)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        model.train()
        torch.manual_seed(123)  # same expert-dropout draws in both runs
        model(**batch).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    plain, checkpointed = gradients(False), gradients(True)
    assert plain.keys() == checkpointed.keys() and plain
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=1e-5, msg=name)


# How far the loss falls in 15 epochs on the tiny BERT: an IA3 vector per module learns this task slowest.
TRAINER_LOSS_FACTOR = {"adapter": 0.6, "ia3": 0.95}


@pytest.mark.parametrize("kind", TRAINER_LOSS_FACTOR)
def test_trainer_lowers_the_loss_and_trains_only_the_adapter(kind, tmp_path):
    torch.manual_seed(0)
    model = smear(tiny_bert(), kind, num_experts=4, init_weights=True, task_type="SEQ_CLS")
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    before = snapshot(model)
    args = training_args(tmp_path, num_train_epochs=15, learning_rate=2e-2)
    trainer = Trainer(model=model, args=args, train_dataset=classification_data(), data_collator=pad_collator)
    trainer.train()
    assert_loss_fell(logged_losses(trainer), factor=TRAINER_LOSS_FACTOR[kind])
    assert changed_keys(before, model) == trainable


# --- generation --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "kind_cls"), [("adapter_ln", BottleneckAdapterExperts), ("ia3", IA3Experts)])
def test_generation_merges_once_per_layer_and_caches_like_no_cache(kind, kind_cls, monkeypatch):
    model = smear(tiny_llama(), kind, task_type="CAUSAL_LM")
    ids = torch.tensor([[0, 0, 5, 9, 14], [0, 21, 30, 4, 7]])
    inputs = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    options = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        uncached = model.generate(**inputs, use_cache=False, **options)
    merges = []
    original = kind_cls.merge
    monkeypatch.setattr(kind_cls, "merge", lambda self, *a: merges.append(self) or original(self, *a))
    with torch.no_grad():
        cached = model.generate(**inputs, use_cache=True, **options)
    assert torch.equal(cached, uncached)
    assert len(merges) == len(smear_layers(model)), "each layer merges its experts once, at prefill"


def test_t5_adapters_generate_with_encoder_routing():
    model = smear(tiny_t5(), "adapter_ln", task_type="SEQ_2_SEQ_LM")
    inputs = random_batch(2, 6, seed=6, lengths=[6, 3])
    options = {"max_new_tokens": 5, "decoder_start_token_id": 0, "num_beams": 2}
    with torch.no_grad():
        cached = model.generate(**inputs, use_cache=True, **options)
        uncached = model.generate(**inputs, use_cache=False, **options)
    assert torch.equal(cached, uncached)


# --- export ------------------------------------------------------------------------------------------------------


def trained_like(arch: str, kind: str, task_type: str, **overrides):
    """A SMEAR model of ``kind`` whose experts, routers and head all differ from their initial values."""
    model = smear(ARCHITECTURES[arch](), kind, task_type=task_type, **overrides).eval()
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad and ("router" in name or "classifier" in name):
                param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


def one_example(batch: dict[str, torch.Tensor], row: int) -> dict[str, torch.Tensor]:
    """Row ``row`` of ``batch`` alone, without its padding (decoder inputs are never padded here)."""
    length = int(batch["attention_mask"][row].sum())
    return {
        k: v[row : row + 1, :length] if k in ("input_ids", "attention_mask") else v[row : row + 1]
        for k, v in batch.items()
    }


@pytest.mark.parametrize(("arch", "task_type"), [("llama", "CAUSAL_LM"), ("bert", "SEQ_CLS"), ("gpt2", "CAUSAL_LM")])
def test_ia3_exports_to_a_plain_peft_ia3_adapter_with_the_same_outputs(arch, task_type, tmp_path):
    model = trained_like(arch, "ia3", task_type)
    batch = random_batch(2, 7, seed=3, lengths=[7, 4])
    expected = logits(model, batch)
    for row in range(2):
        example = one_example(batch, row)
        config = export_merged_adapter(
            model, tmp_path / str(row), routing=peft_smear.get_routing_weights(model, **example)
        )
        assert type(config).__name__ == "IA3Config"
        loaded = PeftModel.from_pretrained(ARCHITECTURES[arch](), tmp_path / str(row)).eval()
        assert type(loaded.peft_config["default"]).__name__ == "IA3Config"
        exported = logits(loaded, example)
        reference = expected[row] if arch == "bert" else expected[row, : example["input_ids"].shape[1]]
        assert (exported[0] - reference).abs().max() <= 1e-5
    saved = json.loads((tmp_path / "0" / "adapter_config.json").read_text())
    assert saved["peft_type"] == "IA3" and saved["feedforward_modules"]
    assert set(saved["feedforward_modules"]) < set(saved["target_modules"])
    assert sorted(saved["target_modules"]) == sorted(smear_layers(model))
    merged_model = loaded.merge_and_unload()  # vanilla PEFT folds it into the base weights
    torch.testing.assert_close(logits(merged_model, example), exported, atol=1e-5, rtol=1e-5)


def test_ia3_export_loads_where_peft_smear_cannot_be_imported(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "base")
    model = smear(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), "ia3").eval()
    example = random_batch(1, 6, seed=5)
    export_merged_adapter(model, tmp_path / "ia3", routing=peft_smear.get_routing_weights(model, **example))
    loaded = logits_without_peft_smear(tmp_path / "base", tmp_path / "ia3", example, tmp_path, "IA3Config")
    assert (loaded - logits(model, example)).abs().max() <= 1e-5


@pytest.mark.parametrize(
    ("arch", "kind", "task_type"),
    [("t5", "adapter_ln", "SEQ_2_SEQ_LM"), ("bert", "adapter", "SEQ_CLS"), ("llama", "adapter_ln", "CAUSAL_LM")],
)
def test_adapter_exports_to_a_single_expert_smear_adapter_with_the_same_outputs(arch, kind, task_type, tmp_path):
    model = trained_like(arch, kind, task_type)
    batch = model_inputs(arch, random_batch(2, 7, seed=3, lengths=[7, 4]))
    expected = logits(model, batch)
    for row in range(2):
        example = one_example(batch, row)
        routing = peft_smear.get_routing_weights(model, **example)
        config = export_merged_adapter(model, tmp_path / str(row), routing=routing)
        assert (config.peft_type, config.expert_type, config.routing, config.num_experts) == (
            "SMEAR",
            "adapter",
            "single",
            1,
        )
        loaded = PeftModel.from_pretrained(ARCHITECTURES[arch](), tmp_path / str(row)).eval()
        exported = logits(loaded, example)
        reference = expected[row] if arch in ("bert", "t5") else expected[row, : example["input_ids"].shape[1]]
        assert (exported[0] - reference).abs().max() <= 1e-5
    weights = load_file(tmp_path / "0" / "adapter_model.safetensors")
    assert not any("router" in key for key in weights)
    assert all(w.shape[0] == 1 for key, w in weights.items() if ".smear_adapter_" in key)


@pytest.mark.parametrize("kind", ["adapter_ln", "ia3"])
def test_fixed_distribution_export_equals_the_forced_smear_model(kind, tmp_path):
    model = trained_like("llama", kind, "CAUSAL_LM")
    layers = smear_layers(model)
    generator = torch.Generator().manual_seed(0)
    distribution = {name: torch.rand(3, generator=generator).softmax(0) for name in layers}
    batch = random_batch(2, 6, seed=4)
    export_merged_adapter(model, tmp_path, routing=distribution)
    exported = logits(PeftModel.from_pretrained(tiny_llama(), tmp_path).eval(), batch)
    context = model.base_model.routing_context
    context.routing_cache = {(layers[n], "default"): merged(p.expand(2, -1)) for n, p in distribution.items()}
    try:
        forced = logits(model, batch)
    finally:
        context.routing_cache = None
    assert (exported - forced).abs().max() <= 1e-5


@pytest.mark.parametrize("kind", ["adapter", "ia3"])
def test_output_mixtures_are_refused_by_export(kind, tmp_path):
    model = smear(tiny_llama(), kind, routing="ensemble")
    with pytest.raises(ValueError, match="routing='ensemble', which mixes or scales the experts' outputs"):
        export_merged_adapter(model, tmp_path / "out", routing=[random_batch(2, 5)])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("kind", "written"), [("ia3", "an IA3 adapter"), ("adapter", "a single-expert SMEAR adapter")]
)
def test_cli_exports_one_expert_of_every_kind(kind, written, tmp_path, capsys):
    tiny_bert().save_pretrained(tmp_path / "base")
    tiny_tokenizer().save_pretrained(tmp_path / "base")
    model = trained_like("bert", kind, "SEQ_CLS")
    model.save_pretrained(tmp_path / "adapter")
    paths = ["--base-model", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter")]
    assert cli.main(["export", *paths, "--output", str(tmp_path / "out"), "--expert", "1"]) == 0
    printed = capsys.readouterr().out
    assert f"Wrote {written} to {tmp_path / 'out'}" in printed
    assert ("peft_smear imported" in printed) == (kind == "adapter")
    one_hot = {name: torch.tensor([0.0, 1.0, 0.0]) for name in smear_layers(model)}
    export_merged_adapter(model, tmp_path / "direct", routing=one_hot)
    for name, tensor in load_file(tmp_path / "direct" / "adapter_model.safetensors").items():
        assert torch.equal(load_file(tmp_path / "out" / "adapter_model.safetensors")[name], tensor)


# --- the paper's T5 configuration --------------------------------------------------------------------------------


def load_example(name: str):
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = spec_from_file_location(name, path)
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_t5_example_places_an_adapter_after_every_sub_layer(capsys):
    example = load_example("t5_adapter_config")
    model = get_peft_model(example.tiny_t5_v1_1(), example.paper_t5_config())
    layers = smear_layers(model)
    encoder = [n for n in layers if n.startswith("encoder.")]
    decoder = [n for n in layers if n.startswith("decoder.")]
    config = model.base_model.model.config
    assert len(encoder) == 2 * config.num_layers and len(decoder) == 3 * config.num_decoder_layers
    assert {n.split(".", 3)[-1] for n in layers} == {
        "layer.0.SelfAttention.o",
        "layer.1.EncDecAttention.o",
        "layer.1.DenseReluDense.wo",
        "layer.2.DenseReluDense.wo",
    }
    layer = layers[encoder[0]]
    assert layer.expert_kind["default"].width == config.d_model // 32
    assert {layer.router_input["default"] for name, layer in layers.items() if name in decoder} == {"encoder"}
    assert any("layer_norm" in n for n, p in model.named_parameters() if p.requires_grad)  # the paper trains them
    example.main(steps=3)
    assert "routing blocks: 2 per encoder layer, 3 per decoder layer" in capsys.readouterr().out


def test_the_docs_t5_snippet_matches_the_example():
    page = (Path(__file__).resolve().parents[1] / "docs" / "experts.md").read_text()
    blocks = [block.split("```")[0] for block in page.split("```python")[1:]]
    snippet = next(block for block in blocks if 'expert_type="adapter"' in block)
    example = load_example("t5_adapter_config")
    namespace = {"peft_smear": peft_smear, "get_peft_model": get_peft_model, "base_model": example.tiny_t5_v1_1()}
    exec(snippet, namespace)
    assert namespace["config"] == example.paper_t5_config()
    assert len(smear_layers(namespace["model"])) == 2 * 2 + 3 * 2


# --- configuration errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"expert_type": "prefix"}, "expert_type must be one of ('lora', 'adapter', 'ia3'), got 'prefix'"),
        ({"adapter_width": 16}, "adapter_width=16 only applies to expert_type='adapter', but expert_type='lora'"),
        ({"expert_type": "ia3", "r": 4}, "r=4 only applies to expert_type='lora', but expert_type='ia3'"),
        (
            {"expert_type": "adapter", "ia3_feedforward_modules": ["down_proj"]},
            "ia3_feedforward_modules={'down_proj'} only applies to expert_type='ia3', but expert_type='adapter'",
        ),
        (
            {"expert_type": "ia3", "init_weights": "gaussian"},
            "init_weights='gaussian' is not a scheme of expert_type='ia3', which takes one of (True, False, 'smear')",
        ),
        (
            {"expert_type": "adapter", "adapter_activation": "tanh"},
            "adapter_activation must be one of ('swish', 'silu', 'relu', 'gelu'), got 'tanh'",
        ),
        (
            {"expert_type": "adapter", "adapter_width": 8, "adapter_reduction_factor": 4},
            "Set adapter_width or adapter_reduction_factor, not both (got adapter_width=8, adapter_reduction_factor=4",
        ),
        ({"expert_type": "adapter", "adapter_width": 0}, "adapter_width must be an integer >= 1, got 0"),
        (
            {"expert_type": "adapter", "adapter_reduction_factor": 2.5},
            "adapter_reduction_factor must be an integer >= 1, got 2.5",
        ),
        ({"expert_type": "adapter", "adapter_layer_norm": "output"}, "adapter_layer_norm must be True or False"),
        (
            {"expert_type": "ia3", "target_modules": ["k_proj", "v_proj"], "ia3_feedforward_modules": ["down_proj"]},
            "ia3_feedforward_modules ['down_proj'] are not in target_modules ['k_proj', 'v_proj']",
        ),
    ],
)
def test_config_errors_name_the_option_and_the_kind(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SmearConfig(**settings)


def test_reduction_factor_too_large_for_a_module_names_it():
    with pytest.raises(
        ValueError, match=r"adapter_reduction_factor=64 leaves module 'model.layers.0.self_attn.o_proj'"
    ):
        smear(tiny_llama(), "adapter", adapter_width=None, adapter_reduction_factor=64)


@pytest.mark.parametrize("kind", ["ia3", "adapter"])
def test_a_module_type_no_kind_can_wrap_is_refused_with_the_kind(kind):
    with pytest.raises(
        TypeError,
        match=rf"expert_type='{KINDS[kind]['expert_type']}'\) cannot wrap target module "
        r"'model.embed_tokens' of type Embedding",
    ):
        smear(tiny_llama(), kind, target_modules=["embed_tokens"])


def test_a_model_type_without_a_default_placement_asks_for_target_modules():
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(vocab_size=VOCAB, hidden_size=16, ffn_dim=32, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="expert_type='adapter' has no default placement for model type 'opt'"):
        smear(OPTForCausalLM(config), "adapter")
    placed = smear(OPTForCausalLM(config), "adapter", target_modules=["out_proj", "fc2"])
    assert len(smear_layers(placed)) == 2


@pytest.mark.parametrize("y_dtype", [torch.float32, torch.bfloat16])
def test_lora_experts_add_into_the_base_output_with_scaling_and_output_scale(y_dtype):
    """The fused path (the second matmul adds into ``y``) and the path for a base output of another dtype (as under
    autocast) against an explicit per-example computation."""
    torch.manual_seed(0)
    tokens, y = torch.randn(3, 5, 6, dtype=torch.bfloat16), torch.randn(3, 5, 4).to(y_dtype)
    expert_A, expert_B = torch.randn(3, 2, 6, dtype=torch.bfloat16), torch.randn(3, 4, 2, dtype=torch.bfloat16)
    output_scale = torch.tensor([1.0, 0.5, 0.0])
    base_output = y.clone()
    result = add_per_example_experts(y, tokens, expert_A, expert_B, 0.25, output_scale)
    assert result.dtype == y_dtype
    for b in range(3):
        delta = tokens[b].float() @ expert_A[b].float().T @ expert_B[b].float().T * 0.25 * output_scale[b]
        torch.testing.assert_close(result[b].float(), base_output[b].float() + delta, atol=0.1, rtol=0.02)


@pytest.mark.parametrize(
    "dtype, param_dtype",
    [
        (torch.float64, torch.float32),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),  # a model cast to bf16 whole, its experts included
    ],
)
@pytest.mark.parametrize("trained", ["all", "experts only", "router only"])
def test_lora_merge_and_apply_backward_equals_autograds_through_the_plain_steps(dtype, param_dtype, trained):
    """LoRA experts' hand-written backward (``MergeAndApply``, training's path) gives the output and gradients that
    autograd gives through ``merge_parameters`` and ``add_per_example_experts``, for each input that needs one (frozen
    experts, a frozen router), with a LoRA scaling other than 1, each gradient in its input's dtype (the router's fp32
    even from bf16 experts); in bf16, within its rounding."""
    generator = torch.Generator().manual_seed(0)
    batch, tokens, features_in, features_out, num_experts, rank = 3, 5, 12, 10, 4, 2

    def random(*shape, **kwargs):
        return torch.randn(*shape, generator=generator).to(kwargs.pop("dtype", torch.float32)).requires_grad_(**kwargs)

    x, y = random(batch, tokens, features_in, dtype=dtype), random(batch, tokens, features_out, dtype=dtype)
    lora_A = random(num_experts, rank, features_in, dtype=param_dtype, requires_grad=trained != "router only")
    lora_B = random(num_experts, features_out, rank, dtype=param_dtype, requires_grad=trained != "router only")
    logits = random(batch, num_experts, requires_grad=trained != "experts only")
    grad_output = torch.randn(batch, tokens, features_out, generator=generator).to(dtype)
    inputs = [tensor for tensor in (x, y, lora_A, lora_B, logits) if tensor.requires_grad]

    def run(fused: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        probs = logits.softmax(dim=-1)
        if fused:
            out = MergeAndApply.apply(y, x, lora_A, lora_B, probs, 2.0)
        else:
            out = add_per_example_experts(y, x, *merge_parameters((lora_A, lora_B), probs, dtype), 2.0)
        return out, torch.autograd.grad(out, inputs, grad_output)

    (fused, fused_grads), (plain, plain_grads) = run(True), run(False)
    assert torch.equal(fused, plain)
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    for tensor, got, expected in zip(inputs, fused_grads, plain_grads, strict=True):
        assert got.dtype == expected.dtype == tensor.dtype and got.shape == expected.shape
        error = float((got.double() - expected.double()).norm() / expected.double().norm())
        assert error <= tolerance, (tuple(tensor.shape), error)


@pytest.mark.parametrize("dtype, casts", [(torch.float32, 0), (torch.bfloat16, 1)])
def test_lora_merge_and_apply_backward_launches_one_matmul_per_gradient_and_no_concatenation(dtype, casts):
    """``MergeAndApply``'s backward dispatches four batched matmuls (the rank-r hidden units', the input's and the two
    merged experts', each merged one written into its side of one buffer), three matmuls to the experts and the
    router, the scaling's two multiplications and, for bf16 tokens over fp32 experts, one cast: no concatenation
    and no copy, each of which launches a kernel on a GPU (``benchmarks/work_counts.py``)."""
    x, y = torch.randn(3, 5, 12, dtype=dtype, requires_grad=True), torch.randn(3, 5, 10, dtype=dtype)
    lora_A, lora_B = torch.randn(4, 2, 12, requires_grad=True), torch.randn(4, 10, 2, requires_grad=True)
    probs = torch.randn(3, 4).softmax(dim=-1).requires_grad_()
    out = MergeAndApply.apply(y, x, lora_A, lora_B, probs, 2.0)
    grad_output = torch.ones_like(out)
    with import_script("work_counts").DispatchCounter() as counter:  # the operations that launch a kernel
        torch.autograd.grad(out, (x, lora_A, lora_B, probs), grad_output)
    expected = {"bmm": 4, "mm": 3, "mul_": 2, "_to_copy": casts}
    assert +counter.operations == +collections.Counter(expected), dict(counter.operations)
    # and what launches no kernel but costs the host all the same: the buffer, its parts (split as the matmuls write
    # them, then in the parameters' dtype) and their layouts, no slice, no view taken only to read a size
    no_kernel = {"new_empty": 1, "split_with_sizes": 2, "view": 4, "transpose": 2, "permute": 2}
    assert counter.without_kernel == no_kernel, dict(counter.without_kernel)


def backward_nodes(root: torch.autograd.graph.Node) -> list[str]:
    """The names of every node of the autograd graph below ``root``, once each."""
    seen, todo, names = set(), [root], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.parametrize("routing, fused_modules", [("smear", 4), ("top_k", 0)])
def test_training_merges_and_applies_lora_experts_through_the_written_backward(routing, fused_modules):
    """A training forward runs each wrapped module's merged LoRA experts through ``MergeAndApply``: the layer's
    dispatch, not only the function, is what saves the operations. A routing that chooses one expert per example
    (Top-k, k=1 by default, gathers it) does not."""
    config = SmearConfig(num_experts=3, r=2, init_weights=False, routing=routing, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(tiny_llama(), config).train()
    output = model(**random_batch(2, 6)).logits
    assert backward_nodes(output.grad_fn).count("MergeAndApplyBackward") == fused_modules  # q and v of 2 layers
