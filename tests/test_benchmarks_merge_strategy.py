"""The merge-strategy benchmark compares two ways of computing the same thing; check that they are the same thing,
and that the harness runs end to end. Timing itself is not tested."""

from __future__ import annotations

import math
import re

import pytest
import torch

from conftest import import_script


@pytest.fixture(scope="module")
def merge_strategy():
    return import_script("merge_strategy")


def test_dense_concatenated_equals_an_explicit_per_example_merge(merge_strategy):
    torch.manual_seed(0)
    tokens, A, B = (
        torch.randn(3, 5, 6, dtype=torch.float64),
        torch.randn(4, 2, 6).double(),
        torch.randn(4, 7, 2).double(),
    )
    probs = torch.randn(3, 4).softmax(-1).double()
    expected = []
    for b in range(3):
        merged_A = sum(probs[b, n] * A[n] for n in range(4))
        merged_B = sum(probs[b, n] * B[n] for n in range(4))
        expected.append(tokens[b] @ merged_A.T @ merged_B.T)
    expected = torch.stack(expected)
    torch.testing.assert_close(merge_strategy.dense_concatenated_delta(tokens, A, B, probs, 1.0), expected)


def test_harness_writes_one_finite_row_per_shape(merge_strategy, tmp_path):
    results = tmp_path / "RESULTS.md"
    merge_strategy.main(
        [
            "--width",
            "16",
            "--seq-lens",
            "1",
            "4",
            "--num-experts",
            "2",
            "--ranks",
            "2",
            "--batches",
            "2",
            "--repeats",
            "1",
            "--append-results",
            str(results),
        ]
    )
    rows = [line for line in results.read_text().splitlines() if re.match(r"\| \d", line)]
    assert len(rows) == 2
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        ratios = [float(cell.rstrip("×")) for cell in cells[4:10]]
        assert all(math.isfinite(x) and x > 0 for x in ratios)
        assert cells[10] in ("merge then bmm", "dense concatenated")
