"""LoRA expert banks: initialise them, and apply them to each example as its routing decides."""

from __future__ import annotations

import math

import torch

from .routing_methods import RoutingDecision


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


def selected_lora_delta(
    tokens: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, expert_index: torch.Tensor, scaling: float
) -> torch.Tensor:
    """The update of one chosen expert per example (``expert_index [batch]``): gathered, not merged, so discrete
    routing costs exactly one rank-r LoRA."""
    chosen_A = lora_A[expert_index].to(tokens.dtype)
    chosen_B = lora_B[expert_index].to(tokens.dtype)
    return torch.bmm(torch.bmm(tokens, chosen_A.transpose(1, 2)), chosen_B.transpose(1, 2)) * scaling


def mixture_lora_delta(
    tokens: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, weights: torch.Tensor, scaling: float
) -> torch.Tensor:
    """The experts' *outputs* mixed per example, ``sum_n w_n B_n A_n x`` (ensemble, Top-k with k > 1, DSelect-k).

    All experts run as one rank ``N * r`` LoRA whose rank dimensions are weighted by their expert's ``w_n``: one
    dense matmul pair instead of N, but still N times the work of one expert.
    """
    n, r, _ = lora_A.shape
    stacked_A = lora_A.reshape(n * r, -1).to(tokens.dtype)
    stacked_B = lora_B.permute(1, 0, 2).reshape(-1, n * r).to(tokens.dtype)
    hidden = tokens @ stacked_A.T * weights.repeat_interleave(r, dim=1).unsqueeze(1).to(tokens.dtype)
    return hidden @ stacked_B.T * scaling


def routed_lora_delta(
    tokens: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, decision: RoutingDecision, scaling: float
) -> torch.Tensor:
    """Apply the expert bank to ``tokens [batch, seq, in]`` as ``decision`` says: parameters merged (SMEAR and the
    methods that merge), one expert gathered, or outputs mixed."""
    if decision.mixture:
        delta = mixture_lora_delta(tokens, lora_A, lora_B, decision.weights, scaling)
    elif decision.expert_index is not None:
        delta = selected_lora_delta(tokens, lora_A, lora_B, decision.expert_index, scaling)
    else:
        delta = merged_lora_delta(tokens, lora_A, lora_B, decision.weights, scaling)
    if decision.output_scale is not None:
        delta = delta * decision.output_scale.to(delta.dtype).view(-1, 1, 1)
    return delta
