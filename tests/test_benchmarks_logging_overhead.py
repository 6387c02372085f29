"""The routing-statistics overhead benchmark runs end to end on a toy model and replaces its section of the results
file. Only the plumbing is tested: timing is not."""

from __future__ import annotations

import math

import torch

from conftest import import_script


def test_the_benchmark_replaces_its_section_with_its_command_and_every_variant(tmp_path):
    overhead = import_script("logging_overhead")
    older = "## Routing statistics overhead, preset `tiny`, 2000-01-01 00:00 UTC\n\n| stale | 1.00 ms | 1.0000× |\n\n"
    other = "## Routing statistics overhead, preset `cpu`, 2000-01-01 00:00 UTC\n\n| off | 2.00 ms | 1.0000× |\n"
    (tmp_path / "R.md").write_text("# Benchmark results\n\n" + older + other)
    threads = torch.get_num_threads()
    try:
        assert overhead.main(["--preset", "tiny", "--threads", "1", "--append-results", str(tmp_path / "R.md")]) == 0
    finally:
        torch.set_num_threads(threads)
    text = (tmp_path / "R.md").read_text()
    assert text.startswith("# Benchmark results\n\n## Routing statistics overhead, preset `tiny`, ")
    assert text.endswith("\n\n" + other) and "stale" not in text  # replaced in place; the other preset's kept
    text = text.removesuffix(other)
    assert "python benchmarks/logging_overhead.py --preset tiny --threads 1 --append-results " in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "ms |" in line]
    names = [row.split(" | ")[0].removeprefix("| ") for row in rows]
    assert names == [*overhead.variant_names(overhead.PRESETS["tiny"]), overhead.WORK_ALONE]
    assert all(math.isfinite(float(row.split(" | ")[1].removesuffix(" ms"))) for row in rows)
