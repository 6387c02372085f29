"""What each routing method decides for a batch: which experts an example uses, and how they are combined.

SMEAR merges parameters; the baselines the paper compares it with (section 2) select one expert, mix expert outputs,
or merge with weights that do not come from a router. Every decision also carries the ``[batch, num_experts]``
weights that :func:`peft_smear.get_routing_weights` reports: the distribution for SMEAR and the output mixtures, a
one-hot for discrete choices.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class RoutingDecision:
    """How one layer applies its experts to each example of a batch."""

    weights: torch.Tensor
    """``[batch, num_experts]`` fp32: the merge weights, or the output-mixture weights when ``mixture``."""

    mixture: bool = False
    """Mix the experts' outputs (ensemble-style) instead of merging their parameters."""

    expert_index: torch.Tensor | None = None
    """``[batch]``: the one expert each example uses, when there is exactly one (applied by gathering it)."""

    output_scale: torch.Tensor | None = None
    """``[batch]`` multiplier of the expert's output: Top-k's probability, ST-Gumbel's straight-through factor."""

    per_example_expert: tuple[torch.Tensor, ...] | None = None
    """Each example's expert (merged by ``weights``, or the chosen one), once built: kept so that a decision reused
    across calls (every step of ``generate``) builds it only once."""


@dataclass
class PolicyStep:
    """What REINFORCE needs from one layer to form its losses once the example's task loss is known."""

    log_prob: torch.Tensor  # [batch] log-probability of the sampled expert
    probs: torch.Tensor  # [batch, num_experts] the routing distribution
    baseline: torch.Tensor  # [batch] the learned baseline's estimate of the reward
    policy_weight: float
    entropy_weight: float
    value_weight: float


def merged(weights: torch.Tensor) -> RoutingDecision:
    return RoutingDecision(weights=weights)


def mixed(weights: torch.Tensor) -> RoutingDecision:
    return RoutingDecision(weights=weights, mixture=True)


def one_expert(index: torch.Tensor, num_experts: int, output_scale: torch.Tensor | None = None) -> RoutingDecision:
    weights = F.one_hot(index, num_experts).float()
    return RoutingDecision(weights=weights, expert_index=index, output_scale=output_scale)


def top_k(probs: torch.Tensor, k: int) -> RoutingDecision:
    """The ``k`` most probable experts, each output scaled by its (not renormalised) probability."""
    if k == 1:
        index = probs.argmax(dim=-1)
        return one_expert(index, probs.shape[-1], output_scale=probs.gather(1, index[:, None]).squeeze(1))
    top = probs.topk(k, dim=-1).indices
    return mixed(probs * torch.zeros_like(probs).scatter_(1, top, 1.0))


def st_gumbel(probs: torch.Tensor, temperature: float, training: bool) -> RoutingDecision:
    """Training: the argmax of a Gumbel-softmax sample, its output multiplied by ``1 - sg(y_i) + y_i`` (1 in value,
    the relaxed sample's gradient in backward). Inference: the argmax of the router."""
    if not training:
        return one_expert(probs.argmax(dim=-1), probs.shape[-1])
    gumbel = -torch.empty_like(probs).exponential_().log()  # -log of an Exp(1) sample is Gumbel(0, 1)
    relaxed = ((probs.clamp_min(1e-20).log() + gumbel) / temperature).softmax(dim=-1)
    index = relaxed.argmax(dim=-1)
    chosen = relaxed.gather(1, index[:, None]).squeeze(1)
    return one_expert(index, probs.shape[-1], output_scale=1 - chosen.detach() + chosen)


def annealed_temperature(start: float, rate: float, floor: float, step: int) -> float:
    return max(floor, start * math.exp(-rate * step))


def sampled(probs: torch.Tensor, training: bool) -> tuple[RoutingDecision, torch.Tensor | None]:
    """REINFORCE's action: training samples one expert from the router (returning its log-probability for the
    policy gradient); inference takes the argmax."""
    if not training:
        return one_expert(probs.argmax(dim=-1), probs.shape[-1]), None
    index = torch.multinomial(probs.detach(), 1).squeeze(1)
    log_prob = probs.gather(1, index[:, None]).squeeze(1).clamp_min(1e-20).log()
    return one_expert(index, probs.shape[-1]), log_prob


def adamix(batch_size: int, num_experts: int, training: bool, device: torch.device) -> RoutingDecision:
    """Training: a uniformly random expert per example. Inference: the plain average of all experts' parameters."""
    if training:
        return one_expert(torch.randint(num_experts, (batch_size,), device=device), num_experts)
    return merged(torch.full((batch_size, num_experts), 1 / num_experts, device=device))


def latent_skills(skill_logits: torch.Tensor, temperature: float, training: bool) -> RoutingDecision:
    """Polytropon: each task's row of skill logits gives a relaxed-Bernoulli sample per expert in training (the
    sigmoid at inference), normalised to sum to one, and the experts' parameters are merged by it."""
    logits = skill_logits.float()
    if training:
        noise = torch.rand_like(logits).clamp(1e-6, 1 - 1e-6)
        active = ((logits + noise.log() - (-noise).log1p()) / temperature).sigmoid()
    else:
        active = logits.sigmoid()
    return merged(active / (active.sum(dim=-1, keepdim=True) + 1e-12))


def hashed_experts(token_bytes: list[bytes], salt: str, num_experts: int, device: torch.device) -> torch.Tensor:
    """A fixed expert per example: a keyed BLAKE2b of its routing tokens, so the choice is the same in every epoch
    and process (Python's ``hash`` is salted per process) and differs between layers (``salt``)."""
    key = hashlib.blake2b(salt.encode(), digest_size=16).digest()
    choices = [
        int.from_bytes(hashlib.blake2b(tokens, digest_size=8, key=key).digest(), "little") % num_experts
        for tokens in token_bytes
    ]
    return torch.tensor(choices, dtype=torch.long, device=device)
