"""Every adapter the library writes gets a card that is right about it: each card's facts (its table, its metadata, its
code) are read back and checked against the model it came from, computed here independently (parameter counts by
summing ``numel``, routers' traits, saved tensors). Covered: a SMEAR adapter, a bank of existing adapters under each
bank router, a ``train`` run, ``export`` (one expert, a task's mean routing), ``export-tasks``, and ``save_emoe``."""

from __future__ import annotations

import configparser
import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from huggingface_hub import ModelCard
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import peft_smear
from conftest import random_batch, save_bank_inputs, save_tiny_encoder, tiny_bert, tiny_llama, write_task_files
from peft_smear import (
    ROUTERS,
    RoutingReport,
    SmearConfig,
    SmearLinear,
    build_expert_bank,
    cli,
    embed_texts,
    export_merged_adapter,
    train_phatgoose_gates,
)
from peft_smear.bank import BankRouter
from peft_smear.emoe import emoe_gates, load_emoe, moefy, save_emoe
from peft_smear.multitask import training
from peft_smear.saving.cards import SECTION_BEGIN


COUNTS = re.compile(r"^([\d,]+) of all ([\d,]+) \(([\d.]+)%\)$")


def read_card(directory: Path) -> tuple[ModelCard, dict[str, str]]:
    card = ModelCard.load(Path(directory) / "README.md")
    return card, dict(re.findall(r"^\| ([^|]+?) \| (.+?) \|$", card.text, flags=re.MULTILINE))


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def assert_counts_match(row: str, model: torch.nn.Module, printed: str | None = None) -> None:
    """The row is ``trainable of all total (percent%)``, as summed here, and as print_trainable_parameters prints."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    match = COUNTS.match(row)
    assert match, row
    assert (int(match[1].replace(",", "")), int(match[2].replace(",", ""))) == (trainable, total)
    assert match[3] == f"{100 * trainable / total:.4f}"
    if printed is not None:
        assert f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {match[3]}" in printed


def assert_no_local_base_model(card: ModelCard) -> None:
    """The Hub reads ``base_model`` as a model id: a local directory appears neither there nor in the tags."""
    assert card.data.base_model is None
    assert not any(tag.startswith("base_model:") for tag in card.data.tags or [])


def run_card_code(code: str, **names) -> dict:
    namespace = dict(names)
    exec(code, namespace)
    return namespace


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- a SMEAR adapter ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("routing", ["smear", "tag"])
def test_a_smear_adapters_card(tmp_path, capsys, routing):
    tiny_llama().save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    settings = {"num_tasks": 2} if routing == "tag" else {}
    config = peft_smear.SmearConfig(
        num_experts=3, r=2, routing=routing, target_modules=["q_proj", "o_proj"], task_type="CAUSAL_LM", **settings
    )
    model = get_peft_model(base, config)
    model.print_trainable_parameters()
    model.save_pretrained(tmp_path / "adapter")

    card, rows = read_card(tmp_path / "adapter")
    assert_no_local_base_model(card)
    layers = [m for m in model.modules() if isinstance(m, SmearLinear)]
    assert rows["experts per layer (N)"] == str(config.num_experts)
    assert rows["target modules"] == f"`o_proj`, `q_proj` ({len(layers)} layers)"
    assert_counts_match(rows["trainable parameters"], model, capsys.readouterr().out)
    assert "frozen adapter parameters" not in rows
    router = ROUTERS[routing]
    assert rows["routing"].startswith(f"`{routing}`: {router.describe(config)}")
    assert ("SMEAR paper compares with" in card.text) == (routing != "smear")
    for call_input in router.call_inputs:  # tag: how to give smear_task_ids, as code that runs
        assert f"Every call needs `{call_input.name}`" in card.text
        load, example = python_blocks(card.text)
        inputs = random_batch(2, 5)
        namespace = run_card_code(load + example, inputs=inputs)
        assert namespace["outputs"].logits.shape[:2] == (2, 5)

    # A Hub id is written as the base model, with PEFT's tag for it.
    model.peft_config["default"].base_model_name_or_path = "tiny-org/tiny-llama"
    (tmp_path / "hub").mkdir()
    model.create_or_update_model_card(str(tmp_path / "hub"))  # what save_pretrained calls, without a Hub lookup
    card, _ = read_card(tmp_path / "hub")
    assert card.data.base_model == "tiny-org/tiny-llama" and "base_model:adapter:tiny-org/tiny-llama" in card.data.tags


# --- a bank of existing adapters ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bank_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bank")
    adapters = save_bank_inputs(root, ("one", "two", "three"))
    save_tiny_encoder(root / "encoder")
    return root, adapters


def gate_batches(root: Path) -> list[dict[str, torch.Tensor]]:
    tokenizer = AutoTokenizer.from_pretrained(root / "base")
    rows = [json.loads(line) for line in (root / "data.jsonl").read_text().splitlines()]
    encoded = tokenizer([f"{row['prompt']} {row['response']}" for row in rows[:4]], return_tensors="pt", padding=True)
    return [{**encoded, "labels": encoded["input_ids"]}]


@pytest.mark.parametrize("routing", [name for name, router in ROUTERS.items() if issubclass(router, BankRouter)])
def test_a_banks_card(bank_inputs, tmp_path, routing):
    root, adapters = bank_inputs
    router = ROUTERS[routing]
    descriptions = {name: f"the task of expert {name}" for name in adapters}
    encoder = AutoModel.from_pretrained(root / "encoder").eval()
    encoder_tokenizer = AutoTokenizer.from_pretrained(root / "encoder")
    embeddings = embed_texts(list(descriptions.values()), encoder, encoder_tokenizer)
    bank = build_expert_bank(
        AutoModelForCausalLM.from_pretrained(root / "base"),
        adapters,
        {"routing": routing},
        descriptions=descriptions,
        embeddings=embeddings,
    )
    gated = any(name.endswith(".gate") for name, _ in bank.named_parameters())
    if gated:  # the first expert's gates only: the card must say the others' were never trained
        train_phatgoose_gates(bank, {"one": gate_batches(root)}, steps=2)
    bank.save_pretrained(tmp_path / "bank")

    card, rows = read_card(tmp_path / "bank")
    text = card.text
    assert_no_local_base_model(card)
    assert "SMEAR paper compares with" not in text and "a bank of existing, separately trained adapters" in text
    assert rows["experts"] == "`one`, `two`, `three`"
    assert "existing LoRA adapters (`one`, `two`, `three`), one per expert, frozen." in text
    assert rows["expert task descriptions"] == "; ".join(f"`{n}`: {d}" for n, d in descriptions.items())
    assert_counts_match(rows["trainable parameters"], bank)
    frozen = sum(p.numel() for n, p in bank.named_parameters() if ".smear_" in n and not p.requires_grad)
    assert rows["frozen adapter parameters"] == f"{frozen:,} (the experts: `freeze_experts`)"
    if router.per_token:  # each token on its own: not the averaged prompt
        assert (
            rows["router input"].startswith("each token's own hidden state") and "averaged" not in rows["router input"]
        )
    else:
        assert "averaged" in rows["router input"]
    if gated:
        gates = [p for n, p in bank.named_parameters() if n.endswith(".gate")]
        never = [i for i in range(3) if all(gate[i].abs().sum() == 0 for gate in gates)]
        assert [["one", "two", "three"][i] for i in never] == ["two", "three"]
        assert rows["untrained routing"].startswith("`two`, `three`: ")
    else:
        assert "untrained routing" not in rows

    # Every smear_* input the router reads: named, and computed by code that runs (the encoder filled in).
    assert [c.name for c in router.call_inputs] == (["smear_query_embeddings"] if routing.startswith("glider") else [])
    for call_input in router.call_inputs:
        assert f"Every call needs `{call_input.name}`" in rows["router input"] + text
        load, example = python_blocks(text)
        assert f"[batch, {embeddings.shape[1]}]" in example
        inputs = random_batch(2, 5)
        namespace = run_card_code(load + example.replace("ENCODER", str(root / "encoder")), inputs=inputs)
        expected_query = embed_texts([descriptions["one"]] * 2, encoder, encoder_tokenizer)
        torch.testing.assert_close(namespace["query"], expected_query)
        with torch.no_grad():
            reference = bank.eval()(**inputs, smear_query_embeddings=expected_query).logits
        torch.testing.assert_close(namespace["outputs"].logits, reference)


def test_build_banks_card_loads_the_output_directory(bank_inputs, tmp_path):
    """The bank is saved into a temporary directory first; its card's code must load the final one."""
    root, adapters = bank_inputs
    argv = ["build-bank", "--base-model", root / "base", "--output", tmp_path / "bank", "--routing", "tag"]
    argv += [arg for name, path in adapters.items() for arg in ("--adapter", f"{name}={path}")]
    assert cli.main([str(arg) for arg in argv]) == 0
    card, rows = read_card(tmp_path / "bank")
    load, _ = python_blocks(card.text)  # and how to give smear_task_ids
    assert f'PeftModel.from_pretrained(base, "{tmp_path / "bank"}")' in load
    namespace = run_card_code(load)
    assert namespace["model"].peft_config["default"].expert_names == list(adapters)
    assert_counts_match(rows["trainable parameters"], build_expert_bank(tiny_llama(), adapters, {"routing": "tag"}))


# --- export and export-tasks --------------------------------------------------------------------------------------


MEAN_UPDATE_GAP = (
    r" \(its update is [\d.]+% from the examples' mean update on average over the modules, [\d.]+% at most\)"
)


def assert_export_card_matches(directory: Path, routing_row: str, states_gap: bool = False) -> dict[str, str]:
    """``states_gap``: a mean-routing export's row ends with its measured distance to the mean update."""
    card, rows = read_card(directory)
    config = json.loads((directory / "adapter_config.json").read_text())
    assert_no_local_base_model(card)
    assert config["peft_type"] == "LORA" and "lora" in card.data.tags and card.data.library_name == "peft"
    assert rows["adapter"] == f"`peft_type: LORA`, PEFT LoRA, r={config['r']}, lora_alpha={config['lora_alpha']:g}"
    assert rows["target modules"].endswith(f"({len(config['target_modules'])} layers)")
    saved = sum(tensor.numel() for tensor in load_file(directory / "adapter_model.safetensors").values())
    assert rows["parameters"] == f"{saved:,}"
    assert re.fullmatch(re.escape(routing_row) + (MEAN_UPDATE_GAP if states_gap else ""), rows["routing merged"])
    assert "loads with plain PEFT, without peft_smear" in card.text
    return rows


def test_exports_cards(bank_inputs, tmp_path):
    root, adapters = bank_inputs
    bank = tmp_path / "bank"
    argv = ["build-bank", "--base-model", root / "base", "--output", bank, "--routing", "smear"]
    argv += [arg for name, path in adapters.items() for arg in ("--adapter", f"{name}={path}")]
    assert cli.main([str(arg) for arg in argv]) == 0
    export = ["export", "--base-model", root / "base", "--adapter", bank]

    assert cli.main([str(arg) for arg in [*export, "--output", tmp_path / "two", "--expert", "1"]]) == 0
    assert_export_card_matches(tmp_path / "two", "expert 1 (`two`) of every layer: that expert alone, exactly")
    card, rows = read_card(tmp_path / "two")
    assert (
        rows["exported from"] == f"`{bank}`: 3 LoRA experts per layer, routing `smear`, experts `one`, `two`, `three`"
    )
    (load,) = python_blocks(card.text)
    loaded = run_card_code(load.replace("# model = model.merge", "model = model.merge"))["model"]
    reference = PeftModel.from_pretrained(tiny_llama(), adapters["two"]).eval()
    batch = random_batch(2, 5)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, reference(**batch).logits, atol=1e-5, rtol=1e-5)
    trainable = PeftModel.from_pretrained(tiny_llama(), tmp_path / "two", is_trainable=True)
    assert rows["parameters"] == f"{sum(p.numel() for p in trainable.parameters() if p.requires_grad):,}"

    rows_of_a = [{"text": f"w{i} w{i + 1}", "task": "a" if i % 3 else "b"} for i in range(2, 30)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows_of_a))
    task_argv = [*export, "--output", tmp_path / "a", "--task-data", tmp_path / "data.jsonl", "--task", "a"]
    assert cli.main([str(arg) for arg in task_argv]) == 0
    examples = sum(row["task"] == "a" for row in rows_of_a)
    routing_row = f"the mean routing of {examples} examples of task `a`, fixed: the merged expert of that routing"
    assert_export_card_matches(tmp_path / "a", routing_row, states_gap=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A ``train`` run, the SMEAR model it trained, and what the run printed."""
    root = tmp_path_factory.mktemp("train")
    save_tiny_encoder(root / "encoder")
    files = [arg for name, path in write_task_files(root).items() for arg in ("--task-file", f"{name}={path}")]
    built, printed = [], io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(training, "get_peft_model", lambda *a, **k: built.append(get_peft_model(*a, **k)) or built[-1])
        argv = ["train", "--model", root / "encoder", *files, "--num-experts", 3, "--r", 2, "--steps", 2]
        argv += ["--batch-size", 8, "--eval-every", 2, "--max-length", 16, "--output-dir", root / "run"]
        assert cli.main([str(arg) for arg in argv]) == 0
    return root / "run", built[0], printed.getvalue()


def test_a_train_runs_card(run):
    run_dir, model, printed = run
    card, rows = read_card(run_dir)
    assert "## Test metrics" in card.text and "frozen baseline" not in printed  # its own encoder: no baseline
    assert_no_local_base_model(card)  # the encoder is a local directory
    assert_counts_match(rows["trainable parameters"], model, printed)
    assert rows["trained in full"] == "`heads`"
    assert rows["experts per layer (N)"] == "3"
    assert rows["target modules"].endswith(f"({sum(isinstance(m, SmearLinear) for m in model.modules())} layers)")
    (load,) = [block for block in python_blocks(card.text) if "model =" in block]
    pasted = subprocess.run(
        [sys.executable, "-c", load + "\nprint(type(model).__name__)"], capture_output=True, text=True
    )
    assert pasted.returncode == 0 and pasted.stdout.split() == ["PeftModel"], pasted.stderr[-3000:]


def test_export_tasks_cards(run, tmp_path):
    run_dir, _, _ = run
    assert cli.main(["export-tasks", "--run", str(run_dir), "--output", str(tmp_path), "--batch-size", "8"]) == 0
    batches = training.run_batches(run_dir, "validation", 8)
    for task in ("topic", "count"):
        examples = sum(batch["input_ids"].shape[0] for batch in batches[task])
        routing_row = (
            f"the mean routing of {examples} examples of task `{task}` (validation split), fixed: the merged expert "
            "of that routing"
        )
        rows = assert_export_card_matches(tmp_path / task, routing_row, states_gap=True)
        assert rows["trained in full"] == "`heads`"
        card, _ = read_card(tmp_path / task)
        (load,) = python_blocks(card.text)
        assert isinstance(run_card_code(load)["model"], PeftModel)


# --- EMoE ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lora", "smear"])
def test_an_emoe_directorys_card_says_load_emoe_comes_first(tmp_path, kind):
    tiny_llama().save_pretrained(tmp_path / "base")
    base = moefy(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), num_experts=8, top_k=3, layers=[1], seed=0)
    if kind == "lora":
        config = LoraConfig(r=2, target_modules=["q_proj", "up_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
    else:
        config = peft_smear.SmearConfig(num_experts=2, r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(base, config).eval()
    model.save_pretrained(tmp_path / "run")
    save_emoe(model, tmp_path / "run")
    model.save_pretrained(tmp_path / "run")  # saving again keeps the section

    text = (tmp_path / "run" / "README.md").read_text()
    assert text.count("## EMoE") == 1 and (text.count(SECTION_BEGIN) == 1) == (kind == "smear")
    gates = emoe_gates(model)
    (gate,) = gates.values()
    assert f"the neurons of 1 FFN (`{next(iter(gates))}`) in {gate.num_experts} experts each" in text
    assert f"of which every token uses {gate.top_k}" in text
    emoe_code = next(code for code in python_blocks(text) if "load_emoe" in code)
    assert emoe_code.index("emoe.load_emoe(") < emoe_code.index("PeftModel.from_pretrained(")
    batch = random_batch(2, 6)
    with torch.no_grad():
        expected = model(**batch).logits
        torch.testing.assert_close(run_card_code(emoe_code)["model"].eval()(**batch).logits, expected)
    assert load_emoe  # the function the card names is the package's


def test_save_emoe_without_an_adapter_makes_a_card(tmp_path):
    model = moefy(tiny_llama(), num_experts=8, top_k=3, layers=[0], seed=0)
    save_emoe(model, tmp_path)
    card = ModelCard.load(tmp_path / "README.md")
    assert "emoe" in card.data.tags and "## EMoE" in card.text
    assert "base = emoe.load_emoe(base, " in card.text and "PeftModel" not in card.text


# --- every card's code, pasted as a reader would ------------------------------------------------------------------


PASTED = """
import json, sys, torch
exec(open(sys.argv[1]).read())
batch = json.loads(sys.argv[2])
with torch.no_grad():
    logits = model.eval()(**{key: torch.tensor(value) for key, value in batch.items()}).logits
torch.save(logits, sys.argv[3])
"""


def smear_lm(base: Path, **settings):
    config = peft_smear.SmearConfig(num_experts=3, r=2, target_modules=["q_proj", "o_proj"], **settings)
    return get_peft_model(AutoModelForCausalLM.from_pretrained(base), config).eval()


def write_smear_card(base: Path, out: Path):
    model = smear_lm(base, task_type="CAUSAL_LM")
    model.save_pretrained(out)
    return model


def write_export_card(base: Path, out: Path):
    model = smear_lm(base, task_type="CAUSAL_LM")
    peft_smear.export_merged_adapter(model, out, routing=[random_batch(4, 5)])  # its logits: tests/test_export.py


def write_merge_card(base: Path, out: Path):
    peft_smear.merge_experts(smear_lm(base, task_type="CAUSAL_LM"), out, weights=[0.5, 0.3, 0.2])


def write_emoe_card_on_a_classifier(base: Path, out: Path):
    """A classifier's EMoE with a SMEAR adapter that names no task type: the card must load the classifier."""
    tiny_bert().save_pretrained(base.parent / "classifier")
    classifier = AutoModelForSequenceClassification.from_pretrained(base.parent / "classifier")
    moefy(classifier, num_experts=8, top_k=3, layers=[1], seed=0)
    config = peft_smear.SmearConfig(num_experts=2, r=2, target_modules=["query"], modules_to_save=["classifier"])
    model = get_peft_model(classifier, config).eval()
    model.save_pretrained(out)
    save_emoe(model, out)
    return model


CARD_WRITERS = {
    "smear adapter": write_smear_card,
    "export": write_export_card,
    "merge": write_merge_card,
    "emoe on a classifier": write_emoe_card_on_a_classifier,
}


@pytest.mark.parametrize("card", CARD_WRITERS)
def test_every_cards_code_runs_as_pasted(tmp_path, card):
    """The first Python block of each card, run on its own in a fresh process, loads a model that runs, and it is
    the model that was saved (for what was saved as it is: a SMEAR adapter, an EMoE model)."""
    tiny_llama().save_pretrained(tmp_path / "base")
    saved = CARD_WRITERS[card](tmp_path / "base", tmp_path / "out")
    code = next(block for block in python_blocks((tmp_path / "out" / "README.md").read_text()) if "model =" in block)
    (tmp_path / "card.py").write_text(code)
    (tmp_path / "paste.py").write_text(PASTED)
    batch = random_batch(2, 5)
    result = subprocess.run(
        [
            sys.executable,
            tmp_path / "paste.py",
            tmp_path / "card.py",
            json.dumps({k: v.tolist() for k, v in batch.items()}),
            tmp_path / "logits.pt",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if isinstance(saved, torch.nn.Module):
        with torch.no_grad():
            torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), saved(**batch).logits)


def test_the_card_templates_ship_with_the_package():
    """A non-editable install has every template: setup.cfg's package data names them all."""
    setup = configparser.ConfigParser()
    setup.read(Path(__file__).parents[1] / "setup.cfg")
    globs = setup["options.package_data"]["peft_smear"].split()
    package = Path(peft_smear.__file__).parent
    templates = sorted(path.relative_to(package) for path in (package / "saving" / "templates").iterdir())
    assert templates and all(any(template.match(pattern) for pattern in globs) for template in templates)


def test_card_text_says_where_peft_smear_comes_from_and_names_the_source_once(tmp_path):
    """Every card said `pip install peft-smear`, which fails (the package is not on the index); an export without
    ``source=`` read "from a SMEAR adapter, a SMEAR adapter"."""
    model = get_peft_model(tiny_llama(), SmearConfig(num_experts=2, r=2))
    model.save_pretrained(tmp_path / "adapter")
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert "pip install peft-smear\n" not in card and "peft-smear is not on the Python package index" in card
    assert "pypi.org/project/peft-smear" not in card
    layers = [n for n, m in model.base_model.model.named_modules() if isinstance(m, SmearLinear)]
    export_merged_adapter(model, tmp_path / "export", routing={name: torch.tensor([1.0, 0.0]) for name in layers})
    exported = (tmp_path / "export" / "README.md").read_text()
    assert "a SMEAR adapter, a" not in exported and "`export_merged_adapter` from a [SMEAR](" in exported
    report = RoutingReport(["a"], layers, [3], np.full((1, len(layers), 2), 0.5), np.array([0.69]))
    assert "held-out" not in report.table()  # EMoE's selection report routes the batches a user passes
