"""The checks every setting passes when a config is built, and how their errors read: the setting's name, the value
given, and what is allowed. One place, so that ``True`` is never taken for the integer 1 and NaN never for a number."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence


Check = Callable[[str, object], None]
"""A check of one setting: ``check(name, value)`` raises a ``ValueError`` that names both, or returns."""


def is_integer(value: object) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is an ``int`` in Python, never a count or an index here)."""
    return isinstance(value, int) and not isinstance(value, bool)


SMALLEST, LARGEST = 1e-6, 1e4
"""The range of every real-valued setting (a positive one at least ``SMALLEST``): beyond it SMEAR's arithmetic
overflows, e.g. a temperature of 1e-300 is zero in float32, a loss weight of 1e6 overflows a half-precision loss."""


def require_number(name: str, value: object, *, minimum: float = 0.0, inclusive: bool = False) -> None:
    """A finite real number above ``minimum`` (or equal to it, when ``inclusive``) and at most :data:`LARGEST`; a
    positive one (``minimum=0``, not inclusive) at least :data:`SMALLEST`. Never a bool."""
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
