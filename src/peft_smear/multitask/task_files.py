"""Your own tasks, from CSV, JSON or JSONL files: one reader built on ``datasets``' CSV and JSON readers, used by
:func:`load_task_file` (``peft-smear train --task-file``) and by ``peft-smear export --task-data``."""

from __future__ import annotations

import codecs
import contextlib
import logging
import math
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pandas
from datasets import Dataset, Features, Value, are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
from datasets.exceptions import DatasetGenerationError
from datasets.utils import logging as datasets_logging

from .features import task_dataset
from .tasks import TASK_KINDS, TaskInfo


DATA_FILE_SUFFIXES = (".csv", ".json", ".jsonl")


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Without ``datasets``' progress bars and error log while it reads one small file: a failure is re-raised as one
    clear error instead."""
    verbosity, bars = datasets_logging.get_verbosity(), not are_progress_bars_disabled()
    datasets_logging.set_verbosity(logging.CRITICAL)
    if bars:
        disable_progress_bars()
    try:
        yield
    finally:
        datasets_logging.set_verbosity(verbosity)
        if bars:
            enable_progress_bars()


def _head(path: Path) -> bytes:
    """The file's first non-blank bytes (after a UTF-8 byte order mark); empty for a blank file."""
    with open(path, "rb") as file:
        chunk = file.read(1 << 16).removeprefix(codecs.BOM_UTF8)
        while chunk and not chunk.strip():
            chunk = file.read(1 << 16)
    return chunk.lstrip()


def _encoding(path: Path) -> str:
    """UTF-8 (with or without byte order mark) where the whole file decodes as UTF-8, else Latin-1."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open(path, "rb") as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                decoder.decode(chunk)
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return "latin-1"
    return "utf-8"


def _innermost(error: BaseException) -> BaseException:
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def read_data_file(path: str | os.PathLike) -> Dataset:
    """The rows of a CSV file, a JSON file (an array of objects, or one object per line) or a JSONL file, read with
    ``datasets``: the one reader of :func:`load_task_file` and of ``peft-smear export --task-data``.

    CSV cells stay the strings written in the file (no number or missing-value inference: ``007`` and ``NA`` are
    text, an empty cell is ``""``); JSON values keep their JSON types (a column mixing strings and numbers holds
    both). Files that are not UTF-8 are read as Latin-1. A blank file, a header without rows or ``[]`` gives a dataset
    without rows. Raises ``ValueError`` naming the file for another suffix and for content that is not valid CSV or
    JSON objects, ``FileNotFoundError`` for a missing file.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in DATA_FILE_SUFFIXES:
        raise ValueError(f"{path}: unsupported file type {suffix!r}; use .csv, .json or .jsonl.")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file.")
    head = _head(path)
    if not head:
        return Dataset.from_dict({})
    encoding = _encoding(path)
    try:
        with _quiet_datasets(), tempfile.TemporaryDirectory(prefix="peft-smear-read-") as cache:
            if suffix == ".csv":
                # Every column as a string column, so that pandas infers no numbers or missing values.
                options = {"keep_default_na": False, "na_filter": False, "index_col": False, "encoding": encoding}
                with warnings.catch_warnings():  # the full read below warns once about rows longer than the header
                    warnings.simplefilter("ignore", pandas.errors.ParserWarning)
                    first_row = pandas.read_csv(path, nrows=1, dtype=str, **options)
                if first_row.empty:
                    return Dataset.from_dict({name: [] for name in first_row.columns})
                strings = Features({name: Value("string") for name in first_row.columns})
                return Dataset.from_csv(str(path), features=strings, cache_dir=cache, keep_in_memory=True, **options)
            if head.startswith(b"["):
                first = head[1:].lstrip()[:1]
                if first == b"]":
                    return Dataset.from_dict({})
                if first != b"{":  # datasets would read an array of other values as a column "text"
                    raise ValueError("row 1 is not an object")
            return Dataset.from_json(str(path), cache_dir=cache, keep_in_memory=True, encoding=encoding)
    except (DatasetGenerationError, ValueError) as error:
        kind = "CSV" if suffix == ".csv" else "JSON objects (an array, or one per line)"
        raise ValueError(f"{path}: not valid {kind}: {_innermost(error)}.") from None


def _is_missing(value: object) -> bool:
    return value is None or value == "" or (isinstance(value, float) and math.isnan(value))


def load_task_file(path: str | os.PathLike, name: str, kind: str | None = None) -> tuple[Dataset, TaskInfo]:
    """Read your own task from a CSV, JSON (an array of objects, or one object per line) or JSONL file
    (with :func:`read_data_file`).

    The file needs ``text`` and ``label`` columns; other columns are ignored, except that a ``task`` column must equal
    ``name`` in every row. String labels make a classification task whose label names are the sorted unique strings.
    Numeric labels (in a CSV: labels that all parse as numbers) make a regression task, unless
    ``kind="classification"``: then they must be class indices 0, 1, ... and label ``i`` is named ``str(i)``.
    Texts are cleaned and de-duplicated as the built-in tasks' are. Returns the task's examples (columns ``text``,
    ``label``, ``task`` and ``label_by_task``, whose features hold the task's metadata) and its :class:`TaskInfo`.
    """
    path = Path(path)
    if kind not in (None, *TASK_KINDS):
        raise ValueError(f"kind must be None or one of {TASK_KINDS}, got {kind!r}.")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{path}: the task name must be a non-empty string, got {name!r}.")
    table = read_data_file(path)
    if not table.num_rows:
        raise ValueError(f"{path}: the file holds no examples.")
    missing = [column for column in ("text", "label") if column not in table.column_names]
    if missing:
        raise ValueError(f"{path}: no {' or '.join(map(repr, missing))} column (its columns: {table.column_names}).")
    texts, values = list(table["text"]), list(table["label"])
    tasks = list(table["task"]) if "task" in table.column_names else [name] * len(texts)
    for row, (text, label, task) in enumerate(zip(texts, values, tasks, strict=True), start=1):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path}: row {row} has an empty or missing text ({text!r}).")
        if _is_missing(label) or isinstance(label, bool):
            raise ValueError(f"{path}: row {row} has no usable label ({label!r}).")
        if task != name:
            raise ValueError(f"{path}: row {row} belongs to task {task!r}, not {name!r}.")

    if path.suffix.lower() == ".csv":
        with contextlib.suppress(ValueError):  # else not all numeric: class names
            values = [float(value) for value in values]
    if all(isinstance(value, str) for value in values):
        if kind == "regression":
            raise ValueError(f"{path}: kind='regression' needs numeric labels, found {values[0]!r}.")
        labels = tuple(sorted(set(values)))
    elif all(isinstance(value, (int, float)) for value in values):
        bad = next((row for row, value in enumerate(values, start=1) if not math.isfinite(value)), None)
        if bad is not None:
            raise ValueError(f"{path}: row {bad} has a non-finite label ({values[bad - 1]!r}).")
        if kind == "classification":
            if not all(value >= 0 and float(value).is_integer() for value in values):
                raise ValueError(f"{path}: kind='classification' with numeric labels needs class indices 0, 1, ...")
            labels = tuple(str(i) for i in range(int(max(values)) + 1))
            values = [str(int(value)) for value in values]
        else:
            labels = ()
            values = [float(value) for value in values]
    else:
        raise ValueError(f"{path}: labels mix strings and numbers.")
    try:
        info = TaskInfo(name, "classification" if labels else "regression", labels)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    return task_dataset(list(zip(texts, values, strict=True)), info, str(path)), info
