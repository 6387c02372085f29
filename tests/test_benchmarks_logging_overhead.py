"""The routing-statistics overhead benchmark runs end to end on a toy model and appends its section. Only the plumbing
is tested: timing is not."""

from __future__ import annotations

import math

import torch

from conftest import import_script


def test_the_benchmark_appends_a_section_with_its_command_and_every_variant(tmp_path):
    overhead = import_script("logging_overhead")
    threads = torch.get_num_threads()
    try:
        assert overhead.main(["--preset", "tiny", "--threads", "1", "--append-results", str(tmp_path / "R.md")]) == 0
    finally:
        torch.set_num_threads(threads)
    text = (tmp_path / "R.md").read_text()
    assert "python benchmarks/logging_overhead.py --preset tiny --threads 1 --append-results " in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "ms |" in line]
    names = [row.split(" | ")[0].removeprefix("| ") for row in rows]
    assert names == [*overhead.variant_names(overhead.PRESETS["tiny"]), overhead.WORK_ALONE]
    assert all(math.isfinite(float(row.split(" | ")[1].removesuffix(" ms"))) for row in rows)
