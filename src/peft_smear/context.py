"""RoutingContext: what a router needs to know about the current batch beyond the layer's own input."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RoutingContext:
    """Per-batch state shared by a :class:`~peft_smear.model.SmearModel` and all of its layers.

    The tuner's forward pre-hooks fill it on every call of the wrapped model; the layers only read it. It deliberately
    outlives the forward call: gradient checkpointing re-runs layer forwards during backward, after any per-call hook
    is gone, and must route exactly as the forward did.
    """

    token_mask: torch.Tensor | None = None
    """``[batch, seq]``, nonzero at real tokens of the sequence that self-routed layers see (``None``: all real)."""

    encoder_summary: torch.Tensor | None = None
    """``[batch, hidden]``, fp32 masked mean of the encoder's final hidden states (decoders of encoder-decoders)."""

    recorded: dict[tuple[torch.nn.Module, str], torch.Tensor] | None = None
    """When a dict, every layer stores its routing weights here under ``(layer, adapter_name)``."""

    def token_mask_for(self, batch_size: int, seq_len: int) -> torch.Tensor | None:
        """The padding mask of the ``seq_len`` tokens a layer sees now.

        With a KV cache the model gets the mask of cached plus new tokens while layers see only the new ones, which
        are the trailing columns of the mask.
        """
        mask = self.token_mask
        if mask is None:
            return None
        if mask.shape[0] != batch_size or mask.shape[1] < seq_len:
            raise ValueError(
                f"SMEAR cannot pool a layer input of batch {batch_size} and {seq_len} tokens with an attention_mask "
                f"of shape {tuple(mask.shape)}: the mask must be [batch, tokens] and cover every token the layer sees."
            )
        return mask[:, mask.shape[1] - seq_len :]
