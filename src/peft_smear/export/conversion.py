"""PEFT's own conversion of a SMEAR model to a LoRA (``peft.tuners.lora.conversion``: ``convert_to_lora``,
``save_as_lora``), for a fixed routing.

PEFT asks every tuner layer whether it converts (``supports_lora_conversion``) and for its update of the base weight
(``get_delta_weight``), which it factorises by SVD. A SMEAR layer's update depends on each example's routing, so only
a fixed routing has one: an adapter with one expert, or a routing fixed by :func:`fixed_routing` (a task's batches, one
example, a distribution per layer, or a task id for methods that route by it alone). Its update is the merged expert
that :func:`~peft_smear.export.export_merged_adapter` writes for that routing, in each expert kind's export
(:meth:`~peft_smear.export.kinds.KindExport.delta_weight`). The layers' two methods
(:class:`peft_smear.tuner.SmearLinear`) answer with :func:`converted_distribution` and :func:`lora_delta_weight`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from transformers.pytorch_utils import Conv1D

from ..core.layer import SmearLinear
from ..core.model import SmearModel
from ..core.routers import Router
from .export import Routing, check_exportable, routing_distributions
from .kinds import KIND_EXPORTS, KindExport


NOT_ONE_LORA = (
    "no single LoRA reproduces it. Export the merged expert of a fixed routing with "
    "peft_smear.export_merged_adapter (a task's batches, one example, one expert), or fix one for PEFT's conversion: "
    "with peft_smear.fixed_routing(model, routing=... or task=...): convert_to_lora(model, rank)."
)


@contextlib.contextmanager
def fixed_routing(
    peft_model: torch.nn.Module,
    routing: Routing | None = None,
    *,
    task: int | None = None,
    adapter_name: str = "default",
) -> Iterator[dict[str, torch.Tensor]]:
    """Fix the routing of ``adapter_name`` while the block runs: every example is routed by it, and PEFT's
    ``convert_to_lora`` / ``save_as_lora`` write the LoRA that :func:`export_merged_adapter` writes for it (at a
    rank of at least ``r``: the same update). Yields each layer's distribution.

    ``routing`` is what :func:`export_merged_adapter` takes (a task's batches: their mean routing; one example's
    routing weights; a distribution per layer), or ``task`` a task id, for methods that route by it alone (the
    task's expert, or its learned mixture). Adapters whose routing is fixed already (one expert) convert without it.
    """
    tuner = getattr(peft_model, "base_model", None)
    if not isinstance(tuner, SmearModel):
        raise TypeError(f"fixed_routing needs a PeftModel with a SMEAR adapter, got {type(peft_model).__name__}.")
    if adapter_name not in tuner.peft_config:
        raise ValueError(f"No adapter named {adapter_name!r}; adapters: {sorted(tuner.peft_config)}.")
    if (routing is None) == (task is None):
        raise ValueError("fixed_routing takes a routing or a task, one of the two.")
    method, what = tuner.peft_config[adapter_name].routing, f"Adapter {adapter_name!r}"
    layers = {
        name: module
        for name, module in tuner.model.named_modules()
        if isinstance(module, SmearLinear) and adapter_name in module.expert_kind
    }
    if task is not None:
        distributions = {
            name: fixed_distribution(layer.smear_router[adapter_name], task) for name, layer in layers.items()
        }
        if any(p is None for p in distributions.values()):
            raise ValueError(
                f"{what} uses routing={method!r}, which does not route by the task id alone; give routing=... instead."
            )
    else:
        if not isinstance(routing, Mapping):
            check_exportable(method, what)
        distributions, _, _ = routing_distributions(peft_model, layers, routing, adapter_name, method, what)
    for name, layer in layers.items():
        layer.fixed_routing[adapter_name] = distributions[name].float()
    try:
        yield distributions
    finally:
        for layer in layers.values():
            layer.fixed_routing.pop(adapter_name, None)


def fixed_distribution(router: Router, task: int | None = None) -> torch.Tensor | None:
    """``[num_experts]`` fp32: the distribution every example (of task ``task``) is routed by at inference, whatever
    its content, where there is one, else ``None``: export's trait of a router, ``Router.fixed_distribution(task)``
    (the expert of a task id, Adamix's average), and one expert's for an adapter with one."""
    distribution = router.fixed_distribution(task)
    if distribution is None and task is None and router.num_experts == 1:
        return torch.ones(1)
    return distribution


def lora_delta_weight(layer: SmearLinear, adapter_name: str) -> torch.Tensor:
    """The merged expert of the fixed routing as an update of the base weight, in the base weight's layout."""
    kind = layer.expert_kind[adapter_name]
    delta = KIND_EXPORTS[kind.name].delta_weight(
        kind, layer.expert_params(adapter_name), converted_distribution(layer, adapter_name)
    )
    return delta.T if isinstance(layer.get_base_layer(), Conv1D) else delta


def converted_distribution(layer: SmearLinear, adapter_name: str) -> torch.Tensor:
    """The fixed routing that ``adapter_name`` converts with (LoRA experts only); refused otherwise, saying why."""
    if adapter_name not in layer.expert_kind:
        raise ValueError(
            f"SMEAR layer {layer.module_name!r} has no adapter {adapter_name!r} (it has "
            f"{', '.join(map(repr, sorted(layer.expert_kind)))}): PEFT's LoRA conversion converts every adapted "
            f"layer, and {adapter_name!r} targets other modules than another adapter of the model. Convert a "
            f"model that holds {adapter_name!r} alone, or export it with peft_smear.export_merged_adapter."
        )
    kind, router = layer.expert_kind[adapter_name], layer.smear_router[adapter_name]
    export = KIND_EXPORTS.get(kind.name)
    if export is None or type(export).delta_weight is KindExport.delta_weight:
        exported = f"exported as {export.exported_as}" if export is not None else "exported"
        raise TypeError(
            f"PEFT's LoRA conversion needs LoRA experts; {kind.title} experts are {exported} by "
            "peft_smear.export_merged_adapter."
        )
    fixed = layer.fixed_routing.get(adapter_name)
    fixed = fixed_distribution(router) if fixed is None else fixed
    if fixed is None:
        raise TypeError(
            f"SMEAR adapter {adapter_name!r} routes each example by routing={router.name!r}, so " + NOT_ONE_LORA
        )
    return fixed
