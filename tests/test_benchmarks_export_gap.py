"""benchmarks/export_gap.py's weight-space gap equals an explicit per-example computation."""

from __future__ import annotations

import torch
from peft import get_peft_model

import peft_smear
from conftest import import_script, tiny_bert
from peft_smear import SmearLinear


weight_gap = import_script("export_gap").weight_gap


def test_weight_gap_is_the_relative_error_of_the_mean_routing_update():
    model = get_peft_model(tiny_bert(), peft_smear.SmearConfig(num_experts=4, r=2, init_weights=False))
    layer = next(m for m in model.modules() if isinstance(m, SmearLinear))
    A, B = layer.smear_lora_A["default"].detach().double(), layer.smear_lora_B["default"].detach().double()
    p = torch.randn(9, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64).softmax(dim=-1)

    def update(weights):
        return torch.einsum("n,nor->or", weights, B) @ torch.einsum("n,nri->ri", weights, A)

    per_example = sum(update(p[b]) for b in range(9)) / 9
    expected = (update(p.mean(dim=0)) - per_example).norm() / per_example.norm()
    gap = weight_gap(layer, p.mean(dim=0), p.T @ p / 9)
    assert abs(gap - expected.item()) < 1e-9
    assert weight_gap(layer, p[0], torch.outer(p[0], p[0])) < 1e-12  # identical routing: no gap
