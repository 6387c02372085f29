"""Export the merged expert of a fixed routing as an adapter with one expert per module.

For one fixed distribution ``p`` per layer the merged expert is an ordinary adapter of the same kind, and each expert
kind writes it as such (:meth:`~peft_smear.core.experts.ExpertKind.export_weights`):

* LoRA experts: SMEAR applies ``(sum_n p_n B_n)(sum_n p_n A_n) x * scaling``, exactly a LoRA with
  ``A = sum_n p_n A_n`` and ``B = sum_n p_n B_n`` at the same rank and scaling, which vanilla PEFT, vLLM, TGI and
  LoRAX can load and which ``merge_and_unload`` can fold into the base weights;
* IA3 experts: a PEFT IA3 adapter with ``l = sum_n p_n l_n``, loadable and mergeable by vanilla PEFT too;
* bottleneck adapter experts: no PEFT method is one, so a SMEAR adapter with a single expert and
  ``routing="single"`` (no router, one adapter's cost), which loads wherever ``peft_smear`` is imported.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import PeftConfig, get_peft_model_state_dict
from peft.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME
from safetensors.torch import save_file
from transformers.pytorch_utils import Conv1D

from . import atomic
from .experts import EXPERT_KINDS
from .layer import SmearLinear
from .model import SmearModel, get_routing_weights
from .model_card import write_export_card
from .routers import ROUTERS


Routing = Mapping[str, torch.Tensor] | Iterable[Mapping[str, Any]]


def export_merged_adapter(
    peft_model: torch.nn.Module,
    save_directory: str | os.PathLike,
    *,
    routing: Routing,
    adapter_name: str = "default",
    overwrite: bool = False,
    source: str | None = None,
    task: str | None = None,
    usage: str | None = None,
) -> PeftConfig:
    """Write the merged expert of ``routing`` as an adapter directory and return its config: a PEFT LoRA adapter for
    LoRA experts, a PEFT IA3 adapter for IA3 experts, a single-expert SMEAR adapter for bottleneck adapter experts.

    ``routing`` is one of:

    * the routing weights of one example, as returned by :func:`get_routing_weights` for a batch of size 1
      (``{module name: [1, num_experts]}``): that example's merged expert, exactly;
    * a fixed distribution per router, ``{module name: [num_experts]}`` (e.g. one-hot to extract one expert);
    * a task: an iterable (not a mapping) of input batches. Each router gets the mean of its routing distributions
      over all the task's examples, and the export is the merged expert *of that mean routing*. Because A and B are
      merged separately, that is not the average of the examples' own merged experts.

    One expert (a one-hot routing) can be exported from an adapter of any routing method: it is that expert, however
    the method routes. Other routings only from methods whose output is one merged or chosen expert
    (``Router.exportable``): a per-token router or an output mixture has no single expert to export.

    The directory is replaced in one step once the new export, card included, is complete: a process killed at any
    moment leaves the old directory (or nothing, if there was none) or the complete new export, never a mix. An
    existing non-empty directory needs ``overwrite=True``. It
    gets a model card (``README.md``) that says what it was exported from (``source``, e.g. the SMEAR adapter's
    directory or Hub id, when given), with which routing (``task``: the task of a task's batches, in the card's
    Markdown, e.g. ``"`topic` (validation split)"``) and how to load it (``usage``: Python code that replaces the
    load snippet).
    """
    tuner = getattr(peft_model, "base_model", None)
    if not isinstance(tuner, SmearModel):
        raise TypeError(
            f"export_merged_adapter needs a PeftModel with a SMEAR adapter, got {type(peft_model).__name__}."
        )
    if adapter_name not in tuner.peft_config:
        raise ValueError(f"No adapter named {adapter_name!r}; adapters: {sorted(tuner.peft_config)}.")
    method, what = tuner.peft_config[adapter_name].routing, f"Adapter {adapter_name!r}"
    if not isinstance(routing, Mapping):  # a task's mean routing: refused before any batch is routed
        check_exportable(method, what)
    target = Path(save_directory)
    refuse_occupied(target, overwrite, "pass overwrite=True to replace it")

    layers = {
        name: module
        for name, module in tuner.model.named_modules()
        if isinstance(module, SmearLinear) and adapter_name in module.expert_kind
    }
    distributions, examples = _routing_distributions(peft_model, layers, routing, adapter_name, method, what)
    kinds = {name: layer.expert_kind[adapter_name] for name, layer in layers.items()}
    weights = {}
    with torch.no_grad():
        for name, layer in layers.items():
            params = layer.expert_params(adapter_name)
            for suffix, tensor in kinds[name].export_weights(params, distributions[name]).items():
                weights[f"base_model.model.{name}.{suffix}"] = tensor
    # modules_to_save (e.g. a classification head) are stored exactly as PEFT stores them for every adapter type.
    for key, value in get_peft_model_state_dict(peft_model, adapter_name=adapter_name).items():
        if ".smear_" not in key:
            weights[key] = value

    smear_config = tuner.peft_config[adapter_name]
    fan_in_fan_out = any(isinstance(layer.get_base_layer(), Conv1D) for layer in layers.values())
    exported_config = EXPERT_KINDS[smear_config.expert_type].export_config(smear_config, kinds, fan_in_fan_out)
    exported_from = ExportedRouting.of(routing, distributions, examples, smear_config, task)
    parameters = sum(tensor.numel() for tensor in weights.values())

    def card(directory: Path) -> None:
        write_export_card(
            directory, exported_config, peft_model, adapter_name, exported_from, parameters, source, usage
        )

    _write_atomically(target, exported_config, {k: v.detach().cpu().contiguous() for k, v in weights.items()}, card)
    return exported_config


def check_exportable(
    routing_method: str, what: str, one_expert: str = "a one-hot routing, {module name: one-hot}"
) -> None:
    """Refuse, before any work is done, to export a routing other than one expert (a task's mean routing, a fixed
    distribution) from a routing method whose layer output is not one merged or chosen expert. ``one_expert``: how
    the caller exports one expert instead, for the message."""
    reason = _why_not_one_expert(routing_method)
    if reason is not None:
        raise ValueError(
            f"{what} uses routing={routing_method!r}, which {reason}, so no single expert reproduces its routing. "
            f"Only one of its experts can be exported: {one_expert}."
        )


def _why_not_one_expert(routing_method: str) -> str | None:
    router = ROUTERS[routing_method]
    if router.per_token:
        return "routes every token on its own and mixes the experts' outputs per token"
    if not router.exportable:
        return "mixes or scales the experts' outputs instead of merging their parameters"
    return None


@dataclass(frozen=True)
class ExportedRouting:
    """What an export merged, in the model card's words: one expert, one example, a task's mean, or a distribution."""

    kind: str
    """``"expert"``, ``"example"``, ``"task"`` or ``"fixed"``."""
    expert: int | None = None
    expert_name: str | None = None
    examples: int | None = None
    task: str | None = None

    @classmethod
    def of(
        cls,
        routing: Routing,
        distributions: dict[str, torch.Tensor],
        examples: int | None,
        config: Any,
        task: str | None,
    ) -> ExportedRouting:
        if examples is not None:
            return cls("task", examples=examples, task=task)
        experts = {_one_hot_index(p) for p in distributions.values()}
        if len(experts) == 1 and None not in experts:
            (expert,) = experts
            names = config.expert_names
            return cls("expert", expert=expert, expert_name=names[expert] if names else None)
        batched = any(torch.as_tensor(weights).dim() == 2 for weights in routing.values())
        return cls("example" if batched else "fixed")

    def describe(self) -> str:
        if self.kind == "expert":
            name = f" (`{self.expert_name}`)" if self.expert_name else ""
            return f"expert {self.expert}{name} of every layer: that expert alone, exactly"
        if self.kind == "task":
            of_task = f" of task {self.task}" if self.task else ""
            return f"the mean routing of {self.examples} examples{of_task}, fixed: the merged expert of that routing"
        if self.kind == "example":
            return "the routing of one example, fixed: that example's merged expert, exactly"
        return "a fixed distribution over the experts per layer: the merged expert of that routing"


def _one_hot_index(p: torch.Tensor) -> int | None:
    """The expert a one-hot distribution selects, else ``None``."""
    index = int(p.argmax())
    return index if bool(p[index] == 1) and int((p != 0).sum()) == 1 else None


def refuse_occupied(directory: Path, overwrite: bool, hint: str) -> None:
    """An existing non-empty output is only replaced when the caller said so: nothing a user saved is lost."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())) and not overwrite:
        raise FileExistsError(f"{directory} exists and is not empty; {hint}.")


def _routing_distributions(
    peft_model: torch.nn.Module,
    layers: dict[str, SmearLinear],
    routing: Routing,
    adapter_name: str,
    method: str,
    what: str,
) -> tuple[dict[str, torch.Tensor], int | None]:
    """Each layer's distribution, and the number of examples when they are a task's mean routing."""
    examples = None
    if isinstance(routing, Mapping):
        distributions = {}
        for name, weights in routing.items():
            weights = torch.as_tensor(weights).detach().float()
            if weights.dim() == 3:
                raise ValueError(
                    f"Routing weights for {name!r} have shape {tuple(weights.shape)}, one distribution per token: "
                    "no single expert reproduces them. Export one expert (a one-hot routing) instead."
                )
            if weights.dim() == 2:
                if weights.shape[0] != 1:
                    raise ValueError(
                        f"Routing weights for {name!r} have batch {weights.shape[0]}; export one example (batch 1) "
                        "or pass a task's batches to export their mean routing."
                    )
                weights = weights[0]
            distributions[name] = weights
        if _why_not_one_expert(method) is not None and any(
            p.dim() != 1 or _one_hot_index(p) is None for p in distributions.values()
        ):
            check_exportable(method, what)
    elif isinstance(routing, Iterable):
        distributions, examples = _mean_routing(peft_model, routing, adapter_name)
    else:
        raise TypeError(f"routing must be a mapping of routing weights or an iterable of batches, got {routing!r}.")
    _check_distributions(distributions, layers, adapter_name)
    return {name: distributions[name].cpu() for name in layers}, examples


def _mean_routing(
    peft_model: torch.nn.Module, batches: Iterable[Mapping[str, Any]], adapter_name: str
) -> tuple[dict[str, torch.Tensor], int]:
    totals: dict[str, torch.Tensor] = {}
    examples = 0
    for batch in batches:
        routing = get_routing_weights(peft_model, adapter_name=adapter_name, **batch)
        for name, weights in routing.items():
            totals[name] = totals.get(name, 0) + weights.sum(dim=0).cpu()
        examples += next(iter(routing.values())).shape[0]
    if not examples:
        raise ValueError("The task has no examples: routing is an empty iterable of batches.")
    return {name: total / examples for name, total in totals.items()}, examples


def _check_distributions(
    distributions: dict[str, torch.Tensor], layers: dict[str, SmearLinear], adapter_name: str
) -> None:
    missing, unknown = sorted(set(layers) - set(distributions)), sorted(set(distributions) - set(layers))
    if missing or unknown:
        raise ValueError(
            f"The routing must name exactly the SMEAR layers of adapter {adapter_name!r}. "
            f"Missing: {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
            f"not SMEAR layers: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}."
        )
    for name, p in distributions.items():
        experts = layers[name].num_experts(adapter_name)
        if p.shape != (experts,):
            raise ValueError(f"Routing for {name!r} has shape {tuple(p.shape)}; that layer has {experts} experts.")
        if (p < 0).any() or not torch.isclose(p.sum(), torch.tensor(1.0), atol=1e-4):
            raise ValueError(f"Routing for {name!r} must be a distribution (>= 0, summing to 1), got {p.tolist()}.")


def _write_atomically(
    target: Path, config: PeftConfig, weights: dict[str, torch.Tensor], card: Callable[[Path], None]
) -> None:
    """Write the adapter and its card into a staging directory beside ``target``, then swap it into place in one
    step (see :mod:`peft_smear.core.atomic`): a kill at any moment leaves the old directory or the new adapter, never
    a mix and never nothing; the old one is deleted only once the new one is in place."""
    with atomic.staged_directory(target) as staging:
        config.save_pretrained(staging)
        atomic.step(f"wrote {CONFIG_NAME}")
        save_file(weights, staging / SAFETENSORS_WEIGHTS_NAME, metadata={"format": "pt"})
        atomic.step(f"wrote {SAFETENSORS_WEIGHTS_NAME}")
        card(staging)
        atomic.step("wrote README.md")
