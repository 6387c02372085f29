"""benchmarks/export_gap.py's weight-space gap equals an explicit per-example computation, for every export it
compares, and its tables show every export of every task."""

from __future__ import annotations

import math

import pytest
import torch
from peft import PeftConfig, get_peft_model
from safetensors.torch import load_file

import peft_smear
from conftest import import_script, random_batch, tiny_bert
from peft_smear import SmearLinear, export_merged_adapter


export_gap = import_script("export_gap")


@pytest.fixture(scope="module")
def model():
    model = get_peft_model(tiny_bert(), peft_smear.SmearConfig(num_experts=4, r=2, init_weights=False)).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "router" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


def test_mean_update_is_the_average_of_the_examples_updates(model):
    layer = next(m for m in model.modules() if isinstance(m, SmearLinear))
    A, B = layer.smear_lora_A["default"].detach().double(), layer.smear_lora_B["default"].detach().double()
    scaling = layer.expert_kind["default"].scaling
    p = torch.randn(9, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64).softmax(dim=-1)

    def update(weights):
        return scaling * torch.einsum("n,nor->or", weights, B) @ torch.einsum("n,nri->ri", weights, A)

    per_example = sum(update(p[b]) for b in range(9)) / 9
    torch.testing.assert_close(export_gap.mean_update(layer, p.T @ p / 9), per_example, atol=1e-12, rtol=1e-10)
    gap = export_gap.relative_gap(update(p.mean(dim=0)), per_example)
    assert gap == pytest.approx(((update(p.mean(dim=0)) - per_example).norm() / per_example.norm()).item())
    assert export_gap.relative_gap(update(p[0]), export_gap.mean_update(layer, torch.outer(p[0], p[0]))) < 1e-12


@pytest.mark.parametrize(("form", "rank"), [("mean_routing", None), ("mean_update", None), ("mean_update", 3)])
def test_exported_update_is_read_with_peft_s_scaling(model, form, rank, tmp_path):
    """The gap of each compared export, from its saved files: 0 for the exact mean update, sqrt(1 - energy kept) for a
    truncation (Eckart-Young), the routing covariance's share for the mean routing."""
    batches = [random_batch(3, 6, seed=seed, lengths=[6, 4, 2]) for seed in range(2)]
    exported = export_merged_adapter(model, tmp_path, routing=batches, form=form, rank=rank)
    moments = export_gap.routing_moments(model, batches)
    layers = {n: m for n, m in model.base_model.model.named_modules() if isinstance(m, SmearLinear)}
    weights = load_file(tmp_path / "adapter_model.safetensors")
    config = PeftConfig.from_pretrained(tmp_path)
    for name, (_, second, _) in moments.items():
        gap = export_gap.relative_gap(
            export_gap.exported_update(weights, name, config), export_gap.mean_update(layers[name], second)
        )
        if form == "mean_routing":
            assert gap > 1e-3, name
        elif rank is None:
            assert gap < 1e-5, name
        else:
            assert gap == pytest.approx(math.sqrt(max(1 - exported.energy_kept[name], 0)), abs=1e-5), name


def test_exports_and_tables():
    assert [label for label, _, _ in export_gap.exports(8, 8)] == [
        "mean routing",
        "mean update, rank 8",
        "mean update, rank 16",
        "mean update, rank 32",
        "mean update, exact (rank 64)",
    ]
    assert [rank for _, _, rank in export_gap.exports(4, 8)] == [None, 8, 16, None]  # 4r is the exact rank
    row = {
        "export": "mean update, rank 8",
        "rank": 8,
        "score": 0.9,
        "agreement": 0.95,
        "weight_gap_mean": 0.1,
        "weight_gap_max": 0.2,
        "energy_mean": 0.99,
        "energy_min": 0.9,
        "file_bytes": 2_000_000,
    }
    routing_row = {**row, "export": "mean routing", "energy_mean": None, "energy_min": None}
    results = [
        {
            "task": t,
            "metric": "accuracy",
            "examples": 10,
            "smear": 0.92,
            "routing_tv": 0.2,
            "exports": [routing_row, row],
        }
        for t in ("a", "b")
    ]
    table = export_gap.markdown(results)
    assert (
        "| a | accuracy | 10 | mean update, rank 8 | 8 | 0.9000 | -0.0200 | 0.9500 | 0.100 / 0.200 | 0.9900 / 0.9000 |"
        in table
    )
    assert "| mean routing | 8 | 2.00 MB | -0.0200 / -0.0200 | 0.9500 | 0.100 |" in table
