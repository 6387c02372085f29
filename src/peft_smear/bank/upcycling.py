"""Upcycling: a SMEAR adapter whose experts all start as copies of one trained PEFT LoRA, as sparse upcycling starts
a mixture of experts from a dense layer.

With identical experts every routing gives the same merged (or mixed, or chosen) expert, so at step 0 the model
computes exactly the LoRA's function, whatever the routing; SMEAR then starts where the LoRA is instead of from zero.
The same identity makes the router's gradient exactly zero at step 0 (the softmax Jacobian cancels the experts'
common contribution). The copies drift apart from the first optimiser step, through what makes their gradients
differ: expert dropout (each expert misses other examples), the router's not quite uniform initial distribution,
and routings that send examples to different experts. ``expert_noise`` adds a relative perturbation on top, at the
price of the step-0 equality; ``docs/upcycling.md`` has the measurement behind its default of 0.
"""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Any

import torch
from peft import PeftConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import ModulesToSaveWrapper
from torch import nn

from ..core.config import SmearConfig
from ..core.layer import SmearLinear
from ..core.routers import ROUTERS
from .build import _PEFT_PREFIX, AdapterSource, LoraAdapter, read_lora_adapter


# What the LoRA decides and the caller must leave unset: its rank, scaling and modules carry over exactly.
FROM_THE_LORA = ("r", "lora_alpha", "use_rslora", "target_modules", "layers_to_transform", "layers_pattern")
# Routings whose experts are other trained adapters, read as a bank (their routers score each expert on its own).
BANK_ROUTINGS = ("arrow", "phatgoose", "glider", "glider_merge")


def upcycle(
    lora: AdapterSource,
    base_model: nn.Module | None = None,
    *,
    num_experts: int | None = None,
    expert_noise: float = 0.0,
    adapter_name: str = "default",
    **settings: Any,
) -> PeftModel:
    """A SMEAR model whose ``num_experts`` experts start as copies of the PEFT LoRA ``lora``.

    ``lora`` is a ``PeftModel`` with a LoRA adapter (its active one; its base model is unwrapped and reused, so the
    ``PeftModel`` must not be used afterwards) or a saved LoRA adapter (a directory or Hub id), then applied to
    ``base_model``. ``settings`` are ``SmearConfig`` fields and routing options (``routing="top_k"``,
    ``expert_dropout=0.1``, ``task_type``, ...); the rank, ``lora_alpha``, rsLoRA and the wrapped modules come from the
    LoRA, so its scaling carries over exactly, as does its ``lora_dropout`` unless set here. Experts are LoRA
    experts. ``expert_noise``: a relative std (of each copy's own tensor's std) of Gaussian noise added to every copy's
    A and B, which breaks the experts' symmetry at once but the step-0 equality with the LoRA too (0, the default,
    keeps it; see ``docs/upcycling.md``).

    The LoRA's ``modules_to_save`` (a trained head) carry over as the SMEAR adapter's, with their weights, besides
    any given here. A LoRA SMEAR cannot take is refused by name: other PEFT types, DoRA, LoRA biases or ``bias`` other
    than ``"none"``, per-module rank or alpha patterns, LoRAs of embeddings or convolutions, modules the base model
    lacks.
    """
    if isinstance(lora, PeftModel):
        _check_config(lora.peft_config[lora.active_adapter])
        adapter = read_lora_adapter("lora", lora, _Unwrapped(lora.get_base_model()), keep_modules_to_save=True)
        if base_model is None:
            base_model = lora.unload()
    elif base_model is None:
        raise ValueError(f"upcycle({str(lora)!r}) needs base_model=, the model the saved LoRA adapter was trained on.")
    elif isinstance(lora, (str, os.PathLike)):
        try:
            config = PeftConfig.from_pretrained(str(lora))
        except (OSError, ValueError):
            config = None  # read_lora_adapter says why the adapter cannot be read
        if config is not None:
            _check_config(config)
        adapter = read_lora_adapter("lora", lora, base_model, keep_modules_to_save=True)
    else:
        raise TypeError(f"upcycle takes a PeftModel or the path of a saved LoRA adapter, got {type(lora).__name__}.")
    rank = _rank(adapter)
    config = _upcycled_config(adapter, rank, num_experts, settings, base_model)
    if expert_noise < 0:
        raise ValueError(f"expert_noise must be >= 0, got {expert_noise!r}.")
    model = get_peft_model(base_model, config, adapter_name=adapter_name)
    _load_saved_modules(model, adapter, adapter_name)
    layers = {name: m for name, m in model.base_model.model.named_modules() if isinstance(m, SmearLinear)}
    if set(layers) != set(adapter.weights):
        raise RuntimeError(f"SMEAR wrapped {sorted(layers)} instead of the LoRA's modules {sorted(adapter.weights)}.")
    # top_k scales each chosen expert's output by its probability (not renormalised): the router starts exactly
    # uniform (its rows' gain 0) and the copies' B are scaled by N / k, so that the k outputs add up to the LoRA's.
    top_k = config.routing_options["top_k"] if config.routing == "top_k" else None
    with torch.no_grad():
        for module, layer in layers.items():
            A, B = adapter.weights[module]
            if top_k is not None:
                layer.smear_router[adapter_name].row_norm_weight.zero_()
                B = B * (config.num_experts / top_k)
            for name, source in (("smear_lora_A", A), ("smear_lora_B", B)):
                copies = getattr(layer, name)[adapter_name]
                copies.copy_(source.to(copies).expand_as(copies))
                if expert_noise:
                    copies.add_(torch.randn_like(copies) * expert_noise * source.std().to(copies))
    return model


class _Unwrapped:
    """A model with PEFT layers seen as its base model: each tuner layer as the module it wraps."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def named_modules(self):
        for name, module in self.model.named_modules():
            yield name, module.get_base_layer() if isinstance(module, BaseTunerLayer) else module


def _check_config(config: PeftConfig) -> None:
    """Refuse, by name, the LoRA settings that the bank reader lets through but upcycling cannot take."""
    if getattr(config, "bias", "none") != "none":
        raise ValueError(f"The LoRA sets bias={config.bias!r}: SMEAR trains no biases (only bias='none' is taken).")
    if getattr(config, "rank_pattern", None):
        raise ValueError(
            f"The LoRA sets rank_pattern={config.rank_pattern!r}: every expert of a SMEAR adapter has one rank r."
        )


def _load_saved_modules(model: PeftModel, adapter: LoraAdapter, adapter_name: str) -> None:
    """The LoRA's trained ``modules_to_save`` (a classifier head, say) into the SMEAR adapter's copies of them."""
    for name, wrapper in model.base_model.model.named_modules():
        prefix = f"{_PEFT_PREFIX}{name}."
        state = {k.removeprefix(prefix): v for k, v in adapter.saved_modules.items() if k.startswith(prefix)}
        if isinstance(wrapper, ModulesToSaveWrapper) and state:
            wrapper.modules_to_save[adapter_name].load_state_dict(state, strict=True)


def _rank(adapter: LoraAdapter) -> int:
    ranks = {adapter.rank(module) for module in adapter.weights}
    if len(ranks) != 1:
        raise ValueError(
            f"The LoRA has modules of ranks {sorted(ranks)}: every expert of a SMEAR adapter has one rank r."
        )
    return ranks.pop()


def _upcycled_config(
    adapter: LoraAdapter, rank: int, num_experts: int | None, settings: dict[str, Any], base_model: nn.Module
) -> SmearConfig:
    """The caller's settings with the LoRA's rank, scaling and modules, validated as a new ``SmearConfig``."""
    for name in (*FROM_THE_LORA, "expert_type", "init_weights"):
        if name in settings:
            raise ValueError(
                f"upcycle takes {name} from the LoRA (its experts are LoRA copies); leave it unset (it is "
                f"{settings[name]!r})."
            )
    routing = settings.get("routing", "smear")
    if routing in BANK_ROUTINGS:
        raise ValueError(
            f"routing={routing!r} scores experts trained apart (a bank: peft_smear.build_expert_bank), and copies of "
            f"one LoRA are all alike to it; upcycle with one of {tuple(r for r in ROUTERS if r not in BANK_ROUTINGS)}."
        )
    config = adapter.config
    lora_dropout = settings.pop("lora_dropout", config.lora_dropout)
    modules_to_save = [*(settings.pop("modules_to_save", None) or ()), *(config.modules_to_save or ())]
    known = {f.name for f in fields(SmearConfig)}
    values = {
        **settings,
        "num_experts": num_experts,
        "r": rank,
        "lora_alpha": config.lora_alpha,
        "use_rslora": bool(config.use_rslora),
        "lora_dropout": lora_dropout,
        "target_modules": sorted(adapter.weights),
        "modules_to_save": sorted(set(modules_to_save)) or None,
    }
    if "task_type" in known and values.get("task_type") is None:
        values["task_type"] = config.task_type
    if values.get("base_model_name_or_path") is None:
        values["base_model_name_or_path"] = config.base_model_name_or_path or getattr(base_model, "name_or_path", None)
    return SmearConfig(**values)
