"""Argument types and message helpers shared by the ``peft-smear`` commands. Light on purpose (the standard library
only): the commands parse their arguments before torch and PEFT are imported, so that ``--help`` and a wrong argument
answer at once."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from .export.forms import DEFAULT_FORM, FORMS, energy_summary


class CommandError(Exception):
    """A problem with the command's input: reported as one ``error:`` line and exit code 2, without a traceback."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one ``<prog>: error: ...`` line, exit code 2, like every other
    error of the commands (argparse's own prints the usage first). Its subcommands' parsers are of this class too."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def one_line(message: object) -> str:
    """``message`` with its line breaks and runs of spaces folded into single spaces."""
    return " ".join(str(message).split())


def report_error(command: str, error: BaseException | str) -> int:
    """Print ``error`` as the one line ``peft-smear <command>: error: ...`` on stderr and return exit code 2."""
    print(f"peft-smear {command}: error: {one_line(error)}", file=sys.stderr)
    return 2


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def name_path_pairs(entries: Sequence[str], option: str) -> dict[str, str]:
    """``NAME=PATH`` entries of a repeatable option as ``{name: path}``, each name once."""
    pairs: dict[str, str] = {}
    for entry in entries:
        name, separator, path = entry.partition("=")
        if not separator or not name or not path:
            raise ValueError(f"{option} takes NAME=PATH, got {entry!r}.")
        if name in pairs:
            raise ValueError(f"{option} names {name!r} twice.")
        pairs[name] = path
    return pairs


def add_form_arguments(parser: argparse.ArgumentParser) -> None:
    """``--form`` and ``--rank``: how a task is exported (``peft-smear export --task-data`` and ``export-tasks``)."""
    group = parser.add_argument_group("how a task is exported")
    group.add_argument(
        "--form",
        choices=FORMS,
        default=DEFAULT_FORM,
        help=(
            "mean_routing: the merged expert of the task's mean routing, at the experts' rank r; mean_update: the "
            "average of the examples' own merged experts, exactly (for LoRA experts one LoRA of rank num_experts * "
            "r; for IA3 experts the same as mean_routing; refused for bottleneck adapters) or truncated by --rank "
            f"(default: {DEFAULT_FORM})"
        ),
    )
    group.add_argument(
        "--rank",
        type=positive_int,
        metavar="K",
        help="with --form mean_update and LoRA experts: truncate the mean update by SVD to rank K (at most "
        "num_experts * r), reporting the share of its energy kept (default: exact)",
    )


def form_summary(exported: Any, form: str) -> str:
    """What a task's export holds, for the printed summary: its form, rank and, truncated, the energy it keeps."""
    if form == "mean_routing":
        return "the merged expert of the mean routing"
    energy = getattr(exported, "energy_kept", None)
    if energy is None:
        return "the mean update: for these experts, exactly the merged expert of the mean routing"
    (module, least), average = energy_summary(energy)
    if least == 1:
        return f"the mean update, exactly, as a LoRA of rank {exported.r}"
    return (
        f"the mean update truncated to rank {exported.r}, keeping {average:.2%} of its energy on average over the "
        f"modules and {least:.2%} at least ({module}; every module in the adapter's README.md)"
    )
