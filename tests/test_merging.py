"""merge_experts: PEFT's add_weighted_adapter combinations of a SMEAR adapter's LoRA experts (a trained SMEAR model's
or a bank's), by given weights, by a task's mean routing or one expert, written as one plain PEFT LoRA. Checked
against an explicit formula (linear, cat) and against add_weighted_adapter called directly on a PEFT model that holds
the experts as adapters (every other type), layer by layer."""

from __future__ import annotations

import json
import math

import peft.utils.merge_utils
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

import peft_smear
from conftest import BUILDERS, logits_without_peft_smear, random_batch, tiny_llama, trained_like_smear
from peft_smear import SmearConfig, SmearLinear, merge_experts
from peft_smear.export.merging import COMBINATION_TYPES


DENSITY = {t: 0.5 for t in COMBINATION_TYPES if t.startswith(("ties", "dare", "magnitude"))}


def smear_layers(model) -> dict[str, SmearLinear]:
    return {name: m for name, m in model.base_model.model.named_modules() if isinstance(m, SmearLinear)}


def logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits


def saved_pairs(directory) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """The written LoRA's ``(A, B, scaling)`` by module name."""
    config = json.loads((directory / "adapter_config.json").read_text())
    state = load_file(directory / "adapter_model.safetensors")
    scaling = config["lora_alpha"] / config["r"]
    return {
        key.removeprefix("base_model.model.").removesuffix(".lora_A.weight"): (
            state[key],
            state[key.replace("lora_A", "lora_B")],
            scaling,
        )
        for key in state
        if key.endswith(".lora_A.weight")
    }


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def deterministic_dare(monkeypatch):
    """DARE's random pruning with a mask that depends only on the tensor's shape, so that PEFT's own call and
    merge_experts' per-layer calls, which draw in different orders, drop the same entries."""

    def fixed_random_pruning(tensor, density, rescale):
        generator = torch.Generator().manual_seed(tensor.numel())
        mask = torch.rand(tensor.shape, generator=generator) < density
        pruned = tensor * mask.to(tensor.device)
        return pruned / density if rescale else pruned

    monkeypatch.setattr(peft.utils.merge_utils, "random_pruning", fixed_random_pruning)


# --- the explicit formulas ---------------------------------------------------------------------------------------


def test_linear_merge_with_given_weights_is_peft_s_linear_combination_of_a_and_b(tmp_path):
    """PEFT's linear type weights A and B by sqrt(|w| * scaling) each (the sign on A), so one adapter of weight w
    is w times its update; the written LoRA has scaling 1."""
    model = trained_like_smear("llama")
    weights = [0.2, -0.3, 0.5]
    merge_experts(model, tmp_path, weights=weights)
    saved = saved_pairs(tmp_path)
    assert set(saved) == set(smear_layers(model))
    for name, layer in smear_layers(model).items():
        A_n, B_n, s = layer.smear_lora_A["default"], layer.smear_lora_B["default"], 8 / 4
        root = torch.tensor([math.sqrt(abs(w) * s) for w in weights])
        sign = torch.tensor([math.copysign(1.0, w) for w in weights])
        A, B, scaling = saved[name]
        assert scaling == 1.0
        torch.testing.assert_close(A, torch.einsum("n,nri->ri", root * sign, A_n.detach()))
        torch.testing.assert_close(B, torch.einsum("n,nor->or", root, B_n.detach()))


def test_cat_merge_is_the_weighted_sum_of_the_experts_updates(tmp_path):
    model = trained_like_smear("llama")
    weights = [0.5, 1.5, -1.0]
    config = merge_experts(model, tmp_path, weights=weights, combination_type="cat")
    assert config.r == config.lora_alpha == 3 * 4
    for name, (A, B, scaling) in saved_pairs(tmp_path).items():
        layer = smear_layers(model)[name]
        A_n, B_n = layer.smear_lora_A["default"].detach(), layer.smear_lora_B["default"].detach()
        expected = sum(w * 2.0 * B_n[n] @ A_n[n] for n, w in enumerate(weights))
        torch.testing.assert_close(B @ A * scaling, expected, atol=1e-6, rtol=1e-5)


def test_one_expert_is_that_expert_exactly(tmp_path):
    """expert=I writes expert I alone, as export_merged_adapter's one-hot export does (the head of a classifier
    included)."""
    model = trained_like_smear("bert")
    layers = smear_layers(model)
    merge_experts(model, tmp_path / "merged", expert=2)
    peft_smear.export_merged_adapter(model, tmp_path / "export", routing={n: torch.eye(3)[2] for n in layers})
    batch = random_batch(2, 6, seed=2)
    build = BUILDERS["bert"][0]
    merged = PeftModel.from_pretrained(build(), tmp_path / "merged").eval()
    exported = PeftModel.from_pretrained(build(), tmp_path / "export").eval()
    assert merged.peft_config["default"].modules_to_save == exported.peft_config["default"].modules_to_save
    torch.testing.assert_close(logits(merged, batch), logits(exported, batch), atol=1e-5, rtol=1e-5)


# --- PEFT's own add_weighted_adapter, called directly --------------------------------------------------------------


def reference_model(model, arch: str):
    """A plain PEFT LoRA model on a fresh base holding the SMEAR model's experts as adapters ``e0``, ``e1``, ...,
    at the SMEAR adapter's rank and alpha."""
    config = model.peft_config["default"]
    layers = smear_layers(model)
    lora = LoraConfig(
        r=config.r, lora_alpha=config.lora_alpha, target_modules=sorted(layers), fan_in_fan_out=arch == "gpt2"
    )
    reference = get_peft_model(BUILDERS[arch][0](), lora, adapter_name="e0")
    for n in range(1, config.num_experts):
        reference.add_adapter(f"e{n}", lora)
    with torch.no_grad():
        for name, layer in layers.items():
            target = reference.base_model.model.get_submodule(name)
            for n in range(config.num_experts):
                target.lora_A[f"e{n}"].weight.copy_(layer.smear_lora_A["default"][n])
                target.lora_B[f"e{n}"].weight.copy_(layer.smear_lora_B["default"][n])
    return reference


def assert_same_updates(reference, names, reference_adapter: str, directory, atol=1e-5):
    """Every module's update of our written LoRA (loaded into ``reference``) equals PEFT's merged adapter's."""
    reference.load_adapter(str(directory), adapter_name="ours")
    for name in names:
        target = reference.base_model.model.get_submodule(name)
        ours, theirs = target.get_delta_weight("ours"), target.get_delta_weight(reference_adapter)
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize("combination_type", [t for t in COMBINATION_TYPES if t not in ("linear", "cat")])
def test_each_type_equals_add_weighted_adapter_on_the_experts(combination_type, deterministic_dare, tmp_path):
    model = trained_like_smear("llama")
    weights = [0.7, 0.4, 1.1]
    options = {"density": DENSITY[combination_type]} if combination_type in DENSITY else {}
    merge_experts(model, tmp_path, weights=weights, combination_type=combination_type, **options)
    reference = reference_model(model, "llama")
    reference.add_weighted_adapter(["e0", "e1", "e2"], weights, "ref", combination_type=combination_type, **options)
    assert_same_updates(reference, smear_layers(model), "ref", tmp_path)


@pytest.mark.parametrize(
    ("combination_type", "options"),
    [
        ("svd", {"svd_rank": 2}),
        ("ties", {"density": 0.3, "majority_sign_method": "frequency"}),
        ("ties_svd", {"density": 1.0, "svd_clamp": 0.99}),
    ],
)
def test_options_reach_add_weighted_adapter_on_a_gpt2_model(combination_type, options, tmp_path):
    """GPT-2's Conv1D layers store their weights transposed (fan_in_fan_out): the written LoRA says so, and its
    updates are PEFT's."""
    model = trained_like_smear("gpt2")
    config = merge_experts(model, tmp_path, weights=[1.0, 0.5, 0.25], combination_type=combination_type, **options)
    assert config.fan_in_fan_out
    reference = reference_model(model, "gpt2")
    reference.add_weighted_adapter(["e0", "e1", "e2"], [1.0, 0.5, 0.25], "ref", combination_type, **options)
    assert_same_updates(reference, smear_layers(model), "ref", tmp_path)


def save_adapters(directory, count: int = 3) -> dict[str, str]:
    adapters = {}
    for seed in range(count):
        torch.manual_seed(seed)
        config = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM"
        )
        get_peft_model(tiny_llama(), config).save_pretrained(directory / f"a{seed}")
        adapters[f"a{seed}"] = str(directory / f"a{seed}")
    return adapters


@pytest.mark.parametrize("combination_type", ["linear", "cat", "svd", "ties", "dare_ties", "magnitude_prune_svd"])
def test_a_bank_merges_as_add_weighted_adapter_merges_its_adapters(combination_type, deterministic_dare, tmp_path):
    """A bank's experts are its adapters (their scaling folded into B): merging them by name equals PEFT merging
    the saved adapters themselves (of one rank and alpha)."""
    adapters = save_adapters(tmp_path)
    bank = peft_smear.build_expert_bank(tiny_llama(), adapters)
    options = {"density": DENSITY[combination_type]} if combination_type in DENSITY else {}
    weights = {"a0": 0.5, "a1": 0.25, "a2": 1.0}
    merge_experts(bank, tmp_path / "merged", weights=weights, combination_type=combination_type, **options)
    reference = PeftModel.from_pretrained(tiny_llama(), adapters["a0"], adapter_name="a0")
    for name in ("a1", "a2"):
        reference.load_adapter(adapters[name], adapter_name=name)
    reference.add_weighted_adapter(list(weights), list(weights.values()), "ref", combination_type, **options)
    assert_same_updates(reference, smear_layers(bank), "ref", tmp_path / "merged")


def test_an_expert_of_weight_zero_is_left_out_of_the_merge(tmp_path):
    """In PEFT's TIES an adapter passed with weight 0 still votes on the signs and counts in the disjoint mean; a
    zero weight here leaves the expert out."""
    model = trained_like_smear("llama")
    merge_experts(model, tmp_path, weights=[1.0, 0.0, 1.0], combination_type="ties", density=0.5)
    reference = reference_model(model, "llama")
    reference.add_weighted_adapter(["e0", "e2"], [1.0, 1.0], "ref", combination_type="ties", density=0.5)
    assert_same_updates(reference, smear_layers(model), "ref", tmp_path)


def test_per_layer_weights_are_each_layer_s_own(tmp_path):
    model = trained_like_smear("llama")
    layers = sorted(smear_layers(model))
    vectors = ([0.1, 0.2, 0.7], [0.5, 0.5, 0.0])
    per_layer = {name: torch.tensor(vectors[i % 2]) for i, name in enumerate(layers)}
    merge_experts(model, tmp_path / "layers", weights=per_layer, combination_type="svd")
    for k, vector in enumerate(vectors):
        merge_experts(model, tmp_path / str(k), weights=vector, combination_type="svd")
    saved = saved_pairs(tmp_path / "layers")
    for i, name in enumerate(layers):
        A, B, _ = saved_pairs(tmp_path / str(i % 2))[name]
        assert torch.equal(saved[name][0], A) and torch.equal(saved[name][1], B)


# --- a task's mean routing ---------------------------------------------------------------------------------------


def test_a_task_is_merged_with_each_layer_s_mean_routing(tmp_path):
    model = trained_like_smear("llama")
    batches = [random_batch(4, 6, seed=s, lengths=[6, 4, 5, 2]) for s in range(3)]
    routed = [peft_smear.get_routing_weights(model, **b) for b in batches]
    mean = {name: torch.cat([r[name] for r in routed]).double().mean(0) for name in routed[0]}
    assert len({tuple(p.tolist()) for p in mean.values()}) == len(mean)  # each layer its own weights
    merge_experts(model, tmp_path / "task", routing=iter(batches), combination_type="ties_svd", density=0.7, task="t")
    merge_experts(model, tmp_path / "mean", weights=mean, combination_type="ties_svd", density=0.7)
    task, by_mean = saved_pairs(tmp_path / "task"), saved_pairs(tmp_path / "mean")
    for name in mean:
        torch.testing.assert_close(task[name][1] @ task[name][0], by_mean[name][1] @ by_mean[name][0])
    assert "each layer's mean routing over 12 examples of task t" in (tmp_path / "task" / "README.md").read_text()


def test_a_per_token_router_s_task_weights_average_the_real_tokens(tmp_path):
    adapters = save_adapters(tmp_path, count=2)
    bank = peft_smear.build_expert_bank(tiny_llama(), adapters, {"routing": "arrow", "arrow_top_k": 2})
    batch = random_batch(3, 6, seed=1, lengths=[6, 3, 4])
    routed = peft_smear.get_routing_weights(bank, **batch)
    mask = batch["attention_mask"].bool()
    mean = {name: weights[mask].double().mean(0) for name, weights in routed.items()}
    merge_experts(bank, tmp_path / "task", routing=[batch], combination_type="cat")
    merge_experts(bank, tmp_path / "mean", weights=mean, combination_type="cat")
    task, by_mean = saved_pairs(tmp_path / "task"), saved_pairs(tmp_path / "mean")
    for name in mean:
        torch.testing.assert_close(task[name][1] @ task[name][0], by_mean[name][1] @ by_mean[name][0])


# --- the written adapter -----------------------------------------------------------------------------------------


def test_the_merge_loads_without_peft_smear_and_gives_the_merged_update_s_logits(tmp_path):
    """Loaded by plain PEFT in a process where peft_smear cannot be imported, the merged LoRA gives the base model's
    logits with every layer's weight plus the explicit merged update (here PEFT's cat: sum_n w_n s B_n A_n)."""
    tiny_llama().save_pretrained(tmp_path / "base")
    model = trained_like_smear("llama")
    weights = [0.6, 0.3, 0.1]
    merge_experts(model, tmp_path / "lora", weights=weights, combination_type="cat")
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    batch = random_batch(2, 6, seed=7, lengths=[6, 4])
    loaded = logits_without_peft_smear(tmp_path / "base", tmp_path / "lora", batch, tmp_path)

    base = tiny_llama()
    with torch.no_grad():
        for name, layer in smear_layers(model).items():
            A_n, B_n = layer.smear_lora_A["default"], layer.smear_lora_B["default"]
            base.get_submodule(name).weight += sum(w * 2.0 * B_n[n] @ A_n[n] for n, w in enumerate(weights))
    torch.testing.assert_close(loaded, logits(base, batch), atol=1e-5, rtol=1e-5)


def test_the_card_says_what_was_merged_and_dare_is_seeded(tmp_path):
    adapters = save_adapters(tmp_path, count=2)
    bank = peft_smear.build_expert_bank(tiny_llama(), adapters)
    torch.manual_seed(5)
    untouched = torch.rand(3)
    torch.manual_seed(5)
    for name, seed in (("one", 3), ("again", 3), ("other", 4)):
        merge_experts(bank, tmp_path / name, weights=[1.0, 1.0], combination_type="dare_ties", density=0.5, seed=seed)
    assert torch.equal(torch.rand(3), untouched)  # the seed is the merge's own: torch's generator is left as it was
    read = {name: (tmp_path / name / "adapter_model.safetensors").read_bytes() for name in ("one", "again", "other")}
    assert read["one"] == read["again"] != read["other"]
    card = (tmp_path / "one" / "README.md").read_text()
    assert "`dare_ties` (density=0.5, majority_sign_method='total'), seed 3" in card
    assert "`a0` 1, `a1` 1" in card and "without peft_smear" in card and "merge_experts" in card


def test_an_existing_directory_needs_overwrite(tmp_path):
    model = trained_like_smear("llama")
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        merge_experts(model, tmp_path, expert=0)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
    merge_experts(model, tmp_path, expert=0, overwrite=True)
    assert not (tmp_path / "keep.txt").exists()


# --- bad input: one clear line, nothing written --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({}, ValueError, r"exactly one of weights=, routing= or expert= \(got none\)"),
        ({"weights": [1, 1, 1], "expert": 0}, ValueError, r"exactly one of .* \(got \['weights', 'expert'\]\)"),
        ({"weights": [1, 1, 1], "combination_type": "mean"}, ValueError, "combination_type must be one of"),
        ({"weights": [1, 1, 1], "combination_type": "ties"}, ValueError, "needs density, the share of values kept"),
        ({"weights": [1, 1, 1], "combination_type": "dare_linear", "density": 0}, ValueError, r"in \(0, 1\]"),
        ({"weights": [1, 1, 1], "density": 0.5}, ValueError, "'linear' does not use density"),
        ({"weights": [1, 1, 1], "combination_type": "svd", "majority_sign_method": "total"}, ValueError, "does not"),
        ({"weights": [1, 1, 1], "combination_type": "ties", "density": 0.5, "svd_rank": 2}, ValueError, "svd_rank"),
        (
            {"weights": [1, 1, 1], "combination_type": "ties", "density": 0.5, "majority_sign_method": "mean"},
            ValueError,
            "majority_sign_method must be 'total' or 'frequency'",
        ),
        ({"weights": [1, 1, 1], "combination_type": "svd", "svd_rank": 0}, ValueError, "svd_rank must be a positive"),
        ({"weights": [1, 1]}, ValueError, r"one weight per expert \(3\), got shape \(2,\)"),
        ({"weights": [1, float("nan"), 1]}, ValueError, "must be finite"),
        ({"weights": [0, 0, 0]}, ValueError, "Every expert's weight is 0 in"),
        ({"weights": {"sports": 1.0}}, ValueError, "weights keys must be the SMEAR layers' module names"),
        ({"weights": "uniform"}, TypeError, "weights must be a sequence of 3 numbers"),
        ({"expert": 3}, ValueError, r"an index in \[0, 3\), got 3"),
        ({"expert": "law"}, ValueError, "experts have no names: pass an index"),
        ({"expert": 0, "combination_type": "svd"}, ValueError, "expert= writes one expert exactly"),
        ({"routing": {"x": torch.ones(3)}}, TypeError, "routing= takes a task as an iterable of input batches"),
        ({"routing": []}, ValueError, "The task has no examples"),
        ({"weights": [1, 1, 1], "seed": 0.5}, ValueError, "seed must be an integer"),
        ({"weights": [1, 1, 1], "adapter_name": "other"}, ValueError, "No adapter named 'other'"),
    ],
)
def test_bad_input_is_one_clear_error_and_writes_nothing(arguments, error, message, tmp_path):
    model = trained_like_smear("llama")
    with pytest.raises(error, match=message) as raised:
        merge_experts(model, tmp_path / "out", **arguments)
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "out").exists()


def test_a_bank_s_expert_names_are_checked(tmp_path):
    bank = peft_smear.build_expert_bank(tiny_llama(), save_adapters(tmp_path, count=2))
    with pytest.raises(ValueError, match=r"No expert named 'a9'; the experts are \['a0', 'a1'\]"):
        merge_experts(bank, tmp_path / "out", expert="a9")
    with pytest.raises(ValueError, match=r"must give every expert a weight; missing \['a1'\]"):
        merge_experts(bank, tmp_path / "out", weights={"a0": 1.0})


def test_other_models_and_expert_kinds_are_refused(tmp_path):
    lora = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(TypeError, match="merge_experts needs a PeftModel with a SMEAR adapter, got PeftModel"):
        merge_experts(lora, tmp_path, weights=[1.0])
    config = SmearConfig(num_experts=2, expert_type="ia3", target_modules=["q_proj", "v_proj"])
    ia3 = get_peft_model(tiny_llama(), config)
    with pytest.raises(ValueError, match="merges LoRA experts; adapter 'default' has expert_type='ia3'"):
        merge_experts(ia3, tmp_path, weights=[1.0, 1.0])
