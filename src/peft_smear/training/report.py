"""Where each task is routed: the average routing distribution per (task, router), as JSON, a heatmap grid (the SMEAR
paper's figure 3) and a compact text table."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .recording import get_routing_weights


@dataclass
class RoutingReport:
    """``mean_routing[t, k]``: router ``k``'s routing distribution averaged over the examples of task ``t``;
    ``entropy[t]``: the entropy (nats) of an example's routing, averaged over task ``t``'s examples and all routers."""

    tasks: list[str]
    routers: list[str]
    examples: list[int]
    mean_routing: np.ndarray
    entropy: np.ndarray

    @classmethod
    def collect(
        cls, peft_model: torch.nn.Module, batches_by_task: Mapping[str, Iterable[Mapping[str, Any]]]
    ) -> RoutingReport:
        """Run every task's batches through ``peft_model`` (eval mode, no gradients) and average its routing."""
        routers: list[str] = []

        def weights(batches: Iterable[Mapping[str, Any]]) -> Iterator[torch.Tensor]:
            for batch in batches:
                routing = get_routing_weights(peft_model, **batch)
                routers[:] = routers or list(routing)
                yield torch.stack([routing[name].float().cpu() for name in routers])

        return cls.from_weights({task: weights(batches) for task, batches in batches_by_task.items()}, routers)

    @classmethod
    def from_weights(cls, weights_by_task: Mapping[str, Iterable[torch.Tensor]], routers: list[str]) -> RoutingReport:
        """The report of per-example distributions: each task's ``[routers, batch, experts]`` tensors, one per batch,
        averaged over the task's examples. ``routers`` names their first dimension (it may be filled while the
        iterables run)."""
        tasks, examples, means, entropies = [], [], [], []
        for task, batches in weights_by_task.items():
            totals, entropy_total, count = None, 0.0, 0
            for weights in batches:
                totals = weights.sum(dim=1) if totals is None else totals + weights.sum(dim=1)
                entropy_total += -(weights * weights.clamp_min(1e-12).log()).sum(dim=-1).mean(dim=0).sum().item()
                count += weights.shape[1]
            if not count:
                raise ValueError(f"Task {task!r} has no examples to report routing on.")
            tasks.append(task)
            examples.append(count)
            means.append((totals / count).numpy())
            entropies.append(entropy_total / count)
        return cls(tasks, list(routers), examples, np.stack(means), np.array(entropies))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RoutingReport:
        """The report :meth:`to_dict` wrote (a run's ``routing.json``, or a benchmark journal's run)."""
        tasks, routers = list(data["tasks"]), list(data["routers"])
        return cls(
            tasks,
            routers,
            [data["examples"][task] for task in tasks],
            np.array([[data["mean_routing"][task][router] for router in routers] for task in tasks]),
            np.array([data["entropy"][task] for task in tasks]),
        )

    @property
    def num_experts(self) -> int:
        return self.mean_routing.shape[-1]

    def similarity(self) -> np.ndarray:
        """``[tasks, tasks]``: 1 minus the total-variation distance between two tasks' mean routing, averaged over
        routers. 1: routed identically; 0: to disjoint experts everywhere."""
        means = self.mean_routing
        distance = 0.5 * np.abs(means[:, None] - means[None, :]).sum(axis=-1)  # [tasks, tasks, routers]
        return 1.0 - distance.mean(axis=-1)

    def to_dict(self, decimals: int | None = None) -> dict[str, Any]:
        """The report as JSON-ready values; ``decimals`` rounds its numbers (a benchmark journal keeps a report per
        run, and a heatmap needs no more than a few digits)."""
        mean_routing, entropy, similarity = (
            values if decimals is None else values.astype(np.float64).round(decimals)
            for values in (self.mean_routing, self.entropy, self.similarity())
        )
        return {
            "num_experts": self.num_experts,
            "tasks": self.tasks,
            "routers": self.routers,
            "examples": dict(zip(self.tasks, self.examples, strict=True)),
            "mean_routing": {
                task: {router: mean_routing[t, k].tolist() for k, router in enumerate(self.routers)}
                for t, task in enumerate(self.tasks)
            },
            "entropy": dict(zip(self.tasks, entropy.tolist(), strict=True)),
            "uniform_entropy": math.log(self.num_experts),
            "similarity": {
                task: dict(zip(self.tasks, row.tolist(), strict=True))
                for task, row in zip(self.tasks, similarity, strict=True)
            },
        }

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def save_heatmaps(self, path: str | Path) -> None:
        """One small heatmap per router (tasks by experts), in a grid with one row per transformer block."""
        import matplotlib

        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt

        names = _short_names(self.routers)
        columns = _routers_per_block(self.routers)
        rows = math.ceil(len(self.routers) / columns)
        size = (columns * (0.3 * self.num_experts + 1.4), rows * (0.25 * len(self.tasks) + 0.9))
        figure, axes = plt.subplots(rows, columns, figsize=size, squeeze=False, constrained_layout=True)
        top = float(self.mean_routing.max())
        for k, ax in enumerate(axes.flat):
            if k >= len(self.routers):
                ax.axis("off")
                continue
            image = ax.imshow(self.mean_routing[:, k], vmin=0.0, vmax=top, cmap="viridis", aspect="auto")
            ax.set_title(names[k], fontsize=7)
            ax.set_xticks(range(self.num_experts), [str(i) for i in range(self.num_experts)], fontsize=6)
            ax.set_yticks(range(len(self.tasks)), self.tasks if k % columns == 0 else [], fontsize=6)
        figure.colorbar(image, ax=axes, shrink=0.6, label="mean routing weight")
        figure.suptitle("Average routing distribution per task (rows) over experts (columns), per router")
        figure.savefig(path, dpi=100)
        plt.close(figure)

    def table(self) -> str:
        """Per task: experts used per router (mean weight above uniform), the mean of each router's top weight, the
        routing entropy, and the most used expert of every router; then the task-by-task routing similarity."""
        uniform = 1.0 / self.num_experts
        separator = "" if self.num_experts <= 10 else " "
        width = max(len(task) for task in self.tasks)
        lines = [
            f"Routing of {sum(self.examples)} examples over {len(self.routers)} routers with "
            f"{self.num_experts} experts each (uniform routing: entropy {math.log(self.num_experts):.2f} nats)",
            f"{'task':<{width}}  experts/router  top weight  entropy  top expert of each router",
        ]
        for t, task in enumerate(self.tasks):
            used = (self.mean_routing[t] > uniform + 1e-9).sum(axis=-1).mean()
            top = self.mean_routing[t].max(axis=-1).mean()
            signature = separator.join(str(e) for e in self.mean_routing[t].argmax(axis=-1))
            lines.append(f"{task:<{width}}  {used:14.1f}  {top:10.2f}  {self.entropy[t]:7.2f}  {signature}")
        lines.append("")
        lines.append("Routing similarity (1 - total-variation distance of the mean routing, averaged over routers)")
        cell = max(5, width)
        lines.append(" " * width + "".join(f"  {task[:cell]:>{cell}}" for task in self.tasks))
        for task, row in zip(self.tasks, self.similarity(), strict=True):
            lines.append(f"{task:<{width}}" + "".join(f"  {value:>{cell}.2f}" for value in row))
        return "\n".join(lines)


def _short_names(routers: list[str]) -> list[str]:
    """Router names without the leading name components they all share (``bert.encoder.layer.``)."""
    split = [name.split(".") for name in routers]
    shared = 0
    while all(len(parts) > shared + 1 and parts[shared] == split[0][shared] for parts in split):
        shared += 1
    return [".".join(parts[shared:]) for parts in split]


def _routers_per_block(routers: list[str]) -> int:
    """How many routers the first transformer block holds (the first numbered name component), so that each row of the
    heatmap grid is one block; a square-ish grid when names carry no block number."""
    parts = routers[0].split(".")
    block = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    if block is None:
        return math.ceil(math.sqrt(len(routers)))
    prefix = ".".join(parts[: block + 1]) + "."
    return sum(name.startswith(prefix) for name in routers)
