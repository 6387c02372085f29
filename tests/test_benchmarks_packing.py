"""The packing benchmark trains on the same examples packed and padded; check that the two batches hold the same
tokens, labels and loss, and that the harness runs end to end. Timing itself is not tested."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import import_script


@pytest.fixture(scope="module")
def packing():
    return import_script("packing")


def test_packed_and_padded_batches_hold_the_same_examples_and_loss(packing):
    lengths = packing.example_lengths(5, 20, seed=1)
    inputs = packing.batches(lengths, vocab=128, seed=1)
    packed, padded = inputs["packed"], inputs["padded"]
    real = padded["attention_mask"].bool()
    assert torch.equal(packed["input_ids"][0], padded["input_ids"][real])
    assert torch.equal(packed["labels"][0], padded["labels"][real])
    assert packed["position_ids"][0].tolist() == [i for n in lengths for i in range(n)]
    model = packing.build("smear_packed", packing.PRESETS["tiny"].model, num_experts=2, r=2).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**packed).loss, model(**padded).loss, atol=1e-6, rtol=1e-5)


def test_harness_replaces_its_section_with_one_row_per_method(packing, tmp_path):
    results = tmp_path / "RESULTS.md"
    older = (
        "## Packed (padding-free) training steps, 2000-01-01 00:00 UTC\n\n| SMEAR | 9.000 s | 9.000 s | 1.00× |\n\n"
    )
    other = "## Speed, preset `cpu`, 2000-01-01 00:00 UTC\n\n- Command: `speed`\n"
    results.write_text("# Benchmark results\n\n" + older + other)
    options = ["--preset", "tiny", "--examples", "4", "--mean-length", "16", "--repeats", "1"]
    packing.main([*options, "--append-results", str(results)])
    text = results.read_text()
    assert (
        text.startswith("# Benchmark results\n\n## Packed (padding-free) training steps, ") and "--preset tiny" in text
    )
    assert text.endswith("\n\n" + other) and "9.000 s" not in text  # replaced in place; the other section kept
    rows = re.findall(r"^\| (SMEAR|LoRA rank r) \| ([\d.]+) s \| ([\d.]+) s \| ([\d.]+)× \|$", text, re.M)
    assert [row[0] for row in rows] == ["SMEAR", "LoRA rank r"]
    assert all(float(value) > 0 for row in rows for value in row[1:])
