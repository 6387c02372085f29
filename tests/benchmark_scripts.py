"""The scripts of ``benchmarks/`` as modules, imported by name, as they import each other when run from there."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def import_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``name``."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)
