"""Does the learned routing find the task groups? SMEAR against Top-k, DSelect-k and tag routing on the synthetic
multi-task regression data of the DSelect-k supplement (Hazimeh et al., 2021, appendix C.1).

The data: ``num_groups`` groups of ``tasks_per_group`` regression tasks over one shared input matrix ``X`` (standard
normal, 10 features). Each group has its own mixture of experts: ``experts_per_group`` experts, each the sum of
``units_per_expert`` ReLU units whose weights and biases are standard normal, drawn independently for every group.
Task ``t`` of a group outputs ``y_t(x) = sum_i softmax(alpha_t)_i f_i(x)`` over its group's experts. The task weight
vectors ``alpha`` of a group are drawn from a zero-mean normal with unit variances and correlation ``correlation``
(0.8) between any two tasks of the group, independently per coordinate and per group; tasks of different groups are
uncorrelated. So tasks of a group are closely related and tasks of different groups only marginally.

The model (ours, not the appendix's multi-gate MoE: peft-smear's experts are LoRA experts of linear layers): an
example is an observation ``x`` and a task ``t``; the input ``[x, one_hot(t)]`` goes through a frozen random
``Linear -> ReLU -> Linear`` network whose two linear layers carry ``num_groups`` routed LoRA experts each. The output
layer starts at zero, so everything is learned by the experts and their routers. Each router sees its layer's input,
so it can route on the task (the one-hot) and on ``x``. The ideal routing gives each group its own expert: tag
routing does exactly that from the group of the task (the oracle); SMEAR, Top-k and DSelect-k must learn it. Targets
are standardised per task (train mean and std), so an MSE of 1 is predicting the mean.

Reported per method: the test MSE (mean ± std over seeds, learning rate chosen on validation with seed 0), and how
the learned routing relates tasks: the routing similarity (1 − total-variation distance between two tasks' mean
routing) and the Jaccard index of the experts they use (those with a mean weight above uniform), averaged over the
pairs of tasks of the same group and over pairs from different groups, and over routers (the appendix's measure).

    python benchmarks/synthetic_routing.py --append-results benchmarks/RESULTS.md

Longer than 400 lines on purpose: the data generator, the model, the training loop and the report of one experiment
stay in the one file its RESULTS.md command names.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import peft
import torch
import torch.nn.functional as F
from common import add_results_option, load_description, machine_description, methods_in_title, write_results
from peft import get_peft_model
from torch import nn
from transformers.utils import ModelOutput

from peft_smear import SmearConfig, create_router_optimizer
from peft_smear.multitask.report import RoutingReport


@dataclass(frozen=True)
class Method:
    """A routing method with extra :class:`SmearConfig` options; ``router_lr_ratio`` multiplies the routers' rate
    (``None``: the method's own default, as the library sets it)."""

    label: str
    routing: str
    options: dict = field(default_factory=dict)
    router_lr_ratio: float | None = None


PAPER_ROUTER = {"router_balance_weight": 0.0}  # SMEAR as the paper ran it; "smear_balanced" is the library's default
METHODS = {
    "smear": Method("SMEAR (the paper's router)", "smear", PAPER_ROUTER),
    "top_k": Method("Top-k (k=1)", "top_k"),
    "dselect_k": Method("DSelect-k (k=1)", "dselect_k"),
    "tag": Method("Tag (expert = task's group)", "tag"),
    "ensemble": Method("Ensemble", "ensemble"),
    "single": Method("Single expert", "single"),
    "reinforce": Method("REINFORCE", "reinforce"),
    "adamix": Method("Adamix", "adamix"),
    "latent_skills": Method("Latent Skills", "latent_skills"),
    # SMEAR variants, to see what its routing depends on.
    "smear_no_dropout": Method("SMEAR without expert dropout", "smear", {**PAPER_ROUTER, "expert_dropout": 0.0}),
    "smear_slow_router": Method("SMEAR, router learning rate ×0.1", "smear", PAPER_ROUTER, router_lr_ratio=0.1),
    "smear_fast_router": Method("SMEAR, router learning rate ×10", "smear", PAPER_ROUTER, router_lr_ratio=10.0),
    "smear_balanced": Method("SMEAR, load balancing 0.01 (the default)", "smear", {"router_balance_weight": 0.01}),
}
DEFAULT_METHODS = ("smear", "top_k", "dselect_k", "tag")


@dataclass(frozen=True)
class SyntheticTasks:
    """``x [observations, features]``; ``y [observations, tasks]``; ``group [tasks]``: each task's group;
    ``task_weights [tasks, experts_per_group]``: the ``alpha`` of each task; ``splits``: observation indices."""

    x: np.ndarray
    y: np.ndarray
    group: np.ndarray
    task_weights: np.ndarray
    splits: dict[str, np.ndarray]

    @property
    def num_tasks(self) -> int:
        return self.y.shape[1]


def correlated_task_weights(
    rng: np.random.Generator, num_groups: int, tasks_per_group: int, experts_per_group: int, correlation: float
) -> np.ndarray:
    """``[num_groups, tasks_per_group, experts_per_group]``: for every group and expert coordinate, the tasks'
    weights are one draw of a zero-mean normal with unit variances and ``correlation`` between any two tasks."""
    covariance = np.full((tasks_per_group, tasks_per_group), correlation) + (1 - correlation) * np.eye(tasks_per_group)
    draws = rng.standard_normal((num_groups, experts_per_group, tasks_per_group)) @ np.linalg.cholesky(covariance).T
    return draws.transpose(0, 2, 1)


def make_synthetic_tasks(
    num_groups: int = 4,
    tasks_per_group: int = 16,
    experts_per_group: int = 4,
    units_per_expert: int = 4,
    features: int = 10,
    correlation: float = 0.8,
    observations: tuple[int, int, int] = (100_000, 20_000, 20_000),
    seed: int = 0,
) -> SyntheticTasks:
    """Appendix C.1's data (its defaults: 4 groups of 16 tasks, 4 experts of 4 ReLU units per group, 10 features,
    correlation 0.8, 100k/20k/20k train/validation/test observations). Tasks are numbered group by group."""
    rng = np.random.default_rng(seed)
    alpha = correlated_task_weights(rng, num_groups, tasks_per_group, experts_per_group, correlation)
    weights = rng.standard_normal((num_groups, experts_per_group, units_per_expert, features))
    biases = rng.standard_normal((num_groups, experts_per_group, units_per_expert))
    x = rng.standard_normal((sum(observations), features))
    experts = np.maximum(np.einsum("nf,geuf->ngeu", x, weights) + biases, 0).sum(axis=-1)  # [n, groups, experts]
    gates = np.exp(alpha - alpha.max(axis=-1, keepdims=True))
    gates /= gates.sum(axis=-1, keepdims=True)  # softmax(alpha_t)
    y = np.einsum("nge,gte->ngt", experts, gates).reshape(len(x), num_groups * tasks_per_group)
    bounds = np.cumsum((0, *observations))
    return SyntheticTasks(
        x=x.astype(np.float32),
        y=y.astype(np.float32),
        group=np.repeat(np.arange(num_groups), tasks_per_group),
        task_weights=alpha.reshape(num_groups * tasks_per_group, experts_per_group),
        splits={name: np.arange(bounds[i], bounds[i + 1]) for i, name in enumerate(("train", "validation", "test"))},
    )


@dataclass
class RegressionOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    example_losses: torch.Tensor | None = None


class TaskConditionedMLP(nn.Module):
    """``[x, one_hot(task)] -> Linear -> ReLU -> Linear``: the layers the experts are added to. The output layer
    starts at zero, so the frozen network predicts 0 (the standardised mean) and the experts learn everything."""

    def __init__(self, features: int, num_tasks: int, hidden: int) -> None:
        super().__init__()
        self.num_tasks = num_tasks
        self.hidden = nn.Linear(features + num_tasks, hidden)
        self.output = nn.Linear(hidden, 1)
        nn.init.zeros_(self.output.weight)
        nn.init.zeros_(self.output.bias)

    def forward(self, x: torch.Tensor, task: torch.Tensor, labels: torch.Tensor | None = None) -> RegressionOutput:
        inputs = torch.cat([x, F.one_hot(task, self.num_tasks).to(x.dtype)], dim=-1)
        prediction = self.output(torch.relu(self.hidden(inputs))).squeeze(-1)
        if labels is None:
            return RegressionOutput(logits=prediction)
        losses = (prediction - labels) ** 2
        return RegressionOutput(loss=losses.mean(), logits=prediction, example_losses=losses)


@dataclass(frozen=True)
class Settings:
    hidden: int = 64
    r: int = 4
    steps: int = 2000
    batch_size: int = 256
    routing_observations: int = 256  # test observations per task for the routing report
    eval_batch_size: int = 8192


def build(data: SyntheticTasks, method: str, settings: Settings, seed: int) -> peft.PeftModel:
    """The network with ``num_groups`` experts per layer (one for ``single``) routed by ``method``."""
    torch.manual_seed(seed)
    base = TaskConditionedMLP(data.x.shape[1], data.num_tasks, settings.hidden)
    groups = int(data.group.max()) + 1
    spec = METHODS[method]
    options = dict(spec.options)
    if spec.routing == "tag":
        options.update(num_tasks=data.num_tasks, tag_experts=data.group.tolist())
    if spec.routing == "latent_skills":
        options.update(num_tasks=data.num_tasks)
    config = SmearConfig(
        r=settings.r,
        lora_alpha=settings.r,
        num_experts=None if spec.routing == "single" else groups,
        routing=spec.routing,
        target_modules=["hidden", "output"],
        **options,
    )
    return get_peft_model(base, config)


def _tensors(data: SyntheticTasks, observations: np.ndarray, tasks: np.ndarray) -> dict[str, torch.Tensor]:
    task = torch.from_numpy(tasks).long()
    return {
        "x": torch.from_numpy(data.x[observations]),
        "task": task,
        "labels": torch.from_numpy(data.y[observations, tasks]),
        "smear_task_ids": task,
    }


def standardised(data: SyntheticTasks) -> SyntheticTasks:
    """Targets scaled per task by the train mean and std, so every task weighs the same and an MSE of 1 is the
    mean's."""
    train = data.y[data.splits["train"]]
    y = (data.y - train.mean(axis=0)) / train.std(axis=0)
    return SyntheticTasks(data.x, y.astype(np.float32), data.group, data.task_weights, data.splits)


def train(
    model: peft.PeftModel,
    data: SyntheticTasks,
    settings: Settings,
    learning_rate: float,
    seed: int,
    router_lr_ratio: float | None = None,
) -> None:
    """Adam at a constant rate (the routers' times ``router_lr_ratio``, or their method's default) on random
    (observation, task) pairs of the training split."""
    rng = np.random.default_rng(seed)
    optimizer = create_router_optimizer(model, torch.optim.Adam, lr=learning_rate, router_lr_ratio=router_lr_ratio)
    model.train()
    train_rows = data.splits["train"]
    for _ in range(settings.steps):
        batch = _tensors(
            data,
            rng.choice(train_rows, settings.batch_size),
            rng.integers(data.num_tasks, size=settings.batch_size),
        )
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def mse(model: peft.PeftModel, data: SyntheticTasks, split: str, settings: Settings) -> float:
    """Mean squared error over every (observation, task) pair of ``split``: all tasks weigh the same."""
    model.eval()
    observations = data.splits[split]
    pairs = np.stack(np.meshgrid(observations, np.arange(data.num_tasks), indexing="ij"), axis=-1).reshape(-1, 2)
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(pairs), settings.eval_batch_size):
            chunk = pairs[start : start + settings.eval_batch_size]
            batch = _tensors(data, chunk[:, 0], chunk[:, 1])
            labels = batch.pop("labels")
            total += ((model(**batch).logits - labels) ** 2).sum().item()
    return total / len(pairs)


def routing_report(model: peft.PeftModel, data: SyntheticTasks, settings: Settings) -> RoutingReport:
    observations = data.splits["test"][: settings.routing_observations]
    batches = {}
    for task in range(data.num_tasks):
        batch = _tensors(data, observations, np.full(len(observations), task))
        batch.pop("labels")
        batches[f"task {task}"] = [batch]
    return RoutingReport.collect(model, batches)


def group_scores(report: RoutingReport, group: np.ndarray) -> dict[str, float]:
    """Routing similarity and Jaccard index of the experts used (mean weight above uniform), averaged over routers and
    over the pairs of tasks of the same group (``within``) or of different groups (``across``)."""
    similarity = report.similarity()
    used = report.mean_routing > 1 / report.num_experts + 1e-9  # [tasks, routers, experts]
    union = (used[:, None] | used[None, :]).sum(axis=-1)
    jaccard = np.where(union > 0, (used[:, None] & used[None, :]).sum(axis=-1) / np.maximum(union, 1), 1.0)
    jaccard = jaccard.mean(axis=-1)
    same = group[:, None] == group[None, :]
    within = same & ~np.eye(len(group), dtype=bool)
    return {
        "similarity_within": float(similarity[within].mean()),
        "similarity_across": float(similarity[~same].mean()),
        "jaccard_within": float(jaccard[within].mean()),
        "jaccard_across": float(jaccard[~same].mean()),
    }


def run_one(data: SyntheticTasks, method: str, learning_rate: float, seed: int, settings: Settings) -> dict:
    started = time.perf_counter()
    model = build(data, method, settings, seed)
    train(model, data, settings, learning_rate, seed, METHODS[method].router_lr_ratio)
    row = {
        "method": method,
        "learning_rate": learning_rate,
        "seed": seed,
        "validation_mse": mse(model, data, "validation", settings),
        "test_mse": mse(model, data, "test", settings),
    }
    if METHODS[method].routing != "single":
        row.update(group_scores(routing_report(model, data, settings), data.group))
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def run_suite(
    data: SyntheticTasks,
    methods: Sequence[str],
    learning_rates: Sequence[float],
    seeds: int,
    settings: Settings,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Seed 0 at every rate; the rate with the lowest validation MSE (ties: the smaller) for the other seeds."""
    rows = []
    for method in methods:
        sweep = [run_one(data, method, rate, 0, settings) for rate in learning_rates]
        best = min(sweep, key=lambda row: (_finite_or_inf(row["validation_mse"]), row["learning_rate"]))
        others = [run_one(data, method, best["learning_rate"], seed, settings) for seed in range(1, seeds)]
        for row in sweep + others:
            row["chosen"] = row["learning_rate"] == best["learning_rate"]
            log(
                f"{method:<10} lr {row['learning_rate']:.0e} seed {row['seed']}: validation MSE "
                f"{row['validation_mse']:.4f}, test MSE {row['test_mse']:.4f} ({row['seconds']} s)"
            )
        rows += sweep + others
    return rows


def _finite_or_inf(value: float) -> float:
    """A diverged run's NaN loss ranks last."""
    return value if math.isfinite(value) else math.inf


def _mean_std(values: list[float], digits: int) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.{digits}f} ± {std:.{digits}f}"


def markdown_table(rows: list[dict]) -> str:
    header = "| method | lr | test MSE | similarity within groups | across groups | Jaccard within | Jaccard across |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    for method in dict.fromkeys(row["method"] for row in rows):
        chosen = [row for row in rows if row["method"] == method and row["chosen"]]
        cells = [
            METHODS[method].label,
            f"{chosen[0]['learning_rate']:.0e}",
            _mean_std([r["test_mse"] for r in chosen], 3),
        ]
        for key in ("similarity_within", "similarity_across", "jaccard_within", "jaccard_across"):
            cells.append(_mean_std([r[key] for r in chosen], 2) if key in chosen[0] else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def results_section(
    table: str, methods: list[str], command: str, description: str, seconds: float, load: tuple[tuple, tuple]
) -> str:
    return "\n".join(
        [
            f"## Synthetic routing (DSelect-k appendix C.1){methods_in_title(methods, list(DEFAULT_METHODS))}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "",
            f"- Command: `{command}`",
            f"- Machine: {machine_description('cpu')}",
            f"- Load average (1, 5, 15 min) before / after the run: {load_description(load, 'slowed the run')}. "
            f"Wall time: {seconds / 60:.1f} min.",
            f"- {description}",
            "",
            table,
            "",
            "Similarity and Jaccard index: high within groups and low across groups means the routing found the "
            "groups (tag routing has them by construction: 1 within, 0 across).",
            "",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=list(DEFAULT_METHODS))
    parser.add_argument("--learning-rates", nargs="+", type=float, default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--tasks-per-group", type=int, default=8)
    parser.add_argument(
        "--observations", type=int, nargs=3, default=[20_000, 2_000, 2_000], metavar=("TRAIN", "VALIDATION", "TEST")
    )
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--threads", type=int, default=1)
    add_results_option(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, log: Callable[[str], None] = print) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = Settings(steps=args.steps)
    load_before, started = os.getloadavg(), time.perf_counter()
    data = standardised(make_synthetic_tasks(args.groups, args.tasks_per_group, observations=tuple(args.observations)))
    rows = run_suite(data, args.methods, args.learning_rates, args.seeds, settings, log)
    seconds, load_after = time.perf_counter() - started, os.getloadavg()
    table = markdown_table(rows)
    log(table)
    if args.append_results is not None:
        description = (
            f"{args.groups} groups of {args.tasks_per_group} tasks, 4 experts of 4 ReLU units per group, 10 "
            f"features, correlation 0.8; {args.observations[0]:,} / {args.observations[1]:,} / "
            f"{args.observations[2]:,} train / validation / test observations (the appendix: 16 tasks per group, "
            f"100k / 20k / 20k). Model: hidden width {settings.hidden}, {args.groups} LoRA experts of rank "
            f"{settings.r} per layer, {settings.steps} Adam steps of {settings.batch_size} (observation, task) pairs; "
            f"learning rate from {', '.join(f'{r:.0e}' for r in args.learning_rates)} by validation MSE of seed 0, "
            f"then {args.seeds} seeds; mean ± sample std over seeds."
        )
        command = shlex.join(["python", "benchmarks/synthetic_routing.py", *(sys.argv[1:] if argv is None else argv)])
        section = results_section(table, args.methods, command, description, seconds, (load_before, load_after))
        write_results(args.append_results, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
