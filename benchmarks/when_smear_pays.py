"""When does SMEAR pay? A controlled study of the features the SMEAR paper credits for its win (issue 31): task
imbalance, the relatedness of the tasks, their number, and the training budget. Every regime below was fixed, with
the reason for it, before any of its runs (git shows this file committed before the numbers).

Protocol: ``quality.py``'s, regime by regime. Every method gets the same steps, batch, sequence length, schedule and
data order; sweeps the regime's learning rates with seed 0 and keeps the rate with the best validation average (ties:
the smaller rate); then trains the other seeds at that rate. Test metrics (accuracy, Pearson for ``nyt_reg``) are
reported ×100, per task, on average and for the regime's small task. The runs of each regime are journalled in
``<output-dir>/<regime>/runs.jsonl`` (``quality.RunJournal``), so that a study cut off resumes with ``--resume``; the
second sitting's journals are committed in ``benchmarks/journals/when_smear_pays/reduced/``.

    OMP_NUM_THREADS=1 PYTHONPATH=src:benchmarks python benchmarks/when_smear_pays.py --preset reduced --jobs 2 \
        --threads 1 --output-dir benchmarks/journals/when_smear_pays/reduced --append-results benchmarks/RESULTS.md \
        --resume

Methods (``quality.py``'s, and one more): SMEAR with the library's default router (load balancing 0.01), LoRA at 1×
parameters (rank N·r) and at 1× compute (rank r), tag routing, a single expert, the ensemble, and SMEAR's router
trained over a frozen bank of per-task LoRAs (``bank``, the setting where SMEAR led on the SmolLM2 bank benchmark).

The bank's budget: the same total optimizer steps as every other method. A quarter of the steps (``steps // 4``)
trains the router and the heads on the mixture; the other steps are split evenly among the tasks, each training its
own LoRA of rank r (``lora_alpha = r``, every block Linear, the same initialisation for every expert as in
``bank_routing.py``) and its own head on that task's examples alone. The experts become a bank
(``peft_smear.build_expert_bank``, SMEAR routing with the library's defaults) and stay frozen; the heads start from
the experts' runs. At 72 steps and six tasks: 9 steps per expert and 18 router steps; three tasks: 18 and 18; eight
tasks: 6 (48 in all, 6 steps are left unused) and 18.

Verdict, per regime: the paired difference, seed by seed, of SMEAR's test average minus that of the best
non-ensemble baseline (best by mean over seeds: LoRA 1× parameters, LoRA 1× compute, tag, single expert or the bank);
its mean ± sample std over seeds. **win** if mean − std > 0, **lose** if mean + std < 0, **tie** otherwise. The same
rule on the small task's own metric (best baseline by the small task's mean) gives the small task's verdict. The
ensemble (N× the compute of one expert per token) is reported but is no baseline.

The regimes (preset ``reduced``: 72 steps of batch 16, 32 tokens, 640 training and 120 validation and test examples
per task unless cut, 8 experts of rank 8, 3 seeds). The small task is ``tweets_sent``: one of the three sentiment
tasks, so it has two related tasks in most mixtures (``rt_fresh``, movie-review polarity, and ``nyt_reg``, the
sentiment strength of editorial snippets), as CoLA in the paper is a small task with related tasks beside it. Cut
training sets are the examples with the smallest rank in ``load_benchmark``'s split rule, so 64 ⊂ 128 ⊂ 256 ⊂ 640.

* ``small64`` (imbalance): the six tasks, ``tweets_sent`` cut to 64 training examples (2% of the mixture): the paper's
  situation, a starved task among full ones, some related to it and some unrelated (interference).
* ``related3_small64`` (relatedness): ``tweets_sent`` (64) with its two related tasks only.
* ``unrelated3_small64`` (relatedness): ``tweets_sent`` (64) with two unrelated tasks (``trec6`` question type,
  ``bbc_news`` topic): the same small task, so its own score compares directly with ``related3_small64``.
* ``balanced6`` (control): the six tasks at 640 each, where every earlier comparison found a tie; the 640 point of
  the imbalance curve.
* ``small128``, ``small256`` (imbalance): ``small64`` with 128 and 256 ``tweets_sent`` examples.
* ``subtasks8_small64`` (number of tasks, related sub-tasks): ``small64`` with ``trec6`` split by label into two
  three-class tasks (ABBR/DESC/ENTY and HUM/LOC/NUM) and ``bbc_news`` into two (business/politics/tech and
  entertainment/sports), each capped at 640: eight tasks, two pairs of closely related tasks (the same texts'
  distribution, other labels) that tag routing keeps apart and a learned router may share. With 3, 6 and 8 tasks,
  ``related3_small64``, ``small64`` and this regime form the number-of-tasks axis at the same small task.
* ``small64_3x`` (budget): ``small64`` at three times the steps (216), where routing has more steps to learn.

Learning rates: the ``reduced`` preset's grid {2e-3, 4e-3, 8e-3} is shifted to {1.5e-3, 3e-3, 6e-3} at 72 steps,
because in its sweep (RESULTS.md, section "Quality, preset `reduced`, 2026-11-21 21:12 UTC") no method chose 8e-3,
which diverged for SMEAR and the ensemble, and tag routing chose the grid's bottom, 2e-3. At 216 steps the grid is
{1e-3, 2e-3, 4e-3}: longer runs chose lower rates (1e-3 or below at 500 steps of batch 32).

Widening (added on 2026-12-07, before the runs of the study's second sitting; the first sitting, of 2026-11-25, chose
24 of its 56 rates at an edge of these fixed grids): while a method's best validation rate lies at an edge of
its grid, the next rate of the regime's ladder beyond that edge (the grid's rates halved or doubled: {3.75e-4, 7.5e-4,
..., 1.2e-2, 2.4e-2} at 72 steps, {2.5e-4, ..., 8e-3, 1.6e-2} at 216) is swept with seed 0 and the choice made again
(``quality.widened``); the ladder's ends are the caps, and a method stopped by one is listed. Only then do its other
seeds run.

Longer than 400 lines on purpose: the study's whole design (regimes, data, the bank, the scheduler, the verdicts, the
figure and the report) stays in the one file its RESULTS.md command names.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from common import (
    RunPool,
    add_study_options,
    chosen_regimes,
    command_line,
    load_description,
    machine_description,
    write_results,
)
from datasets import DatasetDict
from peft import LoraConfig
from quality import (
    ALL_METHODS,
    PRESETS,
    RATE_SETTINGS,
    Preset,
    Run,
    RunClock,
    RunJournal,
    Setup,
    Summary,
    _task_file,
    choose_learning_rates,
    csv_columns,
    paired_difference,
    result_row,
    routing_batches_on,
    run_one,
    setup_of,
    summarise,
    sweep_table,
    widen,
)
from transformers import AutoTokenizer, set_seed

from peft_smear import build_expert_bank
from peft_smear.multitask.data import SPLITS, load_benchmark
from peft_smear.multitask.features import benchmark_task_info, duplicate_key, examples_dataset
from peft_smear.multitask.model import MultiTaskModel, block_linear_names, metric_name
from peft_smear.multitask.report import RoutingReport
from peft_smear.multitask.tasks import TaskInfo
from peft_smear.multitask.training import (
    build_model,
    default_model_dir,
    evaluate,
    fit,
    rows_of,
)


# --- the regimes, fixed before any run ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskSpec:
    """A task of a regime: drawn from the benchmark (or task-file) task ``source``; a sub-task keeps only the source's
    classes ``labels`` (relabelled in that order); ``train`` cuts its training examples (``None``: the preset's
    cap)."""

    name: str
    source: str
    labels: tuple[str, ...] = ()
    train: int | None = None


@dataclass(frozen=True)
class Regime:
    """One cell of the study: its tasks, the small task whose own score is reported, the steps as a multiple of the
    preset's, the learning-rate grid it starts from and the ``ladder`` it may be widened along (its ends are the
    caps), what it varies (``axis``), and whether it is a point of the figure's imbalance curve."""

    name: str
    axis: str
    tasks: tuple[TaskSpec, ...]
    small: str
    learning_rates: tuple[float, ...]
    ladder: tuple[float, ...]
    steps_factor: int = 1
    on_curve: bool = False


def _whole(*names: str, small: str | None = None, size: int | None = None) -> tuple[TaskSpec, ...]:
    """The benchmark tasks ``names`` whole, ``small`` cut to ``size`` training examples."""
    return tuple(TaskSpec(name, name, train=size if name == small else None) for name in names)


SIX = ("trec6", "sms_spam", "bbc_news", "rt_fresh", "tweets_sent", "nyt_reg")
SMALL = "tweets_sent"
RATES = (1.5e-3, 3e-3, 6e-3)
RATES_3X = (1e-3, 2e-3, 4e-3)
LADDER = (3.75e-4, 7.5e-4, *RATES, 1.2e-2, 2.4e-2)
LADDER_3X = (2.5e-4, 5e-4, *RATES_3X, 8e-3, 1.6e-2)
TINY = ((1e-3, 1e-2), (3e-4, 1e-3, 1e-2, 3e-2))  # the smoke test's grid and ladder
SUBTASKS = (
    TaskSpec("trec6_abbr_desc_enty", "trec6", ("ABBR", "DESC", "ENTY")),
    TaskSpec("trec6_hum_loc_num", "trec6", ("HUM", "LOC", "NUM")),
    TaskSpec("sms_spam", "sms_spam"),
    TaskSpec("bbc_business_politics_tech", "bbc_news", ("business", "politics", "tech")),
    TaskSpec("bbc_entertainment_sports", "bbc_news", ("entertainment", "sports")),
    TaskSpec("rt_fresh", "rt_fresh"),
    TaskSpec("tweets_sent", "tweets_sent", train=64),
    TaskSpec("nyt_reg", "nyt_reg"),
)
# In the order they run: if the study is cut off, the regimes it finished are the most informative ones.
STUDY_REGIMES = {
    "reduced": (
        Regime("small64", "imbalance", _whole(*SIX, small=SMALL, size=64), SMALL, RATES, LADDER, on_curve=True),
        Regime(
            "related3_small64",
            "relatedness",
            _whole("rt_fresh", "tweets_sent", "nyt_reg", small=SMALL, size=64),
            SMALL,
            RATES,
            LADDER,
        ),
        Regime(
            "unrelated3_small64",
            "relatedness",
            _whole("trec6", "bbc_news", "tweets_sent", small=SMALL, size=64),
            SMALL,
            RATES,
            LADDER,
        ),
        Regime("balanced6", "control", _whole(*SIX), SMALL, RATES, LADDER, on_curve=True),
        Regime("small128", "imbalance", _whole(*SIX, small=SMALL, size=128), SMALL, RATES, LADDER, on_curve=True),
        Regime("small256", "imbalance", _whole(*SIX, small=SMALL, size=256), SMALL, RATES, LADDER, on_curve=True),
        Regime("subtasks8_small64", "number of tasks", SUBTASKS, SMALL, RATES, LADDER),
        Regime("small64_3x", "budget", _whole(*SIX, small=SMALL, size=64), SMALL, RATES_3X, LADDER_3X, steps_factor=3),
    ),
    # The smoke test's regimes, on the test suite's task files (tests/conftest.py: ``topic``, ``count``) and a
    # four-class ``quad`` task that the test writes; their numbers mean nothing. A rung beyond each end of the grid.
    "tiny": (
        Regime("small", "imbalance", _whole("topic", "count", small="topic", size=16), "topic", *TINY, 1, True),
        Regime(
            "subtasks",
            "number of tasks",
            (
                TaskSpec("quad_ab", "quad", ("a", "b")),
                TaskSpec("quad_cd", "quad", ("c", "d")),
                TaskSpec("topic", "topic", train=16),
            ),
            "topic",
            *TINY,
        ),
        Regime("balanced", "control", _whole("topic", "count"), "topic", *TINY, 2, True),
    ),
}
STUDY_PRESETS = {"reduced": "reduced", "tiny": "tiny"}  # study preset -> quality.py's preset of the same scale

# SMEAR as the library ships it (load balancing 0.01), the baselines, the ensemble, and the bank.
SMEAR = "smear_balanced"
BANK = "bank"
METHODS = (SMEAR, "lora_1x_params", "lora_1x_compute", "tag", "single", "ensemble", BANK)
BASELINES = ("lora_1x_params", "lora_1x_compute", "tag", "single", BANK)  # non-ensemble
LABELS = {
    **{name: ALL_METHODS[name].label for name in METHODS if name != BANK},
    SMEAR: "SMEAR (library default: load balancing 0.01)",
    BANK: "SMEAR's router over a frozen bank of task LoRAs",
}
BANK_ROUTER_SHARE = 4  # the router phase takes steps // 4
VERDICT_RULE = (
    "win if the paired difference's mean − its sample std over seeds > 0, lose if mean + std < 0, tie otherwise"
)


# --- data --------------------------------------------------------------------------------------------------------


def split_rank(text: str, source: str, seed: int = 0) -> int:
    """An example's rank in ``load_benchmark``'s split rule (the second half of its digest): a cap keeps the smallest
    ranks, so a cut training set is what ``max_examples_per_task`` of that size keeps, and a smaller cut is a subset
    of a larger one."""
    digest = hashlib.sha256(f"{seed}\x1f{source}\x1f{duplicate_key(text)}".encode()).digest()
    return int.from_bytes(digest[8:16], "big")


def task_info(spec: TaskSpec, source: TaskInfo) -> TaskInfo:
    if not spec.labels:
        return replace(source, name=spec.name)
    missing = [label for label in spec.labels if label not in source.labels]
    if source.kind != "classification" or missing:
        raise ValueError(f"{spec.name}: {source.name} has no classes {missing or list(spec.labels)}.")
    return TaskInfo(spec.name, "classification", spec.labels)


def regime_data(full: DatasetDict, regime: Regime, preset: Preset) -> DatasetDict:
    """The regime's splits from the uncapped benchmark ``full``: each task's examples of its source (only the kept
    classes of a sub-task, relabelled), capped at the preset's sizes (the task's ``train`` for a cut training set) by
    the split rule's rank, in file order."""
    sources = benchmark_task_info(full)
    infos = [task_info(spec, sources[spec.source]) for spec in regime.tasks]
    eval_cap = preset.eval_examples_per_task or -(-preset.max_examples_per_task // 8)
    splits = {}
    for split in SPLITS:
        data = full[split]
        texts, labels, names = list(data["text"]), list(data["label"]), list(data["task"])
        columns: dict[str, list] = {"texts": [], "labels": [], "names": []}
        for spec, info in zip(regime.tasks, infos, strict=True):
            source = sources[spec.source]
            relabel = {source.labels.index(label): i for i, label in enumerate(spec.labels)}
            rows = [i for i, name in enumerate(names) if name == spec.source]
            if relabel:
                rows = [i for i in rows if int(labels[i]) in relabel]
            cap = (spec.train or preset.max_examples_per_task) if split == "train" else eval_cap
            kept = sorted(sorted(rows, key=lambda i: split_rank(texts[i], spec.source))[:cap])
            columns["texts"] += [texts[i] for i in kept]
            columns["labels"] += [float(relabel[int(labels[i])]) if relabel else labels[i] for i in kept]
            columns["names"] += [info.name] * len(kept)
        splits[split] = examples_dataset(**columns, tasks=infos)
    return DatasetDict(splits)


def load_setups(
    regimes: Sequence[Regime],
    preset: Preset,
    model_dir: Path,
    task_files: dict[str, str],
    cache_dir: str | None,
    use_cpu: bool,
    scratch: Path,
) -> dict[str, Setup]:
    """Every regime's ``quality.Setup``, from one uncapped load of the source tasks."""
    sources = list(dict.fromkeys(spec.source for regime in regimes for spec in regime.tasks))
    full = load_benchmark(sources, cache_dir=cache_dir, task_files=task_files)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    setups = {}
    for regime in regimes:
        regime_preset = replace(preset, steps=preset.steps * regime.steps_factor)
        data = regime_data(full, regime, regime_preset)
        setups[regime.name] = setup_of(data, regime_preset, model_dir, tokenizer, use_cpu, scratch)
    return setups


# --- the bank ----------------------------------------------------------------------------------------------------


def bank_steps(steps: int, num_tasks: int) -> tuple[int, int]:
    """Steps of each task's expert and of the router phase: ``steps // 4`` for the router, the rest split evenly."""
    router = max(1, steps // BANK_ROUTER_SHARE)
    return max(1, (steps - router) // num_tasks), router


def run_bank(run: Run, setup: Setup) -> dict[str, Any]:
    """One LoRA (and head) per task trained on that task alone, the LoRAs frozen as a bank, then SMEAR's router and
    the heads trained on the mixture; the row ``quality.run_one`` would write."""
    preset, tasks, train = setup.preset, setup.tasks, setup.splits["train"]
    expert_steps, router_steps = bank_steps(preset.steps, len(tasks))
    clock = RunClock()
    experts, heads = {}, {}

    def lora(base: MultiTaskModel) -> LoraConfig:
        return LoraConfig(r=preset.r, lora_alpha=preset.r, target_modules=block_linear_names(base))

    def train_on(model: Any, examples: Any, directory: Path, steps: int) -> Any:
        """``fit`` with the run's rate, seed and batch: experts and router differ only in data and steps."""
        return fit(
            model,
            examples,
            tasks,
            setup.collator,
            directory,
            steps=steps,
            batch_size=preset.batch_size,
            learning_rate=run.learning_rate,
            seed=run.seed,
            quiet=True,
            use_cpu=setup.use_cpu,
        )

    with tempfile.TemporaryDirectory(dir=setup.scratch) as output_dir:
        for index, task in enumerate(tasks):
            expert = build_model(setup.model_dir, tasks, lora, run.seed)  # one initialisation for every expert
            for parameter in expert.base_model.model.heads.parameters():
                parameter.requires_grad_(True)  # the task's head learns with its expert; no other head sees data
            train_on(expert, train.select(rows_of(train, index)), Path(output_dir) / task.name, expert_steps)
            experts[task.name] = Path(output_dir) / task.name / "adapter"
            expert.save_pretrained(str(experts[task.name]))  # the LoRA alone: the heads are no part of it
            head = expert.base_model.model.heads.linears[index]
            heads[index] = {key: value.detach().clone() for key, value in head.state_dict().items()}
            del expert
        set_seed(run.seed)
        base = MultiTaskModel.from_encoder_dir(setup.model_dir, tasks)
        model = build_expert_bank(base, experts, {"routing": "smear", "modules_to_save": ["heads"]})
        trained_heads = model.base_model.model.heads.modules_to_save["default"]
        for index, state in heads.items():
            trained_heads.linears[index].load_state_dict(state)
        trainable, _ = model.get_nb_trainable_parameters()
        trainer = train_on(model, train, Path(output_dir) / "router", router_steps)
        clock.trained = time.perf_counter()
        validation = evaluate(trainer, setup.splits["validation"], tasks) if run.phase == "sweep" else {}
        test = evaluate(trainer, setup.splits["test"], tasks)
    model.eval()
    report = RoutingReport.collect(model, routing_batches_on(model, setup))
    # ``trainable``: the router phase's parameters (routers and heads); the experts trained before.
    return result_row(run, trainable, clock, report, validation, test)


def run_in_regime(regime: str, run: Run, setups: dict[str, Setup]) -> dict[str, Any]:
    """One run of ``regime``: the bank's protocol for the bank, quality.py's for every other method."""
    setup = setups[regime]
    return run_bank(run, setup) if run.method == BANK else run_one(run, setup)[0]


# --- the scheduler -----------------------------------------------------------------------------------------------


def run_study(
    setups: dict[str, Setup],
    regimes: Sequence[Regime],
    methods: Sequence[str],
    learning_rates: dict[str, Sequence[float]],
    seeds: int,
    journals: dict[str, RunJournal],
    jobs: int = 1,
    threads: int | None = None,
    log: Callable[[str], None] = print,
) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """Every regime's runs, ``jobs`` at a time: each method's rate sweep (seed 0), widened along the regime's ladder
    while its best rate lies at an edge of its grid (:func:`~quality.widened`), then its other seeds at the chosen
    rate. The next run started is always the first ready one in regime order, so regimes finish one after another
    and a study cut off leaves whole regimes. Runs in a regime's journal are replayed, not trained again. Returns the
    rows of each regime (``chosen`` set) and the number of replayed runs."""
    order = {regime.name: i for i, regime in enumerate(regimes)}
    method_order = {method: i for i, method in enumerate(methods)}
    ready = [
        (regime.name, Run(method, rate, 0, "sweep"))
        for regime in regimes
        for method in methods
        for rate in learning_rates[regime.name]
    ]
    grids = {(regime.name, method): list(learning_rates[regime.name]) for regime in regimes for method in methods}
    ladders = {regime.name: regime.ladder for regime in regimes}
    rows: dict[tuple[str, Run], dict[str, Any]] = {}
    chosen: dict[tuple[str, str], float] = {}
    replayed = 0

    def priority(item: tuple[str, Run]) -> tuple:
        regime, run = item
        return order[regime], method_order[run.method], run.phase != "sweep", run.learning_rate, run.seed

    def finish(regime: str, run: Run, row: dict[str, Any], from_journal: bool) -> None:
        rows[regime, run] = {**row, "regime": regime}
        if not from_journal:
            journals[regime].record(row)
        validation = row.get("validation_average")
        shown = f"validation {validation:.4f}, " if validation is not None else ""
        log(
            f"{regime:<20} {run.method:<16} lr {run.learning_rate:.1e} seed {run.seed}: {shown}test "
            f"{row['test_average']:.4f} ({row['total_seconds']:.0f} s)"
            + (" (from the journal)" if from_journal else "")
        )
        grid = grids[regime, run.method]
        swept = [rows.get((regime, Run(run.method, rate, 0, "sweep"))) for rate in grid]
        if run.phase != "sweep" or None in swept:
            return
        best = choose_learning_rates(swept)[run.method]
        if (wider := widen(grid, best, ladders[regime], log, f"{regime:<20} {run.method:<16}")) is not None:
            ready.append((regime, Run(run.method, wider, 0, "sweep")))
            return
        chosen[regime, run.method] = best
        ready.extend((regime, Run(run.method, best, seed, "seeds")) for seed in range(1, seeds))

    executor = RunPool(setups, jobs, threads)
    pending: dict[Future, tuple[str, Run]] = {}
    with executor:
        while ready or pending:
            while ready and len(pending) < jobs:
                ready.sort(key=priority)
                regime, run = ready.pop(0)
                if run in journals[regime].finished:
                    replayed += 1
                    finish(regime, run, journals[regime].finished[run], True)
                    continue
                pending[executor.submit(run_in_regime, regime, run)] = (regime, run)
            if not pending:
                continue
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                regime, run = pending.pop(future)
                finish(regime, run, future.result(), False)
    by_regime: dict[str, list[dict[str, Any]]] = {regime.name: [] for regime in regimes}
    for regime, run in sorted(rows, key=priority):
        row = rows[regime, run]
        row["chosen"] = row["learning_rate"] == chosen[regime, run.method]
        by_regime[regime].append(row)
    return by_regime, replayed


# --- verdicts ----------------------------------------------------------------------------------------------------


def verdict(mean: float, std: float) -> str:
    """The study's rule: win if mean − std > 0, lose if mean + std < 0, tie otherwise."""
    return "win" if mean - std > 0 else "lose" if mean + std < 0 else "tie"


def best_baseline(summaries: dict[str, Summary], metric: str = "average", exclude: Sequence[str] = ()) -> str | None:
    """The non-ensemble baseline with the best mean ``metric`` (ties: the first in ``BASELINES``)."""
    candidates = [m for m in BASELINES if m in summaries and m not in exclude]
    return max(candidates, key=lambda m: summaries[m].mean(metric), default=None)


@dataclass
class Outcome:
    """One regime's summaries and verdicts."""

    regime: Regime
    tasks: list[TaskInfo]
    summaries: dict[str, Summary]
    sweep: list[dict[str, Any]]  # the seed-0 runs of every rate each method swept
    small_metric: str
    small_size: int
    steps: int
    best: str | None  # the best baseline on average
    gain: tuple[float, float] | None  # SMEAR − best, paired
    small_best: str | None
    small_gain: tuple[float, float] | None
    bank_vs_lora: tuple[str, float, float] | None  # the best LoRA, bank − it, paired

    @cached_property
    def grids(self) -> dict[str, list[float]]:
        """Each method's swept rates, in order."""
        grids: dict[str, list[float]] = {}
        for row in self.sweep:
            grids.setdefault(row["method"], []).append(row["learning_rate"])
        return {method: sorted(rates) for method, rates in grids.items()}


def outcome(regime: Regime, setup: Setup, rows: list[dict[str, Any]]) -> Outcome:
    summaries = summarise(rows, setup.tasks)
    small_task = next(task for task in setup.tasks if task.name == regime.small)
    small_metric = metric_name(small_task)
    small_size = len(rows_of(setup.splits["train"], setup.tasks.index(small_task)))
    best = best_baseline(summaries)
    small_best = best_baseline(summaries, small_metric)
    smear = summaries.get(SMEAR)
    gain = paired_difference(smear, summaries[best]) if smear and best else None
    small_gain = paired_difference(smear, summaries[small_best], small_metric) if smear and small_best else None
    loras = [m for m in ("lora_1x_params", "lora_1x_compute") if m in summaries]
    bank_vs_lora = None
    if BANK in summaries and loras:
        lora = max(loras, key=lambda m: summaries[m].mean())
        bank_vs_lora = (lora, *paired_difference(summaries[BANK], summaries[lora]))
    return Outcome(
        regime,
        setup.tasks,
        summaries,
        [row for row in rows if row["phase"] == "sweep"],
        small_metric,
        small_size,
        setup.preset.steps,
        best,
        gain,
        small_best,
        small_gain,
        bank_vs_lora,
    )


# --- the report --------------------------------------------------------------------------------------------------


def _pm(pair: tuple[float, float] | None) -> str:
    return "–" if pair is None else f"{pair[0]:+.2f} ± {pair[1]:.2f}"


def _verdict_cell(pair: tuple[float, float] | None) -> str:
    return "–" if pair is None else f"**{verdict(*pair)}**"


def summary_table(outcomes: Sequence[Outcome]) -> str:
    header = [
        "regime",
        "varies",
        "tasks",
        "small task's training examples",
        "steps",
        "SMEAR average",
        "best non-ensemble baseline (average)",
        "SMEAR − best, paired",
        "verdict",
        "small task: SMEAR − best, paired",
        "small-task verdict",
        "bank − best LoRA, paired",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for o in outcomes:
        smear = o.summaries.get(SMEAR)
        best = f"{LABELS[o.best]} {o.summaries[o.best].mean():.2f}" if o.best else "–"
        small_best = f" (vs {LABELS[o.small_best]})" if o.small_best else ""
        cells = [
            f"`{o.regime.name}`",
            o.regime.axis,
            str(len(o.tasks)),
            f"{o.small_size} ({o.regime.small})",
            str(o.steps),
            f"{smear.mean():.2f} ± {smear.std():.2f}" if smear else "–",
            best,
            _pm(o.gain),
            _verdict_cell(o.gain),
            _pm(o.small_gain) + small_best,
            _verdict_cell(o.small_gain),
            f"{_pm(o.bank_vs_lora[1:])} (vs {LABELS[o.bank_vs_lora[0]]})" if o.bank_vs_lora else "–",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def regime_table(o: Outcome) -> str:
    """A row per method: its chosen rate and the rates it swept, test mean ± std per task and on average, and SMEAR
    minus it (paired)."""
    names = [metric_name(task) for task in o.tasks]
    header = [
        "method",
        "lr",
        "rates swept",
        *[name.replace("_", " ") for name in names],
        "average",
        "SMEAR − this, paired",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    smear = o.summaries.get(SMEAR)
    for method, summary in o.summaries.items():
        cells = [LABELS[method], f"{summary.learning_rate:.1e}", ", ".join(f"{r:.1e}" for r in o.grids[method])]
        for name in names:
            cell = f"{summary.mean(name):.1f} ± {summary.std(name):.1f}"
            cells.append(f"*{cell}*" if name == o.small_metric else cell)
        cells.append(f"**{summary.mean():.2f} ± {summary.std():.2f}**")
        cells.append(_pm(paired_difference(smear, summary)) if smear and method != SMEAR else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def edge_rates(o: Outcome) -> list[str]:
    """Methods whose chosen rate is the top or bottom of the rates they swept: the ladder's cap stopped the widening
    (a wider grid might have done better)."""
    return [
        f"{LABELS[m]} ({s.learning_rate:.1e})"
        for m, s in o.summaries.items()
        if len(o.grids[m]) > 1 and s.learning_rate in (o.grids[m][0], o.grids[m][-1])
    ]


def save_figure(outcomes: Sequence[Outcome], path: Path) -> Path | None:
    """SMEAR minus the best non-ensemble baseline (paired mean ± std) against the small task's training examples:
    the imbalance curve on average and on the small task's own metric; the other regimes as single points."""
    curve = sorted((o for o in outcomes if o.regime.on_curve and o.gain), key=lambda o: o.small_size)
    others = [o for o in outcomes if not o.regime.on_curve and o.gain]
    if not curve and not others:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    for axis, attribute, title in (
        (axes[0], "gain", "average over the regime's tasks"),
        (axes[1], "small_gain", "the small task's own metric"),
    ):
        if curve:
            axis.errorbar(
                [o.small_size for o in curve],
                [getattr(o, attribute)[0] for o in curve],
                yerr=[getattr(o, attribute)[1] for o in curve],
                marker="o",
                capsize=4,
                label="six tasks, small task cut (imbalance)",
            )
        markers = "s^vDP*X"
        for k, o in enumerate(others):
            axis.errorbar(
                [o.small_size * (1.06 + 0.06 * k)],
                [getattr(o, attribute)[0]],
                yerr=[getattr(o, attribute)[1]],
                marker=markers[k % len(markers)],
                linestyle="none",
                capsize=3,
                label=o.regime.name,
            )
        axis.axhline(0, color="grey", linewidth=0.8)
        axis.set_xscale("log", base=2)
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("training examples of the small task")
    axes[0].set_ylabel("SMEAR − best non-ensemble baseline (points)")
    axes[1].legend(fontsize=7, loc="best")
    figure.suptitle("When SMEAR pays: paired gain over the best non-ensemble baseline (mean ± std over seeds)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def report_body(outcomes: Sequence[Outcome], preset: Preset, seeds: int, figure: Path | None) -> str:
    lines = [
        f"Every method in every regime: {preset.steps} steps (× the regime's factor) of batch {preset.batch_size}, "
        f"{preset.max_length} tokens, {preset.num_experts} experts of rank {preset.r} where there are experts (LoRA "
        f"1× parameters: rank {preset.num_experts * preset.r}; lora_alpha = {preset.r}), up to "
        f"{preset.max_examples_per_task} training examples per task unless cut, learning rate chosen by the "
        "validation average of seed 0 from the regime's grid, widened along its ladder while a method's best rate "
        f"lies at an edge of the rates it swept, then {seeds} seeds at that rate; test mean ± sample std "
        "over seeds, ×100 (accuracy, Pearson for nyt_reg). The bank: the same total steps, a quarter for the router "
        "and heads on the mixture, the rest split evenly among the tasks' own LoRAs (see the script's docstring). "
        f"Verdict ({SMEAR}, the library's default SMEAR, against the best non-ensemble baseline by mean): "
        f"{VERDICT_RULE}.",
        "",
        summary_table(outcomes),
    ]
    if figure is not None:
        lines += ["", f"Figure: `{figure.as_posix()}`"]
    for o in outcomes:
        tasks = ", ".join(
            f"{task.name} ({o.small_size} training examples)" if task.name == o.regime.small else task.name
            for task in o.tasks
        )
        rates = ", ".join(f"{rate:.1e}" for rate in o.regime.learning_rates)
        ladder = ", ".join(f"{rate:.1e}" for rate in o.regime.ladder)
        edges = edge_rates(o)
        lines += [
            "",
            f"### `{o.regime.name}` ({o.regime.axis})",
            "",
            f"Tasks: {tasks}. {o.steps} steps; learning rates {rates}, widened along {ladder}. The small task's "
            "column is in italics.",
            "",
            regime_table(o),
            "",
            "Rates chosen at an edge of the rates swept (the ladder's cap): " + (", ".join(edges) or "none") + ".",
            "",
            "Learning-rate sweep (seed 0):",
            "",
            sweep_table(o.sweep, LABELS.__getitem__),
        ]
    return "\n".join(lines) + "\n"


def results_section(
    body: str,
    study: str,
    regimes: Sequence[Regime],
    command: str,
    machine: str,
    load: tuple[tuple, tuple],
    seconds: float,
    cpu_seconds: float,
    replayed: int,
) -> str:
    default = [regime.name for regime in STUDY_REGIMES[study]]
    chosen = [regime.name for regime in regimes]
    subset = "" if chosen == default else f", regimes {', '.join(chosen)}"
    reused = (
        f" {replayed} runs were replayed from the journals of an earlier command with the same settings (`--resume`): "
        "their time is in the CPU-minutes, not in the wall time."
        if replayed
        else ""
    )
    return "\n".join(
        [
            f"## When SMEAR pays: a controlled study, preset `{study}`{subset}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "",
            f"- Command: `{command}`",
            f"- Machine: {machine}",
            f"- Load average (1, 5, 15 min) before / after the run: {load_description(load, 'slowed the run')}.",
            f"- Wall time: {seconds / 60:.1f} min; the runs took {cpu_seconds / 60:.0f} CPU-minutes in all.{reused}",
            "",
            body,
        ]
    )


def write_csv(by_regime: dict[str, list[dict[str, Any]]], setups: dict[str, Setup], path: Path) -> None:
    columns = ["regime"]
    for setup in setups.values():
        columns += [c for c in csv_columns(setup.tasks) if c not in columns]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, restval="")
        writer.writeheader()
        for rows in by_regime.values():
            writer.writerows(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(STUDY_REGIMES), default="reduced")
    parser.add_argument("--regimes", nargs="+", help="run only these regimes (default: all of the preset's)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--learning-rates", nargs="+", type=float, help="one grid for every regime (default: theirs)")
    parser.add_argument("--seeds", type=int, help="seeds per method at the chosen rate (default: the preset's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", type=Path, help="local encoder directory (default: the MiniLM of the benchmark)")
    parser.add_argument("--task-file", action="append", type=_task_file, default=[], metavar="NAME=PATH")
    parser.add_argument("--cache-dir", help="data cache (default: $PEFT_SMEAR_CACHE or ~/.cache/peft_smear)")
    add_study_options(parser, "when_smear_pays")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, log: Callable[[str], None] = print) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    preset = PRESETS[STUDY_PRESETS[args.preset]]
    seeds = args.seeds or preset.seeds
    regimes = chosen_regimes(list(STUDY_REGIMES[args.preset]), args.regimes, args.preset)
    rates = {regime.name: tuple(args.learning_rates or regime.learning_rates) for regime in regimes}
    load_before, started = os.getloadavg(), time.perf_counter()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.output_dir) as scratch:
        setups = load_setups(
            regimes,
            preset,
            args.model or default_model_dir(),
            dict(args.task_file),
            args.cache_dir,
            args.device == "cpu",
            Path(scratch),
        )
        journals = {}
        for regime in regimes:
            setup = setups[regime.name]
            shared = {k: v for k, v in asdict(setup.preset).items() if k not in RATE_SETTINGS}
            settings = {
                "preset": shared,
                "tasks": [asdict(spec) for spec in regime.tasks],
                "bank_router_share": BANK_ROUTER_SHARE,
            }
            (args.output_dir / regime.name).mkdir(parents=True, exist_ok=True)
            journals[regime.name] = RunJournal(args.output_dir / regime.name / "runs.jsonl", settings, args.resume)
            if journals[regime.name].finished:
                log(f"resuming {regime.name}: {len(journals[regime.name].finished)} finished runs")
        by_regime, replayed = run_study(
            setups, regimes, args.methods, rates, seeds, journals, args.jobs, args.threads, log
        )
    seconds, load_after = time.perf_counter() - started, os.getloadavg()
    outcomes = [outcome(regime, setups[regime.name], by_regime[regime.name]) for regime in regimes]
    figure = save_figure(outcomes, args.figure)
    body = report_body(outcomes, preset, seeds, figure)
    write_csv(by_regime, setups, args.output_dir / "runs.csv")
    (args.output_dir / "study.md").write_text(body)
    log(body)
    if args.append_results is not None:
        command = command_line("when_smear_pays.py", argv)
        machine = f"{machine_description(args.device)}; {args.jobs} run(s) side by side, each with those threads"
        cpu_seconds = sum(row["cpu_seconds"] for rows in by_regime.values() for row in rows)
        section = results_section(
            body, args.preset, regimes, command, machine, (load_before, load_after), seconds, cpu_seconds, replayed
        )
        write_results(args.append_results, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
