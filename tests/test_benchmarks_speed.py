"""The speed benchmark harness runs end to end on a toy model. Only its plumbing is tested here: timing is not."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from conftest import import_script


METHODS = ["lora", "smear", "ensemble", "poly", "exported"]


@pytest.fixture(scope="module")
def speed():
    return import_script("speed")


common = import_script("common")


@pytest.fixture(scope="module")
def rows(speed):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a toy model gains nothing from threads, and a shared machine loses a lot to them
    try:
        return speed.run_benchmark("tiny", repeats=1, methods=METHODS, memory="inprocess", log=lambda _: None)
    finally:
        torch.set_num_threads(threads)


def test_one_finite_row_per_method_with_positive_timings(speed, rows):
    assert [row["method"] for row in rows] == METHODS
    for row in rows:
        assert set(row) == set(speed.CSV_COLUMNS)
        for name in speed.FIGURES:
            assert math.isfinite(row[name]), (row["method"], name, row[name])
            # A toy model's training can add less than the RSS high-water mark resolves in-process: 0 MiB is a reading.
            assert row[name] > 0 or (name == "peak_memory_mb" and row[name] == 0), (row["method"], name, row[name])


def test_cpu_peak_memory_sees_a_known_allocation(speed):
    with speed.peak_memory("cpu") as peak:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, every page touched
        del block
    assert 60 <= peak[0] <= 200, peak


def test_outputs_have_the_documented_columns(speed, rows, tmp_path):
    paths = speed.write_outputs(rows, tmp_path, log=lambda _: None)
    with open(paths["csv"]) as handle:
        reader = csv.DictReader(handle)
        assert tuple(reader.fieldnames) == speed.CSV_COLUMNS
        assert len(list(reader)) == len(METHODS)
    table = paths["markdown"].read_text().splitlines()
    assert table[0].count("|") == 10 and "train step" in table[0] and "peak memory" in table[0]
    lora_row = next(line for line in table if "LoRA rank r |" in line)
    # LoRA over itself, except where its toy reading is 0 (peak memory under the RSS mark's resolution): NaN, not 1.
    measured = next(row for row in rows if row["method"] == "lora")
    expected = ["1.00×" if measured[name] else "nan×" for name in speed.FIGURES]
    assert lora_row.rstrip(" |").split(" | ")[-len(speed.FIGURES) :] == expected


def test_results_section_reports_command_machine_and_targets(speed, rows, tmp_path):
    section = speed.results_section(rows, "tiny", "cpu", "inprocess", "python benchmarks/speed.py", ((1,) * 3,) * 2, 1)
    results = tmp_path / "RESULTS.md"
    common.write_results(results, section)
    text = results.read_text()
    assert text.startswith("# Benchmark results") and "never edited by hand" in text
    assert "`python benchmarks/speed.py`" in text and f"torch {torch.__version__}" in text
    assert "not checked" in text  # the toy sweep does not include the target shape
    assert "Changed on the command line" not in text  # the preset's own sweep


def test_command_line_overrides_of_the_sweep_are_measured_and_reported(speed):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = speed.run_benchmark(
            "tiny", repeats=2, methods=["smear"], memory="inprocess", log=lambda _: None, num_experts=[3]
        )
    finally:
        torch.set_num_threads(threads)
    assert [(row["method"], row["num_experts"], row["repeats"]) for row in rows] == [("lora", 3, 2), ("smear", 3, 2)]
    section = speed.results_section(rows, "tiny", "cpu", "inprocess", "python benchmarks/speed.py", ((1,) * 3,) * 2, 1)
    assert "Changed on the command line: N {3}, 2 repetitions." in section


def test_load_description_says_when_other_jobs_shared_the_machine(speed):
    quiet, busy = ((0.5, 0.4, 0.3), (0.6, 0.5, 0.4)), ((1e4,) * 3, (0.5,) * 3)
    assert common.load_description(quiet, "timings are noisy") == "0.50, 0.40, 0.30 / 0.60, 0.50, 0.40"
    assert common.load_description(busy, "timings are noisy").endswith(
        f"above the {common.usable_cores()} cores, so other jobs shared the machine and timings are noisy"
    )
