"""Argument types and message helpers shared by the ``peft-smear`` commands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


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
