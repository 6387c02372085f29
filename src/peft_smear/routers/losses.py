"""Each example's own task loss, recomputed from a model's logits and labels for the heads whose loss is known here:
what a routing method that learns from the task loss of each example needs (REINFORCE's reward), where the model's
batch-mean loss is not enough.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F


if TYPE_CHECKING:
    from ..core.model import ModelCall


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
        f"{tuple(labels.shape)}; the supported heads are: "
        f"{SUPPORTED_HEADS}."
    )


def example_task_losses(call: ModelCall, method: str) -> torch.Tensor:
    """``[examples]`` fp32: each example's own task loss in ``call``, from the output's logits and the call's labels,
    for routing ``method``; one per sequence of a packed call, as routed."""
    logits = getattr(call.output, "logits", None)
    if call.labels is None or logits is None:
        raise ValueError(
            f"routing={method!r} learns from each example's task loss, so training calls need labels and an "
            "output with logits (or an output with example_losses)."
        )
    labels, packing = call.labels, call.context.call.packing
    if packing is not None:
        logits, labels = packing.unpack(logits), packing.unpack_tokens(labels, -100, "labels")
    try:
        return per_example_task_loss(logits, labels, call.shifts_tokens)
    except ValueError as error:
        raise ValueError(f"routing={method!r} rewards each example with minus its own loss: {error}") from None


def predicting_positions(call: ModelCall) -> torch.Tensor | None:
    """``[batch, tokens]`` bool: the output positions of ``call`` whose prediction has a label (``None`` for
    per-example labels)."""
    labels = call.labels
    if labels is None or labels.dim() != 2:
        return None
    supervised = labels != -100
    return F.pad(supervised[:, 1:], (0, 1), value=False) if call.shifts_tokens else supervised
