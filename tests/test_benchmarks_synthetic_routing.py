"""The synthetic data of the DSelect-k supplement (appendix C.1) as built by ``benchmarks/synthetic_routing.py``: task
weights correlated 0.8 within a group and independent across groups, each group's tasks mixtures of that group's own
experts; and the suite's plumbing on a few steps."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import import_script


@pytest.fixture(scope="module")
def synthetic():
    return import_script("synthetic_routing")


def test_task_weights_correlate_within_groups_only(synthetic):
    groups, tasks, experts = 3000, 6, 4
    weights = synthetic.correlated_task_weights(np.random.default_rng(1), groups, tasks, experts, 0.8)
    assert weights.shape == (groups, tasks, experts)
    # Every (group, expert) coordinate is one draw of the tasks' joint normal: 12,000 draws per pair of tasks, so
    # an estimated correlation has a standard error of about 0.004 at 0.8 and 0.009 at 0.
    draws = weights.transpose(0, 2, 1).reshape(-1, tasks)
    within = np.corrcoef(draws, rowvar=False)
    off_diagonal = within[~np.eye(tasks, dtype=bool)]
    assert np.abs(off_diagonal - 0.8).max() < 0.03
    np.testing.assert_allclose(draws.mean(axis=0), 0, atol=0.05)
    np.testing.assert_allclose(draws.var(axis=0), 1, atol=0.06)
    # The same tasks in two different groups: independent.
    across = np.corrcoef(draws[: len(draws) // 2], draws[len(draws) // 2 :], rowvar=False)[:tasks, tasks:]
    assert np.abs(across).max() < 0.05


def test_each_group_is_a_mixture_of_its_own_four_experts(synthetic):
    data = synthetic.make_synthetic_tasks(num_groups=3, tasks_per_group=10, observations=(300, 50, 50), seed=3)
    assert data.x.shape == (400, 10) and data.y.shape == (400, 30)
    assert data.group.tolist() == [g for g in range(3) for _ in range(10)]
    assert data.task_weights.shape == (30, 4)
    assert [len(data.splits[name]) for name in ("train", "validation", "test")] == [300, 50, 50]
    assert len(np.unique(np.concatenate(list(data.splits.values())))) == 400
    # A group's 10 tasks are convex combinations of the same 4 expert functions: rank 4, and 8 for two groups,
    # while any one task is a genuinely nonlinear function of x (not in the span of x and a constant).
    singular = lambda y: np.linalg.svd(y - y.mean(axis=0), compute_uv=False)  # noqa: E731
    for group in range(3):
        values = singular(data.y[:, data.group == group])
        assert values[3] > 1e-3 * values[0] and values[4] < 1e-5 * values[0], group
    values = singular(data.y[:, data.group < 2])
    assert values[7] > 1e-3 * values[0] and values[8] < 1e-5 * values[0]
    linear = np.c_[data.x, np.ones(len(data.x))]
    residual = data.y[:, 0] - linear @ np.linalg.lstsq(linear, data.y[:, 0], rcond=None)[0]
    assert residual.var() > 0.05 * data.y[:, 0].var()


def test_the_suite_runs_and_tag_routing_is_the_groups(synthetic):
    data = synthetic.standardised(
        synthetic.make_synthetic_tasks(num_groups=2, tasks_per_group=3, observations=(200, 40, 40))
    )
    np.testing.assert_allclose(data.y[data.splits["train"]].mean(axis=0), 0, atol=1e-5)
    settings = synthetic.Settings(hidden=16, steps=5, batch_size=32, routing_observations=16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = synthetic.run_suite(data, ["smear", "tag"], [1e-3, 1e-2], 2, settings, log=lambda _: None)
    finally:
        torch.set_num_threads(threads)
    expected = [(method, seed) for method in ("smear", "tag") for seed in (0, 0, 1)]  # two rates, then seed 1
    assert [(row["method"], row["seed"]) for row in rows] == expected
    for row in rows:
        assert math.isfinite(row["test_mse"]) and row["test_mse"] > 0
    tag = next(row for row in rows if row["method"] == "tag")
    assert (tag["similarity_within"], tag["similarity_across"]) == (1.0, 0.0)
    assert (tag["jaccard_within"], tag["jaccard_across"]) == (1.0, 0.0)
    table = synthetic.markdown_table(rows).splitlines()
    assert len(table) == 4 and table[2].startswith("| SMEAR (the paper's router) |") and "Tag" in table[3]


def test_the_command_replaces_its_table_with_command_and_machine(synthetic, tmp_path):
    results = tmp_path / "RESULTS.md"
    # A run of other methods than the default ones is a benchmark of its own: it never replaces the full comparison.
    full = "## Synthetic routing (DSelect-k appendix C.1), 2000-01-01 00:00 UTC\n\n- Command: `full`\n\n"
    older = (
        "## Synthetic routing (DSelect-k appendix C.1), methods tag, 2000-01-01 00:00 UTC\n\n- Command: `stale`\n\n"
    )
    other = "## Speed, preset `cpu`, 2000-01-01 00:00 UTC\n\n- Command: `speed`\n"
    results.write_text("# Benchmark results\n\n" + full + older + other)
    argv = ["--methods", "tag", "--learning-rates", "1e-2", "--seeds", "1", "--groups", "2", "--tasks-per-group", "2"]
    argv += ["--observations", "64", "16", "16", "--steps", "2", "--append-results", str(results)]
    tables, threads = [], torch.get_num_threads()
    try:
        assert synthetic.main(argv, log=tables.append) == 0
    finally:
        torch.set_num_threads(threads)  # the command sets its own
    text = results.read_text()
    assert text.startswith(
        "# Benchmark results\n\n" + full + "## Synthetic routing (DSelect-k appendix C.1), methods tag, "
    )
    assert text.endswith("\n\n" + other) and "stale" not in text  # replaced in place; the other section kept
    assert f"- Command: `python benchmarks/synthetic_routing.py {' '.join(argv)}`" in text
    assert f"torch {torch.__version__}" in text and "Load average" in text
    assert tables[-1] in text  # the very table it printed
