"""The SMEAR router: one distribution over experts per example, from a pooled summary of its sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F


# Gain of the LayerNorm over the router's weight rows at initialisation. Small, so that initial routing is close to
# uniform and every expert receives gradient early (the reference implementation's choice).
ROW_NORM_INIT_GAIN = 1e-2


def masked_mean(hidden: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over the real tokens of ``[batch, seq, features]`` in fp32, giving ``[batch, features]``.

    Padding is removed with ``masked_fill`` rather than multiplication, so non-finite values at padded positions
    (which some attention implementations produce for fully masked rows) cannot leak into the mean.
    """
    hidden = hidden.float()
    if token_mask is None:
        return hidden.mean(dim=1)
    keep = token_mask.to(device=hidden.device, dtype=torch.bool)
    summed = hidden.masked_fill(~keep.unsqueeze(-1), 0.0).sum(dim=1)
    return summed / keep.sum(dim=1, keepdim=True).clamp(min=1)


def router_probabilities(
    pooled: torch.Tensor,
    input_norm_weight: torch.Tensor,
    input_norm_bias: torch.Tensor,
    weight: torch.Tensor,
    row_norm_weight: torch.Tensor,
) -> torch.Tensor:
    """``softmax(LN(pooled) @ LN_rows(weight).T)`` in fp32: ``[batch, features]`` -> ``[batch, num_experts]``.

    Normalising both the input and the weight rows helps keep the logits from saturating the softmax (paper, section
    4.1); the row gain is learned, so routing can still become sharp when that helps. The router has no bias.
    """
    features = pooled.shape[-1]
    normed_input = F.layer_norm(pooled.float(), (features,), input_norm_weight.float(), input_norm_bias.float())
    normed_rows = F.layer_norm(weight.float(), (features,), row_norm_weight.float())
    return (normed_input @ normed_rows.T).softmax(dim=-1)


def drop_experts(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Expert dropout: zero each expert of each example with probability ``p``, then renormalise.

    An example that would lose every expert keeps them all, so its distribution stays defined.
    """
    keep = torch.rand_like(probs) >= p
    keep |= ~keep.any(dim=-1, keepdim=True)
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)
