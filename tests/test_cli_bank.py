"""peft-smear build-bank: saved adapters in, a loadable bank out, with descriptions, embeddings and PHATGOOSE gates;
bad input is one error line and writes nothing."""

from __future__ import annotations

import json

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import random_batch, save_bank_inputs, save_tiny_encoder, tiny_llama
from peft_smear import cli


saved_inputs = save_bank_inputs


def test_build_bank_writes_a_bank_that_reproduces_its_adapters(tmp_path):
    adapters = saved_inputs(tmp_path)
    argv = [
        "build-bank",
        "--base-model",
        str(tmp_path / "base"),
        "--output",
        str(tmp_path / "bank"),
        "--routing",
        "tag",
    ]
    argv += [arg for name, path in adapters.items() for arg in ("--adapter", f"{name}={path}")]
    assert cli.main(argv) == 0
    bank = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "bank").eval()
    assert bank.peft_config["default"].expert_names == ["one", "two"]
    batch = random_batch(2, 5, seed=1)
    for index, path in enumerate(adapters.values()):
        adapter = PeftModel.from_pretrained(tiny_llama(), path).eval()
        with torch.no_grad():
            expected = adapter(**batch).logits
            routed = bank(**batch, smear_task_ids=torch.full((2,), index)).logits
        torch.testing.assert_close(routed, expected, atol=1e-5, rtol=1e-5)


def test_build_bank_with_descriptions_embeddings_and_gates(tmp_path):
    adapters = saved_inputs(tmp_path)
    save_tiny_encoder(tmp_path / "encoder")
    argv = ["build-bank", "--base-model", str(tmp_path / "base"), "--output", str(tmp_path / "bank")]
    argv += ["--routing", "glider", "--embedding-model", str(tmp_path / "encoder"), "--gate-steps", "3"]
    argv += ["--description", "one=the cat is small", "--description", "two=bread and soup today"]
    for name, path in adapters.items():
        argv += ["--adapter", f"{name}={path}", "--gate-data", f"{name}={tmp_path / 'data.jsonl'}"]
    assert cli.main(argv) == 0
    config = json.loads((tmp_path / "bank" / "adapter_config.json").read_text())
    assert config["routing"] == "glider" and config["expert_descriptions"] == [
        "the cat is small",
        "bread and soup today",
    ]
    assert len(config["expert_embeddings"]) == 2 and len(config["expert_embeddings"][0]) == 32
    gates = {
        k: v for k, v in load_file(tmp_path / "bank" / "adapter_model.safetensors").items() if k.endswith(".gate")
    }
    assert gates and all(v.abs().sum(-1).gt(0).all() for v in gates.values()), "both experts' gates must be trained"


def test_bad_input_is_one_error_line_and_writes_nothing(tmp_path, capsys):
    adapters = saved_inputs(tmp_path)
    base = ["build-bank", "--base-model", str(tmp_path / "base"), "--output", str(tmp_path / "bank")]
    one = ["--adapter", f"one={adapters['one']}"]
    cases = {
        "takes NAME=VALUE": [*base, "--adapter", str(adapters["one"])],
        "needs descriptions": [*base, *one, "--routing", "glider"],
        "not one of the adapters": [*base, *one, "--description", "three=x"],
        "has no adapter_config.json": [*base, "--adapter", f"x={tmp_path / 'base'}"],
    }
    for message, argv in cases.items():
        assert cli.main(argv) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "bank").exists()
