"""A task's exact mean update: ``form="mean_update"`` of export_merged_adapter, its SVD truncation (``rank``), and the
``--form`` / ``--rank`` options of ``peft-smear export``.

Every reference here is computed independently of the export: each example's own merged expert
``scaling * B(p_b) A(p_b)`` built by explicit sums, averaged by a loop; singular values from ``torch.linalg.svdvals``
of that explicit matrix.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file

import peft_smear
from conftest import BUILDERS, random_batch, tiny_llama, tiny_tokenizer
from peft_smear import SmearConfig, SmearLinear, cli, export_merged_adapter


EXPERTS, RANK = 3, 4
LENGTHS = [[7, 5, 3, 6], [4, 7, 2, 5], [6, 3, 7, 7]]


def smear_model(arch: str = "llama", **overrides):
    """A SMEAR model whose routers send different examples to different mixtures, as after training."""
    build, task_type = BUILDERS[arch]
    settings = {"num_experts": EXPERTS, "r": RANK, "lora_alpha": 8, "init_weights": False, "task_type": task_type}
    settings.setdefault("target_modules", "all-linear")
    model = get_peft_model(build(), SmearConfig(**{**settings, **overrides})).eval()
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad and "router" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 2.0)
    return model


def task_batches() -> list[dict[str, torch.Tensor]]:
    return [random_batch(4, 7, seed=seed, lengths=lengths) for seed, lengths in enumerate(LENGTHS)]


def examples(batches):
    """Each example of the batches alone, without its padding."""
    for batch in batches:
        for row in range(batch["input_ids"].shape[0]):
            length = int(batch["attention_mask"][row].sum())
            yield {key: value[row : row + 1, :length] for key, value in batch.items()}


def smear_layers(model) -> dict[str, SmearLinear]:
    return {name: m for name, m in model.base_model.model.named_modules() if isinstance(m, SmearLinear)}


def average_updates(model, batches) -> dict[str, torch.Tensor]:
    """Per layer, in float64: the mean over the examples of each one's own ``scaling * B(p_b) A(p_b)``, example by
    example (routed in their batches, as the export routes them: routed alone, an example's routing differs in the
    last float32 digits)."""
    layers = smear_layers(model)
    totals, count = {}, 0
    for batch in batches:
        routing = peft_smear.get_routing_weights(model, **batch)
        for row in range(batch["input_ids"].shape[0]):
            for name, layer in layers.items():
                p = routing[name][row].double()
                A = sum(p[n] * layer.smear_lora_A["default"][n].double() for n in range(EXPERTS))
                B = sum(p[n] * layer.smear_lora_B["default"][n].double() for n in range(EXPERTS))
                update = layer.expert_kind["default"].scaling * B @ A
                totals[name] = totals.get(name, 0) + update
            count += 1
    return {name: total.detach() / count for name, total in totals.items()}


def exported_updates(directory) -> dict[str, torch.Tensor]:
    """Per module, the update ``scaling * B A`` of a saved PEFT LoRA adapter, with PEFT's scaling, in float64."""
    config = json.loads((directory / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / (math.sqrt(config["r"]) if config["use_rslora"] else config["r"])
    weights = load_file(directory / "adapter_model.safetensors")
    updates = {}
    for key, lora_A in weights.items():
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            lora_B = weights[key.replace(".lora_A.", ".lora_B.")]
            updates[module] = scaling * lora_B.double() @ lora_A.double()
    return updates


def relative(update: torch.Tensor, reference: torch.Tensor) -> float:
    return ((update - reference).norm() / reference.norm()).item()


# --- the exact mean update ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("llama", {}), ("llama", {"use_rslora": True, "lora_alpha": 6}), ("gpt2", {})],
    ids=["llama", "llama-rslora", "gpt2-conv1d"],
)
def test_exact_mean_update_is_the_average_of_the_examples_own_updates(arch, overrides, tmp_path):
    model = smear_model(arch, **overrides)
    batches = task_batches()
    expected = average_updates(model, batches)
    config = export_merged_adapter(model, tmp_path / "exact", routing=iter(batches), form="mean_update")
    assert config.r == EXPERTS * RANK and config.energy_kept == dict.fromkeys(expected, 1.0)
    updates = exported_updates(tmp_path / "exact")
    assert updates.keys() == expected.keys()
    for name, average in expected.items():
        assert relative(updates[name], average) <= 1e-6, name

    # Vanilla PEFT loads it, and every LoRA layer computes W x + (the average update) x.
    loaded = PeftModel.from_pretrained(BUILDERS[arch][0](), tmp_path / "exact").eval()
    assert type(loaded.peft_config["default"]).__name__ == "LoraConfig"
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, module in loaded.base_model.model.named_modules():
            if name not in expected:
                continue
            base = module.get_base_layer()
            x = torch.randn(3, expected[name].shape[1], generator=generator)
            wanted = base(x).double() + x.double() @ expected[name].T
            assert (module(x).double() - wanted).abs().max() <= 1e-5 * (1 + wanted.abs().max()), name


def test_mean_update_differs_from_the_mean_routing_by_the_routing_covariance(tmp_path):
    model = smear_model()
    batches = task_batches()
    expected = average_updates(model, batches)
    export_merged_adapter(model, tmp_path / "mean_routing", routing=batches)
    mean_routing = exported_updates(tmp_path / "mean_routing")
    assert max(relative(mean_routing[name], average) for name, average in expected.items()) > 1e-3


def test_one_example_and_one_expert_exports_are_the_same_in_both_forms(tmp_path):
    model = smear_model()
    example = next(examples(task_batches()))
    one_example = peft_smear.get_routing_weights(model, **example)
    one_expert = {name: torch.eye(EXPERTS)[1] for name in one_example}
    for label, routing in (("example", one_example), ("expert", one_expert)):
        export_merged_adapter(model, tmp_path / f"{label}-routing", routing=routing)
        config = export_merged_adapter(model, tmp_path / f"{label}-update", routing=routing, form="mean_update")
        assert config.r == RANK and config.energy_kept is None
        ours = load_file(tmp_path / f"{label}-update" / "adapter_model.safetensors")
        theirs = load_file(tmp_path / f"{label}-routing" / "adapter_model.safetensors")
        assert all(torch.equal(ours[key], theirs[key]) for key in theirs) and ours.keys() == theirs.keys()


def test_one_expert_adapter_is_its_own_mean_update(tmp_path):
    """With a single expert S = [[1]]: both forms are that expert, at its rank."""
    model = smear_model(num_experts=1, routing="single")
    batches = task_batches()
    export_merged_adapter(model, tmp_path / "routing", routing=batches)
    export_merged_adapter(model, tmp_path / "update", routing=batches, form="mean_update")
    ours, theirs = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("update", "routing"))
    assert all(torch.allclose(ours[key], theirs[key], atol=1e-7, rtol=0) for key in theirs)
    assert json.loads((tmp_path / "update" / "adapter_config.json").read_text())["r"] == RANK


# --- truncation --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [1, 5, EXPERTS * RANK])
def test_truncation_keeps_the_top_singular_values_and_reports_their_energy(rank, tmp_path):
    model = smear_model(use_rslora=True)
    batches = task_batches()
    expected = average_updates(model, batches)
    config = export_merged_adapter(model, tmp_path / "lora", routing=batches, form="mean_update", rank=rank)
    saved = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert config.r == saved["r"] == rank and "energy_kept" not in saved
    updates = exported_updates(tmp_path / "lora")
    for name, average in expected.items():
        sigma = torch.linalg.svdvals(average)
        energy = (sigma[:rank].square().sum() / sigma.square().sum()).item()
        assert config.energy_kept[name] == pytest.approx(energy, abs=1e-6), name
        assert torch.linalg.matrix_rank(updates[name], rtol=1e-6) <= rank
        # Eckart-Young: the best rank-k approximation misses exactly the energy it drops.
        assert relative(updates[name], average) == pytest.approx(math.sqrt(max(1 - energy, 0)), abs=1e-5), name
    if rank == EXPERTS * RANK:
        assert set(config.energy_kept.values()) == {1.0}
        export_merged_adapter(model, tmp_path / "exact", routing=batches, form="mean_update")
        exact = exported_updates(tmp_path / "exact")
        assert all(relative(updates[name], exact[name]) <= 1e-6 for name in exact)
    else:
        assert min(config.energy_kept.values()) < 1
    card = (tmp_path / "lora" / "README.md").read_text()
    assert f"truncated by SVD to rank {rank}" in card and "## Energy kept per module" in card
    first = next(iter(config.energy_kept))
    assert f"| `{first}` | {config.energy_kept[first]:.4%} |" in card


def test_truncated_export_loads_in_vanilla_peft_with_its_update(tmp_path):
    model = smear_model()
    batches = task_batches()
    export_merged_adapter(model, tmp_path / "lora", routing=batches, form="mean_update", rank=2)
    updates = exported_updates(tmp_path / "lora")
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "lora").eval()
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    module = loaded.base_model.model.model.layers[1].self_attn.o_proj
    with torch.no_grad():
        wanted = module.get_base_layer()(x).double() + x.double() @ updates["model.layers.1.self_attn.o_proj"].T
        assert (module(x).double() - wanted).abs().max() <= 1e-5


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"form": "mean_update", "rank": 13}, "rank 13 is more than the exact mean update's rank, num_experts * r"),
        ({"form": "mean_update", "rank": 0}, "rank must be a positive integer, got 0"),
        ({"form": "mean_update", "rank": True}, "rank must be a positive integer, got True"),
        ({"form": "mean_update", "rank": 2.0}, "rank must be a positive integer, got 2.0"),
        ({"rank": 4}, "rank truncates the mean update: it needs form mean_update, not 'mean_routing'"),
        ({"form": "exact"}, "form must be one of mean_routing, mean_update, got 'exact'"),
    ],
)
def test_bad_form_or_rank_is_refused_before_routing(settings, message, tmp_path):
    model = smear_model()

    def batches():
        raise AssertionError("routed before the settings were checked")
        yield

    with pytest.raises(ValueError, match=re.escape(message)):
        export_merged_adapter(model, tmp_path / "out", routing=batches(), **settings)
    assert not (tmp_path / "out").exists()


def test_rank_of_a_fixed_routing_is_refused(tmp_path):
    model = smear_model()
    one_expert = {name: torch.eye(EXPERTS)[0] for name in smear_layers(model)}
    with pytest.raises(ValueError, match="rank truncates a task's mean update; one expert, one example or a fixed"):
        export_merged_adapter(model, tmp_path / "out", routing=one_expert, form="mean_update", rank=2)
    assert not (tmp_path / "out").exists()


# --- other expert kinds ------------------------------------------------------------------------------------------


def test_ia3_mean_update_is_its_mean_routing_exactly(tmp_path):
    model = smear_model(expert_type="ia3", r=8, lora_alpha=8, target_modules=None)
    batches = task_batches()
    export_merged_adapter(model, tmp_path / "routing", routing=batches)
    config = export_merged_adapter(model, tmp_path / "update", routing=batches, form="mean_update")
    assert type(config).__name__ == "IA3Config" and config.energy_kept is None
    ours, theirs = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("update", "routing"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in theirs)
    assert "linear in their parameters" in (tmp_path / "update" / "README.md").read_text()
    with pytest.raises(ValueError, match="rank applies to LoRA experts; the mean update of"):
        export_merged_adapter(model, tmp_path / "ranked", routing=batches, form="mean_update", rank=2)


def test_bottleneck_adapter_mean_update_is_refused_in_one_line(tmp_path):
    model = smear_model(expert_type="adapter", adapter_width=4, r=8, lora_alpha=8, target_modules=None)
    with pytest.raises(ValueError, match="form mean_update is refused for bottleneck adapter experts") as refused:
        export_merged_adapter(model, tmp_path / "out", routing=task_batches(), form="mean_update")
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()
    # One expert is the same in both forms, for every kind.
    one_expert = {name: torch.eye(EXPERTS)[2] for name in smear_layers(model)}
    export_merged_adapter(model, tmp_path / "expert", routing=one_expert, form="mean_update")


# --- the command line --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A base model directory (with tokenizer), a SMEAR adapter directory, the SMEAR model and a task data file."""
    root = tmp_path_factory.mktemp("cli")
    tiny_llama().save_pretrained(root / "base")
    tiny_tokenizer().save_pretrained(root / "base")
    model = smear_model()
    model.save_pretrained(root / "adapter")
    texts = ["w3 w5 w7 w9", "w11 w13", "w15 w17 w19 w21 w23", "w60 w70 w80"]
    (root / "task.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    tokenizer = tiny_tokenizer()
    batches = [dict(tokenizer(texts[i : i + 2], padding=True, return_tensors="pt")) for i in (0, 2)]
    return root, model, batches


def export(root, output, *options) -> int:
    """``peft-smear export``'s exit code, usage errors (which exit in argparse) included."""
    paths = ["--base-model", root / "base", "--adapter", root / "adapter", "--output", output]
    try:
        return cli.main(["export", *map(str, paths), *map(str, options)])
    except SystemExit as exited:
        return exited.code


@pytest.mark.parametrize("rank", [None, 3])
def test_cli_form_and_rank_equal_the_python_export(saved, rank, tmp_path, capsys):
    root, model, batches = saved
    ranked = [] if rank is None else ["--rank", rank]
    options = ["--task-data", root / "task.jsonl", "--batch-size", 2, "--form", "mean_update", *ranked]
    assert export(root, tmp_path / "cli", *options) == 0
    out = capsys.readouterr().out
    assert "routing: the mean update of 4 examples" in out
    if rank is None:
        assert f"form: the mean update, exactly, as a LoRA of rank {EXPERTS * RANK}" in out
    else:
        assert "form: the mean update truncated to rank 3, keeping " in out and "at least (model.layers." in out
    export_merged_adapter(model, tmp_path / "python", routing=batches, form="mean_update", rank=rank)
    ours, theirs = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("cli", "python"))
    assert ours.keys() == theirs.keys()
    assert max((ours[key] - theirs[key]).abs().max().item() for key in ours) <= 1e-6
    assert json.loads((tmp_path / "cli" / "adapter_config.json").read_text())["r"] == (rank or EXPERTS * RANK)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--form", "mean_update", "--rank", "13"], "--rank 13 is more than the exact mean update's rank"),
        (["--form", "mean_update", "--rank", "0"], "argument --rank: must be an integer >= 1, got '0'"),
        (["--form", "mean_update", "--rank", "two"], "argument --rank: must be an integer >= 1, got 'two'"),
        (["--rank", "4"], "--rank truncates the mean update: it needs --form mean_update"),
        (["--form", "exact"], "argument --form: invalid choice: 'exact'"),
    ],
)
def test_cli_bad_form_or_rank_is_one_line(saved, options, message, tmp_path, capsys):
    root, _, _ = saved
    code = export(root, tmp_path / "out", "--task-data", root / "task.jsonl", *options)
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_cli_rank_with_one_expert_is_refused(saved, tmp_path, capsys):
    root, _, _ = saved
    assert export(root, tmp_path / "out", "--expert", 1, "--form", "mean_update", "--rank", 2) == 2
    err = capsys.readouterr().err
    assert "--rank truncates a task's mean update" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    assert export(root, tmp_path / "same", "--expert", 1, "--form", "mean_update") == 0  # the same in both forms


def test_a_mean_routing_export_reports_its_measured_gap_to_the_mean_update(tmp_path):
    """The card of a task's mean-routing export states, per module, how far its update is from the task's mean
    update: the relative Frobenius distance, checked here against the explicit matrices."""
    model = smear_model()
    batches = task_batches()
    config = export_merged_adapter(model, tmp_path / "task", routing=batches)
    expected = average_updates(model, batches)
    exported = exported_updates(tmp_path / "task")
    card = (tmp_path / "task" / "README.md").read_text()
    assert "## Gap to the task's mean update, per module" in card
    gaps = dict(re.findall(r"\| `([\w.]+)` \| ([\d.]+)% \|", card))
    assert config.peft_type == "LORA" and set(gaps) == set(expected)
    for name, update in expected.items():
        explicit = float((exported[name] - update).norm() / update.norm())
        assert explicit > 1e-3, "the routers make the task's examples differ, so the mean routing is not exact"
        assert float(gaps[name]) == pytest.approx(100 * explicit, abs=0.006), name  # the card rounds to 0.01%
