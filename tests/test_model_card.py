"""The SMEAR model card: save_pretrained writes one that names the method and its settings and whose load snippet runs;
a user's card is kept and amended, once however often it is saved; other PEFT methods keep PEFT's card; a routing
report next to the adapter adds the per-task table and the heatmap."""

from __future__ import annotations

import re

import numpy as np
import peft
import pytest
import torch
from huggingface_hub import ModelCard
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Trainer, TrainingArguments

import peft_smear
from conftest import random_batch, tiny_bert, tiny_llama
from peft_smear import write_model_card
from peft_smear.multitask.report import RoutingReport
from peft_smear.saving.cards import SECTION_BEGIN


SMEAR_TAGS = {"peft", "smear", "mixture-of-experts", "peft-smear"}


def smear_llama(tmp_path, **options):
    tiny_llama().save_pretrained(tmp_path / "base")
    settings = {"num_experts": 4, "init_weights": False, "task_type": "CAUSAL_LM", **options}
    if settings.get("expert_type", "lora") == "lora":
        settings.setdefault("r", 2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    return get_peft_model(model, peft_smear.SmearConfig(**settings)).eval()


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def table(text: str) -> dict[str, str]:
    """The two-column ``| key | value |`` rows of the card's adapter table."""
    return dict(re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|$", text, flags=re.MULTILINE))


def test_a_new_card_describes_the_adapter_and_its_load_snippet_runs(tmp_path):
    model = smear_llama(tmp_path, num_experts=3, r=2, target_modules=["q_proj", "o_proj"])
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # before save: the adapter trains
    total = sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp_path / "adapter")

    card = ModelCard.load(tmp_path / "adapter" / "README.md")
    assert set(card.data.tags) >= SMEAR_TAGS
    # The Hub reads base_model as a model id: a local directory is left out of the metadata, and out of the tags.
    assert card.data.library_name == "peft" and card.data.base_model is None
    assert not any(tag.startswith("base_model:") for tag in card.data.tags)
    assert card.text.startswith("# SMEAR adapter for a `llama` model")
    text = card.text
    assert "https://arxiv.org/abs/2306.03745" in text and "peft-smear is not on the Python package index" in text
    rows = table(text)
    assert rows["experts per layer (N)"] == "3"
    assert rows["expert"] == "`lora`: LoRA, rank r=2, alpha 8"
    assert rows["routing"].startswith("`smear`: ")
    assert rows["router input"].startswith("`auto`: `prompt`, ")
    against = "load-balancing weight 0.01, temperature 1, uniform warm-up 0 training calls"  # the library's defaults
    assert rows["against router collapse"] == against
    assert rows["target modules"] == "`o_proj`, `q_proj` (4 layers)"
    assert rows["trainable parameters"] == f"{trainable:,} of all {total:,} ({100 * trainable / total:.4f}%)"
    assert "Framework versions" in text and f"- peft-smear {peft_smear.__version__}" in text

    (snippet,) = python_blocks(text)
    assert "import peft_smear" in snippet and "PeftModel.from_pretrained(base" in snippet
    batch = random_batch(2, 5)
    with torch.no_grad():
        expected = model(**batch).logits
        for code, loaded_class in (
            (snippet, "PeftModelForCausalLM"),
            (snippet.replace("# or, in one step: ", ""), "PeftModelForCausalLM"),  # AutoPeftModelForCausalLM's
        ):
            namespace: dict = {}
            exec(code, namespace)
            loaded = namespace["model"].eval()
            assert type(loaded).__name__ == loaded_class and torch.equal(loaded(**batch).logits, expected)


def test_a_users_card_is_kept_and_amended_once_however_often_it_is_saved(tmp_path):
    model = smear_llama(tmp_path)
    directory = tmp_path / "adapter"
    directory.mkdir()
    user_card = "---\nlicense: mit\ntags:\n- my-tag\n---\n\n# My adapter\n\nMy own words about it.\n"
    (directory / "README.md").write_text(user_card)
    model.save_pretrained(directory)
    first = (directory / "README.md").read_text()
    model.save_pretrained(directory)
    second = (directory / "README.md").read_text()

    assert first == second
    card = ModelCard(second)
    assert card.data.license == "mit" and {"my-tag", *SMEAR_TAGS} <= set(card.data.tags)
    assert card.text.index("# My adapter") < card.text.index("My own words about it.") < card.text.index(SECTION_BEGIN)
    assert card.text.count(SECTION_BEGIN) == 1 and card.text.count("pip install ./peft-smear") == 1
    versions = f"### Framework versions\n\n- peft-smear {peft_smear.__version__}\n- PEFT {peft.__version__}\n"
    assert card.text.count(versions) == 1 and card.text.count("### Framework versions") == 1


def test_other_peft_methods_keep_pefts_card(tmp_path):
    model = get_peft_model(tiny_llama(), LoraConfig(r=2, task_type="CAUSAL_LM"))
    model.save_pretrained(tmp_path)
    card = ModelCard.load(tmp_path / "README.md")
    assert SECTION_BEGIN not in card.text and "smear" not in card.data.tags and "lora" in card.data.tags
    with pytest.raises(TypeError, match="active adapter is SMEAR, got PeftModelForCausalLM"):
        write_model_card(model, tmp_path)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"routing": "top_k", "top_k": 2}, {"routing": "`top_k`: the 2 most probable expert(s) run"}),
        (
            {"expert_type": "adapter", "adapter_width": 4, "adapter_layer_norm": True},
            {"expert": "`adapter`: bottleneck adapter, width 4, swish activation, LayerNorm on its output"},
        ),
        ({"expert_type": "ia3"}, {"expert": "`ia3`: (IA)³ scaling vector (input features of `down_proj`)"}),
        ({"routing": "tag", "num_tasks": 4}, {"router input": "no learned router"}),
        (
            {"routing": "ensemble", "router_temperature": 2.0, "router_warmup_steps": 5},
            {"against router collapse": "load-balancing weight 0, temperature 2, uniform warm-up 5 training calls"},
        ),
    ],
)
def test_the_card_describes_other_kinds_and_methods(tmp_path, options, expected):
    model = smear_llama(tmp_path, **{"init_weights": True, **options})
    model.save_pretrained(tmp_path / "adapter")
    text = (tmp_path / "adapter" / "README.md").read_text()
    rows = table(text)
    for key, start in expected.items():
        assert rows[key].startswith(start), rows[key]
    if options.get("routing", "smear") != "smear":
        assert "instead of SMEAR's merging" in text
    assert ("smear_task_ids" in text) == (options.get("routing") == "tag")
    assert ("against router collapse" in rows) == (options.get("routing", "smear") in ("smear", "ensemble", "top_k"))


def test_a_routing_report_adds_the_per_task_table_and_the_heatmap(tmp_path):
    pytest.importorskip("matplotlib")
    base = AutoModelForSequenceClassification
    tiny_bert().save_pretrained(tmp_path / "base")
    model = get_peft_model(
        base.from_pretrained(tmp_path / "base"),
        peft_smear.SmearConfig(num_experts=3, r=2, init_weights=False, router_init_std=1.0, task_type="SEQ_CLS"),
    ).eval()
    report = RoutingReport.collect(
        model, {"alpha": [random_batch(3, 6, seed=1)], "beta": [random_batch(5, 6, seed=2)]}
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # experts, routers, the head's copy
    total = sum(p.numel() for p in model.parameters())
    directory = tmp_path / "run"
    model.save_pretrained(directory)
    report.save_json(directory / "routing.json")
    report.save_heatmaps(directory / "routing.png")
    write_model_card(model, directory, usage="model = load_the_run()")

    text = (directory / "README.md").read_text()
    assert text.count(SECTION_BEGIN) == 1 and python_blocks(text) == ["model = load_the_run()\n"]
    counts = f"{trainable:,} of all {total:,} ({100 * trainable / total:.4f}%)"
    assert table(text)["trainable parameters"] == counts
    assert "![Mean routing of each task (rows) over the experts (columns), per router](routing.png)" in text
    for t, (task, examples) in enumerate((("alpha", 3), ("beta", 5))):
        row = next(line for line in text.splitlines() if line.startswith(f"| {task} | {examples} | "))
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        entropy = report.entropy[t] / np.log(3)
        top_experts = "".join(str(int(np.argmax(report.mean_routing[t, k]))) for k in range(len(report.routers)))
        assert cells[2] == f"{entropy:.2f}" and cells[5] == f"`{top_experts}`"
    similarity = next(line for line in text.splitlines() if line.startswith("| alpha | 1.00 | "))
    assert similarity.endswith(f"{report.similarity()[0, 1]:.2f} |")


def test_trainers_model_card_keeps_the_smear_section(tmp_path):
    """Trainer.create_model_card (what Trainer.push_to_hub uploads) writes its own card over a PEFT card, then lets
    the model amend it: the SMEAR section comes back."""
    model = smear_llama(tmp_path)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
    trainer = Trainer(model=model, args=args)
    trainer.save_model()
    trainer.create_model_card(model_name="tiny-smear")
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert "# tiny-smear" in card.text and "## Training procedure" in card.text  # Trainer's card
    assert card.text.count(SECTION_BEGIN) == 1 and set(card.data.tags) >= SMEAR_TAGS
