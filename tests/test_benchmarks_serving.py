"""The serving benchmark runs end to end on a toy model and replaces its section of the results file. Only the
plumbing is tested: timing is not."""

from __future__ import annotations

import math

import torch

from conftest import import_script


def test_the_benchmark_replaces_its_section_with_every_table(tmp_path):
    serving = import_script("serving")
    title = "## Serving: mixed-task batches and SMEAR vs an exported expert, preset `tiny`, "
    older = title + "2000-01-01 00:00 UTC\n\n| stale |\n\n"
    other = "## Routing statistics overhead, preset `cpu`, 2000-01-01 00:00 UTC\n\n| off | 2.00 ms | 1.0000× |\n"
    (tmp_path / "R.md").write_text("# Benchmark results\n\n" + older + other)
    threads = torch.get_num_threads()
    try:
        assert serving.main(["--preset", "tiny", "--threads", "1", "--append-results", str(tmp_path / "R.md")]) == 0
    finally:
        torch.set_num_threads(threads)
    text = (tmp_path / "R.md").read_text()
    assert text.startswith("# Benchmark results\n\n" + title)
    assert text.endswith("\n\n" + other) and "stale" not in text  # replaced in place; the other section kept
    assert "python benchmarks/serving.py --preset tiny --threads 1 --append-results " in text
    preset = serving.PRESETS["tiny"]
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ")]
    throughput = [row for row in rows if row[0] in ("| forward", "| generate")]
    assert [(row[0], row[1]) for row in throughput] == [
        (f"| {work}", way)
        for work in ("forward", "generate")
        for way in (serving.MIXED, serving.GROUPED, serving.SMEAR)
    ]
    one_task = [row for row in rows if row[0].removeprefix("| ") in (serving.EXPORTED, serving.SMEAR, serving.BASE)]
    assert [row[0] for row in one_task] == [f"| {serving.EXPORTED}", f"| {serving.SMEAR}", f"| {serving.BASE}"]
    assert one_task[0][3] == "1.00× |"  # the exported expert is the reference
    for row in throughput + one_task:
        assert all(math.isfinite(float(cell.split()[0])) for cell in row[-3:-1])
    requests = [row for row in rows if row[0].removeprefix("| ").isdigit()]
    assert len(requests) == preset.tasks * preset.requests_per_task
    for row in requests:
        assert 0 <= float(row[2]) <= 1 and row[1].startswith("task-")
        same, new = row[5].removesuffix(" |").split("/")
        assert 0 <= int(same) <= int(new) == preset.new_tokens
