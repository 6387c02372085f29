"""What several routing methods outside the method's package share: a top-k of a distribution, and its option."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..core.checks import require_integer


if TYPE_CHECKING:
    from ..core.config import SmearConfig


def require_top_k(config: SmearConfig, name: str) -> None:
    """A routing option that counts experts kept per example or token: an integer in ``[1, num_experts]``."""
    require_integer(
        name, config.routing_options[name], minimum=1, maximum=config.num_experts, maximum_name="num_experts"
    )


def top_k_renormalised(probs: torch.Tensor, k: int) -> torch.Tensor:
    """``probs [..., N]`` with all but the ``k`` largest of each row set to zero, the kept ones rescaled to sum to one
    (PHATGOOSE's and GLIDER's top-k). The gradient flows through the kept probabilities."""
    top = probs.topk(k, dim=-1).indices
    kept = probs * torch.zeros_like(probs).scatter_(-1, top, 1.0)
    return kept / kept.sum(dim=-1, keepdim=True)
