"""The forms a task's routing is exported in, and the summary of a truncated mean update: plain names, which the
commands read while they parse their arguments, before torch and PEFT are imported (the standard library only)."""

from __future__ import annotations

from collections.abc import Mapping


FORMS = ("mean_routing", "mean_update")
"""How a task's routing is exported (``form`` of :func:`~peft_smear.export_merged_adapter`)."""
DEFAULT_FORM = "mean_routing"
"""The form a task is exported in unless told otherwise (Python, ``peft-smear export`` and ``export-tasks``)."""


def energy_summary(energy_kept: Mapping[str, float]) -> tuple[tuple[str, float], float]:
    """The module that keeps the least of its mean update's energy, with that share, and the mean share."""
    low = min(energy_kept.items(), key=lambda item: item[1])
    return low, sum(energy_kept.values()) / len(energy_kept)
