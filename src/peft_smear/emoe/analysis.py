"""Which experts each task selects (the EMoE paper's figure 2, right), through the routing report of SMEAR."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..training.report import RoutingReport
from .gate import EmoeGate


def selection_report(model: nn.Module, batches_by_task: Mapping[str, Iterable[Mapping[str, Any]]]) -> RoutingReport:
    """Run every task's batches through ``model`` (eval mode, no gradients) and report, per task and EMoE layer, the
    share of the top-k selections that went to each expert, over the real tokens (``attention_mask``) of its
    examples: ``mean_routing[t, k, e]`` is how often expert ``e`` of layer ``k`` was selected for a token of task
    ``t``, divided by top-k, so each row sums to 1 and the report's heatmaps, table and similarities apply as for
    SMEAR. ``entropy``: of an example's selection shares (uniform over all experts: ``log N``)."""
    # Named by where each gate sits (e.g. ``bert.encoder.layer.4.intermediate.intermediate_act_fn``).
    gates = {name: module for name, module in model.named_modules() if isinstance(module, EmoeGate)}
    if not gates:
        raise ValueError("The model has no EMoE layer; call moefy(model) first.")
    was_training = model.training
    model.eval()
    for gate in gates.values():
        gate.record = True

    def shares(batches: Iterable[Mapping[str, Any]]) -> Iterator[torch.Tensor]:
        for batch in batches:
            with torch.no_grad():
                model(**batch)
            yield torch.stack([_example_shares(gate, batch.get("attention_mask")) for gate in gates.values()])

    try:
        by_task = {task: shares(batches) for task, batches in batches_by_task.items()}
        return RoutingReport.from_weights(by_task, list(gates))
    finally:
        for gate in gates.values():
            gate.record, gate.last_selection = False, None
        model.train(was_training)


def _example_shares(gate: EmoeGate, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``[batch, experts]``: each example's share of the selections of ``gate``'s last call, over its real tokens."""
    selection = gate.last_selection.float().cpu()
    if selection.dim() == 2:  # one row per example
        return selection / gate.top_k
    mask = torch.ones(selection.shape[:2]) if attention_mask is None else attention_mask.float().cpu()
    counts = (selection * mask[..., None]).sum(dim=1)
    return counts / (mask.sum(dim=1, keepdim=True).clamp_min(1.0) * gate.top_k)
