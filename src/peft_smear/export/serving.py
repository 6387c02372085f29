"""Whether an exported adapter is what multi-LoRA servers load.

vLLM, TGI and LoRAX take a PEFT LoRA directory per adapter. vLLM's loader (``PEFTHelper``) refuses
``modules_to_save`` and DoRA, and every server builds the adapter's layers from the weights' module names, which must
be linear layers of the base model it serves. :func:`check_server_ready` checks an adapter directory for all of that
before it is handed over, against the base model it is meant for, and names every point that fails in one line.

A classifier exported from a SMEAR adapter keeps its head in ``modules_to_save`` (the head is trained in full, not a
LoRA): no server takes it, so it is refused here. Serve such an adapter with PEFT itself, where mixed-task batches
(``adapter_names=``) send each row through its own task's LoRA and head.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from peft import LoraConfig
from peft.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME
from safetensors import safe_open
from transformers.pytorch_utils import Conv1D


MODEL_PREFIX = "base_model.model."
LORA_WEIGHT = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
CARD_NAME = "README.md"


class NotServerReadyError(ValueError):
    """An adapter directory that a multi-LoRA server would refuse or load wrongly; the message names every reason."""


def check_server_ready(directory: str | os.PathLike, base_model: torch.nn.Module) -> LoraConfig:
    """Check that the adapter in ``directory`` is what a multi-LoRA server (vLLM, TGI, LoRAX) loads onto
    ``base_model`` (the transformers model the server serves, loaded as the server loads it), and return its config.

    It must be a PEFT LoRA adapter (``peft_type: LORA``, without DoRA or trained biases), with no ``modules_to_save``
    (no head or other module saved in full), with ``base_model_name_or_path`` recorded as PEFT records it for
    ``base_model`` (what ``get_peft_model`` and ``save_pretrained`` write: the name or path the model was loaded
    from), with weights in ``adapter_model.safetensors`` for linear layers that exist in ``base_model`` with those
    shapes, and with its own model card (``README.md``), as :func:`export_merged_adapter` writes it. Otherwise a
    :class:`NotServerReadyError` (a ``ValueError``) names, in one line, every point that fails.
    """
    directory = Path(directory)
    if isinstance(base_model, torch.nn.Module) and hasattr(base_model, "get_base_model"):
        base_model = base_model.get_base_model()  # a PeftModel: the transformers model inside it
    if not isinstance(base_model, torch.nn.Module):
        raise TypeError(f"base_model must be the model the adapter is for, got {type(base_model).__name__}.")
    config_path = directory / CONFIG_NAME
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise NotServerReadyError(_message(directory, [f"no readable {CONFIG_NAME} ({error})"])) from None
    if not isinstance(config, dict):
        raise NotServerReadyError(_message(directory, [f"{CONFIG_NAME} is not a JSON object"]))

    failures = _config_failures(config, base_model)
    weights = directory / SAFETENSORS_WEIGHTS_NAME
    if weights.is_file():
        failures += _weight_failures(weights, base_model, config)
    else:
        failures.append(f"no {SAFETENSORS_WEIGHTS_NAME}")
    card = directory / CARD_NAME
    if not card.is_file() or not card.read_text(encoding="utf-8").strip():
        failures.append(
            f"no model card ({CARD_NAME}) saying what the adapter was exported from and with which routing"
        )
    if failures:
        raise NotServerReadyError(_message(directory, failures))
    return LoraConfig.from_pretrained(str(directory))


def recorded_base_model(base_model: torch.nn.Module) -> str | None:
    """What PEFT records as ``base_model_name_or_path`` for ``base_model``: the name or path it was loaded from
    (``get_peft_model`` reads the model's ``name_or_path``), or nothing for a model built from a config."""
    return base_model.__dict__.get("name_or_path", None) or None


def _message(directory: Path, failures: list[str]) -> str:
    return f"{directory} is not ready for a multi-LoRA server: " + "; ".join(failures) + "."


def _config_failures(config: dict, base_model: torch.nn.Module) -> list[str]:
    failures = []
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        failures.append(
            f"peft_type is {peft_type!r}, not 'LORA' (servers load LoRA adapters only; an exported SMEAR adapter is "
            "LoRA when its experts are)"
        )
    saved = config.get("modules_to_save")
    if saved:
        names = ", ".join(sorted(saved)) if isinstance(saved, list) else str(saved)
        failures.append(
            f"modules_to_save holds {names} (saved in full, e.g. a classification head, which servers refuse; serve "
            "this adapter with PEFT, whose adapter_names= mixed batches run each row through its own task's head)"
        )
    if config.get("use_dora"):
        failures.append("use_dora is true (vLLM refuses DoRA)")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        failures.append(f"it trains biases (bias={config.get('bias')!r}, lora_bias={config.get('lora_bias')!r})")
    recorded, expected = config.get("base_model_name_or_path") or None, recorded_base_model(base_model)
    if recorded != expected:
        failures.append(
            f"base_model_name_or_path is {recorded!r}, but PEFT records {expected!r} for this base model (the name "
            "or path it was loaded from)"
        )
    targets = config.get("target_modules")
    names = [name for name, _ in base_model.named_modules()]
    if isinstance(targets, str):
        if not any(re.fullmatch(targets, name) for name in names):
            failures.append(f"target_modules {targets!r} matches no module of the base model")
    elif isinstance(targets, list):
        missing = [t for t in targets if not any(name == t or name.endswith("." + t) for name in names)]
        if missing:
            failures.append(f"target modules not in the base model: {_few(missing)}")
    return failures


def _weight_failures(path: Path, base_model: torch.nn.Module, config: dict) -> list[str]:
    """The weights must be LoRA's A and B of linear layers of ``base_model``, with matching shapes."""
    modules = dict(base_model.named_modules())
    others, missing, not_linear, mismatched = [], [], [], []
    with safe_open(str(path), framework="pt") as weights:
        keys = list(weights.keys())
        if not keys:
            return [f"{SAFETENSORS_WEIGHTS_NAME} holds no weights"]
        for key in keys:
            match = LORA_WEIGHT.match(key.removeprefix(MODEL_PREFIX))
            if match is None:
                if "modules_to_save" not in key or not config.get("modules_to_save"):  # said once, above
                    others.append(key)
                continue
            name = match["module"]
            module = modules.get(name)
            if module is None:
                missing.append(name)
                continue
            features = _linear_features(module)
            if features is None:
                not_linear.append(f"{name} ({type(module).__name__})")
                continue
            shape = tuple(weights.get_slice(key).get_shape())
            in_features, out_features = features
            if (match["part"] == "A" and shape[1:] != (in_features,)) or (
                match["part"] == "B" and shape[:1] != (out_features,)
            ):
                mismatched.append(f"{key} {shape} for {name} of {in_features} -> {out_features} features")
    failures = []
    if others:
        failures.append(f"weights that are not LoRA's A and B: {_few(others)}")
    if missing:
        failures.append(f"weights for modules the base model does not have: {_few(sorted(set(missing)))}")
    if not_linear:
        failures.append(f"weights for modules that are not linear layers: {_few(sorted(set(not_linear)))}")
    if mismatched:
        failures.append(f"weights whose shapes do not fit the base model: {_few(mismatched)}")
    return failures


def _linear_features(module: torch.nn.Module) -> tuple[int, int] | None:
    """A linear layer's (input, output) features: ``nn.Linear`` (quantized ones included) or GPT-2's ``Conv1D``, also
    when an adapter (of a ``PeftModel`` given as the base) wraps it."""
    if hasattr(module, "get_base_layer"):
        module = module.get_base_layer()
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):
        return module.weight.shape[0], module.nf
    return None


def _few(items: list[str], shown: int = 3) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")
