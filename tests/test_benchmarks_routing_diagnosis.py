"""The routing diagnosis script's statistics, on routing weights whose answers are known by construction."""

from __future__ import annotations

import math

import torch

from conftest import import_script


diagnosis = import_script("routing_diagnosis")


def test_step_statistics_of_a_collapsed_and_a_task_specific_router():
    task_ids = torch.tensor([0, 0, 1, 1])
    collapsed = torch.tensor([[0.05, 0.95]] * 4)
    specific = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    stats = diagnosis.step_statistics(
        {("a", "default"): collapsed, ("b", "default"): specific}, {"a": "collapsed", "b": "specific"}, task_ids, 2
    )
    entropy = -(0.05 * math.log(0.05) + 0.95 * math.log(0.95)) / math.log(2)
    assert math.isclose(stats["collapsed"]["entropy"], entropy, rel_tol=1e-5)
    assert stats["collapsed"]["collapsed"] and stats["collapsed"]["top_expert"] == 1
    assert math.isclose(stats["collapsed"]["task_distance"], 0.0, abs_tol=1e-7)
    assert not stats["specific"]["collapsed"] and math.isclose(stats["specific"]["task_distance"], 1.0)
    assert math.isclose(stats["specific"]["entropy"], 0.0, abs_tol=1e-6)


def test_analysis_finds_each_collapse_and_whether_it_landed_on_the_largest_early_update():
    def entry(step, r_collapsed, s_collapsed):
        routers = {"r": {"collapsed": r_collapsed, "top_expert": 2}, "s": {"collapsed": s_collapsed, "top_expert": 1}}
        return {"step": step, "routers": routers}

    result = {  # r collapses onto its largest early update and stays; s collapses elsewhere for one step
        "history": [entry(10, False, False), entry(20, True, False), entry(30, True, True), entry(40, True, False)],
        "early_norms": {"r": [0.1, 0.2, 0.9], "s": [1.0, 0.0, 0.0]},
    }
    analysis = diagnosis.analyse(result)
    assert analysis["first_collapse"] == {"r": {"step": 20, "expert": 2}, "s": {"step": 30, "expert": 1}}
    assert analysis["collapsed_at_end"] == ["r"] and analysis["collapsed_on_largest_early_update"] == ["r"]
