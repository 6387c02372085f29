"""``peft-smear export`` writes what export_merged_adapter writes, and refuses bad input clearly, writing nothing."""

from __future__ import annotations

import configparser
import csv
import json
import os
import shutil
import subprocess
import sys
from importlib import import_module
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftConfig, PeftModel, PeftType, get_peft_model
from safetensors.torch import load_file

import peft_smear
from conftest import BUILDERS, tiny_bert, tiny_tokenizer, trained_like_smear
from peft_smear import SmearLinear, cli, export_merged_adapter


TASK_A = ["w3 w5 w7 w9", "w11 w13", "w15 w17 w19 w21 w23"]
TASK_B = ["w60 w70 w80", "w61 w71 w81 w91 w93"]
ROWS = [
    {"text": TASK_A[0], "task": "a"},
    {"text": TASK_B[0], "task": "b"},
    {"text": TASK_A[1], "task": "a"},
    {"text": TASK_A[2], "task": "a"},
    {"text": TASK_B[1], "task": "b"},
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per architecture: a base model directory (with tokenizer), a SMEAR adapter directory, and the SMEAR model."""
    saved = {}
    for arch in ("bert", "llama"):
        root = tmp_path_factory.mktemp(arch)
        BUILDERS[arch][0]().save_pretrained(root / "base")
        tiny_tokenizer().save_pretrained(root / "base")
        model = trained_like_smear(arch)
        model.save_pretrained(root / "adapter")
        saved[arch] = (root / "base", root / "adapter", model)
    return saved


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def export(base: Path, adapter: Path, output: Path, *options: str) -> int:
    paths = ["--base-model", str(base), "--adapter", str(adapter), "--output", str(output)]
    return cli.main(["export", *paths, *options])


def task_batches(texts: list[str], batch_size: int) -> list[dict[str, torch.Tensor]]:
    tokenizer = tiny_tokenizer()
    return [
        dict(tokenizer(texts[i : i + batch_size], padding=True, return_tensors="pt"))
        for i in range(0, len(texts), batch_size)
    ]


def largest_difference(directory: Path, reference: Path) -> float:
    ours, theirs = (load_file(d / "adapter_model.safetensors") for d in (directory, reference))
    assert ours.keys() == theirs.keys()
    return max((ours[key] - theirs[key]).abs().max().item() for key in ours)


# --- what it writes ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_task_data_export_equals_the_python_export_of_that_task(saved, arch, tmp_path, capsys):
    base, adapter, model = saved[arch]
    data = write_jsonl(tmp_path / "data.jsonl", ROWS)
    code = export(base, adapter, tmp_path / "cli", "--task-data", str(data), "--task", "a", "--batch-size", "2")
    assert code == 0
    assert "the mean routing of 3 examples of task 'a'" in capsys.readouterr().out

    export_merged_adapter(model, tmp_path / "task_a", routing=task_batches(TASK_A, 2))
    assert largest_difference(tmp_path / "cli", tmp_path / "task_a") <= 1e-6
    # The comparison can tell the tasks apart: without the --task filter the export would differ.
    export_merged_adapter(model, tmp_path / "all", routing=task_batches([row["text"] for row in ROWS], 2))
    assert largest_difference(tmp_path / "cli", tmp_path / "all") > 1e-4

    assert PeftConfig.from_pretrained(tmp_path / "cli").peft_type == PeftType.LORA
    loaded = PeftModel.from_pretrained(BUILDERS[arch][0](), tmp_path / "cli")
    assert isinstance(loaded.peft_config["default"], LoraConfig)


def test_csv_json_and_jsonl_task_data_give_the_same_export(saved, tmp_path):
    base, adapter, _ = saved["llama"]
    with (tmp_path / "data.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=["task", "text"])
        writer.writeheader()
        writer.writerows(ROWS)
    (tmp_path / "list.json").write_text(json.dumps(ROWS))
    write_jsonl(tmp_path / "lines.json", ROWS)  # JSON Lines under a .json name, as datasets' to_json writes them
    write_jsonl(tmp_path / "data.jsonl", ROWS)
    for name in ("data.csv", "list.json", "lines.json", "data.jsonl"):
        assert export(base, adapter, tmp_path / f"out-{name}", "--task-data", str(tmp_path / name), "--task", "b") == 0
    for name in ("data.csv", "list.json", "lines.json"):
        assert largest_difference(tmp_path / f"out-{name}", tmp_path / "out-data.jsonl") <= 1e-6, name


def test_expert_export_equals_the_one_hot_export(saved, tmp_path, capsys):
    base, adapter, model = saved["bert"]
    assert export(base, adapter, tmp_path / "cli", "--expert", "1") == 0
    assert "expert 1 of 3" in capsys.readouterr().out
    layers = [n for n, m in model.base_model.model.named_modules() if isinstance(m, SmearLinear)]
    one_hot = {name: torch.tensor([0.0, 1.0, 0.0]) for name in layers}
    export_merged_adapter(model, tmp_path / "one_hot", routing=one_hot)
    assert largest_difference(tmp_path / "cli", tmp_path / "one_hot") == 0
    assert json.loads((tmp_path / "cli" / "adapter_config.json").read_text())["peft_type"] == "LORA"


def test_console_script_runs_offline_with_a_progress_bar(saved, tmp_path):
    base, adapter, _ = saved["llama"]
    data = write_jsonl(tmp_path / "data.jsonl", ROWS)
    source = str(Path(peft_smear.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")])}
    env["HF_HUB_OFFLINE"] = "1"
    command = [sys.executable, "-m", "peft_smear", "export", "--base-model", str(base), "--adapter", str(adapter)]
    command += ["--output", str(tmp_path / "out"), "--task-data", str(data), "--batch-size", "2"]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert "Routing: 100%" in result.stderr and "3/3" in result.stderr
    assert f"Wrote a LoRA adapter to {tmp_path / 'out'}" in result.stdout
    assert "mean routing of 5 examples" in result.stdout
    assert "PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(" in result.stdout


def test_python_m_peft_smear_is_the_command_and_parses_its_arguments_first():
    """``python -m peft_smear`` did nothing; it is the ``peft-smear`` command, which answers ``--help`` before torch
    is imported (``-X importtime`` lists every module imported). Running a command through it is tested above."""
    environment = {**os.environ, "PYTHONPATH": str(Path(peft_smear.__file__).parents[1])}
    command = [sys.executable, "-X", "importtime", "-m", "peft_smear", "--help"]
    result = subprocess.run(command, capture_output=True, text=True, env=environment)
    assert result.returncode == 0 and result.stdout.startswith("usage: peft-smear [-h] COMMAND"), result.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert "peft_smear.cli" in imported and not imported & {"torch", "transformers", "peft"}


def test_setup_registers_the_console_script():
    setup = configparser.ConfigParser()
    setup.read(Path(__file__).parents[1] / "setup.cfg")
    scripts = dict(line.split(" = ") for line in setup["options.entry_points"]["console_scripts"].split("\n") if line)
    module, function = scripts["peft-smear"].split(":")
    # the launcher outside the package: it parses the arguments before the PEFT method is loaded, then runs cli's job
    assert (module, function) == ("peft_smear_launcher", "main") and callable(getattr(import_module(module), function))
    assert module in setup["options"]["py_modules"].split()


# --- bad input: a clear error, exit code 2, and nothing written --------------------------------------------------


def assert_refused(code: int, capsys, message: str) -> None:
    err = capsys.readouterr().err
    assert code == 2
    assert "\npeft-smear export: error: " in f"\n{err}" and message in err.split("peft-smear export: error: ")[-1], err
    assert "Traceback" not in err


@pytest.fixture
def output(tmp_path):
    """An output directory in a parent that does not exist yet: a refused export must not even create the parent."""
    yield tmp_path / "exports" / "lora"
    assert not (tmp_path / "exports").exists()


def test_non_empty_output_is_refused_before_loading_and_overwrite_replaces_it(saved, tmp_path, capsys, monkeypatch):
    base, adapter, _ = saved["llama"]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with monkeypatch.context() as patch:
        patch.setattr(cli, "_load_model", lambda *args: pytest.fail("loaded the model before checking --output"))
        code = export(base, adapter, tmp_path / "out", "--expert", "0")
    assert_refused(code, capsys, "exists and is not empty; pass --overwrite")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    assert export(base, adapter, tmp_path / "out", "--expert", "0", "--overwrite") == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]


def test_output_holding_an_input_is_refused_even_with_overwrite(saved, capsys):
    base, adapter, _ = saved["llama"]
    before = sorted(p.name for p in adapter.iterdir())
    assert_refused(export(base, adapter, adapter.parent, "--expert", "0", "--overwrite"), capsys, "holds the input")
    assert sorted(p.name for p in adapter.iterdir()) == before


@pytest.mark.parametrize(
    ("rows", "options", "message"),
    [
        (ROWS, ["--task", "c"], "has no row of task 'c'; its tasks: 'a', 'b'."),
        ([{"text": "w3"}], ["--task", "a"], "--task needs a 'task' column"),
        (ROWS, ["--text-column", "body"], "has no column 'body' (columns: ['text', 'task']); use --text-column."),
        ([], [], "has no rows."),
        ([{"text": "w3"}, {"text": " "}], [], "row 2: no text in column 'text', got ' '."),
    ],
    ids=["unknown task", "no task column", "no text column", "empty file", "empty text"],
)
def test_bad_task_data_is_refused(saved, tmp_path, output, capsys, rows, options, message):
    base, adapter, _ = saved["llama"]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    assert_refused(export(base, adapter, output, "--task-data", str(data), *options), capsys, message)


@pytest.mark.parametrize(
    ("name", "content", "problem"),
    [
        ("data.jsonl", '{"text": "w3"}\n{"text": \n', ": not valid JSON objects (an array, or one per line): "),
        ("data.json", '["w3", "w5"]', ": not valid JSON objects (an array, or one per line): row 1 is not an object."),
        ("data.csv", 'text,task\n"w3,a\n', ": not valid CSV: "),
        ("data.tsv", "text\nw3\n", ": unsupported file type '.tsv'; use .csv, .json or .jsonl."),
        ("data.csv", None, ": no such file."),
    ],
    ids=["invalid json", "rows not objects", "invalid csv", "unsupported suffix", "missing file"],
)
def test_unreadable_task_data_is_refused_in_one_line_naming_the_file(
    saved, tmp_path, output, capsys, name, content, problem
):
    base, adapter, _ = saved["llama"]
    data = tmp_path / name
    if content is not None:
        data.write_text(content)
    code = export(base, adapter, output, "--task-data", str(data))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"peft-smear export: error: --task-data {data}{problem}"), err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("index", ["3", "-1"])
def test_expert_index_out_of_range_is_refused(saved, output, capsys, index):
    base, adapter, _ = saved["llama"]
    message = f"--expert {index} is out of range: the adapter has 3 experts (0 to 2)."
    assert_refused(export(base, adapter, output, "--expert", index), capsys, message)


def test_lora_adapter_is_refused(saved, tmp_path, output, capsys):
    base, _, _ = saved["bert"]
    get_peft_model(tiny_bert(), LoraConfig(task_type="SEQ_CLS")).save_pretrained(tmp_path / "lora")
    message = f"--adapter {tmp_path / 'lora'} holds a LORA adapter, not a SMEAR adapter."
    assert_refused(export(base, tmp_path / "lora", output, "--expert", "0"), capsys, message)


@pytest.mark.parametrize(
    ("change", "message"),
    [({"peft_type": "FUTURE"}, "holds a FUTURE adapter, not a SMEAR adapter."), ({"num_experts": 0}, "num_experts")],
    ids=["unknown peft type", "invalid smear setting"],
)
def test_invalid_adapter_config_is_refused(saved, tmp_path, output, capsys, change, message):
    base, adapter, _ = saved["llama"]
    shutil.copytree(adapter, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, **change}))
    assert_refused(export(base, tmp_path / "adapter", output, "--expert", "0"), capsys, message)


def test_missing_directory_is_refused(saved, tmp_path, output, capsys):
    _, adapter, _ = saved["bert"]
    message = f"--base-model {tmp_path / 'nowhere'} is not a directory."
    assert_refused(export(tmp_path / "nowhere", adapter, output, "--expert", "0"), capsys, message)


def test_adapter_with_another_head_size_is_refused(saved, tmp_path, output, capsys):
    _, adapter, _ = saved["bert"]
    tiny_bert(num_labels=5).save_pretrained(tmp_path / "base")
    code = export(tmp_path / "base", adapter, output, "--expert", "0")
    assert_refused(code, capsys, "classifier.modules_to_save.default.weight: checkpoint (3, 32), model (5, 32)")


def test_task_data_and_expert_are_mutually_exclusive(saved, tmp_path, output, capsys):
    base, adapter, _ = saved["llama"]
    data = write_jsonl(tmp_path / "data.jsonl", ROWS)
    with pytest.raises(SystemExit) as exit_info:
        export(base, adapter, output, "--task-data", str(data), "--expert", "0")
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


PARSE_ONLY = """
import json, sys
import peft_smear_launcher
try:
    peft_smear_launcher.main(json.loads(sys.argv[1]))
except SystemExit as stop:
    code = stop.code
print(json.dumps({"code": code, "loaded": [m for m in ("torch", "transformers", "peft") if m in sys.modules]}))
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["export", "--help"],
        ["build-bank", "--help"],
        ["train", "--help"],
        ["export-tasks", "--help"],
        ["export", "--adapter-name", ""],
        ["train", "--steps", "0"],
        ["build-bank", "--routing", "latent_skills"],
        ["frobnicate"],
    ],
)
def test_help_and_argument_errors_answer_before_torch_or_peft_is_imported(argv):
    """They took 6 to 10 s: the command imported torch and PEFT before reading its arguments. Checked by what is
    imported, not by a clock."""
    environment = {**os.environ, "PYTHONPATH": str(Path(peft_smear.__file__).parents[1])}
    result = subprocess.run(
        [sys.executable, "-c", PARSE_ONLY, json.dumps(argv)], capture_output=True, text=True, env=environment
    )
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"code": 0 if argv[-1] == "--help" else 2, "loaded": []}, result.stderr
    if argv[-1] != "--help":
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
