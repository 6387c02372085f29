"""The "when SMEAR pays" study end to end on a tiny random BERT and tiny task files: every regime's runs (the bank's
too) are in the CSV with finite metrics, cut training sets and sub-tasks are built by the benchmark's split rule,
the verdict rule is the documented one, a study cut off resumes from its journals, and the table, the figure and
the RESULTS.md section are written. Only the plumbing is tested: these numbers mean nothing."""

from __future__ import annotations

import csv
import json
import math
import random

import pytest

from conftest import FILLER, TOPICS, import_script, run_script_main, save_tiny_encoder, write_task_files
from peft_smear.multitask.data import load_benchmark


RATES = [1e-3, 1e-2]
SEEDS = 2


@pytest.fixture(scope="module")
def study():
    return import_script("when_smear_pays")


def write_quad(directory) -> str:
    """``quad`` (four classes a-d, CSV): which topic's words a sentence uses, and whether it says "very"."""
    rng = random.Random(1)
    rows = ["text,label"]
    for i in range(96):
        topic, very = sorted(TOPICS)[i % 2], (i // 2) % 2
        words = rng.sample([w for w in FILLER if w != "very"], 4) + rng.sample(TOPICS[topic], 2) + ["very"] * very
        rng.shuffle(words)
        rows.append(f"{' '.join(words)},{'abcd'[2 * (i % 2) + very]}")
    (directory / "quad.csv").write_text("\n".join(rows) + "\n")
    return str(directory / "quad.csv")


def tiny_argv(root, files) -> list[str]:
    argv = ["--preset", "tiny", "--model", root / "encoder", "--device", "cpu", "--seeds", str(SEEDS)]
    return [*argv, *[arg for name, path in files.items() for arg in ("--task-file", f"{name}={path}")]]


@pytest.fixture(scope="module")
def outputs(study, tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    save_tiny_encoder(root / "encoder")
    files = {**write_task_files(root), "quad": write_quad(root)}
    argv = tiny_argv(root, files)
    outputs = ["--output-dir", root / "out", "--figure", root / "figure.png", "--append-results", root / "RESULTS.md"]
    run_script_main(study, [*argv, *outputs])
    with open(root / "out" / "runs.csv") as handle:
        return root, files, list(csv.DictReader(handle)), argv


def test_every_regime_and_method_ran_with_finite_metrics(study, outputs):
    _, _, rows, _ = outputs
    regimes = study.STUDY_REGIMES["tiny"]
    assert {row["regime"] for row in rows} == {regime.name for regime in regimes}
    for regime in regimes:
        mine = [row for row in rows if row["regime"] == regime.name]
        for method in study.METHODS:
            runs = [row for row in mine if row["method"] == method]
            sweep = [row for row in runs if row["phase"] == "sweep"]
            assert len(runs) == len(sweep) + SEEDS - 1, (regime.name, method)
            best = max(sweep, key=lambda row: (float(row["validation_average"]), -float(row["learning_rate"])))
            assert {row["learning_rate"] for row in runs if row["chosen"] == "True"} == {best["learning_rate"]}
            for row in runs:
                assert math.isfinite(float(row["test_average"])), (regime.name, method)
    bank = [row for row in rows if row["method"] == study.BANK]
    assert all(row["routing_entropy"] != "" for row in bank)  # the bank's router is reported like SMEAR's


def test_a_rate_chosen_at_an_edge_widens_the_grid_along_the_ladder_up_to_its_cap(study, outputs):
    _, _, rows, _ = outputs
    widened = 0
    for regime in study.STUDY_REGIMES["tiny"]:
        ladder = list(regime.ladder)
        for method in study.METHODS:
            sweep = [row for row in rows if row["regime"] == regime.name and row["method"] == method]
            sweep = [row for row in sweep if row["phase"] == "sweep"]
            swept = sorted(float(row["learning_rate"]) for row in sweep)
            chosen = {float(row["learning_rate"]) for row in sweep if row["chosen"] == "True"}
            assert set(regime.learning_rates) <= set(swept) <= set(ladder), (regime.name, method, swept)
            # Rungs in a row: the grid grows one rung beyond an edge at a time.
            assert swept == ladder[ladder.index(swept[0]) : ladder.index(swept[-1]) + 1], (regime.name, method)
            widened += len(swept) > len(regime.learning_rates)
            # A rung beyond the starting grid was swept because the best of the rates inside it lay at that edge.
            validation = {float(row["learning_rate"]): float(row["validation_average"]) for row in sweep}
            start = (min(regime.learning_rates), max(regime.learning_rates))
            for rung in swept:
                inside = [r for r in swept if start[0] <= r < rung] or [r for r in swept if rung < r <= start[1]]
                if not start[0] <= rung <= start[1]:
                    best = max(inside, key=lambda r: (validation[r], -r))
                    assert best == (max(inside) if rung > start[1] else min(inside)), (regime.name, method, rung)
            # The choice is inside the rates swept, unless the ladder ends there.
            (rate,) = chosen
            if rate == swept[-1] and len(swept) > 1:
                assert rate == ladder[-1], (regime.name, method, swept, rate)
            if rate == swept[0] and len(swept) > 1:
                assert rate == ladder[0], (regime.name, method, swept, rate)
    assert widened, "no method's grid was widened: the tiny study no longer exercises the rule"


def test_cut_training_sets_and_sub_tasks_follow_the_split_rule(study, outputs):
    _, files, _, _ = outputs
    preset = study.PRESETS["tiny"]
    sources = {name: files[name] for name in ("topic", "quad")}
    full = load_benchmark(list(sources), task_files=sources)
    regime = next(r for r in study.STUDY_REGIMES["tiny"] if r.name == "subtasks")
    data = study.regime_data(full, regime, preset)
    train = data["train"]
    assert train.unique("task") == ["quad_ab", "quad_cd", "topic"]
    topic = train.filter(lambda row: row["task"] == "topic")
    capped = load_benchmark(["topic"], task_files={"topic": files["topic"]}, max_examples_per_task=16)["train"]
    assert len(topic) == 16 and list(topic["text"]) == list(capped["text"])  # what load_benchmark's own cap keeps
    larger = study.regime_data(
        full, study.Regime("r", "x", (study.TaskSpec("topic", "topic", train=32),), "topic", (1e-3,), (1e-3,)), preset
    )
    assert set(topic["text"]) < set(larger["train"]["text"])  # a smaller cut is a subset of a larger one
    quad = full["train"].filter(lambda row: row["task"] == "quad")
    for name, kept in (("quad_ab", "ab"), ("quad_cd", "cd")):
        sub = train.filter(lambda row, name=name: row["task"] == name)
        source = {text: "abcd"[int(label)] for text, label in zip(quad["text"], quad["label"], strict=True)}
        assert sub["label"] and all(
            kept[int(label)] == source[text] for text, label in zip(sub["text"], sub["label"], strict=True)
        )
        assert sub.features["label_by_task"][name].names == list(kept)
    with pytest.raises(ValueError, match="has no classes"):
        study.regime_data(
            full, study.Regime("r", "x", (study.TaskSpec("t", "quad", ("a", "z")),), "t", (1e-3,), (1e-3,)), preset
        )


def test_the_verdict_rule(study):
    assert study.verdict(1.0, 0.5) == "win"
    assert study.verdict(-1.0, 0.5) == "lose"
    assert study.verdict(0.4, 0.5) == "tie" and study.verdict(-0.4, 0.5) == "tie" and study.verdict(0.5, 0.5) == "tie"

    def summary(method, averages, small):
        metrics = {"average": averages, "t_accuracy": small}
        return study.Summary(method, 1e-3, list(range(len(averages))), metrics, 1, None, None, None)

    summaries = {
        study.SMEAR: summary(study.SMEAR, [81.0, 82.0, 83.0], [70.0, 71.0, 72.0]),
        "tag": summary("tag", [80.0, 81.5, 82.0], [75.0, 74.0, 76.0]),
        "single": summary("single", [80.0, 82.5, 82.0], [60.0, 61.0, 62.0]),
        "ensemble": summary("ensemble", [90.0, 90.0, 90.0], [90.0, 90.0, 90.0]),  # never the baseline
    }
    assert study.best_baseline(summaries) == "single"  # 81.5 against tag's 81.17
    mean, std = study.paired_difference(summaries[study.SMEAR], summaries["single"])
    assert (mean, std) == pytest.approx((0.5, 0.866), abs=1e-3) and study.verdict(mean, std) == "tie"
    assert study.best_baseline(summaries, "t_accuracy") == "tag"
    assert study.verdict(*study.paired_difference(summaries[study.SMEAR], summaries["tag"], "t_accuracy")) == "lose"


def test_the_bank_takes_the_same_steps(study):
    assert study.bank_steps(72, 6) == (9, 18)
    assert study.bank_steps(72, 3) == (18, 18)
    assert study.bank_steps(216, 6) == (27, 54)
    expert, router = study.bank_steps(4, 3)
    assert expert * 3 + router <= 4


def test_table_figure_and_results_section(study, outputs):
    root, _, rows, _ = outputs
    text = (root / "out" / "study.md").read_text()
    summary = [line for line in text.split("###")[0].splitlines() if line.startswith("| `")]
    assert [line.split("|")[1].strip() for line in summary] == [f"`{r.name}`" for r in study.STUDY_REGIMES["tiny"]]
    for line in summary:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells[8] in ("**win**", "**tie**", "**lose**") and cells[10] in ("**win**", "**tie**", "**lose**")
    for regime in study.STUDY_REGIMES["tiny"]:
        section, sweep = text.split(f"### `{regime.name}`")[1].split("###")[0].split("Learning-rate sweep (seed 0):")
        table = [line for line in section.splitlines() if line.startswith("|")]
        assert [line.split("|")[1].strip() for line in table[2:]] == [study.LABELS[m] for m in study.METHODS]
        # The sweep behind each choice, read back against the runs' CSV: every swept rate's seed-0 validation / test.
        runs = [row for row in rows if row["regime"] == regime.name and row["phase"] == "sweep"]
        swept = sorted({float(row["learning_rate"]) for row in runs})
        sweep_lines = [line for line in sweep.splitlines() if line.startswith("|")]
        assert sweep_lines[0].count("lr ") == len(swept)
        for method, line in zip(study.METHODS, sweep_lines[2:], strict=True):
            label, *cells = (cell.strip() for cell in line.strip("|").split("|"))
            by_rate = {float(row["learning_rate"]): row for row in runs if row["method"] == method}
            assert label == study.LABELS[method]
            for rate, cell in zip(swept, cells, strict=True):
                row = by_rate.get(rate)
                assert (cell == "–") == (row is None), (regime.name, method, rate)
                if row is not None:
                    validation, test = (float(x) for x in cell.strip("*").split(" / "))
                    assert validation == pytest.approx(100 * float(row["validation_average"]), abs=0.051)
                    assert test == pytest.approx(100 * float(row["test_average"]), abs=0.051)
                    assert cell.startswith("**") == (row["chosen"] == "True"), (regime.name, method, rate)
    assert (root / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = (root / "RESULTS.md").read_text()
    assert "## When SMEAR pays: a controlled study, preset `tiny`, " in results
    assert "python benchmarks/when_smear_pays.py --preset tiny" in results and text in results


def test_a_study_cut_off_resumes_from_its_journals(study, outputs, tmp_path):
    root, _, rows, argv = outputs
    regime = "small"
    journal = (root / "out" / regime / "runs.jsonl").read_text().splitlines()
    assert len(journal) == 1 + sum(row["regime"] == regime for row in rows)
    (tmp_path / "out" / regime).mkdir(parents=True)
    (tmp_path / "out" / regime / "runs.jsonl").write_text("\n".join(journal[:4]) + "\n")  # cut off after 3 runs
    lines = []
    resumed = [*argv, "--regimes", regime, "--output-dir", tmp_path / "out", "--figure", tmp_path / "f.png"]
    run_script_main(study, [*resumed, "--resume", "--append-results", tmp_path / "RESULTS.md"], log=lines.append)
    assert f"resuming {regime}: 3 finished runs" in lines
    assert sum("(from the journal)" in line for line in lines) == 3
    assert len((tmp_path / "out" / regime / "runs.jsonl").read_text().splitlines()) == len(journal)
    with open(tmp_path / "out" / "runs.csv") as handle:
        rerun = {(r["method"], r["learning_rate"], r["seed"]): r for r in csv.DictReader(handle)}
    for line in journal[1:4]:
        kept = json.loads(line)
        assert (
            float(rerun[kept["method"], str(kept["learning_rate"]), str(kept["seed"])]["test_average"])
            == (kept["test_average"])
        )
    results = (tmp_path / "RESULTS.md").read_text()
    assert f"preset `tiny`, regimes {regime}, " in results and "3 runs were replayed" in results
    (tmp_path / "out" / regime / "runs.jsonl").write_text('{"settings": {"preset": "another"}}\n')
    with pytest.raises(SystemExit, match="other settings"):
        run_script_main(study, [*resumed, "--resume"])
