"""The quality benchmark end to end on a tiny random BERT and two tiny task files: every run is in the CSV with finite
metrics, the learning rate kept is the validation argmax, and the table, the targets, the heatmaps and the RESULTS.md
section are written. Only the plumbing is tested: these numbers mean nothing."""

from __future__ import annotations

import csv
import json
import math
import re

import numpy as np
import pytest

from conftest import import_script, run_script_main, save_tiny_encoder, write_task_files
from peft_smear.multitask.report import RoutingReport


SWEPT = ["smear", "tag", "lora_1x_compute", "lora_1x_params"]
ABLATION = "smear_no_dropout"  # takes SMEAR's chosen rate instead of sweeping
METHODS = [*SWEPT, ABLATION]
RATES = [1e-3, 3e-3, 1e-2]
RUNG_ABOVE = 3e-2  # the tiny preset's ladder: one rung above the grid, none below
METRICS = ["topic_accuracy", "count_pearson", "average"]


@pytest.fixture(scope="module")
def quality():
    return import_script("quality")


@pytest.fixture(scope="module")
def outputs(quality, tmp_path_factory):
    root = tmp_path_factory.mktemp("quality")
    save_tiny_encoder(root / "encoder")
    files = write_task_files(root)
    argv = ["--preset", "tiny", "--model", root / "encoder", "--methods", *METHODS, "--device", "cpu"]
    argv += [arg for name, path in files.items() for arg in ("--task-file", f"{name}={path}")]
    written = ["--output-dir", root / "out", "--figures-dir", root / "figures"]
    run_script_main(quality, [*argv, *written, "--append-results", root / "RESULTS.md"])
    with open(root / "out" / "runs.csv") as handle:
        reader = csv.DictReader(handle)
        return root, reader.fieldnames, list(reader), argv


def test_every_run_is_in_the_csv_with_finite_metrics(quality, outputs):
    _, columns, rows, _ = outputs
    tasks = [quality.TaskInfo("topic", "classification", ("a", "b")), quality.TaskInfo("count", "regression")]
    assert columns == quality.csv_columns(tasks)
    seeds = quality.PRESETS["tiny"].seeds
    sweeps = sum(row["phase"] == "sweep" for row in rows)
    assert sweeps >= len(SWEPT) * len(RATES) and len(rows) == sweeps + len(SWEPT) * (seeds - 1) + seeds
    for row in rows:
        metrics = [f"test_{name}" for name in METRICS]
        if row["phase"] == "sweep":
            metrics += [f"validation_{name}" for name in METRICS]
        else:
            assert row["validation_average"] == ""  # the other seeds are only tested
        for name in metrics:
            assert math.isfinite(float(row[name])), (row["method"], name)
        assert int(row["trainable_params"]) > 0 and float(row["train_seconds"]) > 0
        has_routing = row["method"] in ("smear", "tag", ABLATION)
        assert (row["routing_entropy"] != "") == has_routing, row["method"]
        if row["method"] == "tag":  # one expert per task, so one expert for all only with one task
            assert float(row["routing_entropy"]) == 0 and float(row["collapsed_routers"]) == 0
    params = {row["method"]: int(row["trainable_params"]) for row in rows}
    assert params["lora_1x_params"] > params["lora_1x_compute"]  # rank N·r against rank r


def test_the_learning_rate_kept_is_the_validation_argmax(outputs):
    _, _, rows, _ = outputs
    for method in SWEPT:
        sweep = [row for row in rows if row["method"] == method and row["phase"] == "sweep"]
        assert sorted(float(row["learning_rate"]) for row in sweep) in (RATES, [*RATES, RUNG_ABOVE])
        assert {row["seed"] for row in sweep} == {"0"}
        best = max(sweep, key=lambda row: (float(row["validation_average"]), -float(row["learning_rate"])))
        chosen = {row["learning_rate"] for row in rows if row["method"] == method and row["chosen"] == "True"}
        assert chosen == {best["learning_rate"]}
        others = [row for row in rows if row["method"] == method and row["phase"] == "seeds"]
        assert [row["seed"] for row in others] == ["1"] and others[0]["learning_rate"] == best["learning_rate"]


def test_a_grid_widens_until_the_choice_is_inside_it(quality):
    ladder = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
    assert quality.widened([1e-3, 3e-3, 1e-2], 3e-3, ladder) is None  # inside: chosen
    assert quality.widened([1e-3, 3e-3, 1e-2], 1e-2, ladder) == 3e-2
    assert quality.widened([1e-3, 3e-3, 1e-2, 3e-2], 1e-3, ladder) == 3e-4
    assert quality.widened([3e-4, 1e-3, 3e-3], 3e-4, ladder) is None  # the cap
    assert quality.widened([3e-2, 1e-1], 1e-1, ladder) is None
    assert quality.widened([1e-2], 1e-2, ladder) is None  # one rate given: no sweep to widen
    grid, lines = [1e-3, 3e-3], []
    assert quality.widen(grid, 3e-3, ladder, lines.append, "smear:") == 1e-2 and grid == [1e-3, 3e-3, 1e-2]
    assert lines == ["smear: best at the edge 3.0e-03 of its grid: adding 1.0e-02"]
    assert quality.widen(grid, 3e-3, ladder, lines.append, "smear:") is None and grid == [1e-3, 3e-3, 1e-2]


def test_a_best_rate_at_the_top_of_the_grid_sweeps_the_next_rung_and_only_then(outputs):
    _, _, rows, _ = outputs
    widened = []
    for method in SWEPT:
        sweep = {
            float(row["learning_rate"]): row for row in rows if row["method"] == method and row["phase"] == "sweep"
        }
        best = max(RATES, key=lambda rate: (float(sweep[rate]["validation_average"]), -rate))
        assert (RUNG_ABOVE in sweep) == (best == RATES[-1]), (method, best, sorted(sweep))
        widened += [method] * (RUNG_ABOVE in sweep)
    assert widened, "no method chose the top of the grid: the smoke test no longer exercises the widening"


def test_the_ablation_trains_every_seed_at_smears_chosen_rate_without_a_sweep(quality, outputs):
    _, _, rows, _ = outputs
    smear_rate = {row["learning_rate"] for row in rows if row["method"] == "smear" and row["chosen"] == "True"}
    ablation = [row for row in rows if row["method"] == ABLATION]
    assert [row["seed"] for row in ablation] == [str(seed) for seed in range(quality.PRESETS["tiny"].seeds)]
    assert {row["phase"] for row in ablation} == {"seeds"} and {row["chosen"] for row in ablation} == {"True"}
    assert {row["learning_rate"] for row in ablation} == smear_rate


def test_table_targets_and_results_section(quality, outputs):
    root, _, rows, _ = outputs
    text = (root / "out" / "quality.md").read_text()
    table = [line for line in text.split("### Targets")[0].splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header[3:6] == ["topic accuracy", "count pearson", "average"]
    assert len(table) == 2 + len(METHODS)
    for method, line in zip(METHODS, table[2:], strict=True):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells[0] == quality.ALL_METHODS[method].label
        for cell in cells[3:6]:
            mean, std = (float(x) for x in re.fullmatch(r"\**(-?[\d.]+) ± ([\d.]+)\**", cell).groups())
            assert math.isfinite(mean) and std >= 0
        seeds = [row for row in rows if row["method"] == method and row["chosen"] == "True"]
        expected = sum(100 * float(row["test_average"]) for row in seeds) / len(seeds)
        assert float(cells[5].strip("*").split(" ± ")[0]) == pytest.approx(expected, abs=0.006)
    for target in ("SMEAR ≥ Tag", "SMEAR > LoRA 1× compute", "SMEAR ≥ LoRA 1× parameters"):
        assert re.search(rf"- {re.escape(target)}: (met|missed) \(", text), target
    assert "SMEAR within 0.5 points of Ensemble: not run" in text

    for method in ("smear", "tag"):
        assert (root / "figures" / f"{method}_routing.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    figures = ["smear_no_dropout_routing.png", "smear_routing.png", "tag_routing.png"]
    assert sorted(path.name for path in (root / "figures").iterdir()) == figures

    sweep = text.split("### Learning-rate sweep (seed 0)")[1].split("###")[0]
    sweep_rows = [line for line in sweep.splitlines() if line.startswith("|")][2:]
    assert [row.split("|")[1].strip() for row in sweep_rows] == [quality.ALL_METHODS[m].label for m in SWEPT]
    for method, line in zip(SWEPT, sweep_rows, strict=True):
        cells = [cell.strip() for cell in line.strip("|").split("|")][1:]
        runs = sorted(
            (row for row in rows if row["method"] == method and row["phase"] == "sweep"),
            key=lambda row: float(row["learning_rate"]),
        )
        swept = sorted({float(row["learning_rate"]) for row in rows if row["phase"] == "sweep"})
        assert next(line for line in sweep.splitlines() if line.startswith("|")).count("lr ") == len(swept)
        by_rate = {float(row["learning_rate"]): row for row in runs}
        assert [cell == "–" for cell in cells] == [rate not in by_rate for rate in swept]  # a rung it did not sweep
        for cell, row in zip([cell for cell in cells if cell != "–"], runs, strict=True):
            validation, test = (float(x) for x in cell.strip("*").split(" / "))
            assert validation == pytest.approx(100 * float(row["validation_average"]), abs=0.051)
            assert test == pytest.approx(100 * float(row["test_average"]), abs=0.051)
            assert cell.startswith("**") == (row["chosen"] == "True")

    results = (root / "RESULTS.md").read_text()
    assert results.startswith("# Benchmark results") and "## Quality, preset `tiny`" in results
    assert "python benchmarks/quality.py --preset tiny" in results and "Load average" in results
    assert text in results


def test_an_interrupted_benchmark_resumes_from_its_journal(quality, outputs, tmp_path):
    root, _, rows, argv = outputs
    journal = (root / "out" / "runs.jsonl").read_text().splitlines()
    assert len(journal) == 1 + len(rows)  # the settings, then one line per finished run
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "runs.jsonl").write_text("\n".join(journal[:4]) + "\n")  # cut off after three runs
    lines = []
    resumed = [*argv, "--output-dir", tmp_path / "out", "--figures-dir", tmp_path / "figures", "--resume"]
    run_script_main(quality, resumed, lines.append)
    assert f"resuming: 3 finished runs in {tmp_path / 'out' / 'runs.jsonl'}" in lines
    assert sum("(from the journal)" in line for line in lines) == 3
    assert len((tmp_path / "out" / "runs.jsonl").read_text().splitlines()) == 1 + len(rows)
    with open(tmp_path / "out" / "runs.csv") as handle:
        rerun = {(r["method"], r["learning_rate"], r["seed"]): r for r in csv.DictReader(handle)}
    assert len(rerun) == len(rows)
    for line in journal[1:4]:
        kept = json.loads(line)
        row = rerun[(kept["method"], str(kept["learning_rate"]), str(kept["seed"]))]
        assert (
            float(row["test_average"]) == kept["test_average"] and float(row["train_seconds"]) == kept["train_seconds"]
        )

    (tmp_path / "out" / "runs.jsonl").write_text('{"settings": {"preset": "another"}}\n')
    with pytest.raises(SystemExit, match="other settings"):
        run_script_main(quality, resumed)


def test_a_benchmark_replayed_from_its_journal_draws_every_heatmap(quality, outputs, tmp_path):
    """The journal keeps each seed-0 run's routing report, so a study resumed after its sweeps still draws every
    routed method's heatmap; a journal without them says which are missing."""
    root, _, rows, argv = outputs
    header, *lines = (root / "out" / "runs.jsonl").read_text().splitlines()
    routed = [method for method in METHODS if quality.ALL_METHODS[method].routed]
    for row in map(json.loads, lines):
        assert ("routing" in row) == (row["method"] in routed and row["seed"] == 0), (row["method"], row["seed"])
        if "routing" in row:  # the run's own report: the figures computed from it when the run ended
            report = RoutingReport.from_dict(row["routing"])
            assert quality._normalised_entropy(report) == pytest.approx(row["routing_entropy"], abs=1e-4)
            assert quality._mean_task_similarity(report) == pytest.approx(row["routing_similarity"], abs=1e-4)

    def replay(journal_lines, name):
        (tmp_path / name).mkdir()
        (tmp_path / name / "runs.jsonl").write_text("\n".join(journal_lines) + "\n")
        log = []
        out = ["--output-dir", tmp_path / name, "--figures-dir", tmp_path / name / "figures", "--resume"]
        run_script_main(quality, [*argv, *out], log.append)
        assert sum("(from the journal)" in line for line in log) == len(rows)  # nothing trained
        return (tmp_path / name / "quality.md").read_text(), tmp_path / name / "figures"

    body, figures = replay([header, *lines], "kept")
    assert sorted(path.name for path in figures.iterdir()) == sorted(f"{method}_routing.png" for method in routed)
    for method in routed:
        assert f"- {quality.ALL_METHODS[method].label}: `{(figures / f'{method}_routing.png').as_posix()}`" in body

    older = [json.dumps({k: v for k, v in json.loads(line).items() if k != "routing"}) for line in lines]
    body, figures = replay([header, *older], "older")
    assert not figures.exists() or not any(figures.iterdir())
    for method in routed:
        assert f"- {quality.ALL_METHODS[method].label}: none (replayed from a journal without routing)" in body


def test_a_widened_rate_grid_and_more_seeds_reuse_the_journal_and_say_so(quality, outputs, tmp_path):
    root, _, rows, argv = outputs
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "runs.jsonl").write_text((root / "out" / "runs.jsonl").read_text())
    widened = [arg for arg in argv if arg not in METHODS[1:]]  # SMEAR alone
    seeds = quality.PRESETS["tiny"].seeds + 1
    widened += ["--learning-rates", *map(str, [3e-4, *RATES]), "--seeds", seeds, "--output-dir", tmp_path / "out"]
    lines = []
    widened += ["--figures-dir", tmp_path / "figures", "--resume", "--append-results", tmp_path / "RESULTS.md"]
    run_script_main(quality, widened, lines.append)

    def key(row):
        return float(row["learning_rate"]), int(row["seed"]), row["phase"]

    earlier = {key(row): row for row in rows if row["method"] == "smear"}
    with open(tmp_path / "out" / "runs.csv") as handle:
        rerun = list(csv.DictReader(handle))
    reused = [row for row in rerun if key(row) in earlier]
    trained = {key(row) for row in rerun if key(row) not in earlier}
    assert {rate for rate, seed, phase in earlier if phase == "sweep"} >= set(RATES)
    assert (3e-4, 0, "sweep") in trained and any(seed == seeds - 1 for _, seed, _ in trained)  # the new rate and seed
    assert len(reused) >= len(RATES)  # at least the old sweep (the old seeds too if the chosen rate stayed)
    assert sum("(from the journal)" in line for line in lines) == len(reused)  # replayed, none retrained
    for row in reused:  # replayed, not retrained: the journal's numbers
        assert float(row["test_average"]) == float(earlier[key(row)]["test_average"])
    results = (tmp_path / "RESULTS.md").read_text()
    assert f" {len(reused)} of the runs were replayed from the journal" in results


def test_targets_compare_the_means(quality):
    def summary(method, averages):
        metrics = {"average": averages}
        return quality.Summary(method, 1e-3, list(range(len(averages))), metrics, 1, None, None, None)

    summaries = {
        "smear": summary("smear", [80.0, 82.0]),
        "tag": summary("tag", [79.0, 81.0]),
        "ensemble": summary("ensemble", [81.8, 82.8]),  # 1.3 points above SMEAR: beyond 0.5
        "lora_1x_compute": summary("lora_1x_compute", [81.0, 81.0]),  # equal means: not strictly above
        "lora_1x_params": summary("lora_1x_params", [80.5, 81.0]),
    }
    checks = dict(quality.check_targets(summaries))
    assert checks["SMEAR ≥ Tag"].startswith("met") and "+1.00 ± 0.00" in checks["SMEAR ≥ Tag"]
    assert checks["SMEAR within 0.5 points of Ensemble"].startswith("missed")
    assert checks["SMEAR > LoRA 1× compute"].startswith("missed")
    assert checks["SMEAR ≥ LoRA 1× parameters"].startswith("met")
    assert checks["SMEAR's average ≥ every method except Ensemble"].startswith("met")
    summaries["tag"] = summary("tag", [82.0, 81.0])
    checks = dict(quality.check_targets(summaries))
    assert checks["SMEAR's average ≥ every method except Ensemble"] == "missed (methods above SMEAR: Tag 81.50)"


def test_margin_targets_need_the_paired_difference_to_exceed_its_spread(quality):
    def summary(method, averages):
        return quality.Summary(method, 1e-3, [0, 1, 2], {"average": averages}, 1, None, None, None)

    summaries = {
        "smear_balanced": summary("smear_balanced", [81.0, 82.0, 83.0]),
        "tag": summary("tag", [80.0, 81.5, 82.0]),  # paired +1.0, +0.5, +1.0: mean 0.83 > std 0.29
        "single": summary("single", [80.0, 82.5, 82.0]),  # paired +1.0, -0.5, +1.0: mean 0.5 < std 0.87
    }
    checks = dict(quality.check_targets({"smear": summary("smear", [80.0, 80.0, 80.0]), **summaries}))
    label = quality.ALL_METHODS["smear_balanced"].label
    assert checks[f"{label} ≥ Tag by more than the paired spread"].startswith("met (82.00 vs 81.17; paired +0.83")
    single = quality.ALL_METHODS["single"].label
    assert checks[f"{label} > {single} by more than the paired spread"].startswith("missed")
    params = quality.ALL_METHODS["lora_1x_params"].label
    assert checks[f"{label} > {params} by more than the paired spread"] == "not run (lora_1x_params)"


def test_ties_keep_the_smaller_learning_rate_and_nan_never_wins(quality):
    rows = [
        {"method": "smear", "phase": "sweep", "learning_rate": rate, "validation_average": value}
        for rate, value in [(4e-3, 0.8), (1e-3, 0.8), (2e-3, 0.7), (8e-3, math.nan)]
    ]
    rows.append({"method": "smear", "phase": "seeds", "learning_rate": 2e-3, "validation_average": None})
    assert quality.choose_learning_rates(rows) == {"smear": 1e-3}


def test_a_router_has_collapsed_when_every_task_sends_its_weight_to_the_same_expert(quality):
    routing = np.array(
        [
            [[0.95, 0.05], [0.95, 0.05], [0.50, 0.50]],  # task a at routers 0, 1, 2
            [[0.92, 0.08], [0.05, 0.95], [0.95, 0.05]],  # task b: router 1 sends it to the other expert
        ]
    )
    report = RoutingReport(["a", "b"], ["r0", "r1", "r2"], [1, 1], routing, np.zeros(2))
    assert quality._collapsed_share(report) == pytest.approx(1 / 3)
