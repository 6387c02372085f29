"""Auxiliary losses of the routing baselines, computed from the model's output once it exists.

REINFORCE's reward is minus each example's own task loss, so the model's batch-mean loss is not enough: the task
loss is recomputed per example from the logits and labels, for the heads whose loss is known here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .routers import PolicyStep


SUPPORTED_HEADS = (
    "sequence classification / regression (logits [batch, classes], labels [batch] or [batch, classes]), "
    "causal LM and seq2seq LM or token classification (logits [batch, tokens, vocab], labels [batch, tokens])"
)


def per_example_task_loss(logits: torch.Tensor, labels: torch.Tensor, shift_tokens: bool) -> torch.Tensor:
    """``[batch]`` task loss of each example, in fp32.

    Token outputs average cross-entropy over the example's labelled tokens (``labels != -100``), after shifting by
    one position for causal LMs (``shift_tokens``); classification uses cross-entropy, a single output with float
    labels mean squared error, and float labels per class (multi-label) binary cross-entropy.
    """
    logits = logits.float()
    if logits.dim() == 3 and labels.dim() == 2:
        if shift_tokens:
            logits, labels = logits[:, :-1], labels[:, 1:]
        labels = labels.to(logits.device)
        token_losses = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
        counts = (labels != -100).sum(dim=1).clamp(min=1)
        return token_losses.sum(dim=1) / counts
    if logits.dim() == 2 and labels.dim() == 1 and not labels.is_floating_point():
        return F.cross_entropy(logits, labels.to(logits.device), reduction="none")
    if logits.dim() == 2 and logits.shape[1] == 1 and labels.dim() == 1:
        return (logits.squeeze(1) - labels.to(logits.device).float()) ** 2
    if logits.dim() == 2 and labels.shape == logits.shape:
        targets = labels.to(logits.device).float()
        return F.binary_cross_entropy_with_logits(logits, targets, reduction="none").mean(dim=1)
    raise ValueError(
        f"Cannot compute a per-example task loss from logits {tuple(logits.shape)} and labels "
        f"{tuple(labels.shape)}. routing='reinforce' rewards each example with minus its own loss and supports: "
        f"{SUPPORTED_HEADS}."
    )


def reinforce_losses(steps: list[PolicyStep], rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    """The REINFORCE losses summed over routing layers (paper, section 2.2), each a batch mean:

    * policy: ``-alpha * log pi(i) * (r - b)`` with the baseline held fixed;
    * entropy bonus: ``-beta * H(pi)``, so that routing keeps exploring;
    * value: ``gamma * Huber(b, r)``, training the baseline to predict the reward.
    """
    rewards = rewards.detach().float()
    policy = entropy = value = rewards.new_zeros(())
    for step in steps:
        advantage = rewards.to(step.log_prob.device) - step.baseline.detach()
        policy = policy - step.policy_weight * (step.log_prob * advantage).mean()
        plogp = (step.probs * step.probs.clamp_min(1e-20).log()).sum(dim=-1)
        entropy = entropy + step.entropy_weight * plogp.mean()
        value = value + step.value_weight * F.huber_loss(step.baseline, rewards.to(step.baseline.device))
    return {"reinforce_policy": policy, "reinforce_entropy": entropy, "reinforce_value": value}


def consistency_loss(first: torch.Tensor, second: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """Adamix's consistency between two stochastic passes: the symmetric KL divergence of their predictive
    distributions (squared difference for a single regression output), averaged over ``token_mask`` (the positions
    that predict a label) for token outputs."""
    first, second = first.float(), second.float()
    if first.shape[-1] == 1:
        return ((first - second) ** 2).mean()
    log_p, log_q = first.log_softmax(dim=-1), second.log_softmax(dim=-1)
    symmetric = ((log_p.exp() - log_q.exp()) * (log_p - log_q)).sum(dim=-1)
    if token_mask is not None and symmetric.dim() == 2:
        keep = token_mask.to(symmetric.device, symmetric.dtype)
        return (symmetric * keep).sum() / keep.sum().clamp(min=1)
    return symmetric.mean()


def predicting_positions(labels: torch.Tensor, shift_tokens: bool) -> torch.Tensor:
    """``[batch, tokens]`` bool: the output positions whose prediction has a label (shifted for causal LMs)."""
    supervised = labels != -100
    return F.pad(supervised[:, 1:], (0, 1), value=False) if shift_tokens else supervised
