"""export_merged_adapter writes a plain PEFT LoRA that reproduces the SMEAR model for a fixed routing."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel, get_peft_model
from peft.tuners.lora.conversion import convert_to_lora, save_as_lora
from transformers import AutoModelForCausalLM

import peft_smear
from conftest import BUILDERS, logits_without_peft_smear, random_batch, tiny_llama, trained_like_smear
from peft_smear import SmearConfig, SmearLinear, export_merged_adapter
from peft_smear.core.routers import merged


def logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits


def forced_logits(model, batch, distribution: dict[str, torch.Tensor]):
    """The SMEAR model's output with every router forced to ``distribution`` (through the generation cache)."""
    context = model.base_model.routing_context
    layers = {name: m for name, m in model.base_model.model.named_modules() if isinstance(m, SmearLinear)}
    batch_size = batch["input_ids"].shape[0]
    context.routing_cache = {(layers[n], "default"): merged(p.expand(batch_size, -1)) for n, p in distribution.items()}
    try:
        return logits(model, batch)
    finally:
        context.routing_cache = None


def load_lora(arch: str, directory):
    return PeftModel.from_pretrained(BUILDERS[arch][0](), directory).eval()


@pytest.mark.parametrize("arch", BUILDERS)
def test_per_example_export_reproduces_the_example_exactly(arch, tmp_path):
    model = trained_like_smear(arch)
    batch = random_batch(3, 7, seed=3, lengths=[7, 5, 3])
    expected = logits(model, batch)
    for row in range(3):
        example = {k: v[row : row + 1, : int(batch["attention_mask"][row].sum())] for k, v in batch.items()}
        routing = peft_smear.get_routing_weights(model, **example)
        export_merged_adapter(model, tmp_path / str(row), routing=routing)
        exported = logits(load_lora(arch, tmp_path / str(row)), example)
        reference = expected[row] if arch == "bert" else expected[row, : example["input_ids"].shape[1]]
        assert (exported[0] - reference).abs().max() <= 1e-5


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_fixed_distribution_export_equals_the_forced_smear_model(arch, tmp_path):
    model = trained_like_smear(arch)
    layers = [n for n, m in model.base_model.model.named_modules() if isinstance(m, SmearLinear)]
    generator = torch.Generator().manual_seed(0)
    distributions = {
        "one_hot": {name: torch.tensor([0.0, 1.0, 0.0]) for name in layers},
        "mixed": {name: torch.rand(3, generator=generator).softmax(0) for name in layers},
    }
    batch = random_batch(2, 6, seed=4)
    for label, distribution in distributions.items():
        export_merged_adapter(model, tmp_path / label, routing=distribution)
        exported = logits(load_lora(arch, tmp_path / label), batch)
        assert (exported - forced_logits(model, batch, distribution)).abs().max() <= 1e-5, label


def test_export_carries_rank_scaling_targets_and_head(tmp_path):
    model = trained_like_smear("bert")
    layers = sorted(n for n, m in model.base_model.model.named_modules() if isinstance(m, SmearLinear))
    export_merged_adapter(model, tmp_path, routing={name: torch.tensor([1.0, 0.0, 0.0]) for name in layers})
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and saved["r"] == 4 and saved["lora_alpha"] == 8
    assert sorted(saved["target_modules"]) == layers
    assert "classifier" in saved["modules_to_save"]
    loaded = load_lora("bert", tmp_path)
    head = loaded.base_model.model.classifier.modules_to_save["default"].weight
    assert torch.equal(head, model.base_model.model.classifier.modules_to_save["default"].weight)


def test_task_export_uses_the_mean_routing_of_the_task(tmp_path):
    model = trained_like_smear("llama")
    batches = [random_batch(4, 6, seed=s) for s in range(3)]
    per_batch = [peft_smear.get_routing_weights(model, **b) for b in batches]
    mean = {name: torch.cat([w[name] for w in per_batch]).mean(0) for name in per_batch[0]}
    export_merged_adapter(model, tmp_path / "task", routing=iter(batches))
    export_merged_adapter(model, tmp_path / "mean", routing=mean)
    probe = random_batch(2, 5, seed=9)
    torch.testing.assert_close(
        logits(load_lora("llama", tmp_path / "task"), probe), logits(load_lora("llama", tmp_path / "mean"), probe)
    )


def test_export_loads_where_peft_smear_cannot_be_imported(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "base")
    config = SmearConfig(num_experts=3, r=4, init_weights=False, target_modules="all-linear")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), config).eval()
    example = random_batch(1, 6, seed=5)
    export_merged_adapter(model, tmp_path / "lora", routing=peft_smear.get_routing_weights(model, **example))
    loaded = logits_without_peft_smear(tmp_path / "base", tmp_path / "lora", example, tmp_path)
    assert (loaded - logits(model, example)).abs().max() <= 1e-5


def test_exported_adapter_merges_into_the_base_weights(tmp_path):
    model = trained_like_smear("llama")
    example = random_batch(1, 6, seed=6)
    export_merged_adapter(model, tmp_path / "lora", routing=peft_smear.get_routing_weights(model, **example))
    lora = load_lora("llama", tmp_path / "lora")
    expected = logits(lora, example)
    merged = lora.merge_and_unload()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, example), expected, atol=1e-5, rtol=1e-5)
    merged.save_pretrained(tmp_path / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(logits(reloaded, example), expected, atol=1e-5, rtol=1e-5)


# --- bad input: a clear error and nothing written ----------------------------------------------------------------


@pytest.fixture
def llama_smear():
    model = trained_like_smear("llama")
    layers = [n for n, m in model.base_model.model.named_modules() if isinstance(m, SmearLinear)]
    return model, {name: torch.tensor([0.2, 0.3, 0.5]) for name in layers}


def test_routing_with_wrong_keys_is_refused(llama_smear, tmp_path):
    model, routing = llama_smear
    routing = dict(routing)
    routing.pop(next(iter(routing)))
    routing["model.layers.0.not_a_layer"] = torch.tensor([1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"Missing: \['model.layers.0.self_attn.q_proj'\].*not_a_layer"):
        export_merged_adapter(model, tmp_path / "out", routing=routing)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (torch.tensor([0.5, 0.5]), r"has shape \(2,\); that layer has 3 experts"),
        (torch.tensor([0.5, 0.6, -0.1]), "must be a distribution"),
        (torch.tensor([0.3, 0.3, 0.3]), "must be a distribution"),
        (torch.full((2, 3), 1 / 3), "have batch 2; export one example"),
    ],
)
def test_routing_with_wrong_values_is_refused(llama_smear, tmp_path, weights, message):
    model, routing = llama_smear
    routing = {**routing, next(iter(routing)): weights}
    with pytest.raises(ValueError, match=message):
        export_merged_adapter(model, tmp_path / "out", routing=routing)
    assert not (tmp_path / "out").exists()


def test_empty_task_is_refused(llama_smear, tmp_path):
    model, _ = llama_smear
    with pytest.raises(ValueError, match="The task has no examples"):
        export_merged_adapter(model, tmp_path / "out", routing=[])
    assert not (tmp_path / "out").exists()


def test_non_empty_directory_needs_overwrite(llama_smear, tmp_path):
    model, routing = llama_smear
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        export_merged_adapter(model, tmp_path / "out", routing=routing)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    export_merged_adapter(model, tmp_path / "out", routing=routing, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "no staging directory may be left behind"


# --- PEFT's own conversion (convert_to_lora / save_as_lora) and merge entry points -----------------------------------


def one_hot_everywhere(model, expert: int, experts: int) -> dict[str, torch.Tensor]:
    return {
        name: torch.eye(experts)[expert]
        for name, module in model.base_model.model.named_modules()
        if isinstance(module, SmearLinear)
    }


def assert_same_lora(converted_dir, exported_dir, arch, batch):
    """PEFT's converted LoRA and the export: the same update in every layer, and the same logits."""
    converted, exported = load_lora(arch, converted_dir), load_lora(arch, exported_dir)
    deltas = {}
    for model in (converted, exported):
        for name, module in model.base_model.model.named_modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                delta = module.get_delta_weight("default")
                deltas.setdefault(name, []).append(delta)
    assert deltas and all(len(pair) == 2 for pair in deltas.values())
    for name, (first, second) in deltas.items():
        torch.testing.assert_close(first, second, atol=1e-5, rtol=1e-4, msg=name)
    torch.testing.assert_close(logits(converted, batch), logits(exported, batch), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_peft_converts_a_single_expert_adapter_to_the_lora_export_merged_adapter_writes(arch, tmp_path):
    build, task_type = BUILDERS[arch]
    config = SmearConfig(routing="single", r=4, init_weights=False, target_modules="all-linear", task_type=task_type)
    model = get_peft_model(build(), config).eval()
    save_as_lora(tmp_path / "converted", model, rank=4)
    export_merged_adapter(model, tmp_path / "exported", routing=one_hot_everywhere(model, 0, 1))
    assert_same_lora(tmp_path / "converted", tmp_path / "exported", arch, random_batch(2, 6, seed=1))


def test_peft_converts_tag_routing_with_its_task(tmp_path):
    config = SmearConfig(routing="tag", num_experts=3, r=4, init_weights=False, target_modules="all-linear")
    model = get_peft_model(tiny_llama(), config).eval()
    batch = random_batch(2, 6, seed=1)
    with pytest.raises(
        TypeError, match=r"routing='tag', so no single LoRA reproduces it\. Export .*export_merged_adapter"
    ):
        convert_to_lora(model, 4)
    with peft_smear.fixed_routing(model, task=2):
        save_as_lora(tmp_path / "converted", model, rank=4)
        fixed = logits(model, batch)  # every example routed as task 2
    torch.testing.assert_close(fixed, logits(model, {**batch, "smear_task_ids": torch.tensor([2, 2])}))
    export_merged_adapter(model, tmp_path / "exported", routing=one_hot_everywhere(model, 2, 3))
    assert_same_lora(tmp_path / "converted", tmp_path / "exported", "llama", batch)
    with pytest.raises(ValueError, match=r"task must be a task id in \[0, 3\) for routing='tag', got 3"):
        peft_smear.fixed_routing(model, task=3).__enter__()
    assert all(not m.fixed_routing for m in model.modules() if isinstance(m, SmearLinear))


def test_peft_converts_a_routing_given_by_the_user_and_refuses_without_one(tmp_path):
    model = trained_like_smear("llama")
    batch = random_batch(2, 6, seed=1)
    with pytest.raises(TypeError, match=r"routing='smear', so no single LoRA reproduces it\. .*export_merged_adapter"):
        save_as_lora(tmp_path / "refused", model, rank=4)
    generator = torch.Generator().manual_seed(0)
    layers = [n for n, m in model.base_model.model.named_modules() if isinstance(m, SmearLinear)]
    routings = {
        "distribution": {name: torch.rand(3, generator=generator).softmax(0) for name in layers},
        "task": [random_batch(3, 5, seed=2), random_batch(2, 7, seed=3)],
    }
    for label, routing in routings.items():
        with peft_smear.fixed_routing(model, routing) as distributions:
            save_as_lora(tmp_path / f"{label}-converted", model, rank=4)
            if label == "distribution":
                torch.testing.assert_close(logits(model, batch), forced_logits(model, batch, distributions))
        export_merged_adapter(model, tmp_path / f"{label}-exported", routing=routing)
        assert_same_lora(tmp_path / f"{label}-converted", tmp_path / f"{label}-exported", "llama", batch)


def test_peft_conversion_of_experts_that_are_no_lora_names_export_merged_adapter():
    model = get_peft_model(tiny_llama(), SmearConfig(routing="single", expert_type="ia3")).eval()
    with pytest.raises(
        TypeError, match=r"PEFT's LoRA conversion needs LoRA experts; .*peft_smear\.export_merged_adapter"
    ):
        convert_to_lora(model, 4)


def test_add_weighted_adapter_points_to_merge_experts():
    model = trained_like_smear("llama")
    with pytest.raises(TypeError, match=r"peft_smear.merge_experts\(model, directory"):
        model.add_weighted_adapter(["default"], [1.0], "merged")
