"""benchmarks/arrow_prototypes.py runs at a tiny size and writes its section."""

from __future__ import annotations

import torch

from conftest import import_script


def test_the_benchmark_times_both_variants_and_writes_its_section(tmp_path):
    script = import_script("arrow_prototypes")
    results = tmp_path / "RESULTS.md"
    threads = torch.get_num_threads()
    try:
        args = ["--layers", "1", "--experts", "2", "--new-tokens", "2", "--batch", "1", "--seq", "4", "--repeats", "1"]
        assert script.main([*args, "--threads", "1", "--append-results", str(results)]) == 0
    finally:
        torch.set_num_threads(threads)
    text = results.read_text()
    assert "## Arrow prototypes: cached vs recomputed at every call" in text
    assert "python benchmarks/arrow_prototypes.py --layers 1" in text
    for variant in script.VARIANTS:
        assert f"| {variant} |" in text
