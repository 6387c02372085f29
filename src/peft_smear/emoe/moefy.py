"""Find a model's FFNs, partition their neurons into experts, and put an :class:`EmoeGate` in each chosen FFN."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from peft import PeftModel
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..core.checks import is_integer
from .clustering import balanced_kmeans, random_partition
from .gate import EmoeGate


CLUSTERINGS = ("kmeans", "random")
GATES = ("avg_k", "learned")


@dataclass(frozen=True)
class FeedForwardKind:
    """An FFN layout: the paths (relative to the FFN's module) of its first layer (the keys), its other layers, and of
    the module that owns its activation, with the activation's attribute name."""

    name: str
    key_path: str
    other_paths: tuple[str, ...]
    activation_owner: str
    activation_attr: str


FEED_FORWARD_KINDS = (
    FeedForwardKind("BERT-style", "intermediate.dense", ("output.dense",), "intermediate", "intermediate_act_fn"),
    FeedForwardKind("GPT-2", "c_fc", ("c_proj",), "", "act"),
    FeedForwardKind("Llama-style gated", "gate_proj", ("up_proj", "down_proj"), "", "act_fn"),
)


@dataclass
class FeedForward:
    """One FFN found in a model: ``name`` is its module path in the transformers model (a PEFT wrapper's prefix
    removed), ``index`` its position among the model's FFNs (its layer)."""

    name: str
    index: int
    kind: FeedForwardKind
    key_layer: nn.Module
    activation_owner: nn.Module

    def keys(self) -> torch.Tensor:
        """``[d_ff, hidden]``: one key (row of the first layer) per neuron; ``Conv1D`` stores the transpose."""
        weight = self.key_layer.weight.detach()
        return weight.T if isinstance(self.key_layer, Conv1D) else weight

    @property
    def width(self) -> int:
        return self.keys().shape[0]

    @property
    def gate(self) -> EmoeGate | None:
        activation = getattr(self.activation_owner, self.kind.activation_attr)
        return activation if isinstance(activation, EmoeGate) else None


def moefy(
    model: nn.Module,
    num_experts: int = 64,
    top_k: int = 16,
    layers: int | Sequence[int] | str | None = None,
    clustering: str = "kmeans",
    seed: int = 0,
    partition: Mapping[str, torch.Tensor | np.ndarray] | None = None,
    gate: str = "avg_k",
) -> nn.Module:
    """Turn the chosen FFNs of ``model`` (a transformers model, or a ``PeftModel`` around one) into emergent experts,
    in place, and return it. Adds no parameter and leaves every ``state_dict`` unchanged (except ``gate="learned"``).
    Every check runs before the model is changed, so an error leaves it as it was.

    ``layers``: FFN indices (negative counts from the end), a regex matched against FFN module names, or ``None``
    for the paper's default, the last even-numbered layer (0-based). ``clustering``: ``"kmeans"`` (balanced k-means
    of the L2-normalised keys, the paper's) or ``"random"`` (random equal groups, the ablation). ``partition``: the
    expert of every neuron per FFN name (what :func:`~peft_smear.emoe.load_emoe` passes), instead of clustering.
    ``gate``: ``"avg_k"`` (the paper's EMoE, no parameter) or ``"learned"`` (EMoE-learn: a trainable gate per layer,
    initialised at the experts' mean keys; PEFT freezes it, so pass :func:`gate_parameters` to training yourself).
    """
    if gate not in GATES:
        raise ValueError(f"gate={gate!r} is not one of {GATES}.")
    if clustering not in CLUSTERINGS:
        raise ValueError(f"clustering={clustering!r} is not one of {CLUSTERINGS}.")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r} must be a positive integer.")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k!r} must be an integer between 1 and num_experts={num_experts}.")
    if partition is not None and layers is not None:
        raise ValueError(f"Pass either layers={layers!r} or a partition (which names its layers), not both.")
    feed_forwards = find_feed_forwards(model)
    chosen = select_layers(feed_forwards, layers) if partition is None else _by_name(feed_forwards, partition)
    for ffn in chosen:
        if ffn.gate is not None:
            raise ValueError(f"{ffn.name} is already an EMoE layer; call remove_emoe(model) first.")
        if ffn.width % num_experts:
            divisors = [n for n in range(2, ffn.width) if ffn.width % n == 0 and n <= 256]
            raise ValueError(
                f"num_experts={num_experts} does not divide the FFN width {ffn.width} of {ffn.name}; choose a divisor "
                f"such as {divisors[-8:]}."
            )
    partitions = {}
    for ffn in chosen:
        if partition is not None:
            partitions[ffn.name] = torch.as_tensor(np.asarray(partition[ffn.name]), dtype=torch.long)
            check_partition(partitions[ffn.name], ffn, num_experts)
        else:
            partitions[ffn.name] = torch.from_numpy(_partition(ffn, num_experts, clustering, seed))
    for ffn in chosen:
        labels = partitions[ffn.name]
        activation = getattr(ffn.activation_owner, ffn.kind.activation_attr)
        device = ffn.key_layer.weight.device
        keys = ffn.keys() if gate == "learned" else None
        emoe_gate = EmoeGate(activation, labels.to(device), num_experts, top_k, ffn.key_layer, ffn.name, keys)
        setattr(ffn.activation_owner, ffn.kind.activation_attr, emoe_gate)
    return model


def remove_emoe(model: nn.Module) -> nn.Module:
    """Put the dense FFNs back (the original activation modules), in place: what EMoE2LoRA evaluates."""
    for ffn in find_feed_forwards(model):
        if (gate := ffn.gate) is not None:
            gate.detach_from_key_layer()
            setattr(ffn.activation_owner, ffn.kind.activation_attr, gate.activation)
    return model


def gate_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The learned gates' weights (``gate="learned"``), to train: ``for p in gate_parameters(model):
    p.requires_grad_(True)`` after ``get_peft_model``, which freezes them with the rest of the base model."""
    return [gate.weight for gate in emoe_gates(model).values() if gate.weight is not None]


def emoe_gates(model: nn.Module) -> dict[str, EmoeGate]:
    """The EMoE gates of ``model`` by FFN name, in layer order."""
    return {ffn.name: gate for ffn in find_feed_forwards(model) if (gate := ffn.gate) is not None}


def find_feed_forwards(model: nn.Module) -> list[FeedForward]:
    """Every FFN of ``model`` of a kind in :data:`FEED_FORWARD_KINDS`, in module order; an error naming the model
    and the layouts looked for when there is none."""
    root = model.get_base_model() if isinstance(model, PeftModel) else model
    found = []
    for name, module in root.named_modules():
        for kind in FEED_FORWARD_KINDS:
            key_layer = _submodule(module, kind.key_path)
            owner = _submodule(module, kind.activation_owner) if kind.activation_owner else module
            if key_layer is None or owner is None or any(_submodule(module, p) is None for p in kind.other_paths):
                continue
            if not isinstance(getattr(owner, kind.activation_attr, None), nn.Module):
                continue
            found.append(FeedForward(name, len(found), kind, _base_layer(key_layer), owner))
            break
    if not found:
        layouts = "; ".join(
            f"{kind.name}: {kind.key_path} with {', '.join(kind.other_paths)} and an activation module "
            f"{'.'.join(filter(None, [kind.activation_owner, kind.activation_attr]))}"
            for kind in FEED_FORWARD_KINDS
        )
        raise ValueError(
            f"EMoE found no feed-forward block it recognises in {type(root).__name__} (looked for {layouts})."
        )
    return found


def select_layers(feed_forwards: list[FeedForward], layers: int | Sequence[int] | str | None) -> list[FeedForward]:
    """The FFNs ``layers`` names (see :func:`moefy`)."""
    count = len(feed_forwards)
    if layers is None:
        return [feed_forwards[count - 1 if (count - 1) % 2 == 0 else count - 2]]
    if isinstance(layers, str):
        chosen = [ffn for ffn in feed_forwards if re.search(layers, ffn.name)]
        if not chosen:
            names = ", ".join(ffn.name for ffn in feed_forwards)
            raise ValueError(f"layers={layers!r} matches none of the FFNs: {names}.")
        return chosen
    indices = [layers] if isinstance(layers, int) else list(layers)
    if not indices:
        raise ValueError("layers=[] chooses no FFN; pass None for the paper's default.")
    for index in indices:
        if not is_integer(index) or not -count <= index < count:
            raise ValueError(f"Layer index {index!r} is out of range: the model has {count} FFNs (0 to {count - 1}).")
    return [feed_forwards[i] for i in sorted({i % count for i in indices})]


def check_partition(labels: torch.Tensor, ffn: FeedForward, num_experts: int) -> None:
    """A partition must give each of the FFN's neurons an expert in ``[0, num_experts)``, each expert equally many."""
    size = ffn.width // num_experts
    balanced = labels.shape == (ffn.width,) and bool((labels >= 0).all()) and bool((labels < num_experts).all())
    if not balanced or not bool((torch.bincount(labels, minlength=num_experts) == size).all()):
        raise ValueError(
            f"The partition of {ffn.name} is not {num_experts} experts of {size} neurons each over its {ffn.width} "
            f"neurons (got shape {tuple(labels.shape)})."
        )


def _partition(ffn: FeedForward, num_experts: int, clustering: str, seed: int) -> np.ndarray:
    if clustering == "random":
        return random_partition(ffn.width, num_experts, seed)
    keys = torch.nn.functional.normalize(ffn.keys().float(), dim=-1).cpu().numpy()
    return balanced_kmeans(keys, num_experts, seed=seed)


def _by_name(feed_forwards: list[FeedForward], partition: Mapping[str, object]) -> list[FeedForward]:
    by_name = {ffn.name: ffn for ffn in feed_forwards}
    missing = sorted(set(partition) - set(by_name))
    if missing:
        raise ValueError(f"The partition names FFNs the model does not have: {missing}.")
    return [by_name[name] for name in partition]


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    for part in path.split("."):
        module = getattr(module, part, None)
        if not isinstance(module, nn.Module):
            return None
    return module


def _base_layer(layer: nn.Module) -> nn.Module:
    """The ``Linear`` / ``Conv1D`` under any adapter wrappers (PEFT's ``base_layer``)."""
    while hasattr(layer, "base_layer"):
        layer = layer.base_layer
    if not isinstance(layer, (nn.Linear, Conv1D)):
        raise ValueError(f"The FFN's first layer is a {type(layer).__name__}; EMoE supports Linear and Conv1D.")
    return layer
