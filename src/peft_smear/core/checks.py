"""Config setting checks, in one place so that ``True`` never passes for 1 nor NaN for a number."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence


Check = Callable[[str, object], None]  # check(name, value) raises a ValueError naming both, or returns


def is_integer(value: object) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is an ``int`` in Python, never a count or an index here)."""
    return isinstance(value, int) and not isinstance(value, bool)


SMALLEST, LARGEST = 1e-6, 1e4
"""Real settings' range (positives from ``SMALLEST``): past it 1e-300 is 0 in fp32; 1e6 loss weights overflow fp16."""


def require_number(name: str, value: object, *, minimum: float = 0.0, inclusive: bool = False) -> None:
    """Finite, not bool, in (``minimum``, :data:`LARGEST`], ``[`` if ``inclusive``; positive: from :data:`SMALLEST`."""
    if minimum == 0 and not inclusive:
        minimum, inclusive = SMALLEST, True
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    in_range = is_number and math.isfinite(value) and (value >= minimum if inclusive else value > minimum)
    if not (in_range and value <= LARGEST):
        low = "[" if inclusive else "("
        raise ValueError(f"{name} must be a finite number in {low}{minimum:g}, {LARGEST:g}], got {value!r}.")


def require_integer(
    name: str, value: object, *, minimum: int, maximum: int | None = None, maximum_name: str | None = None
) -> None:
    """An integer in ``[minimum, maximum]`` (``maximum_name``: the setting that bounds it); never a bool."""
    in_range = is_integer(value) and value >= minimum
    if not (in_range and (maximum is None or value <= maximum)):
        upper = f"{maximum_name}={maximum}" if maximum_name else maximum
        bound = f"in [{minimum}, {upper}]" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}.")


def require_probability(name: str, value: object) -> None:
    """A probability that leaves something: a finite number in ``[0, 1)``."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (is_number and math.isfinite(value) and 0 <= value < 1):
        raise ValueError(f"{name} must be a probability in [0, 1), got {value!r}.")


def require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}.")


def choice(choices: tuple[str, ...]) -> Check:
    """A check that the value is one of ``choices``."""

    def check(name: str, value: object) -> None:
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}.")

    return check


def number(minimum: float = 0.0, inclusive: bool = False) -> Check:
    """:func:`require_number` as a :data:`Check`."""
    return lambda name, value: require_number(name, value, minimum=minimum, inclusive=inclusive)


def integer(minimum: int) -> Check:
    """:func:`require_integer` as a :data:`Check`."""
    return lambda name, value: require_integer(name, value, minimum=minimum)


def listing(items: Sequence[str], limit: int = 10, separator: str = ", ") -> str:
    """At most ``limit`` items joined by ``separator``, with a count of the rest."""
    shown = separator.join(items[:limit])
    return shown + (f"{separator}... and {len(items) - limit} more" if len(items) > limit else "")
