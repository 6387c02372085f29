"""Which base layers SMEAR wraps: quantized layers of every backend but bitsandbytes are refused with their class and
backend named, whether they are no ``nn.Linear`` (HQQ, GPTQ, AWQ, ...) or an ``nn.Linear`` holding a quantized weight
(torchao, float8).

Most backends cannot be installed on a CPU-only machine (they need CUDA kernels or a compiler), so their layers are
stood in for by minimal classes that carry the real class's module path and name, which is all the check reads. torchao
runs on the CPU and is tested for real where it is installed.
"""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from torch import nn

import peft_smear
from conftest import tiny_llama
from peft_smear.core.base_layers import check_base_layer


def stand_in_layer(module: str, name: str, base: type = nn.Module) -> nn.Module:
    """An instance of a class called ``name`` defined in ``module`` (as the quantization package defines it) that maps
    ``[..., 32]`` to ``[..., 32]`` like the q_proj it replaces."""

    def __init__(self):
        base.__init__(self, 32, 32) if base is nn.Linear else base.__init__(self)
        self.in_features = self.out_features = 32

    cls = type(name, (base,), {"__init__": __init__, "__module__": module, "forward": lambda self, x: x})
    return cls()


# PEFT LoRA's dispatchers (peft/tuners/lora/*.py) and transformers' quantizers: the class each backend's layer has.
QUANTIZED_LAYERS = {
    "HQQ": ("hqq.core.quantize", "HQQLinear", nn.Module),
    "GPTQModel (GPTQ / AWQ)": ("gptqmodel.nn_modules.qlinear.torch", "TorchQuantLinear", nn.Module),
    "AutoGPTQ": ("auto_gptq.nn_modules.qlinear.qlinear_cuda", "QuantLinear", nn.Module),
    "AutoAWQ": ("awq.modules.linear.gemm", "WQLinear_GEMM", nn.Module),
    "EETQ": ("eetq.modules.qlinear", "EetqLinear", nn.Module),
    "AQLM": ("aqlm.inference", "QuantizedLinear", nn.Module),
    "Intel Neural Compressor": (
        "neural_compressor.torch.algorithms.fp8_quant._quant_common.helper_modules",
        "PatchedLinear",
        nn.Module,
    ),
    "Transformer Engine": ("transformer_engine.pytorch.module.linear", "Linear", nn.Module),
    "Megatron-LM (tensor-parallel layers)": ("megatron.core.tensor_parallel.layers", "RowParallelLinear", nn.Module),
    # nn.Linear subclasses: wrapping them would not fail by itself, so the backend check must catch them.
    "optimum-quanto": ("optimum.quanto.nn.qlinear", "QLinear", nn.Linear),
    "transformers' finegrained_fp8 integration": ("transformers.integrations.finegrained_fp8", "FP8Linear", nn.Linear),
}


def llama_with_q_proj(layer: nn.Module) -> nn.Module:
    model = tiny_llama()
    model.model.layers[1].self_attn.q_proj = layer
    return model


@pytest.mark.parametrize("backend", list(QUANTIZED_LAYERS))
def test_quantized_layers_of_other_backends_are_refused_by_name(backend):
    module, name, base = QUANTIZED_LAYERS[backend]
    model = llama_with_q_proj(stand_in_layer(module, name, base))
    with pytest.raises(TypeError) as error:
        get_peft_model(model, peft_smear.SmearConfig(num_experts=2, r=2, target_modules=["q_proj"]))
    message = str(error.value)
    assert f"'model.layers.1.self_attn.q_proj' of type {name} ({module})" in message
    assert f"quantized with {backend}" in message
    assert "bitsandbytes.nn.Linear4bit (NF4, FP4) and bitsandbytes.nn.Linear8bitLt" in message


class FakeQuantizedTensor(torch.Tensor):
    """Stands in for a quantized weight tensor subclass (torchao's ``Int8Tensor`` keeps the float dtype it replaces,
    so only its class tells it apart)."""


FakeQuantizedTensor.__module__ = "torchao.quantization"


@pytest.mark.parametrize(
    ("weight", "expected"),
    [
        (FakeQuantizedTensor._make_subclass(FakeQuantizedTensor, torch.zeros(32, 32)), "quantized with torchao"),
        (torch.zeros(32, 32, dtype=torch.float8_e4m3fn), "of dtype torch.float8_e4m3fn"),
        (torch.zeros(32, 32, dtype=torch.int8), "of dtype torch.int8"),
    ],
    ids=["tensor-subclass", "float8", "int8"],
)
def test_a_linear_with_a_quantized_weight_is_refused(weight, expected):
    layer = nn.Linear(32, 32)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    with pytest.raises(TypeError, match=r"its weight is a .* not a float tensor") as error:
        check_base_layer(layer, "q_proj", "lora")
    assert expected in str(error.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_plain_float_linears_are_accepted(dtype):
    check_base_layer(nn.Linear(4, 4, dtype=dtype), "q_proj", "lora")


def test_real_torchao_weight_only_quantization_is_refused():
    torchao = pytest.importorskip("torchao.quantization")
    model = tiny_llama()
    torchao.quantize_(model.model.layers[1].self_attn.q_proj, torchao.Int8WeightOnlyConfig())
    with pytest.raises(TypeError, match=r"q_proj.*its weight is a torchao\..* quantized with torchao"):
        get_peft_model(model, peft_smear.SmearConfig(num_experts=2, r=2, target_modules=["q_proj"]))
