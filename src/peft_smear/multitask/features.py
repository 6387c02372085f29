"""The columns of the benchmark's datasets and the task metadata their features carry.

Columns and task metadata: ``text`` (string), ``label`` (float32: the class index, or a regression task's value; what
training reads), ``task`` (string: the task's name) and ``label_by_task``, a struct with one field per task in task
order, whose features are the task metadata: a classification task's field is ``ClassLabel(names=<its class names>)``
and a regression task's is ``Value("float32")``. Each row holds its label under its own task (``None`` under the
others), so ``features["label_by_task"][task].int2str(row["label_by_task"][task])`` names a row's class. Features
travel with the data (``save_to_disk``, Parquet, ``filter``, ``map``, ...); :func:`benchmark_task_info` reads them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pyarrow
from datasets import ClassLabel, Dataset, DatasetDict, Features, Value, concatenate_datasets

from .tasks import TaskInfo


LABEL_BY_TASK = "label_by_task"
Rows = list[tuple[str, str | float]]
"""A task's raw examples: (text, label) pairs, the label a class name or a regression value."""


def duplicate_key(text: str) -> str:
    return " ".join(text.casefold().split())


def task_features(tasks: Iterable[TaskInfo]) -> Features:
    """The features of a dataset of ``tasks`` (see the module docstring): its task metadata."""
    by_task = {
        task.name: ClassLabel(names=list(task.labels)) if task.kind == "classification" else Value("float32")
        for task in tasks
    }
    return Features(
        {"text": Value("string"), "label": Value("float32"), "task": Value("string"), LABEL_BY_TASK: by_task}
    )


def examples_dataset(texts: list[str], labels: list[float], names: list[str], tasks: Sequence[TaskInfo]) -> Dataset:
    """A dataset of ``tasks``' examples: ``names[i]`` is the task of example ``i``, ``labels[i]`` its float label."""
    fields = []
    for task in tasks:
        classification = task.kind == "classification"
        own = [
            (int(label) if classification else label) if name == task.name else None
            for label, name in zip(labels, names, strict=True)
        ]
        fields.append(pyarrow.array(own, pyarrow.int64() if classification else pyarrow.float32()))
    columns = {
        "text": pyarrow.array(texts, pyarrow.string()),
        "label": pyarrow.array(labels, pyarrow.float32()),
        "task": pyarrow.array(names, pyarrow.string()),
        LABEL_BY_TASK: pyarrow.StructArray.from_arrays(fields, names=[task.name for task in tasks]),
    }
    # Arrow arrays, which from_dict casts to the features at once (lists it encodes value by value, much slower).
    return Dataset.from_dict(columns, features=task_features(tasks))


def task_dataset(rows: Rows, info: TaskInfo, origin: str) -> Dataset:
    """Strip, drop empty texts and duplicates (first wins), encode class names as label indices."""
    index = {label: i for i, label in enumerate(info.labels)}
    texts, labels, seen = [], [], set()
    for text, label in rows:
        text = text.strip()
        key = duplicate_key(text)
        if not text or key in seen:
            continue
        if info.kind == "classification" and label not in index:
            raise ValueError(f"{origin}: label {label!r} is not one of task {info.name!r}'s labels {info.labels}.")
        seen.add(key)
        texts.append(text)
        labels.append(float(index[label] if info.kind == "classification" else label))
    return examples_dataset(texts, labels, [info.name] * len(texts), [info])


def _tasks_of(split_name: str, split: Dataset) -> dict[str, TaskInfo]:
    """The tasks that the features of ``split``'s ``label_by_task`` column describe."""
    by_task = split.features.get(LABEL_BY_TASK)
    if not isinstance(by_task, dict) or not by_task:
        raise ValueError(
            f"{split_name!r} carries no peft-smear task metadata: it has no {LABEL_BY_TASK!r} struct column (columns: "
            f"{split.column_names}). It was not made by load_benchmark or load_task_file, or a transform dropped it."
        )
    tasks = {}
    for name, feature in by_task.items():
        if isinstance(feature, ClassLabel):
            tasks[name] = TaskInfo(name, "classification", tuple(feature.names))
        elif feature == Value("float32"):
            tasks[name] = TaskInfo(name, "regression")
        else:
            raise ValueError(
                f"{split_name!r} carries no peft-smear task metadata for task {name!r}: its {LABEL_BY_TASK!r} "
                f"feature is {feature}, neither a ClassLabel (classification) nor float32 (regression). A transform "
                "rebuilt the features: concatenate_datasets of datasets with different tasks (use concatenate_tasks), "
                "or a round trip through pandas, CSV or JSON (Parquet and save_to_disk keep them)."
            )
    return tasks


def benchmark_task_info(dataset: DatasetDict | Dataset) -> dict[str, TaskInfo]:
    """The :class:`TaskInfo` of every task of a dataset made by :func:`load_benchmark` or :func:`load_task_file`, in
    task order, read from the features of its ``label_by_task`` column (see the module docstring).

    ``save_to_disk``/``load_from_disk``, Parquet files, ``filter``, ``select``, ``shuffle``, ``map``,
    ``train_test_split`` and ``remove_columns`` of other columns keep the features; :func:`concatenate_tasks` joins
    datasets of different tasks. ``concatenate_datasets`` of different tasks, ``to_pandas``/``from_pandas`` and
    CSV/JSON export lose them: a clear error here. So is a ``task`` column naming a task the features lack.
    """
    splits = dict(dataset) if isinstance(dataset, DatasetDict) else {"dataset": dataset}
    if not splits:
        raise ValueError("The DatasetDict has no splits.")
    found: dict[str, TaskInfo] | None = None
    for split_name, split in splits.items():
        tasks = _tasks_of(split_name, split)
        if found is not None and tasks != found:
            raise ValueError(f"The splits disagree on the tasks: {list(found)} vs {list(tasks)} in {split_name!r}.")
        found = tasks
        if "task" in split.column_names:
            strangers = sorted(set(split.unique("task")) - set(tasks))
            if strangers:
                raise ValueError(f"{split_name!r} has examples of task(s) {strangers} that its metadata lacks.")
    return found


def concatenate_tasks(parts: Sequence[Dataset]) -> Dataset:
    """``concatenate_datasets`` for datasets of different tasks (e.g. of :func:`load_task_file`): each part's
    ``label_by_task`` column is widened to all the parts' tasks first, in order of appearance, so the class names
    survive (``concatenate_datasets`` alone keeps only features that all parts share). A task that two parts
    describe differently is refused. The parts must agree on their other columns, as for ``concatenate_datasets``."""
    tasks: dict[str, TaskInfo] = {}
    for number, part in enumerate(parts, start=1):
        for info in benchmark_task_info(part).values():
            if tasks.setdefault(info.name, info) != info:
                raise ValueError(
                    f"Conflicting metadata for task {info.name!r}: {tasks[info.name]} vs {info} in part {number}."
                )
    by_task = task_features(tasks.values())[LABEL_BY_TASK]
    return concatenate_datasets([part.cast(Features({**part.features, LABEL_BY_TASK: by_task})) for part in parts])
