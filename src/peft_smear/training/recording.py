"""What the routers decided: every routing decision of a call, recorded through the routing context's observers, and
each layer's routing weights for a batch (:func:`get_routing_weights`), which the routing report and export build on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..core.model import SmearModel
from ..core.types import RoutingDecision


@contextlib.contextmanager
def recording_routing(peft_model: nn.Module) -> Iterator[dict[tuple[nn.Module, str], torch.Tensor]]:
    """Within the block, every routing decision the SMEAR layers of ``peft_model`` apply is recorded: the yielded dict
    maps ``(layer, adapter_name)`` to the layer's last ``[batch, num_experts]`` routing weights (detached)."""
    recorded: dict[tuple[nn.Module, str], torch.Tensor] = {}

    def record(layer: nn.Module, adapter_name: str, decision: RoutingDecision, generating: bool) -> None:
        recorded[(layer, adapter_name)] = decision.weights.detach()

    observers = [module.routing_context.observers for module in peft_model.modules() if isinstance(module, SmearModel)]
    for watching in observers:
        watching.append(record)
    try:
        yield recorded
    finally:
        for watching in observers:
            watching.remove(record)


def get_routing_weights(
    peft_model: nn.Module, adapter_name: str | None = None, **inputs: Any
) -> dict[str, torch.Tensor]:
    """Run ``peft_model(**inputs)`` in eval mode without gradients and return, for every SMEAR layer that ran, its
    ``[batch, num_experts]`` routing weights, keyed by the layer's module name in the base model.

    Routing follows the configured source: pass ``labels`` (or ``smear_routing_mask``) to route a causal LM on the
    prompt exactly as in training. ``adapter_name`` defaults to the active adapter and must be active. Training mode
    of every module is restored afterwards.
    """
    tuner = getattr(peft_model, "base_model", None)
    if not isinstance(tuner, SmearModel):
        raise TypeError(
            f"get_routing_weights needs a PeftModel with a SMEAR adapter, got {type(peft_model).__name__}."
        )
    if adapter_name is None:
        if len(tuner.active_adapters) != 1:
            raise ValueError(f"Several adapters are active ({tuner.active_adapters}); pass adapter_name.")
        adapter_name = tuner.active_adapters[0]
    if adapter_name not in tuner.active_adapters:
        raise ValueError(
            f"Adapter {adapter_name!r} is not active (active: {tuner.active_adapters}, "
            f"all: {sorted(tuner.peft_config)}); set_adapter() it first."
        )

    training_modes = [(module, module.training) for module in peft_model.modules()]
    try:
        peft_model.eval()
        with torch.no_grad(), recording_routing(peft_model) as recorded:
            peft_model(**inputs)
    finally:
        for module, training in training_modes:
            module.training = training
    return {
        name: recorded[(module, adapter_name)]
        for name, module in tuner.model.named_modules()
        if (module, adapter_name) in recorded
    }
