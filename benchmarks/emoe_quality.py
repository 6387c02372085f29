"""Does EMoE help? LoRA and SMEAR with and without emergent experts in MiniLM's FFNs, on the real multi-task benchmark,
under the protocol of ``benchmarks/quality.py`` (same data, preset, schedule, rate sweep on validation, seeds).

Methods: LoRA (rank r on every linear layer of the blocks, as quality.py's "LoRA 1× compute"); EMoE + LoRA (the
paper's N=64, k=16 in the last even-numbered layer, clustered keys); EMoE with random groups + LoRA (the paper's
table 4 ablation); EMoE-learn + LoRA (a learned gate, initialised at the mean keys, trained with the adapter: not
in the default list); SMEAR; EMoE + SMEAR. Every EMoE run is also evaluated with its EMoE layers removed, i.e. its
adapter on the dense model (EMoE2LoRA), at the same rate and seeds.

    python benchmarks/emoe_quality.py --preset reduced --jobs 2 --threads 1 --append-results benchmarks/RESULTS.md

Writes ``<output-dir>/runs.csv`` and ``<output-dir>/emoe_quality.md``, and per EMoE method the heatmap of how
often each task selects each expert (seed 0, chosen rate, test examples) to ``<figures-dir>/emoe_<method>.png``.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import quality
import torch
from common import (
    RunPool,
    add_results_option,
    command_line,
    load_description,
    machine_description,
    methods_in_title,
    write_results,
)
from quality import (
    PRESETS,
    Run,
    RunClock,
    Setup,
    Summary,
    load_setup,
    paired_difference,
    result_row,
    routing_batches_on,
    summarise,
)

from peft_smear.emoe import gate_parameters, moefy, remove_emoe, selection_report
from peft_smear.multitask.model import metric_name
from peft_smear.multitask.report import RoutingReport
from peft_smear.multitask.training import build_model, default_model_dir, evaluate, fit


@dataclass(frozen=True)
class Method:
    """``adapter``: a method of quality.py (its PEFT config); ``clustering``: EMoE's partition, or ``None``
    (no EMoE)."""

    label: str
    adapter: str
    clustering: str | None = None
    gate: str = "avg_k"


METHODS = {
    "lora": Method("LoRA (rank r)", "lora_1x_compute"),
    "emoe_lora": Method("EMoE + LoRA", "lora_1x_compute", "kmeans"),
    "emoe_random_lora": Method("EMoE, random groups + LoRA", "lora_1x_compute", "random"),
    "emoe_learn_lora": Method("EMoE-learn (learned gate) + LoRA", "lora_1x_compute", "kmeans", "learned"),
    "smear": Method("SMEAR", "smear"),
    "emoe_smear": Method("EMoE + SMEAR", "smear", "kmeans"),
}
DENSE = "_dense"  # suffix of an EMoE run evaluated with its EMoE layers removed (EMoE2LoRA)


@dataclass
class EmoeSetup(Setup):
    """quality.py's setup and EMoE's shape (the paper's N=64, k=16 by default)."""

    num_experts: int = 64
    top_k: int = 16


def label(method: str) -> str:
    if method.endswith(DENSE):
        return f"{METHODS[method.removesuffix(DENSE)].label}, evaluated dense (EMoE2LoRA)"
    return METHODS[method].label


def run_one(run: Run, setup: EmoeSetup) -> tuple[list[dict[str, Any]], RoutingReport | None]:
    """Train one method at one rate and seed; its row (and, for EMoE, the row of the same adapter evaluated dense)
    and, for EMoE, the expert-selection report on the routing examples."""
    preset, method = setup.preset, METHODS[run.method]
    clock = RunClock()

    def make_config(base: torch.nn.Module):
        if method.clustering is not None:  # random groups: a new draw per seed; k-means is deterministic
            moefy(base, setup.num_experts, setup.top_k, clustering=method.clustering, seed=run.seed, gate=method.gate)
        return quality.peft_config(method.adapter, base, preset)

    model = build_model(setup.model_dir, setup.tasks, make_config, run.seed)
    for parameter in gate_parameters(model):  # EMoE-learn: PEFT froze the learned gates with the base model
        parameter.requires_grad_(True)
    trainable, _ = model.get_nb_trainable_parameters()
    rows, report = [], None
    with tempfile.TemporaryDirectory(dir=setup.scratch) as output_dir:
        trainer = fit(
            model,
            setup.splits["train"],
            setup.tasks,
            setup.collator,
            output_dir,
            steps=preset.steps,
            batch_size=preset.batch_size,
            learning_rate=run.learning_rate,
            seed=run.seed,
            quiet=True,
            use_cpu=setup.use_cpu,
        )
        clock.trained = time.perf_counter()
        variants = [run.method] if method.clustering is None else [run.method, run.method + DENSE]
        for variant in variants:
            if variant.endswith(DENSE):
                model.eval()
                report = selection_report(model, routing_batches_on(model, setup))
                remove_emoe(model)
            validation = evaluate(trainer, setup.splits["validation"], setup.tasks) if run.phase == "sweep" else {}
            test = evaluate(trainer, setup.splits["test"], setup.tasks)
            rows.append({**result_row(run, trainable, clock, None, validation, test), "method": variant})
    return rows, report


def run_benchmark(
    setup: Setup,
    methods: Sequence[str],
    learning_rates: Sequence[float],
    seeds: int,
    jobs: int,
    threads: int | None,
    log: Callable[[str], None] = print,
    ladder: Sequence[float] = (),
) -> tuple[list[dict[str, Any]], dict[str, RoutingReport]]:
    """As quality.py: each method sweeps the rates with seed 0, widened along ``ladder`` while its best on validation
    lies at an edge (``quality.widened``), keeps the best, then runs the other seeds at it. An EMoE2LoRA row takes its
    EMoE run's rate."""
    executor = RunPool(setup, jobs, threads)
    results: dict[Run, tuple[list[dict[str, Any]], RoutingReport | None]] = {}
    chosen: dict[str, float] = {}
    grids = {method: list(learning_rates) for method in methods}
    pending: dict[Future, Run] = {}

    def submit(method: str, rate: float, seed: int, phase: str) -> None:
        run = Run(method, rate, seed, phase)
        pending[executor.submit(run_one, run)] = run

    with executor:
        for method in methods:
            for rate in learning_rates:
                submit(method, rate, 0, "sweep")
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                run = pending.pop(future)
                results[run] = future.result()
                for row in results[run][0]:
                    log(quality._progress(row))
                swept = [rows[0] for other, (rows, _) in results.items() if other.method == run.method]
                if run.phase == "sweep" and len(swept) == len(grids[run.method]):
                    best = quality.choose_learning_rates(swept)[run.method]
                    if (wider := quality.widen(grids[run.method], best, ladder, log, f"{run.method}:")) is not None:
                        submit(run.method, wider, 0, "sweep")
                        continue
                    chosen[run.method] = best
                    for seed in range(1, seeds):
                        submit(run.method, chosen[run.method], seed, "seeds")
    order = {method: i for i, method in enumerate(methods)}
    runs = sorted(results, key=lambda r: (order[r.method], r.phase != "sweep", r.learning_rate, r.seed))
    rows = [row for run in runs for row in results[run][0]]
    for row in rows:
        row["chosen"] = row["learning_rate"] == chosen[row["method"].removesuffix(DENSE)]
    reports = {
        run.method: report
        for run in runs
        if (report := results[run][1]) is not None and run.seed == 0 and run.learning_rate == chosen[run.method]
    }
    ordered = sorted(rows, key=lambda row: (order[row["method"].removesuffix(DENSE)], row["method"].endswith(DENSE)))
    return ordered, reports


def markdown_table(summaries: dict[str, Summary], metrics: Sequence[str]) -> str:
    header = ["method", "lr", "trainable params", *[name.replace("_", " ") for name in metrics], "average"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for summary in summaries.values():
        cells = [
            label(summary.method),
            f"{summary.learning_rate:.0e}",
            f"{summary.trainable_params / 1e6:.2f} M",
            *[f"{summary.mean(name):.1f} ± {summary.std(name):.1f}" for name in metrics],
            f"**{summary.mean():.2f} ± {summary.std():.2f}**",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_targets(summaries: dict[str, Summary]) -> list[tuple[str, str]]:
    """The paper's claims at this budget, each with the means and the paired difference over seeds."""

    def compare(a: str, b: str, ok: Callable[[float], bool], claim: str) -> tuple[str, str]:
        if a not in summaries or b not in summaries:
            return claim, f"not run ({a} or {b})"
        mean, std = paired_difference(summaries[a], summaries[b])
        detail = (
            f"{label(a)} {summaries[a].mean():.2f} ± {summaries[a].std():.2f} vs {label(b)} "
            f"{summaries[b].mean():.2f} ± {summaries[b].std():.2f}; paired difference {mean:+.2f} ± {std:.2f}"
        )
        return claim, f"{'held' if ok(summaries[a].mean() - summaries[b].mean()) else 'did not hold'} ({detail})"

    return [
        compare("emoe_lora", "lora", lambda d: d >= 0, "EMoE + LoRA ≥ LoRA"),
        compare("emoe_lora", "emoe_random_lora", lambda d: d > 0, "clustered groups > random groups"),
        compare("emoe_lora_dense", "emoe_lora", lambda d: abs(d) <= 0.5, "EMoE2LoRA within 0.5 points of EMoE"),
        compare("emoe_lora", "emoe_learn_lora", lambda d: d >= 0, "avg-k gate ≥ learned gate (EMoE ≥ EMoE-learn)"),
        compare("emoe_smear", "smear", lambda d: d >= 0, "EMoE + SMEAR ≥ SMEAR (not a paper claim)"),
        compare("emoe_smear_dense", "emoe_smear", lambda d: abs(d) <= 0.5, "EMoE + SMEAR evaluated dense within 0.5"),
    ]


def default_methods() -> list[str]:
    """The methods of a run without ``--methods``: every method but the learned gate (an investigation)."""
    return [method for method in METHODS if method != "emoe_learn_lora"]


def main(argv: list[str] | None = None, log: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="reduced")
    default = default_methods()
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=default)
    parser.add_argument("--learning-rates", nargs="+", type=float, help="default: the preset's")
    parser.add_argument("--seeds", type=int, help="seeds per method at the chosen rate (default: the preset's)")
    parser.add_argument("--steps", type=int, help="training steps (default: the preset's)")
    parser.add_argument("--model", type=Path, help="local encoder directory (default: the MiniLM of the benchmark)")
    parser.add_argument("--tasks", nargs="+", help="benchmark tasks (default: all, or only the --task-file tasks)")
    parser.add_argument("--task-file", action="append", type=quality._task_file, default=[], metavar="NAME=PATH")
    parser.add_argument("--num-experts", type=int, default=64, help="EMoE experts per layer (default: 64)")
    parser.add_argument("--top-k", type=int, default=16, help="EMoE experts kept per token (default: 16)")
    parser.add_argument("--cache-dir", help="data cache (default: $PEFT_SMEAR_CACHE or ~/.cache/peft_smear)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/emoe_quality"))
    parser.add_argument("--figures-dir", type=Path, default=Path("benchmarks/figures"))
    add_results_option(parser)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    preset = replace(preset, steps=args.steps or preset.steps, seeds=args.seeds or preset.seeds)
    learning_rates = args.learning_rates or list(preset.learning_rates)
    load_before, started = os.getloadavg(), time.perf_counter()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    task_files = dict(args.task_file)
    tasks = args.tasks if args.tasks or not task_files else list(task_files)
    with tempfile.TemporaryDirectory(dir=args.output_dir) as scratch:
        loaded = load_setup(
            preset, args.model or default_model_dir(), tasks, task_files, args.cache_dir, True, Path(scratch)
        )
        setup = EmoeSetup(**vars(loaded), num_experts=args.num_experts, top_k=args.top_k)
        rows, reports = run_benchmark(
            setup, args.methods, learning_rates, preset.seeds, args.jobs, args.threads, log, preset.ladder
        )
    seconds, load_after = time.perf_counter() - started, os.getloadavg()
    metrics = [metric_name(task) for task in setup.tasks]
    summaries = summarise(rows, setup.tasks)
    args.figures_dir.mkdir(parents=True, exist_ok=True)
    figures = {}
    for method, report in reports.items():
        figures[method] = args.figures_dir / f"emoe_{method}.png"
        report.save_heatmaps(figures[method])
    body = "\n".join(
        [
            f"Tasks: {', '.join(task.name for task in setup.tasks)}. {preset.steps} steps of batch "
            f"{preset.batch_size}, {preset.max_length} tokens; LoRA rank {preset.r} on every linear layer of the "
            f"blocks; SMEAR {preset.num_experts} experts of rank {preset.r}; EMoE N={setup.num_experts}, top-k="
            f"{setup.top_k} in the last even-numbered layer. Learning rate chosen from "
            f"{', '.join(f'{r:.1e}' for r in learning_rates)}, widened along "
            f"{', '.join(f'{r:.1e}' for r in preset.ladder)} while a method's best lies at an edge of the rates it "
            f"swept, on the validation average of seed 0 (EMoE2LoRA: its EMoE run's), then {preset.seeds} seeds; "
            "test mean ± sample std over seeds. " + quality.TARGETS_NOTE,
            "",
            markdown_table(summaries, metrics),
            "",
            "### The paper's claims at this budget",
            "",
            *[f"- {claim}: {result}" for claim, result in check_targets(summaries)],
            "",
            "### Expert selection per task (seed 0, chosen rate, test examples)",
            "",
            *[f"- {label(m)}: `{path.as_posix()}`" for m, path in figures.items()],
            *[f"\n{label(m)}:\n\n```\n{report.table()}\n```" for m, report in reports.items()],
        ]
    )
    with open(args.output_dir / "runs.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(k for row in rows for k in row)), restval="")
        writer.writeheader()
        writer.writerows(rows)
    (args.output_dir / "emoe_quality.md").write_text(body + "\n")
    log(body)
    if args.append_results is not None:
        command = command_line("emoe_quality.py", argv)
        cpu_minutes = sum(row["cpu_seconds"] for row in rows if not row["method"].endswith(DENSE)) / 60
        section = "\n".join(
            [
                f"## EMoE quality, preset `{args.preset}`{methods_in_title(args.methods, default_methods())}, "
                f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
                "",
                f"- Command: `{command}`",
                f"- Machine: {machine_description('cpu')}; {args.jobs} run(s) side by side",
                f"- Load average before / after: {load_description((load_before, load_after), 'slowed the run')}.",
                f"- Wall time: {seconds / 60:.1f} min; {cpu_minutes:.0f} CPU-minutes. {preset.note}",
                "",
                body,
                "",
            ]
        )
        write_results(args.append_results, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
