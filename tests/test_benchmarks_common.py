"""What every benchmark shares. The RESULTS.md writer: a run's section replaces the previous section of the same title,
byte for byte nowhere else, so the file holds each benchmark's latest results. The command that reproduces a run. The
pool that runs training jobs side by side."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from conftest import import_script


common = import_script("common")

HEADER = "# Benchmark results\n\nA header paragraph that stays as it is.\n\n"
SPEED = "## Speed, preset `cpu`, 2026-11-21 16:05 UTC\n\n- Command: `old`\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
SPEED_LONG = "## Speed, preset `cpu`, long, 2026-11-21 17:00 UTC\n\n- Command: `long`\n\n### Targets\n\n- met\n\n"
EXPORT = "## Export: a task's mean-routing LoRA vs SMEAR's per-example experts\n\n- Command: `export`\n\n"
QUALITY = "## Quality, preset `reduced`, 2026-11-21 22:08 UTC\n\n- Command: `quality`\n"  # the last: one newline


@pytest.fixture
def results(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text(HEADER + SPEED + SPEED_LONG + EXPORT + QUALITY)
    return path


@pytest.mark.parametrize(
    ("heading", "title"),
    [
        ("## Speed, preset `cpu`, 2026-11-24 04:11 UTC", "Speed, preset `cpu`"),
        ("## Speed, preset `cpu`, long, 2026-11-24 04:11 UTC", "Speed, preset `cpu`, long"),
        ("## Routing diagnosis `smear_warmup_100`, 2026-11-24 05:28 UTC", "Routing diagnosis `smear_warmup_100`"),
        (
            "## Export: a task's mean-routing LoRA vs SMEAR's per-example experts",
            "Export: a task's mean-routing LoRA vs SMEAR's per-example experts",
        ),
    ],
)
def test_a_title_is_the_heading_without_its_date(heading, title):
    assert common.section_title(heading + "\n\n- Command: `x`\n") == title


def test_a_section_replaces_the_older_one_of_its_title_and_nothing_else(results):
    new = "## Speed, preset `cpu`, 2026-11-25 09:00 UTC\n\n- Command: `new`\n\n| a | b |\n|---|---|\n| 3 | 4 |\n"
    common.write_results(results, new)
    assert results.read_text() == HEADER + new + "\n" + SPEED_LONG + EXPORT + QUALITY


def test_the_last_section_and_an_undated_one_are_replaced_in_place(results):
    quality = "## Quality, preset `reduced`, 2026-11-25 10:00 UTC\n\n- Command: `quality, again`\n\n| x |\n"
    common.write_results(results, quality)
    assert results.read_text() == HEADER + SPEED + SPEED_LONG + EXPORT + quality
    export = EXPORT.replace("`export`", "`export, again`")
    common.write_results(results, export)
    assert results.read_text() == HEADER + SPEED + SPEED_LONG + export + quality


def test_a_title_that_extends_another_is_a_different_section(results):
    long = "## Speed, preset `cpu`, long, 2026-11-25 11:00 UTC\n\n- Command: `long, again`\n"
    common.write_results(results, long)
    assert results.read_text() == HEADER + SPEED + long + "\n" + EXPORT + QUALITY
    short = "## Speed, preset `cpu`, 2026-11-25 12:00 UTC\n\n- Command: `short, again`\n"
    common.write_results(results, short)
    assert results.read_text() == HEADER + short + "\n" + long + "\n" + EXPORT + QUALITY


def test_a_new_title_is_appended_after_the_last_section(results):
    new = "## Speed, preset `full`, 2026-11-25 13:00 UTC\n\n- Command: `full`\n"
    common.write_results(results, new)
    assert results.read_text() == HEADER + SPEED + SPEED_LONG + EXPORT + QUALITY + "\n" + new


def test_a_missing_file_gets_the_header_then_the_section(tmp_path):
    path = tmp_path / "RESULTS.md"
    common.write_results(path, QUALITY)
    assert path.read_text() == common.RESULTS_HEADER + "\n" + QUALITY
    assert "replaced by that script's next run" in common.RESULTS_HEADER


def test_a_section_must_start_with_its_heading(results):
    with pytest.raises(ValueError, match="'## ' heading"):
        common.write_results(results, "- Command: `no heading`\n")


def test_the_command_names_the_environment_that_changes_what_the_run_imports_and_its_timings(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setattr(sys, "argv", ["benchmarks/quality.py", "--preset", "tiny"])
    assert common.command_line("quality.py", None) == "python benchmarks/quality.py --preset tiny"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", "src:benchmarks")
    assert (
        common.command_line("when_smear_pays.py", ["--output-dir", Path("a dir")])
        == "OMP_NUM_THREADS=1 PYTHONPATH=src:benchmarks python benchmarks/when_smear_pays.py --output-dir 'a dir'"
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # only a single thread is worth naming: it is the shared-CPU setting
    assert common.command_line("quality.py", []) == "PYTHONPATH=src:benchmarks python benchmarks/quality.py"


def process_argument_and_state(value: int, state: str) -> tuple[int, int, str]:
    """A pool job: the process it ran in, its argument, and the state the pool holds."""
    return os.getpid(), value, state


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_pool_gives_every_job_its_arguments_and_the_state_in_the_processes_it_promises(jobs):
    with common.RunPool("loaded data", jobs, threads=1) as pool:
        futures = [pool.submit(process_argument_and_state, value) for value in range(4)]
        results = [future.result() for future in futures]
    assert [(value, state) for _, value, state in results] == [(value, "loaded data") for value in range(4)]
    processes = {pid for pid, _, _ in results}
    if jobs == 1:
        assert processes == {os.getpid()}
    else:
        assert os.getpid() not in processes and 1 <= len(processes) <= jobs
