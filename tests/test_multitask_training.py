"""``peft-smear train`` and ``export-tasks`` end to end on a tiny random BERT and two tiny task files (no network, no
data cache), plus the multi-task model's per-example losses."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, BertConfig, BertModel

from conftest import save_tiny_encoder, write_task_files
from peft_smear import SmearLinear, get_routing_weights
from peft_smear.cli import main
from peft_smear.core.routers import merged
from peft_smear.multitask import training
from peft_smear.multitask.model import UNUSED_CLASS_LOGIT, MultiTaskModel
from peft_smear.multitask.report import RoutingReport
from peft_smear.multitask.tasks import BENCHMARK_TASKS, TaskInfo
from peft_smear.multitask.training import load_run


STEPS, EXPERTS = 4, 3


def run_cli(*argv: str) -> int:
    return main([str(arg) for arg in argv])


def train_args(model_dir, task_files: dict[str, str], output_dir, *extra: str) -> list[str]:
    files = [argument for name, path in task_files.items() for argument in ("--task-file", f"{name}={path}")]
    return [
        "train",
        "--model",
        model_dir,
        *files,
        "--num-experts",
        EXPERTS,
        "--r",
        2,
        "--steps",
        STEPS,
        "--batch-size",
        8,
        "--eval-every",
        2,
        "--max-length",
        16,
        "--output-dir",
        output_dir,
        *extra,
    ]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on busy cores two threads spin waiting for each other:
    the end-to-end run takes several times longer with them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("training")
    save_tiny_encoder(root / "encoder")
    return root, write_task_files(root)


@pytest.fixture(scope="module")
def run(workspace):
    """A finished ``train`` run and the SMEAR model it trained (taken from ``get_peft_model`` as it is built)."""
    root, task_files = workspace
    built = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(training, "get_peft_model", lambda *a, **k: built.append(get_peft_model(*a, **k)) or built[-1])
        assert run_cli(*train_args(root / "encoder", task_files, root / "run")) == 0
    return root / "run", built[0].eval()


@pytest.fixture(scope="module")
def exported(run, workspace):
    run_dir, _ = run
    target = workspace[0] / "exported"
    assert run_cli("export-tasks", "--run", run_dir, "--output", target, "--batch-size", 8) == 0
    return target


def test_train_writes_the_adapter_metrics_and_routing_report(run):
    run_dir, _ = run
    for name in ("adapter_config.json", "adapter_model.safetensors", "tasks.json", "metrics.json", "routing.json"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "routing.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(key.startswith("base_model.model.heads.") for key in load_file(run_dir / "adapter_model.safetensors"))
    summary = json.loads((run_dir / "metrics.json").read_text())
    metrics = summary["metrics"]
    assert set(metrics) == {"topic_accuracy", "count_pearson", "average"}
    assert 0 <= metrics["topic_accuracy"] <= 1 and -1 <= metrics["count_pearson"] <= 1
    assert metrics["average"] == pytest.approx((metrics["topic_accuracy"] + metrics["count_pearson"]) / 2)
    assert summary["steps"] == STEPS and all(count > 0 for count in summary["examples"].values())
    tasks = json.loads((run_dir / "tasks.json").read_text())["tasks"]
    assert [TaskInfo(**task).kind for task in tasks] == ["classification", "regression"]


def test_routing_report_has_one_distribution_per_task_and_router(run):
    run_dir, model = run
    report = json.loads((run_dir / "routing.json").read_text())
    layers = [name for name, module in model.base_model.model.named_modules() if isinstance(module, SmearLinear)]
    assert len(layers) == 2 * 6  # every linear layer of both transformer blocks, not the pooler or the heads
    assert report["routers"] == layers
    assert set(report["mean_routing"]) == {"topic", "count"}
    for task, by_router in report["mean_routing"].items():
        assert list(by_router) == layers, task
        for router, distribution in by_router.items():
            assert len(distribution) == EXPERTS
            assert min(distribution) >= 0 and sum(distribution) == pytest.approx(1, abs=1e-5), (task, router)
    assert report["similarity"]["topic"]["topic"] == pytest.approx(1)


def test_a_routing_report_is_read_back_from_its_json_and_rounds_on_request(run):
    run_dir, _ = run
    data = json.loads((run_dir / "routing.json").read_text())
    report = RoutingReport.from_dict(data)
    again = report.to_dict()
    similarity = again.pop("similarity")  # recomputed in float64 from the file's float32 routing
    assert again == {key: value for key, value in data.items() if key != "similarity"}  # every number, in its order
    for task, row in data["similarity"].items():
        assert similarity[task] == pytest.approx(row, abs=1e-6)
    rounded = report.to_dict(decimals=3)
    for task in data["tasks"]:
        for router, distribution in data["mean_routing"][task].items():
            assert rounded["mean_routing"][task][router] == [round(weight, 3) for weight in distribution]
        assert rounded["entropy"][task] == round(data["entropy"][task], 3)
    assert rounded != data


def test_reloaded_run_gives_the_trained_models_logits(run):
    run_dir, model = run
    batch = {
        "input_ids": torch.tensor([[2, 5, 9, 12, 3], [2, 7, 3, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
        "task_index": torch.tensor([0, 1]),
    }
    with torch.no_grad():
        expected = model(**batch).logits
        reloaded = load_run(run_dir)(**batch).logits
    torch.testing.assert_close(reloaded, expected, rtol=0, atol=0)


def test_the_run_card_shows_the_routing_report_and_how_to_load_the_run(run):
    run_dir, _ = run
    text = (run_dir / "README.md").read_text()
    report = json.loads((run_dir / "routing.json").read_text())
    for task in ("topic", "count"):
        assert f"| {task} | {report['examples'][task]} | " in text
    assert "](routing.png)" in text and "| trained in full | `heads` |" in text
    (snippet,) = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    namespace: dict = {}
    exec(snippet, namespace)
    assert isinstance(namespace["model"], PeftModel)


def test_the_run_card_holds_its_test_metrics_and_compares_like_with_like_only(run):
    """The card had no test metrics; the printed table set the full benchmark's frozen MiniLM numbers beside any run
    (any --model, 8 test examples). A run on a model of its own gets no baseline column."""
    run_dir, _ = run
    text = (run_dir / "README.md").read_text()
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert "## Test metrics" in text and "frozen" not in text.lower()
    for task, metric in (("topic", "accuracy"), ("count", "pearson")):
        value = summary["metrics"][f"{task}_{metric}"]
        assert f"| {task} | {metric} | {summary['examples'][task]} | {value:.3f} |" in text
    tasks = [BENCHMARK_TASKS["trec6"], BENCHMARK_TASKS["nyt_reg"]]
    metrics = {"trec6_accuracy": 0.9, "nyt_reg_pearson": 0.7, "average": 0.8}
    assert "frozen baseline" not in training._metrics_table(metrics, tasks, {})
    table = training._metrics_table(metrics, tasks, training.FROZEN_BASELINES)
    assert "frozen baseline" in table and "0.81" in table and "0.63" in table


def test_export_tasks_writes_a_lora_adapter_per_task(exported):
    for task in ("topic", "count"):
        config = PeftConfig.from_pretrained(str(exported / task))
        assert config.peft_type == "LORA"
        assert json.loads((exported / task / "tasks.json").read_text())["task"] == task


def test_exported_lora_applies_to_the_stock_sequence_classification_model(workspace, exported):
    """The LoRA's targets are named as in ``AutoModelForSequenceClassification`` (``bert.encoder...``), so vanilla
    PEFT applies it there: the encoder's output is the multi-task model's (only the heads are ours)."""
    batch = {"input_ids": torch.tensor([[2, 5, 9, 12, 3]]), "attention_mask": torch.ones(1, 5, dtype=torch.long)}
    stock = AutoModelForSequenceClassification.from_pretrained(workspace[0] / "encoder", num_labels=2)
    stock = PeftModel.from_pretrained(stock, exported / "topic").eval()
    ours = load_run(exported / "topic").get_base_model()
    with torch.no_grad():
        expected = ours.encoder(**batch).last_hidden_state
        hidden = stock(**batch, output_hidden_states=True).hidden_states[-1]
        with stock.disable_adapter():
            untuned = stock(**batch, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(hidden, expected, atol=1e-6, rtol=0)
    assert (hidden - untuned).abs().max() > 1e-4  # the adapter did change the encoder


def test_exported_lora_equals_smear_forced_to_the_tasks_mean_routing(run, exported):
    run_dir, model = run
    tasks = model.get_base_model().tasks
    batches = training.run_batches(run_dir, "validation", batch_size=8)["topic"]
    totals = {}
    for batch in batches:
        for name, weights in get_routing_weights(model, **batch).items():
            totals[name] = totals.get(name, 0) + weights.sum(dim=0)
    examples = sum(batch["input_ids"].shape[0] for batch in batches)
    batch = batches[0]
    layers = {name: m for name, m in model.base_model.model.named_modules() if isinstance(m, SmearLinear)}
    context = model.base_model.routing_context
    size = batch["input_ids"].shape[0]
    context.routing_cache = {
        (layers[n], "default"): merged((t / examples).expand(size, -1)) for n, t in totals.items()
    }
    try:
        with torch.no_grad():
            forced = model(**batch).logits
    finally:
        context.routing_cache = None
    lora = load_run(exported / "topic")
    assert type(lora.peft_config["default"]).__name__ == "LoraConfig"
    assert [task.name for task in tasks] == ["topic", "count"]
    with torch.no_grad():
        torch.testing.assert_close(lora(**batch).logits, forced, atol=1e-5, rtol=0)


def test_export_tasks_writes_the_tasks_mean_update_exact_or_truncated(run, tmp_path, capsys):
    run_dir, model = run
    exact, truncated = tmp_path / "exact", tmp_path / "truncated"
    assert (
        run_cli("export-tasks", "--run", run_dir, "--output", exact, "--batch-size", 8, "--form", "mean_update") == 0
    )
    assert (
        f"topic (validation split): the mean update, exactly, as a LoRA of rank {EXPERTS * 2}"
        in capsys.readouterr().out
    )
    options = ["--batch-size", 8, "--form", "mean_update", "--rank", 3]
    assert run_cli("export-tasks", "--run", run_dir, "--output", truncated, *options) == 0
    assert "count (validation split): the mean update truncated to rank 3, keeping " in capsys.readouterr().out
    assert PeftConfig.from_pretrained(str(truncated / "count")).r == 3
    assert "## Energy kept per module" in (truncated / "count" / "README.md").read_text()

    # The exact export's update is the average of the task's examples' own merged experts.
    config = PeftConfig.from_pretrained(str(exact / "topic"))
    assert config.r == EXPERTS * 2
    name, layer = next((n, m) for n, m in model.base_model.model.named_modules() if isinstance(m, SmearLinear))
    A, B = layer.smear_lora_A["default"].double(), layer.smear_lora_B["default"].double()
    total, count = 0, 0
    for batch in training.run_batches(run_dir, "validation", batch_size=8)["topic"]:
        for p in get_routing_weights(model, **batch)[name].double():
            total = total + torch.einsum("n,nor->or", p, B) @ torch.einsum("n,nri->ri", p, A)
            count += 1
    expected = layer.expert_kind["default"].scaling * total.detach() / count
    weights = load_file(exact / "topic" / "adapter_model.safetensors")
    exported = (
        weights[f"base_model.model.{name}.lora_B.weight"].double()
        @ weights[f"base_model.model.{name}.lora_A.weight"].double()
    )
    exported = config.lora_alpha / config.r * exported
    assert ((exported - expected).norm() / expected.norm()).item() <= 1e-6

    refused = ["--form", "mean_update", "--rank", EXPERTS * 2 + 1]
    assert run_cli("export-tasks", "--run", run_dir, "--output", tmp_path / "bad", *refused) == 2
    assert f"--rank {EXPERTS * 2 + 1} is more than the exact mean update's rank" in capsys.readouterr().err
    assert run_cli("export-tasks", "--run", run_dir, "--output", tmp_path / "bad", "--rank", 2) == 2
    assert "--rank truncates the mean update: it needs --form mean_update" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_bad_input_is_a_clear_error(run, workspace, tmp_path, capsys):
    root, task_files = workspace
    run_dir, _ = run
    assert run_cli(*train_args(root / "encoder", task_files, run_dir)) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert run_cli(*train_args(root / "encoder", task_files, tmp_path / "a", "--tasks", "topic", "nope")) == 2
    assert "--tasks names unknown task(s) ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        run_cli(*train_args(root / "encoder", task_files, tmp_path / "b", "--routing", "magic"))
    assert exit_info.value.code != 0 and "invalid choice: 'magic'" in capsys.readouterr().err
    assert run_cli(*train_args(tmp_path / "no-model", task_files, tmp_path / "c")) == 2
    assert "no config.json" in capsys.readouterr().err

    ensemble_run = tmp_path / "ensemble-run"
    shutil.copytree(run_dir, ensemble_run)
    config = json.loads((ensemble_run / "adapter_config.json").read_text())
    (ensemble_run / "adapter_config.json").write_text(json.dumps({**config, "routing": "ensemble"}))
    assert run_cli("export-tasks", "--run", ensemble_run, "--output", tmp_path / "d") == 2
    assert "routing='ensemble'" in capsys.readouterr().err
    assert run_cli("export-tasks", "--run", tmp_path, "--output", tmp_path / "e") == 2
    assert "not a `peft-smear train` run" in capsys.readouterr().err


def test_multitask_losses_match_a_per_example_loop():
    tasks = [
        TaskInfo("three", "classification", ("a", "b", "c")),
        TaskInfo("value", "regression"),
        TaskInfo("two", "classification", ("x", "y")),
    ]
    torch.manual_seed(0)
    encoder = BertModel(
        BertConfig(
            vocab_size=40,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=2,
            pad_token_id=0,
        )
    )
    model = MultiTaskModel(encoder, tasks).eval()
    with torch.no_grad():
        for linear in model.heads.linears:
            linear.weight.normal_()
            linear.bias.normal_()
    task_index = torch.tensor([0, 1, 2, 1, 0, 2])
    labels = torch.tensor([2.0, -0.7, 1.0, 1.5, 0.0, 0.0])
    batch = {"input_ids": torch.randint(1, 40, (6, 5)), "attention_mask": torch.ones(6, 5, dtype=torch.long)}
    with torch.no_grad():
        output = model(**batch, task_index=task_index, labels=labels)
    expected = []
    for row, (index, label) in enumerate(zip(task_index.tolist(), labels.tolist(), strict=True)):
        logits = output.logits[row]
        if tasks[index].kind == "regression":
            expected.append((logits[0] - label) ** 2)
        else:
            n = tasks[index].num_labels
            expected.append(F.cross_entropy(logits[None, :n], torch.tensor([int(label)])))
            assert (logits[n:] == UNUSED_CLASS_LOGIT).all()
    torch.testing.assert_close(output.example_losses, torch.stack(expected))
    torch.testing.assert_close(output.loss, torch.stack(expected).mean())
    assert (output.logits[task_index == 1, 1:] == UNUSED_CLASS_LOGIT).all()


def test_router_lr_ratio_gives_the_routers_their_own_rate(workspace, tmp_path, monkeypatch, capsys):
    """``--router-lr-ratio`` reaches Trainer as an optimizer whose router group has that multiple of the rate."""
    root, task_files = workspace
    seen = {}

    def stop_at_fit(peft_model, *args, optimizer=None, learning_rate=None, **kwargs):
        seen.update(model=peft_model, optimizer=optimizer, learning_rate=learning_rate)
        raise ValueError("stopped before training")

    monkeypatch.setattr(training, "fit", stop_at_fit)
    argv = train_args(root / "encoder", task_files, tmp_path / "out", "--router-lr-ratio", "0.25")
    assert run_cli(*argv, "--learning-rate", "4e-3") == 2  # the stop above, reported as one error line
    routers = {id(p) for name, p in seen["model"].named_parameters() if ".smear_router." in name}
    rates = {group["lr"]: {id(p) for p in group["params"]} for group in seen["optimizer"].param_groups}
    assert rates[1e-3] == routers and seen["learning_rate"] == 4e-3 and len(rates[4e-3]) > 0
    with pytest.raises(SystemExit) as refused:
        run_cli(*train_args(root / "encoder", task_files, tmp_path / "bad", "--router-lr-ratio", "0"))
    assert refused.value.code == 2 and "--router-lr-ratio: must be a number > 0, got '0'" in capsys.readouterr().err


def test_train_upcycles_a_saved_lora_of_the_same_model(run, workspace):
    """``train --upcycle-from``: the SMEAR experts start as the LoRA (heads included), its rank and scaling kept."""
    root, task_files = workspace
    run_dir, _ = run
    tasks = [TaskInfo(**task) for task in json.loads((run_dir / training.RUN_FILE).read_text())["tasks"]]

    def lora_config(model):
        names = training.block_linear_names(model)
        return LoraConfig(r=3, lora_alpha=6, target_modules=names, modules_to_save=["heads"], init_lora_weights=False)

    lora = training.build_model(root / "encoder", tasks, lora_config, seed=1).eval()
    lora.save_pretrained(root / "lora")
    smear = training.upcycled_model(root / "encoder", tasks, root / "lora", "smear", EXPERTS, seed=0).eval()
    inputs = {"input_ids": torch.randint(5, 15, (4, 9)), "task_index": torch.tensor([0, 1, 0, 1])}
    with torch.no_grad():
        torch.testing.assert_close(smear(**inputs).logits, lora(**inputs).logits, atol=1e-6, rtol=0)
    assert run_cli(*train_args(root / "encoder", task_files, root / "upcycled", "--upcycle-from", root / "lora")) == 0
    config = PeftConfig.from_pretrained(str(root / "upcycled"))
    assert (config.r, config.lora_alpha, config.num_experts, set(config.modules_to_save)) == (3, 6, EXPERTS, {"heads"})
