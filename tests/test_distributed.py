"""SMEAR trained by 2 CPU processes (gloo) under DDP, FSDP2, FSDP1 and (where installed) DeepSpeed ZeRO-2 and ZeRO-3,
compared with one process on the same global batch; the adapter each run saves loads in this process with the
outputs of the trained model. Also: the example ``examples/train_accelerate.py`` trains and resumes under
``torchrun``, and its Accelerate configs parse.

One ``torchrun`` launch of ``distributed_worker.py`` (about 20 s on 2 busy cores) produces everything the first tests
read; the example takes two more launches (about 30 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType
from peft import PeftModel
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import distributed_worker as worker
import peft_smear
from conftest import random_batch, tiny_llama
from peft_smear import ROUTERS


# One process with batch 4 and two with batch 2 each compute the same mean loss and gradient, up to the order of
# float sums. Measured here: losses agree to 5e-7 and parameters after 4 AdamW steps to 4.4e-5 (AdamW divides by the
# gradient's magnitude, which amplifies float noise in tiny gradient entries; lr is 1e-2).
LOSS_TOLERANCE = 1e-5
PARAMETER_TOLERANCE = 1e-4
RUNS = ("ddp", "fsdp2", "fsdp1", "zero2", "zero3")

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)


TESTS = Path(__file__).parent
EXAMPLES = TESTS.parent / "examples"


def torchrun(script: Path, *args: object) -> subprocess.CompletedProcess:
    """Run ``script`` on 2 local processes, importing the peft_smear under test; fail with its output if it fails."""
    source = Path(peft_smear.__file__).parent.parent
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(source), str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    result = subprocess.run(command + [str(arg) for arg in args], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"torchrun failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


@pytest.fixture(scope="module")
def output(tmp_path_factory) -> Path:
    """Run ``distributed_worker.py`` on 2 processes once for the whole module."""
    directory = tmp_path_factory.mktemp("distributed")
    torchrun(TESTS / "distributed_worker.py", directory)
    return directory


@pytest.fixture(scope="module")
def single_process() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: the same model and optimiser, one process, all ``GLOBAL_BATCH`` examples of each step."""
    model = worker.build_model()
    optimizer = worker.optimizer_for(model)
    model.train()
    losses = []
    for step in range(worker.STEPS):
        loss = model(**worker.global_batch(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, worker.adapter_parameters(model)


def run_directory(output: Path, run: str) -> Path:
    if (output / run / "unsupported.txt").exists():
        pytest.skip((output / run / "unsupported.txt").read_text())
    return output / run


@pytest.mark.parametrize("run", RUNS)
def test_two_processes_train_like_one_process(output, single_process, run):
    directory = run_directory(output, run)
    reference_losses, reference = single_process
    losses = json.loads((directory / "losses.json").read_text())
    assert losses == pytest.approx(reference_losses, abs=LOSS_TOLERANCE, rel=0)

    rank0 = torch.load(directory / "params-rank0.pt")
    rank1 = torch.load(directory / "params-rank1.pt")
    assert rank0.keys() == rank1.keys() == reference.keys()
    assert any(".smear_lora_A." in name for name in rank0) and any(
        ".smear_router.default.weight" in name for name in rank0
    )
    initial = worker.adapter_parameters(worker.build_model())
    for name, value in rank0.items():
        assert torch.equal(value, rank1[name]), f"{name} differs between the ranks"
        torch.testing.assert_close(value, reference[name], atol=PARAMETER_TOLERANCE, rtol=0, msg=name)
        assert not torch.equal(value, initial[name]), f"{name} did not train"


@pytest.mark.parametrize("run", RUNS)
def test_saved_adapter_loads_on_one_device_with_the_same_outputs(output, run):
    """The adapter gathered and saved by rank 0 (sharded over both ranks under FSDP and ZeRO-3) loads here, in a
    process that never trained it, into a fresh base model: the same parameters and the same logits as the trained
    model."""
    directory = run_directory(output, run)
    loaded = PeftModel.from_pretrained(tiny_llama(seed=0, initializer_range=0.2), directory / "adapter").eval()
    trained = torch.load(directory / "params-rank0.pt")
    saved = {name: param for name, param in loaded.named_parameters() if "smear_" in name}
    assert saved.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(saved[name], value), name
    with torch.no_grad():
        logits = loaded(**worker.eval_batch()).logits
    torch.testing.assert_close(logits, torch.load(directory / "logits.pt"), atol=1e-6, rtol=0)


def test_every_routing_method_trains_under_ddp_without_find_unused_parameters(output):
    """DDP (default ``find_unused_parameters=False``) fails at the next step when a trainable parameter got no
    gradient. Every method, including the discrete ones that apply a single gathered expert and the ones with
    expert dropout, trained with an inactive second adapter beside it, and both ranks ended with the same adapter."""
    differences = json.loads((output / "routing_methods.json").read_text())
    assert differences.keys() == set(ROUTERS)
    assert {method: outcome for method, outcome in differences.items() if outcome != 0.0} == {}


def test_save_inside_activation_checkpointing_wrappers(tmp_path):
    """Wrappers that rename modules but not state-dict keys (FSDP1's auto-wrap units, activation checkpointing) must
    not hide the adapter from ``save_pretrained``; PEFT's own selection finds no key inside them."""
    model = worker.build_model()
    expected = get_peft_model_state_dict(model)
    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, LlamaDecoderLayer))
    assert any("_checkpoint_wrapped_module" in name for name, _ in model.named_modules())
    saved = get_peft_model_state_dict(model)
    assert saved.keys() == expected.keys() and len(saved) == 28  # 6 tensors and the router clock in each of 4 layers
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(tiny_llama(seed=0, initializer_range=0.2), tmp_path).eval()
    batch = random_batch(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model.eval()(**batch).logits, atol=1e-6, rtol=0)


def test_example_trains_and_resumes_under_torchrun(tmp_path):
    """``train_accelerate.py`` on 2 CPU processes with gradient accumulation: resumed from its step-3 checkpoint, it
    logs the same losses for steps 4-6 and saves the same adapter as the uninterrupted run, which the script itself
    reloads on one device."""
    options = ["--steps", 6, "--checkpoint-every", 3, "--batch-size", 4, "--gradient-accumulation-steps", 2]
    script = EXAMPLES / "train_accelerate.py"
    full = torchrun(script, "--output-dir", tmp_path / "full", *options).stdout
    checkpoint = tmp_path / "full" / "checkpoints" / "step-3"
    resumed = torchrun(script, "--output-dir", tmp_path / "resumed", "--resume", checkpoint, *options).stdout

    assert "2 process(es), MULTI_CPU" in full
    assert f"resumed from {checkpoint} at step 3" in resumed
    full_steps = [line for line in full.splitlines() if line.startswith("step ")]
    resumed_steps = [line for line in resumed.splitlines() if line.startswith("step ")]
    assert len(full_steps) == 6 and resumed_steps == full_steps[3:]
    assert "response-token accuracy" in full  # the script reloaded its saved adapter
    saved = load_file(tmp_path / "full" / "adapter" / "adapter_model.safetensors")
    saved_after_resume = load_file(tmp_path / "resumed" / "adapter" / "adapter_model.safetensors")
    assert saved.keys() == saved_after_resume.keys() and len(saved) == 98  # 6 tensors and a clock in 14 layers
    assert all(torch.equal(saved[name], saved_after_resume[name]) for name in saved)


def test_accelerate_configs_parse_with_the_settings_sharded_training_needs():
    paths = (EXAMPLES / "accelerate_configs").glob("*.yaml")
    configs = {path.stem: load_config_from_file(str(path)) for path in paths}
    assert configs.keys() == {"ddp", "fsdp", "fsdp2", "deepspeed_zero2", "deepspeed_zero3"}
    assert configs["ddp"].distributed_type == DistributedType.MULTI_GPU
    fsdp1, fsdp2 = configs["fsdp"], configs["fsdp2"]
    assert fsdp1.distributed_type == fsdp2.distributed_type == DistributedType.FSDP
    assert fsdp1.fsdp_config["fsdp_version"] == 1 and fsdp1.fsdp_config["fsdp_sharding_strategy"] == "FULL_SHARD"
    assert fsdp1.fsdp_config["fsdp_use_orig_params"] is True  # frozen and trainable parameters share flat parameters
    assert fsdp2.fsdp_config["fsdp_version"] == 2 and fsdp2.fsdp_config["fsdp_reshard_after_forward"] is True
    zero2, zero3 = configs["deepspeed_zero2"], configs["deepspeed_zero3"]
    assert zero2.distributed_type == zero3.distributed_type == DistributedType.DEEPSPEED
    assert zero2.deepspeed_config["zero_stage"] == 2 and zero3.deepspeed_config["zero_stage"] == 3
    assert zero3.deepspeed_config["zero3_save_16bit_model"] is True  # else get_state_dict cannot gather the adapter
    # Left to the script (--gradient-accumulation-steps); a value here would silently override it.
    assert all("gradient_accumulation_steps" not in config.deepspeed_config for config in (zero2, zero3))
