"""LoRA expert banks: initialise them, and apply the expert merged from them for each example."""

from __future__ import annotations

import math

import torch


def init_lora_experts(lora_A: torch.Tensor, lora_B: torch.Tensor, scheme: bool | str) -> None:
    """Initialise ``lora_A [N, r, in]`` and ``lora_B [N, out, r]`` in place, each expert independently so that the
    experts differ (SMEAR needs distinct experts to break symmetry). See ``SmearConfig.init_weights``."""
    with torch.no_grad():
        for expert_A, expert_B in zip(lora_A, lora_B, strict=True):
            if scheme == "gaussian":
                torch.nn.init.normal_(expert_A, std=1 / lora_A.shape[1])
            elif scheme == "smear":
                torch.nn.init.normal_(expert_A, std=1e-2)
            else:
                torch.nn.init.kaiming_uniform_(expert_A, a=math.sqrt(5))

            if scheme == "smear":
                torch.nn.init.normal_(expert_B, std=1e-2)
            elif scheme is False:
                torch.nn.init.kaiming_uniform_(expert_B, a=math.sqrt(5))
            else:
                torch.nn.init.zeros_(expert_B)


def merged_lora_delta(
    tokens: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, probs: torch.Tensor, scaling: float
) -> torch.Tensor:
    """The update of one merged LoRA expert per example.

    ``tokens [batch, seq, in]``, ``probs [batch, N]`` -> ``[batch, seq, out]``. A and B are averaged separately,
    ``(sum_n p_n B_n)(sum_n p_n A_n) x``: that is SMEAR's merged expert, not the ensemble ``sum_n p_n B_n A_n x``.
    The merge runs in the adapter's dtype; the two batched matmuls run in the activations' dtype, so the cost is one
    rank-r LoRA plus ``N * r * (in + out)`` multiply-adds per example for the average.
    """
    merged_A = torch.einsum("bn,nri->bri", probs.to(lora_A.dtype), lora_A).to(tokens.dtype)
    merged_B = torch.einsum("bn,nor->bor", probs.to(lora_B.dtype), lora_B).to(tokens.dtype)
    return torch.bmm(torch.bmm(tokens, merged_A.transpose(1, 2)), merged_B.transpose(1, 2)) * scaling
