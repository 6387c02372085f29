"""The multi-task benchmark application built on the SMEAR PEFT method: the tasks (:mod:`.tasks`), the real six-task
text benchmark (:mod:`.data`; its columns and task metadata :mod:`.features`; your own task files
:mod:`.task_files`), a shared encoder with one head per task (:mod:`.model`), the ``peft-smear train`` and
``export-tasks`` jobs (:mod:`.training`, :mod:`.commands`) and the routing report (:mod:`.report`).

It sits above the PEFT method and is never imported by it: ``import peft_smear`` loads neither ``datasets`` nor
``matplotlib``. The names below are imported on first use, so ``import peft_smear.multitask`` is cheap too.
"""

from __future__ import annotations

import importlib
from typing import Any


_EXPORTS = {
    "BENCHMARK_TASKS": "tasks",
    "TaskInfo": "tasks",
    "load_benchmark": "data",
    "load_task_file": "task_files",
    "read_data_file": "task_files",
    "benchmark_task_info": "features",
    "concatenate_tasks": "features",
    "task_features": "features",
    "MultiTaskModel": "model",
    "MultiTaskCollator": "model",
    "RoutingReport": "report",
    "load_run": "training",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
