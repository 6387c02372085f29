"""Argument types and message helpers shared by the ``peft-smear`` commands."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


class CommandError(Exception):
    """A problem with the command's input: reported as one ``error:`` line and exit code 2, without a traceback."""


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
