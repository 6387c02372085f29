"""RoutingStatistics: what the routers did since the last look, accumulated on the device while the model runs.

Every routing decision a SMEAR layer makes is handed to :meth:`RoutingStatistics.observe` (the ``[batch, N]`` fp32
weights the layer applied: after expert dropout in training, one-hot for methods that choose one expert). Nothing is
read back to the host until :meth:`RoutingStatistics.summary`: the decisions of one model call are stacked and
reduced with a handful of kernels when the call ends, and a summary costs one device-to-host copy per device.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.model import SmearModel
from ..core.types import RoutingDecision


COLLAPSE_THRESHOLD = 0.9
"""A router has collapsed when every group of examples (every task, or all examples) sends more than this share of its
mean routing to one and the same expert. ``benchmarks/quality.py`` uses the same definition per task."""

MODES = ("train", "eval")


def collapsed_routers(mean_routing: torch.Tensor, threshold: float = COLLAPSE_THRESHOLD) -> torch.Tensor:
    """``[routers]`` bool: which routers have collapsed, from ``mean_routing[group, router, expert]``, the mean
    routing distribution of each group of examples (e.g. each task) at each router (see :data:`COLLAPSE_THRESHOLD`)."""
    top_weight, top_expert = mean_routing.max(dim=-1)  # [groups, routers]
    return (top_weight > threshold).all(dim=0) & (top_expert == top_expert[0]).all(dim=0)


@dataclass
class _Block:
    """Sums over the examples of every call with the same sequence of routers: ``entropy[k]`` of the normalised
    entropies of router ``keys[k]``'s routing, ``load[k]`` of its routing weights; ``examples`` rows per router."""

    keys: tuple[str, ...]
    entropy: torch.Tensor
    load: torch.Tensor
    examples: int


class RoutingStatistics:
    """Per-router routing statistics of a SMEAR model, accumulated separately for training and eval mode calls.

    Attach it with :meth:`attach`; every SMEAR layer of the model then reports its routing decisions here, and the
    auxiliary losses of each training call are summed too. :meth:`summary` reads and resets one mode's figures.

    Counted: calls in training mode (``"train"``) and in eval mode (``"eval"``), each decision once. Not counted:
    the repeats of a forward that gradient checkpointing runs during backward, ``generate()`` (whose decode steps
    reuse the prefill's routing), routers with a single expert.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[str, str, torch.Tensor]] = []
        self._pending_aux: list[dict[str, torch.Tensor]] = []
        self._blocks: dict[str, dict[tuple, _Block]] = {mode: {} for mode in MODES}
        self._aux: dict[str, tuple[torch.Tensor, int]] = {}
        self._attached: list[tuple[Any, torch.utils.hooks.RemovableHandle]] = []

    @classmethod
    def attach(cls, model: nn.Module) -> RoutingStatistics:
        """A new accumulator that every SMEAR tuner inside ``model`` (a ``PeftModel``, or any module holding one)
        reports to, until :meth:`detach`."""
        statistics = cls()
        statistics.attach_to(model)
        return statistics

    def attach_to(self, model: nn.Module) -> None:
        tuners = [module for module in model.modules() if isinstance(module, SmearModel)]
        if not tuners:
            raise ValueError(
                f"Routing statistics need a model with a SMEAR adapter; {type(model).__name__} contains no SmearModel "
                "(get_peft_model(model, SmearConfig(...)) makes one)."
            )
        for tuner in tuners:
            observers = tuner.routing_context.observers
            if any(isinstance(getattr(o, "__self__", None), RoutingStatistics) for o in observers):
                raise ValueError("This SMEAR model already reports routing statistics elsewhere; detach() that first.")
            observers.append(self.observe)
            handle = tuner.model.register_forward_hook(self._end_of_call)
            self._attached.append((tuner, handle))

    def detach(self) -> None:
        """Stop collecting: the model's layers no longer report here. What was collected can still be read."""
        for tuner, handle in self._attached:
            handle.remove()
            if self.observe in tuner.routing_context.observers:
                tuner.routing_context.observers.remove(self.observe)
        self._attached = []

    def observe(self, layer: nn.Module, adapter_name: str, decision: RoutingDecision, generating: bool) -> None:
        """Note one routing decision of ``layer`` (a routing context's observer): its ``[batch, num_experts]``
        weights, unless ``generating``. Host-side bookkeeping only; the arithmetic waits for the end of the model
        call."""
        weights = decision.weights
        if weights.shape[-1] < 2 or generating:
            return
        name = layer.module_name if adapter_name == "default" else f"{layer.module_name}[{adapter_name}]"
        self._pending.append(("train" if layer.training else "eval", name, weights.detach()))

    def observe_aux_losses(self, losses: dict[str, torch.Tensor]) -> None:
        """Note the (already weighted) auxiliary losses of one training call."""
        self._pending_aux.append({name: value.detach() for name, value in losses.items()})

    def _end_of_call(self, module: nn.Module, args: tuple, output: Any) -> None:
        aux_losses = getattr(output, "smear_aux_losses", None)
        if module.training and aux_losses:
            self.observe_aux_losses(aux_losses)
        self._fold()

    def _fold(self) -> None:
        """Reduce the pending decisions into the running sums: one stack and a few reductions per group of
        decisions of the same shape, mode and device (usually one group per call)."""
        groups: dict[tuple, list[tuple[str, torch.Tensor]]] = defaultdict(list)
        for mode, name, weights in self._pending:
            groups[(mode, tuple(weights.shape), weights.device)].append((name, weights))
        self._pending = []
        for (mode, (batch, num_experts), _), decisions in groups.items():
            keys = tuple(name for name, _ in decisions)
            weights = torch.stack([w for _, w in decisions]).float()  # [routers, batch, experts]
            entropy = torch.special.entr(weights).sum(dim=-1).sum(dim=-1) / math.log(num_experts)
            load = weights.sum(dim=1)
            block = self._blocks[mode].get((keys, num_experts))
            if block is None:
                self._blocks[mode][(keys, num_experts)] = _Block(keys, entropy, load, batch)
            else:
                block.entropy += entropy
                block.load += load
                block.examples += batch
        for losses in self._pending_aux:
            for name, value in losses.items():
                total, calls = self._aux.get(name, (0.0, 0))
                self._aux[name] = (total + value.float(), calls + 1)
        self._pending_aux = []

    def summary(self, mode: str = "train", per_router: bool = False) -> dict[str, float]:
        """The figures of ``mode``'s calls since the last summary of that mode, then forget them. Empty when there
        were none. Reads the device once per device holding statistics.

        * ``routing_entropy``: each router's mean routing entropy over its examples, as a share of ``log N``
          (1: uniform, 0: one expert per example), averaged over routers; ``routing_entropy_min``: the lowest router;
        * ``expert_load_min`` / ``expert_load_max``: each router's load (its mean routing weight per expert, the share
          of examples per expert for one-hot routing; uniform: ``1 / N``), least and most used expert, averaged over
          routers;
        * ``collapsed_routers``: share of routers whose load puts more than :data:`COLLAPSE_THRESHOLD` on one expert;
        * ``aux_<name>`` (training): each auxiliary loss, averaged over the calls that had it;
        * with ``per_router``, also ``<router>/entropy``, ``<router>/load_min``, ``<router>/load_max``.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
        self._fold()
        blocks = list(self._blocks[mode].values())
        aux = self._aux if mode == "train" else {}
        self._blocks[mode] = {}
        if mode == "train":
            self._aux = {}
        values = _to_host([*(t for b in blocks for t in (b.entropy, b.load)), *(total for total, _ in aux.values())])
        entropy_sums: dict[str, float] = defaultdict(float)
        load_sums: dict[str, list[float]] = {}
        examples: dict[str, int] = defaultdict(int)
        for i, block in enumerate(blocks):
            entropies, loads = values[2 * i], values[2 * i + 1]
            for key, entropy, load in zip(block.keys, entropies, loads, strict=True):
                entropy_sums[key] += entropy
                load_sums[key] = [a + b for a, b in zip(load_sums.get(key, [0.0] * len(load)), load, strict=True)]
                examples[key] += block.examples
        figures: dict[str, float] = {}
        if examples:
            figures.update(_router_figures(entropy_sums, load_sums, examples, per_router))
        for (name, (_, calls)), total in zip(aux.items(), values[2 * len(blocks) :], strict=True):
            figures[f"aux_{name}"] = total / calls
        return figures


def _router_figures(
    entropy_sums: dict[str, float], load_sums: dict[str, list[float]], examples: dict[str, int], per_router: bool
) -> dict[str, float]:
    entropy = {key: entropy_sums[key] / examples[key] for key in examples}
    load = {key: [value / examples[key] for value in load_sums[key]] for key in examples}
    collapsed = [max(shares) > COLLAPSE_THRESHOLD for shares in load.values()]
    figures = {
        "routing_entropy": sum(entropy.values()) / len(entropy),
        "routing_entropy_min": min(entropy.values()),
        "expert_load_min": sum(min(shares) for shares in load.values()) / len(load),
        "expert_load_max": sum(max(shares) for shares in load.values()) / len(load),
        "collapsed_routers": sum(collapsed) / len(collapsed),
    }
    if per_router:
        for key in examples:
            figures[f"{key}/entropy"] = entropy[key]
            figures[f"{key}/load_min"] = min(load[key])
            figures[f"{key}/load_max"] = max(load[key])
    return figures


def _to_host(tensors: Iterable[torch.Tensor]) -> list[Any]:
    """Each tensor (0-d, 1-d or 2-d) as a Python number or (nested) list, with one read of each device."""
    tensors = list(tensors)
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for i, tensor in enumerate(tensors):
        by_device[tensor.device].append(i)
    values: list[Any] = [None] * len(tensors)
    for indices in by_device.values():
        flat = torch.cat([tensors[i].detach().float().reshape(-1) for i in indices]).tolist()
        offset = 0
        for i in indices:
            shape = tensors[i].shape
            chunk = flat[offset : offset + tensors[i].numel()]
            offset += len(chunk)
            if len(shape) == 2:
                chunk = [chunk[row * shape[1] : (row + 1) * shape[1]] for row in range(shape[0])]
            values[i] = chunk[0] if len(shape) == 0 else chunk
    return values
