"""Today's data path gives the outputs and gradients the code before issue 43's lean data path gave
(``tests/fixtures/data_path``, written by ``tests/data_path_cases.py``): every routing method and expert kind, fp32,
bf16 and fp16, padding, prompt routing, packed rows, generation with a KV cache, T5 and BERT, evaluation and training
with expert dropout drawn from the same seed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data_path_cases import cases


FIXTURE = Path(__file__).parent / "fixtures" / "data_path"
CASES = dict(cases())
RELATIVE = 1e-6


def relative_error(value: torch.Tensor, expected: torch.Tensor) -> float:
    """``|value - expected| / |expected|`` in float64 (Frobenius norms): one number per tensor, whatever its dtype."""
    difference = (value.double() - expected.double()).norm()
    return float(difference / expected.double().norm().clamp(min=1e-30))


def test_every_case_has_its_recorded_outputs() -> None:
    assert sorted(CASES) == sorted(path.stem for path in FIXTURE.glob("*.safetensors"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_and_gradients_equal_the_recorded_ones(case: str) -> None:
    expected = load_file(FIXTURE / f"{case}.safetensors")
    computed = CASES[case]()
    assert sorted(computed) == sorted(expected)
    for name, value in computed.items():
        assert value.dtype == expected[name].dtype and value.shape == expected[name].shape, name
        if value.is_floating_point():
            assert relative_error(value, expected[name]) <= RELATIVE, (name, relative_error(value, expected[name]))
        else:
            assert torch.equal(value, expected[name]), name
