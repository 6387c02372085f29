"""The EMoE benchmarks' plumbing on tiny models: the quality script end to end (every method, EMoE2LoRA rows, the
chosen rates, the heatmaps and the RESULTS.md section) and the speed script's gathered-rows FFN, which must compute
what the EMoE layer computes. These numbers mean nothing."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from conftest import import_script, save_tiny_encoder, tiny_llama, write_task_files
from peft_smear.emoe import moefy


def test_emoe_quality_end_to_end(tmp_path):
    emoe_quality = import_script("emoe_quality")
    save_tiny_encoder(tmp_path / "encoder")
    files = write_task_files(tmp_path)
    methods = ["lora", "emoe_lora", "emoe_learn_lora"]
    argv = ["--preset", "tiny", "--model", str(tmp_path / "encoder"), "--methods", *methods, "--seeds", "2"]
    argv += [arg for name, path in files.items() for arg in ("--task-file", f"{name}={path}")]
    argv += ["--num-experts", "8", "--top-k", "3", "--learning-rates", "3e-3", "1e-2"]  # a rung on each side
    argv += ["--output-dir", str(tmp_path / "out"), "--figures-dir", str(tmp_path / "figures")]
    argv += ["--append-results", str(tmp_path / "RESULTS.md")]
    threads = torch.get_num_threads()
    try:
        assert emoe_quality.main(argv, log=lambda line: None) == 0
    finally:
        torch.set_num_threads(threads)
    with open(tmp_path / "out" / "runs.csv") as handle:
        rows = list(csv.DictReader(handle))
    methods_run = {row["method"] for row in rows}
    assert methods_run == {"lora", "emoe_lora", "emoe_lora_dense", "emoe_learn_lora", "emoe_learn_lora_dense"}
    swept = {}
    for method in methods_run:
        sweep = {
            float(row["learning_rate"]): row for row in rows if row["method"] == method and row["phase"] == "sweep"
        }
        assert all(math.isfinite(float(row["test_average"])) for row in rows)
        chosen = {row["learning_rate"] for row in rows if row["method"] == method and row["chosen"] == "True"}
        assert len(chosen) == 1
        swept[method] = sorted(sweep)
        if not method.endswith("_dense"):  # widened along the tiny preset's ladder while an edge led, up to its ends
            ladder = list(emoe_quality.PRESETS["tiny"].ladder)
            assert swept[method] == ladder[ladder.index(swept[method][0]) : ladder.index(swept[method][-1]) + 1]
            assert {3e-3, 1e-2} <= set(swept[method]), (method, swept[method])
            best = max(sweep, key=lambda rate: (float(sweep[rate]["validation_average"]), -rate))
            assert best not in (swept[method][0], swept[method][-1]) or best in (ladder[0], ladder[-1]), method
    assert all(swept[method + "_dense"] == swept[method] for method in ("emoe_lora", "emoe_learn_lora"))
    assert any(len(rates) > 2 for rates in swept.values()), "no grid widened: the test no longer exercises it"
    # EMoE2LoRA rows take the rate of their EMoE run
    for method in ("emoe_lora", "emoe_learn_lora"):
        rate = {row["learning_rate"] for row in rows if row["method"] == method and row["chosen"] == "True"}
        assert rate == {
            row["learning_rate"] for row in rows if row["method"] == method + "_dense" and row["chosen"] == "True"
        }
    assert (tmp_path / "figures" / "emoe_emoe_lora.png").stat().st_size > 0
    results = (tmp_path / "RESULTS.md").read_text()
    assert "## EMoE quality, preset `tiny`" in results and "EMoE2LoRA within 0.5 points of EMoE" in results


@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_gathered_rows_compute_the_emoe_ffn(top_k):
    emoe_speed = import_script("emoe_speed")
    model = moefy(tiny_llama(), 8, top_k, layers=[1])
    mlp = model.model.layers[1].mlp
    x = torch.randn(5, model.config.hidden_size)
    args = (x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, mlp.act_fn.order)
    with torch.no_grad():
        torch.testing.assert_close(emoe_speed.gathered_ffn(*args, 8, top_k, mlp.act_fn.activation), mlp(x))
