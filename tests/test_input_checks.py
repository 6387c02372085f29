"""Bad input gets a clear error naming the value and what is allowed, and nothing is silently misread: non-finite
settings, task ids of every integer dtype (bools refused), misspelled or empty routing inputs, packed plain-text data,
empty batches."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from peft import PeftConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

import peft_smear
from conftest import VOCAB, random_batch, tiny_bert, tiny_llama
from peft_smear import SmearConfig


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(
    ("name", "settings"),
    [
        ("lora_alpha", {}),
        ("router_init_std", {}),
        ("router_balance_weight", {}),
        ("router_temperature", {}),
        ("gumbel_temperature", {"routing": "st_gumbel"}),
        ("gumbel_min_temperature", {"routing": "st_gumbel"}),
        ("gumbel_anneal_rate", {"routing": "st_gumbel"}),
        ("reinforce_value_weight", {"routing": "reinforce"}),
        ("dselect_k_gamma", {"routing": "dselect_k"}),
        ("expert_dropout", {}),
    ],
)
def test_a_non_finite_number_is_refused_naming_the_setting(name, settings, value):
    with pytest.raises(
        ValueError, match=rf"^{name} must be a (finite number|probability).*got {re.escape(repr(value))}"
    ):
        SmearConfig(**settings, **{name: value})


@pytest.mark.parametrize(
    ("name", "value", "settings"),
    [
        ("router_init_std", 1e30, {}),
        ("lora_alpha", 1e300, {}),
        ("router_temperature", 1e-300, {}),
        ("router_balance_weight", 1e38, {}),
        ("gumbel_min_temperature", 1e300, {"routing": "st_gumbel"}),
        ("reinforce_entropy_weight", 1e38, {"routing": "reinforce"}),
        ("dselect_k_gamma", 1e300, {"routing": "dselect_k"}),
        ("latent_skills_temperature", 1e-300, {"routing": "latent_skills", "num_tasks": 2}),
        ("adamix_consistency_weight", 1e300, {"routing": "adamix"}),
    ],
)
def test_a_finite_number_that_overflows_is_refused_naming_the_range(name, value, settings):
    """Each of these passed the finite check and gave NaN logits, NaN gradients or an obscure crash."""
    with pytest.raises(ValueError, match=rf"^{name} must be a finite number in [\[(][0-9e.+-]+, 10000\], got "):
        SmearConfig(**settings, **{name: value})


def test_non_finite_expert_embeddings_and_a_non_list_target_are_refused():
    with pytest.raises(ValueError, match="expert_embeddings must be finite numbers"):
        SmearConfig(routing="glider", num_experts=2, expert_embeddings=[[0.1, math.nan], [0.2, 0.3]])
    with pytest.raises(ValueError, match=r"target_modules must be a list of module names or a regex string, got 123"):
        SmearConfig(target_modules=123)


def tagged(routing: str):
    options = {"num_tasks": 3} if routing == "latent_skills" else {}
    config = SmearConfig(
        routing=routing, num_experts=3, r=2, target_modules=["query", "value"], task_type="SEQ_CLS", **options
    )
    torch.manual_seed(0)
    return get_peft_model(tiny_bert(), config).eval()


@pytest.mark.parametrize("routing", ["tag", "latent_skills"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8, torch.int8])
def test_task_ids_of_any_integer_dtype_route_as_int64(routing, dtype):
    model = tagged(routing)
    batch = random_batch(3, 5, seed=1)
    with torch.no_grad():
        expected = model(**batch, smear_task_ids=torch.tensor([2, 0, 1])).logits
        got = model(**batch, smear_task_ids=torch.tensor([2, 0, 1], dtype=dtype)).logits
        from_list = model(**batch, smear_task_ids=[2, 0, 1]).logits
    assert torch.equal(got, expected) and torch.equal(from_list, expected)


@pytest.mark.parametrize("routing", ["tag", "latent_skills"])
def test_boolean_task_ids_are_refused_not_read_as_a_mask(routing):
    model = tagged(routing)
    with pytest.raises(
        ValueError, match=r"smear_task_ids must be an integer tensor \[batch\] .*not bool.*got torch.bool"
    ):
        model(**random_batch(3, 5), smear_task_ids=torch.tensor([True, True, True]))
    with pytest.raises(ValueError, match=r"smear_task_ids must be integers, got \[True, 0, 1\]"):
        model(**random_batch(3, 5), smear_task_ids=[True, 0, 1])


def test_a_misspelled_smear_keyword_is_an_error_not_ignored():
    model = get_peft_model(tiny_llama(), SmearConfig(task_type="CAUSAL_LM"))
    with pytest.raises(TypeError, match=r"Unknown SMEAR input\(s\) \['smear_routing_mak'\]; the smear_ inputs are"):
        model(**random_batch(2, 5), smear_routing_mak=torch.ones(2, 5))
    with pytest.raises(TypeError, match="smear_routing_mak"):
        model.generate(**random_batch(1, 4), smear_routing_mak=torch.ones(1, 4), max_new_tokens=1)


def test_a_routing_mask_row_that_selects_no_token_is_an_error():
    model = get_peft_model(tiny_llama(), SmearConfig(task_type="CAUSAL_LM"))
    mask = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    with pytest.raises(ValueError, match=r"smear_routing_mask selects none of the real tokens of example\(s\) \[1\]"):
        model(**random_batch(2, 5), smear_routing_mask=mask)


def packed_plain_text(rows: int = 1) -> dict[str, torch.Tensor]:
    """Plain-text SFT packed as TRL and DataCollatorWithFlattening pack it: every token labelled but each sequence's
    first."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (rows, 12), generator=generator)
    labels = ids.clone()
    positions = torch.cat([torch.arange(5), torch.arange(7)]).expand(rows, 12)
    labels[:, 0] = labels[:, 5] = -100  # the packing collators' sequence boundaries
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "use_cache": False}


def test_packed_plain_text_is_refused_as_the_same_data_unpacked_is():
    model = get_peft_model(tiny_llama(), SmearConfig(task_type="CAUSAL_LM")).train()
    with pytest.raises(ValueError, match="every packed sequence's prompt is its first token alone"):
        model(**packed_plain_text())
    unpacked = random_batch(2, 6)
    with pytest.raises(ValueError, match="Prompt routing found no prompt"):
        model(**unpacked, labels=unpacked["input_ids"])
    prefixed = get_peft_model(tiny_llama(), SmearConfig(task_type="CAUSAL_LM", routing_prefix_length=2)).train()
    assert torch.isfinite(prefixed(**packed_plain_text()).loss)  # the way out the message names


def test_an_empty_batch_is_refused_in_one_clear_line():
    model = get_peft_model(tiny_llama(), SmearConfig(task_type="CAUSAL_LM"))
    empty = {"input_ids": torch.zeros(0, 5, dtype=torch.long), "attention_mask": torch.zeros(0, 5, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"^The batch is empty \(0 examples\)"):
        model(**empty)
    with pytest.raises(ValueError, match=r"^The batch is empty"):
        peft_smear.get_routing_weights(model, **empty)


@pytest.mark.parametrize(
    ("settings", "size"),
    [
        ({"num_experts": 10**9}, "TB"),
        ({"r": 10**12}, "PB"),
        ({"expert_type": "ia3", "num_experts": 10**11}, "TB"),
        ({"routing": "dselect_k", "num_experts": 10**9}, "TB"),
    ],
)
def test_an_adapter_too_large_for_memory_is_refused_before_anything_is_allocated(settings, size):
    """These allocated for minutes (512 GB; std::bad_alloc after 77 s); now they are counted on the meta device."""
    with pytest.raises(ValueError, match=rf"SMEAR adapter 'default' would need [0-9.]+ {size} for its experts and "):
        get_peft_model(tiny_llama(), SmearConfig(**settings))


def _saved_adapter(tmp_path) -> Path:
    model = get_peft_model(tiny_llama(), SmearConfig(num_experts=3, r=2))
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter"


def _edit_config(directory: Path, **settings) -> None:
    path = directory / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as file:
        file.truncate(path.stat().st_size // 2)


def _nan_weight(path: Path) -> str:
    weights = load_file(path)
    key = next(key for key, tensor in weights.items() if "smear_lora_A" in key)
    weights[key].view(-1)[0] = math.nan
    save_file(weights, path, metadata={"format": "pt"})
    return key


WEIGHTS = "adapter_model.safetensors"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: _truncate(d / WEIGHTS), rf"{WEIGHTS} is damaged \(truncated: "),
        (
            lambda d: (d / WEIGHTS).write_bytes(b"\x0f" + bytes(7) + b"{not a header!!"),
            rf"{WEIGHTS} is damaged \(its ",
        ),
        (lambda d: (d / WEIGHTS).write_bytes(b""), rf"{WEIGHTS} is damaged \(0 bytes"),
        (lambda d: (d / "adapter_config.json").write_text("{not json"), r"adapter_config.json is damaged \(not JSON"),
        (
            lambda d: _edit_config(d, num_experts=10**9),
            rf"{WEIGHTS} does not fit .*adapter_config.json: .*smear_lora_A has shape \[3, 2, 32\], but the config "
            "says num_experts=1000000000",
        ),
        (lambda d: _edit_config(d, r=4), r"smear_lora_A has shape \[3, 2, 32\], but the config says r=4"),
    ],
    ids=["truncated", "corrupt header", "empty", "config not JSON", "num_experts edited", "r edited"],
)
def test_a_damaged_or_mismatched_adapter_file_is_refused_naming_the_file(tmp_path, damage, message):
    """They surfaced as SafetensorError: Error while deserializing header, a bare JSONDecodeError, or an allocation
    of 512 GB; now the files are checked (the weights' header only) before PEFT builds anything."""
    adapter = _saved_adapter(tmp_path)
    damage(adapter)
    with pytest.raises(ValueError, match=message) as error:
        PeftModel.from_pretrained(tiny_llama(), adapter)
    assert str(adapter) in str(error.value)


def test_a_config_that_is_not_json_is_named_by_peft_config_too(tmp_path):
    adapter = _saved_adapter(tmp_path)
    (adapter / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"{re.escape(str(adapter))}/adapter_config.json is damaged \(not JSON"):
        PeftConfig.from_pretrained(adapter)


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path):
    """NaN bytes loaded, and every output was NaN."""
    adapter = _saved_adapter(tmp_path)
    key = _nan_weight(adapter / WEIGHTS)
    with pytest.raises(ValueError, match="its weights hold NaN or infinite values, in") as error:
        PeftModel.from_pretrained(tiny_llama(), adapter)
    assert key.rsplit(".", 1)[0] in str(error.value)


@pytest.mark.parametrize("shape", [(2, 5), (3, 6), (2, 7), (2,), (2, 6, 1)])
def test_labels_of_the_wrong_shape_are_named(shape):
    """A size mismatch came from packing.several_prompts; (2, 6, 1) labels passed and prompt routing ignored them."""
    model = get_peft_model(tiny_llama(), SmearConfig(num_experts=2, r=2))
    with pytest.raises(
        ValueError, match=re.escape(f"labels have shape {shape}, but the input is [batch, tokens] = [2, 6]")
    ):
        model(**random_batch(2, 6), labels=torch.zeros(shape, dtype=torch.long))


def test_per_example_labels_must_have_one_row_per_example():
    model = get_peft_model(tiny_bert(), SmearConfig(num_experts=2, r=2, task_type="SEQ_CLS"))
    model(**random_batch(2, 6), labels=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="labels have 3 rows, but the batch has 2 examples"):
        model(**random_batch(2, 6), labels=torch.tensor([0, 1, 2]))


def replicated(module: torch.nn.Module) -> torch.nn.Module:
    """``torch.nn.parallel.replicate``'s tree of replicas (each ``_replicate_for_data_parallel``), without the CUDA
    broadcast of its parameters, which the replicas here share."""
    replica = module._replicate_for_data_parallel()
    for name, child in module._modules.items():
        replica._modules[name] = None if child is None else replicated(child)
    for name, param in module._parameters.items():
        object.__setattr__(replica, name, param)
    return replica


def test_data_parallel_replicas_are_refused_in_one_line_naming_the_launchers():
    """``Trainer`` wraps a model in ``nn.DataParallel`` when a plain ``python`` run sees several GPUs; its replicas run
    in threads and would share one call's routing state, so a SMEAR model refuses them (CI has no GPUs to replicate
    on: the replicas are built as ``replicate`` builds them)."""
    model = get_peft_model(tiny_llama(), SmearConfig(num_experts=2, r=2, target_modules=["q_proj", "v_proj"]))
    batch = random_batch(2, 5)
    model(**batch)  # the model itself runs
    with pytest.raises(RuntimeError, match=r"nn\.DataParallel.*torchrun or accelerate launch") as raised:
        replicated(model)(**batch)
    assert "\n" not in str(raised.value)
