"""A bank of existing LoRA adapters as one SMEAR adapter: each expert *is* one of the adapters, routed by any routing
method (Arrow, PHATGOOSE, GLIDER, SMEAR's learned router over the frozen bank, ...).

Adapters may differ in rank (zero-padded, which changes nothing: the padded rows of A and columns of B are zero), in
``lora_alpha`` / rsLoRA (each expert's scaling is folded into its B, so every expert shares the bank's scaling of 1),
and in target modules (the bank wraps their union; an adapter that does not touch a module is a zero expert there).
"""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from peft.utils import load_peft_weights
from safetensors import SafetensorError
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..core.config import SmearConfig
from ..core.layer import SmearLinear, in_out_features
from ..core.routers import ROUTERS


AdapterSource = str | os.PathLike | PeftModel
"""A saved PEFT LoRA adapter: a local directory, a Hub id (read from the local cache when offline), or a loaded
``PeftModel`` (its active adapter)."""

_PEFT_PREFIX = "base_model.model."
_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
# Config fields the bank sets from the adapters, which a caller must leave at their defaults.
_FROM_THE_ADAPTERS = ("target_modules", "r", "lora_alpha", "use_rslora", "expert_names", "expert_type")


@dataclass
class LoraAdapter:
    """One adapter as the bank reads it: per module (its name in the base model) ``A [r, in]`` and ``B [out, r]``
    in fp32, and the factor its outputs are scaled by."""

    name: str
    config: LoraConfig
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    saved_modules: dict[str, torch.Tensor] = field(default_factory=dict)  # modules_to_save, as PEFT saves them

    def rank(self, module: str) -> int:
        return self.weights[module][0].shape[0]

    def module_scaling(self, module: str) -> float:
        """``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA) at this module's own rank, as PEFT scales it."""
        r = self.rank(module)
        return self.config.lora_alpha / (math.sqrt(r) if self.config.use_rslora else r)


def build_expert_bank(
    base_model: nn.Module,
    adapters: Mapping[str, AdapterSource],
    config: SmearConfig | Mapping[str, Any] | None = None,
    *,
    general_adapters: Mapping[str, AdapterSource] | None = None,
    trainable_experts: bool = False,
    descriptions: Mapping[str, str] | None = None,
    embeddings: Mapping[str, Sequence[float]] | torch.Tensor | None = None,
    adapter_name: str = "default",
) -> PeftModel:
    """Wrap ``base_model`` (in place, as ``get_peft_model`` does) with one SMEAR adapter whose experts are
    ``adapters`` (expert name -> saved PEFT LoRA adapter), in that order, routed as the config's ``routing`` says.

    ``config`` is a ``SmearConfig`` or a mapping of its fields (e.g. ``{"routing": "glider", "task_type":
    "CAUSAL_LM"}``, validated once the bank's size is known; default: SMEAR routing). ``num_experts``,
    ``target_modules``, ``r`` and the scaling come from the adapters: leave them unset. Routing one-hot to expert
    ``i`` reproduces adapter ``i`` (up to float rounding). ``general_adapters`` applies Arrow's GenKnowSub: the mean
    ``A`` and ``B`` of these "general" adapters is subtracted from every adapter first, as PEFT's Arrow does (all
    adapters then need one rank and the same modules). Experts are frozen unless ``trainable_experts``: only routers
    (and ``modules_to_save``) train. ``descriptions`` and ``embeddings`` (by expert name, or embeddings as a tensor
    with a row per expert; see :func:`peft_smear.describe_tasks` and :func:`peft_smear.embed_texts`) are kept in the
    adapter's config; GLIDER's global router reads the embeddings.

    Adapters that do not fit are refused with an error naming the adapter and the module: another base architecture
    (a module the base model lacks, or other sizes), other PEFT types, DoRA, LoRA biases, per-module alpha patterns,
    adapters that train more than LoRA weights (``modules_to_save``, embedding LoRAs).
    """
    if not adapters:
        raise ValueError("build_expert_bank needs at least one adapter.")
    config = {} if config is None else config
    loaded = [read_lora_adapter(name, source, base_model) for name, source in adapters.items()]
    if general_adapters:
        general = [read_lora_adapter(name, source, base_model) for name, source in general_adapters.items()]
        subtract_general_knowledge(loaded, general)

    modules = [name for name, _ in base_model.named_modules() if any(name in a.weights for a in loaded)]
    rank = max(a.rank(m) for a in loaded for m in a.weights)
    bank_config = _bank_config(config, loaded, modules, rank, trainable_experts, descriptions, embeddings, base_model)
    model = get_peft_model(base_model, bank_config, adapter_name=adapter_name)
    layers = {name: m for name, m in model.base_model.model.named_modules() if isinstance(m, SmearLinear)}
    if set(layers) != set(modules):
        raise RuntimeError(f"The bank wrapped {sorted(layers)} instead of the adapters' modules {sorted(modules)}.")
    with torch.no_grad():
        for module, layer in layers.items():
            bank_A, bank_B = layer.smear_lora_A[adapter_name], layer.smear_lora_B[adapter_name]
            bank_A.zero_()
            bank_B.zero_()
            for n, adapter in enumerate(loaded):
                if module in adapter.weights:
                    A, B = adapter.weights[module]
                    bank_A[n, : A.shape[0]] = A
                    bank_B[n, :, : B.shape[1]] = B * adapter.module_scaling(module)
    return model


def read_lora_adapter(
    name: str, source: AdapterSource, base_model: nn.Module, keep_modules_to_save: bool = False
) -> LoraAdapter:
    """``source`` as a :class:`LoraAdapter`, checked against ``base_model``; refusals name ``name`` and the module.
    ``keep_modules_to_save``: keep the weights of the adapter's ``modules_to_save`` (upcycling carries them over)
    instead of refusing them."""
    if isinstance(source, PeftModel):
        adapter = source.active_adapter
        config = source.peft_config[adapter]
        state = get_peft_model_state_dict(source, adapter_name=adapter)
    else:
        try:
            config = PeftConfig.from_pretrained(str(source))
        except (OSError, ValueError) as error:
            raise ValueError(
                f"Adapter {name!r}: cannot read a PEFT adapter from {str(source)!r}: {error} (expected a saved PEFT "
                "LoRA adapter: a directory with adapter_config.json and its weights, or a Hub id)"
            ) from error
        try:
            state = load_peft_weights(str(source))
        except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError, SafetensorError) as error:
            raise ValueError(
                f"Adapter {name!r}: cannot read the weights of {str(source)!r} ({type(error).__name__}: {error}); "
                "expected the adapter_model.safetensors that save_pretrained() writes: is the file truncated or "
                "corrupt?"
            ) from error
    peft_type = getattr(config.peft_type, "value", config.peft_type)
    if peft_type != "LORA":
        raise ValueError(f"Adapter {name!r} is a {peft_type} adapter; a bank is built from LoRA adapters.")
    refusals = {
        "use_dora": "DoRA adapters rescale the weight's norm, which is no LoRA expert",
        "lora_bias": "LoRA biases are not part of a LoRA expert",
        "alpha_pattern": "per-module lora_alpha patterns are not supported",
    }
    for field_name, why in refusals.items():
        if getattr(config, field_name, None):
            raise ValueError(f"Adapter {name!r} sets {field_name}={getattr(config, field_name)!r}: {why}.")

    modules = dict(base_model.named_modules())
    weights: dict[str, dict[str, torch.Tensor]] = {}
    kept = tuple(config.modules_to_save or ()) if keep_modules_to_save else ()
    saved_modules = {}
    for key, tensor in state.items():
        suffix = next((s for s in _LORA_SUFFIXES if key.endswith(s)), None)
        if suffix is None and any(f".{module}." in f".{key.removeprefix(_PEFT_PREFIX)}" for module in kept):
            saved_modules[key] = tensor
            continue
        if suffix is None:
            raise ValueError(
                f"Adapter {name!r} holds {key!r}, which is not a LoRA weight of a linear layer (a bank takes adapters "
                "that only train lora_A / lora_B: no modules_to_save, no embedding or convolution LoRAs)."
            )
        module = key.removeprefix(_PEFT_PREFIX).removesuffix(suffix)
        weights.setdefault(module, {})[suffix] = tensor.detach().float().cpu()
    loaded = {}
    for module, pair in weights.items():
        if len(pair) != 2:
            raise ValueError(f"Adapter {name!r}, module {module!r}: lora_A and lora_B must both be present.")
        A, B = pair[_LORA_SUFFIXES[0]], pair[_LORA_SUFFIXES[1]]
        target = modules.get(module)
        if target is None:
            raise ValueError(
                f"Adapter {name!r}, module {module!r}: the base model has no such module (was the adapter trained "
                "on another base model?)."
            )
        if not isinstance(target, (nn.Linear, Conv1D)):
            raise ValueError(
                f"Adapter {name!r}, module {module!r}: a {type(target).__name__}; a bank wraps Linear and Conv1D."
            )
        in_features, out_features = in_out_features(target)
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1]:
            raise ValueError(
                f"Adapter {name!r}, module {module!r}: lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} are no "
                "rank-r pair."
            )
        if (A.shape[1], B.shape[0]) != (in_features, out_features):
            raise ValueError(
                f"Adapter {name!r}, module {module!r}: its LoRA maps {A.shape[1]} -> {B.shape[0]} features, the base "
                f"module {in_features} -> {out_features} (another base architecture?)."
            )
        loaded[module] = (A, B)
    if not loaded:
        raise ValueError(f"Adapter {name!r} has no LoRA weights.")
    return LoraAdapter(name, config, loaded, saved_modules)


def subtract_general_knowledge(adapters: list[LoraAdapter], general: list[LoraAdapter]) -> None:
    """GenKnowSub (as PEFT's Arrow applies it): from every adapter's ``A`` and ``B`` subtract the mean ``A`` and ``B``
    of the general adapters, module by module. All adapters must share one rank and one set of modules."""
    reference = adapters[0]
    for adapter in [*adapters, *general]:
        if set(adapter.weights) != set(reference.weights):
            raise ValueError(
                f"GenKnowSub needs every adapter on the same modules: {adapter.name!r} targets "
                f"{sorted(set(adapter.weights) ^ set(reference.weights))[:3]} where {reference.name!r} does not, or "
                "the other way round."
            )
        for module in adapter.weights:
            if adapter.rank(module) != reference.rank(module):
                raise ValueError(
                    f"GenKnowSub needs one rank: adapter {adapter.name!r}, module {module!r} has rank "
                    f"{adapter.rank(module)}, adapter {reference.name!r} {reference.rank(module)}."
                )
    for module in reference.weights:
        mean_A = torch.stack([g.weights[module][0] for g in general]).mean(0)
        mean_B = torch.stack([g.weights[module][1] for g in general]).mean(0)
        for adapter in adapters:
            A, B = adapter.weights[module]
            adapter.weights[module] = (A - mean_A, B - mean_B)


def _bank_config(
    config: SmearConfig | Mapping[str, Any],
    adapters: list[LoraAdapter],
    modules: list[str],
    rank: int,
    trainable_experts: bool,
    descriptions: Mapping[str, str] | None,
    embeddings: Mapping[str, Sequence[float]] | torch.Tensor | None,
    base_model: nn.Module,
) -> SmearConfig:
    """The caller's settings with what the adapters decide filled in, validated as a new ``SmearConfig``."""
    names = [a.name for a in adapters]
    defaults = {f.name: f.default for f in fields(SmearConfig) if f.init}
    if isinstance(config, SmearConfig):
        given = {name: getattr(config, name) for name in defaults if getattr(config, name) != defaults[name]}
        if given.get("num_experts") == ROUTERS[config.routing].default_num_experts:
            del given["num_experts"]  # filled in by the config, not chosen
    else:  # fields and routing options by name; SmearConfig refuses any other name
        given = dict(config)
    for name in (*_FROM_THE_ADAPTERS, "num_experts"):
        if name in given and not (name == "num_experts" and given[name] == len(adapters)):
            raise ValueError(
                f"build_expert_bank takes {name} from the adapters; leave it unset (it is {given[name]!r})."
            )
    task_types = {a.config.task_type for a in adapters if a.config.task_type is not None}
    if given.get("task_type") is None and len(task_types) > 1:
        raise ValueError(f"The adapters have different task types {sorted(task_types)}; set task_type.")
    values = {**defaults, **given}
    values.update(
        num_experts=len(adapters),
        target_modules=modules,
        r=rank,
        lora_alpha=float(rank),  # scaling 1: each expert's own scaling is folded into its B
        use_rslora=False,
        freeze_experts=bool(values["freeze_experts"]) or not trainable_experts,
        expert_names=names,
        task_type=values["task_type"] or (task_types.pop() if task_types else None),
        base_model_name_or_path=values["base_model_name_or_path"] or getattr(base_model, "name_or_path", None) or None,
    )
    if descriptions is not None:
        values["expert_descriptions"] = _per_expert("descriptions", descriptions, names)
    if embeddings is not None:
        values["expert_embeddings"] = _per_expert("embeddings", embeddings, names)
    values.pop("peft_type", None)
    # A bank smaller than a method's default top-k uses every expert (an Arrow bank of two adapters: top-2, not 3).
    options = dict(values.get("routing_options") or {})
    for option in ROUTERS[values["routing"]].options:
        default, name = option.default, option.name
        unset = name not in given and options.get(name, default) == default
        if name.endswith("top_k") and isinstance(default, int) and default > len(adapters) and unset:
            options[name] = len(adapters)
    values["routing_options"] = options or values.get("routing_options")
    return SmearConfig(**values)


def _per_expert(what: str, values, names: list[str]) -> list | None:
    """``values`` (by expert name, or a tensor with one row per expert) as a list in the experts' order."""
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        if values.shape[0] != len(names):
            raise ValueError(f"{what} has {values.shape[0]} rows for {len(names)} experts.")
        return values.tolist()
    missing, unknown = sorted(set(names) - set(values)), sorted(set(values) - set(names))
    if missing or unknown:
        raise ValueError(f"{what} must name every expert exactly: missing {missing}, unknown {unknown}.")
    return [list(map(float, values[n])) if what == "embeddings" else values[n] for n in names]
