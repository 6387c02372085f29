"""Save an EMoE model's partition beside its adapter, and put it back on a fresh base model.

The base weights are not touched by :func:`~peft_smear.emoe.moefy`, so the adapter (LoRA, SMEAR, ...) is saved by
PEFT as usual; what EMoE adds is the expert of every neuron of each EMoE layer, which must be saved too: after full
fine-tuning, or with another seed or library version, clustering again would not give it back. It is written as
``emoe_config.json`` (experts, top-k, layers) and ``emoe_partition.safetensors`` (one int64 vector per layer).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..saving import atomic
from .card import write_emoe_card
from .moefy import emoe_gates, moefy


CONFIG_NAME = "emoe_config.json"
PARTITION_NAME = "emoe_partition.safetensors"
FORMAT_VERSION = 1
GATE_SUFFIX = ":gate_weight"  # the learned gate's weight of a layer, in the partition file


def save_emoe(model: nn.Module, directory: str | os.PathLike) -> None:
    """Write the EMoE settings and partition of ``model`` (a transformers model or a ``PeftModel``) into
    ``directory`` (created if needed; e.g. the adapter's own). The directory is replaced in one step with a copy in
    which both files and the model card are new and everything else is as it was (see :mod:`peft_smear.saving.atomic`):
    a kill at any moment leaves the old pair of files or the new pair, never one of each. The card (README.md, made if
    missing) gets a section saying that loading needs :func:`load_emoe` on the base model before
    ``PeftModel.from_pretrained``."""
    gates = emoe_gates(model)
    if not gates:
        raise ValueError("The model has no EMoE layer to save; call moefy(model) first.")
    settings = {(gate.num_experts, gate.top_k, gate.weight is not None) for gate in gates.values()}
    if len(settings) > 1:
        raise ValueError(
            f"EMoE layers with different (num_experts, top_k, learned) cannot be saved together: {settings}."
        )
    (num_experts, top_k, learned) = settings.pop()
    config = {
        "format": FORMAT_VERSION,
        "num_experts": num_experts,
        "top_k": top_k,
        "gate": "learned" if learned else "avg_k",
        "layers": list(gates),
    }
    directory = Path(directory)
    tensors = {name: gate.group_of.detach().cpu().contiguous() for name, gate in gates.items()}
    if learned:
        tensors.update({name + GATE_SUFFIX: gate.weight.detach().cpu().contiguous() for name, gate in gates.items()})
    # Both files change together: the directory is staged with everything else in it carried over, then swapped.
    staging_directory = atomic.staged_directory(
        directory, keep_others=True, rewrites=[PARTITION_NAME, CONFIG_NAME], amends=["README.md"]
    )
    with staging_directory as staging:
        save_file(tensors, str(staging / PARTITION_NAME))
        atomic.step(f"wrote {PARTITION_NAME}")
        (staging / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        atomic.step(f"wrote {CONFIG_NAME}")
        write_emoe_card(staging, config, CONFIG_NAME, PARTITION_NAME, model)
        atomic.step("wrote README.md")


def load_emoe(model: nn.Module, directory: str | os.PathLike) -> nn.Module:
    """Make ``model`` the EMoE model saved in ``directory`` (same layers, partition and top-k), in place, and return
    it. Every saved layer must exist in ``model``; nothing is clustered again."""
    directory = Path(directory)
    config_path, partition_path = directory / CONFIG_NAME, directory / PARTITION_NAME
    for path in (config_path, partition_path):
        if not path.is_file():
            why = atomic.interrupted(directory) if path == config_path else None
            raise FileNotFoundError(
                f"{directory} holds no saved EMoE model: {path.name} is missing" + (f": {why}." if why else ".")
            )
    config = _read_config(config_path)
    try:
        tensors = load_file(str(partition_path))
    except (OSError, SafetensorError) as error:
        raise ValueError(
            f"{partition_path} cannot be read ({error}); expected the safetensors file save_emoe writes: is it "
            "truncated or corrupt?"
        ) from None
    gate = config["gate"]
    expected = config["layers"] + ([name + GATE_SUFFIX for name in config["layers"]] if gate == "learned" else [])
    if sorted(tensors) != sorted(expected):
        raise ValueError(f"{partition_path} holds {sorted(tensors)}; its config needs {sorted(expected)}.")
    ordered = {name: tensors[name] for name in config["layers"]}
    moefy(model, num_experts=config["num_experts"], top_k=config["top_k"], partition=ordered, gate=gate)
    if gate == "learned":
        with torch.no_grad():
            for name, emoe_gate in emoe_gates(model).items():
                emoe_gate.weight.copy_(tensors[name + GATE_SUFFIX])
    return model


EXPECTED_CONFIG = (
    'the JSON object save_emoe writes: {"format": 1, "num_experts": N, "top_k": K, "gate": "avg_k" or "learned", '
    '"layers": [FFN module names]}'
)


def _read_config(path: Path) -> dict:
    """``emoe_config.json``, checked: every refusal names the file, the value, and what is expected."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); expected {EXPECTED_CONFIG}.") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not an object; expected {EXPECTED_CONFIG}.")
    if config.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path} has format {config.get('format')!r}; this version reads {FORMAT_VERSION}.")
    missing = [key for key in ("num_experts", "top_k", "layers") if key not in config]
    if missing:
        raise ValueError(f"{path} has no {', '.join(map(repr, missing))}; expected {EXPECTED_CONFIG}.")
    config.setdefault("gate", "avg_k")  # files written before learned gates existed
    num_experts, top_k, gate, layers = (config[key] for key in ("num_experts", "top_k", "gate", "layers"))
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{path}: num_experts is {num_experts!r}; expected a positive integer.")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"{path}: top_k is {top_k!r}; expected an integer in [1, num_experts={num_experts}].")
    if gate not in ("avg_k", "learned"):
        raise ValueError(f"{path}: gate is {gate!r}; expected 'avg_k' or 'learned'.")
    if (
        not isinstance(layers, list)
        or not layers
        or not all(isinstance(name, str) and name for name in layers)
        or len(set(layers)) != len(layers)
    ):
        raise ValueError(f"{path}: layers is {layers!r}; expected a non-empty list of distinct FFN module names.")
    return config
