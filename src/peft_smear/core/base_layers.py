"""Which base layers SMEAR wraps. It adds to a base layer's output (or scales its input), never reading its weight: a
quantized ``nn.Linear`` mapping ``[..., in]`` to ``[..., out]`` in the activations' dtype works, as bitsandbytes'
``Linear4bit`` and ``Linear8bitLt`` do (tested). Other quantized layers are refused, class and backend named: most are
no ``nn.Linear``, and a quantized weight (torchao, float8) would have PEFT cast experts to its dtype, untested."""

from __future__ import annotations

import sys

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D


SUPPORTED_BASE_LAYERS = (nn.Linear, Conv1D)

# Unquantized weight dtypes: experts take the base weight's in PEFT (whose autocast lifts fp16 / bf16 to fp32).
FLOAT_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

QUANTIZATION_BACKENDS = {  # quantizing package -> backend: those PEFT LoRA has a layer for, transformers' quantizers
    "torchao": "torchao",
    "hqq": "HQQ",
    "gptqmodel": "GPTQModel (GPTQ / AWQ)",
    "auto_gptq": "AutoGPTQ",
    "awq": "AutoAWQ",
    "eetq": "EETQ",
    "aqlm": "AQLM",
    "neural_compressor": "Intel Neural Compressor",
    "transformer_engine": "Transformer Engine",
    "megatron": "Megatron-LM (tensor-parallel layers)",
    "optimum": "optimum-quanto",
    "quanto": "quanto",
    "compressed_tensors": "compressed-tensors",
    "vptq": "VPTQ",
    "fbgemm_gpu": "FBGEMM",
}

SUPPORTED_QUANTIZATION = (
    "SMEAR wraps unquantized torch.nn.Linear and transformers Conv1D layers, and bitsandbytes-quantized bases: "
    "bitsandbytes.nn.Linear4bit (NF4, FP4) and bitsandbytes.nn.Linear8bitLt"
)


def bitsandbytes_layer_types() -> tuple[type, ...]:
    """bitsandbytes' quantized linear layers, if it is imported (a model quantized with it has imported it)."""
    bnb = sys.modules.get("bitsandbytes")
    return () if bnb is None else (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)


def check_base_layer(target: nn.Module, module_name: str, expert_type: str) -> None:
    """Raise ``TypeError`` naming ``target``'s class and quantization backend unless SMEAR can wrap it (module doc)."""
    what = (
        f"SMEAR (expert_type={expert_type!r}) cannot wrap target module {module_name!r} of type "
        f"{type(target).__name__} ({type(target).__module__})"
    )
    if isinstance(target, bitsandbytes_layer_types()):
        return
    backend = quantization_backend(type(target))
    if backend is not None:
        raise TypeError(
            f"{what}: it is a layer quantized with {backend}, which SMEAR does not support. {SUPPORTED_QUANTIZATION}."
        )
    if not isinstance(target, SUPPORTED_BASE_LAYERS):
        supported = ", ".join(f"{cls.__module__}.{cls.__qualname__}" for cls in SUPPORTED_BASE_LAYERS)
        raise TypeError(f"{what}; supported types: {supported}. Adjust target_modules.")
    weight = target.weight
    backend = quantization_backend(type(weight))
    if backend is not None or not is_plain_float_weight(weight):
        weight_type = f"{type(weight).__module__}.{type(weight).__qualname__} of dtype {weight.dtype}"
        source = f", quantized with {backend}" if backend is not None else ""
        raise TypeError(
            f"{what}: its weight is a {weight_type}{source}, not a float tensor, and SMEAR supports no such "
            f"quantized weight. {SUPPORTED_QUANTIZATION}."
        )


def quantization_backend(cls: type) -> str | None:
    """The quantization backend that defines ``cls``, by its top-level package (or transformers integration)."""
    module = cls.__module__
    package = module.split(".")[0]
    if package == "transformers" and module.startswith("transformers.integrations."):
        integration = module.split(".")[2]
        return None if integration == "bitsandbytes" else f"transformers' {integration} integration"
    if package == "optimum" and not module.startswith("optimum.quanto"):
        return None
    return QUANTIZATION_BACKENDS.get(package)


def is_plain_float_weight(weight: torch.Tensor) -> bool:
    """A float tensor or parameter, or a sharded one (DTensor); not a quantized subclass, integer or float8 weight."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return type(weight) in (torch.Tensor, nn.Parameter, dtensor) and weight.dtype in FLOAT_WEIGHT_DTYPES
