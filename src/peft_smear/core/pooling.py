"""What a router reads: each example's summary, a masked mean of its tokens, and which tokens count (its real
tokens, or for a causal LM its prompt)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


ROUTER_INPUTS = ("self", "prompt", "encoder")
"""What a layer's router pools to route an example (``SmearConfig.router_input``, resolved per layer): the layer's own
input over the example's real tokens, over its prompt tokens only (causal LMs), or the encoder's final hidden states
(decoder layers of encoder-decoders)."""


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


NO_PROMPT = (
    "their labels are set from the first real token on, so routing on anything would leak the targets into the "
    "router. Mark the prompt with labels=-100, pass smear_routing_mask, or set SmearConfig(routing_prefix_length=k) "
    "to route plain language-model training on the first k tokens."
)


def require(condition: torch.Tensor, message: Callable[[], str]) -> None:
    """Raise ``ValueError(message())`` unless the one-element bool tensor ``condition`` holds.

    A check on tensor values reads them on the host, once per call. Under ``torch.compile`` it becomes an assertion
    inside the graph instead (``torch._assert_async``, raising ``RuntimeError`` with the message's fixed part), so
    that validating the input costs no graph break.
    """
    if torch.compiler.is_compiling():
        torch._assert_async(condition, "peft-smear: invalid routing input; run the model uncompiled for details")
    elif not bool(condition):
        raise ValueError(message())


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
        selected = real & F.pad(explicit, (0, seq_len - explicit.shape[1]), value=False)
        empty = ~selected.any(dim=1) & real.any(dim=1)
        require(
            ~empty.any(),
            lambda: (
                f"smear_routing_mask selects none of the real tokens of example(s) "
                f"{empty.nonzero().flatten().tolist()}: every example needs at least one token to route on."
            ),
        )
        return selected

    if prefix_length is not None:
        return real & (real.cumsum(dim=1) <= prefix_length)

    if labels is not None and labels.dim() == 2:  # 1-D labels are per-example classes, not token labels
        if tuple(labels.shape) != shape:
            raise ValueError(f"labels of shape {tuple(labels.shape)} do not match the input's {shape}.")
        supervised = (labels.to(real.device) != -100) & real
        first_label = torch.where(supervised.any(dim=1), supervised.int().argmax(dim=1), seq_len)
        prompt = real & (torch.arange(seq_len, device=real.device) < first_label.unsqueeze(1))
        without_prompt = ~prompt.any(dim=1) & real.any(dim=1)
        require(
            ~without_prompt.any(),
            lambda: (
                f"Prompt routing found no prompt in example(s) {without_prompt.nonzero().flatten().tolist()}: "
                + NO_PROMPT
            ),
        )
        return prompt

    return real
