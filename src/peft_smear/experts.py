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


def merge_lora_experts(
    lora_A: torch.Tensor, lora_B: torch.Tensor, probs: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """SMEAR's merged expert of each example: ``sum_n p_n A_n`` as ``[batch, r, in]`` and ``(sum_n p_n B_n)^T`` as
    ``[batch, r, out]``, from ``probs [batch, N]``, cast to ``dtype`` (the activations').

    A and B are averaged separately: that is SMEAR's merged expert, not the ensemble ``sum_n p_n B_n A_n``. Each
    average is one ``[batch, N] @ [N, r * features]`` matmul in the adapter's dtype (cheaper than an einsum, which
    permutes and copies), and B is merged already transposed so that applying it needs no copy.
    """
    n, r, _ = lora_A.shape
    weights = probs.to(lora_A.dtype)
    merged_A = (weights @ lora_A.reshape(n, -1)).view(-1, r, lora_A.shape[-1])
    merged_B_t = (weights @ lora_B.transpose(1, 2).reshape(n, -1)).view(-1, r, lora_B.shape[1])
    return merged_A.to(dtype), merged_B_t.to(dtype)


def gather_lora_experts(
    lora_A: torch.Tensor, lora_B: torch.Tensor, expert_index: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one chosen expert of each example (``expert_index [batch]``), laid out like :func:`merge_lora_experts`'s
    result: gathered, not merged, so discrete routing costs exactly one rank-r LoRA."""
    return lora_A[expert_index].to(dtype), lora_B[expert_index].transpose(1, 2).to(dtype)


def apply_per_example_experts(
    tokens: torch.Tensor, expert_A: torch.Tensor, expert_B_t: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``tokens [batch, seq, in]`` through each example's own expert (``[batch, r, in]``, ``[batch, r, out]``, from
    :func:`merge_lora_experts` or :func:`gather_lora_experts`): two batched matmuls, the cost of one rank-r LoRA."""
    return torch.bmm(torch.bmm(tokens, expert_A.transpose(1, 2)), expert_B_t) * scaling


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
    tokens: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    decision: RoutingDecision,
    scaling: float,
) -> torch.Tensor:
    """Apply the expert bank to ``tokens [batch, seq, in]`` as ``decision`` says: parameters merged (SMEAR and the
    methods that merge), one expert gathered, or outputs mixed.

    Each example's expert is kept on the decision, so a decision reused by every step of ``generate`` merges once,
    at prefill: per decoded token the merge would cost a quarter of the base layer's work at N=8, r=8, width 512.
    """
    if decision.mixture:
        delta = mixture_lora_delta(tokens, lora_A, lora_B, decision.weights, scaling)
    else:
        if decision.per_example_expert is None:
            decision.per_example_expert = (
                gather_lora_experts(lora_A, lora_B, decision.expert_index, tokens.dtype)
                if decision.expert_index is not None
                else merge_lora_experts(lora_A, lora_B, decision.weights, tokens.dtype)
            )
        delta = apply_per_example_experts(tokens, *decision.per_example_expert, scaling)
    if decision.output_scale is not None:
        delta = delta * decision.output_scale.to(delta.dtype).view(-1, 1, 1)
    return delta
