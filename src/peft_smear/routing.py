"""The SMEAR router: one distribution over experts per example, from a pooled summary of its sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F


# Gain of the LayerNorm over the router's weight rows at initialisation. Small, so that initial routing is close to
# uniform and every expert receives gradient early (the reference implementation's choice).
ROW_NORM_INIT_GAIN = 1e-2


def masked_mean(hidden: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over the real tokens of ``[batch, seq, features]`` in fp32, giving ``[batch, features]``.

    One batched matmul with per-token weights (``mask / count``): it reads the input once and, for fp32 inputs,
    allocates nothing of its size (half-precision inputs are upcast first, so the sum accumulates in fp32). Padded
    positions get weight 0, so their values must be finite; transformers' eager and SDPA attention keep them finite
    (checked for Llama, GPT-2, BERT and T5 with left and right padding).
    """
    hidden = hidden.float()
    if token_mask is None:
        return hidden.mean(dim=1)
    weights = (token_mask != 0).to(device=hidden.device, dtype=hidden.dtype)
    weights = weights / weights.sum(dim=1, keepdim=True).clamp(min=1)
    return torch.bmm(weights.unsqueeze(1), hidden).squeeze(1)


def normalized_router_input(
    pooled: torch.Tensor, input_norm_weight: torch.Tensor, input_norm_bias: torch.Tensor
) -> torch.Tensor:
    """``LN(pooled)`` in fp32: the summary every learned router (and REINFORCE's baseline) reads."""
    features = pooled.shape[-1]
    return F.layer_norm(pooled.float(), (features,), input_norm_weight.float(), input_norm_bias.float())


def router_probabilities(
    normed_input: torch.Tensor, row_norm_weight: torch.Tensor, weight: torch.Tensor, expert_dropout: float = 0.0
) -> torch.Tensor:
    """``softmax(normed_input @ LN_rows(weight).T)`` in fp32: ``[batch, features]`` -> ``[batch, num_experts]``,
    with each expert of each example dropped with probability ``expert_dropout`` (training).

    Normalising both the input (:func:`normalized_router_input`) and the weight rows helps keep the logits from
    saturating the softmax (paper, section 4.1); the row gain is learned, so routing can still become sharp when that
    helps. The router has no bias.
    """
    normed_rows = F.layer_norm(weight.float(), (weight.shape[-1],), row_norm_weight.float())
    logits = normed_input @ normed_rows.T
    if expert_dropout > 0:
        logits = drop_experts(logits, expert_dropout)
    return logits.softmax(dim=-1)


def drop_experts(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Expert dropout on router logits: each expert of each example is removed with probability ``p`` (its logit
    becomes -inf), so the softmax renormalises over the rest.

    Dropping in logit space, not by rescaling probabilities, keeps a sharp router finite: when every kept expert's
    probability underflows, ``kept / kept.sum()`` has a gradient of ``1 / sum**2`` that overflows to NaN. An example
    that would lose every expert keeps them all, so its distribution stays defined.
    """
    keep = torch.rand_like(logits) >= p
    keep |= ~keep.any(dim=-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))


def expand_rows(tensor: torch.Tensor | None, batch_size: int, name: str) -> torch.Tensor | None:
    """Repeat per-example inputs the way ``generate`` expands a batch for beams and ``num_return_sequences``."""
    if tensor is None or tensor.shape[0] == batch_size:
        return tensor
    if batch_size % tensor.shape[0]:
        raise ValueError(f"{name} has {tensor.shape[0]} rows but the model runs on a batch of {batch_size}.")
    return tensor.repeat_interleave(batch_size // tensor.shape[0], dim=0)


def prompt_mask(
    shape: tuple[int, int],
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    routing_mask: torch.Tensor | None,
    prefix_length: int | None,
) -> torch.Tensor:
    """The tokens of each example a causal LM's layers route on: its prompt, never its response.

    The first rule that applies, per call:

    1. an explicit ``routing_mask`` (``smear_routing_mask``), restricted to real tokens; a mask shorter than the
       sequence leaves the tokens after it out;
    2. ``prefix_length`` (``SmearConfig.routing_prefix_length``): the first ``prefix_length`` real tokens;
    3. token ``labels``: the real tokens before the first position that has a label (``!= -100``). An example whose
       first real token already has a label has no prompt, and that is an error, never a silent fallback to the
       whole sequence;
    4. otherwise (a bare prompt, e.g. at generation) every real token.

    Returns a bool mask of ``shape`` (``[batch, seq]``), or of the attention mask's shape when one is given.
    """
    if attention_mask is not None:
        real = attention_mask.bool()
        shape = tuple(real.shape)
    else:
        device = next((t.device for t in (labels, routing_mask) if t is not None), None)
        real = torch.ones(shape, dtype=torch.bool, device=device)
    batch_size, seq_len = shape

    if routing_mask is not None:
        explicit = expand_rows(routing_mask, batch_size, "smear_routing_mask").to(real.device).bool()
        if explicit.dim() != 2 or explicit.shape[1] > seq_len:
            raise ValueError(
                f"smear_routing_mask must be [batch, tokens] with at most {seq_len} tokens, "
                f"got shape {tuple(routing_mask.shape)}."
            )
        return real & F.pad(explicit, (0, seq_len - explicit.shape[1]), value=False)

    if prefix_length is not None:
        return real & (real.cumsum(dim=1) <= prefix_length)

    if labels is not None and labels.dim() == 2:  # 1-D labels are per-example classes, not token labels
        if tuple(labels.shape) != shape:
            raise ValueError(f"labels of shape {tuple(labels.shape)} do not match the input's {shape}.")
        supervised = (labels.to(real.device) != -100) & real
        first_label = torch.where(supervised.any(dim=1), supervised.int().argmax(dim=1), seq_len)
        prompt = real & (torch.arange(seq_len, device=real.device) < first_label.unsqueeze(1))
        without_prompt = (~prompt.any(dim=1) & real.any(dim=1)).nonzero().flatten().tolist()
        if without_prompt:
            raise ValueError(
                f"Prompt routing found no prompt in example(s) {without_prompt}: their labels are set from the first "
                "real token on, so routing on anything would leak the targets into the router. Mark the prompt "
                "with labels=-100, pass smear_routing_mask, or set SmearConfig(routing_prefix_length=k) to route "
                "plain language-model training on the first k tokens."
            )
        return prompt

    return real
