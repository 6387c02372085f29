"""RoutingContext: what routers need to know about the current call beyond a layer's own input; and RouterInputs,
what one layer offers its router, computed only when the router asks."""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .packing import UNMARKED_PACKING, PackedLayout, several_prompts
from .pooling import expand_rows, masked_mean, prompt_mask, require
from .routers.base import CallInput, RoutingDecision


if TYPE_CHECKING:
    from .experts.base import Params
    from .layer import SmearLinear
    from .routing_stats import RoutingStatistics

PROMPT_UNKNOWN_IN_TRAINING = (
    "SMEAR prompt routing in training mode got neither token labels, nor smear_routing_mask, nor "
    "routing_prefix_length, so it routes on every real token, response included. If your loop computes the loss "
    "itself (e.g. Trainer with label_smoothing_factor), pass smear_routing_mask or set routing_prefix_length."
)


def routing_mask_tensor(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"smear_routing_mask must be [batch, tokens], got {shape}.")
    return value


ROUTING_MASK = CallInput(
    "smear_routing_mask",
    "[batch, tokens], nonzero at the tokens a prompt-routed layer pools over (e.g. a causal LM's instruction)",
    routing_mask_tensor,
    per_token=True,
)
"""The one ``smear_*`` input of the core itself: every other is declared by the routers that read it."""


@dataclass
class RoutingContext:
    """Per-call state shared by a :class:`~peft_smear.core.model.SmearModel` and all of its layers.

    The tuner fills it on every call of the wrapped model (from the call's own arguments and the ``smear_*`` inputs it
    took off the call); the layers only read it, through :class:`RouterInputs`. It deliberately outlives the call:
    gradient checkpointing re-runs layer forwards during backward, after any per-call hook is gone, and must route
    exactly as the forward did.
    """

    attention_mask: torch.Tensor | None = None
    """``[batch, seq]`` padding mask of the current call, nonzero at real tokens (``None``: all real)."""

    labels: torch.Tensor | None = None
    """``[batch, seq]`` token labels of the current call, if any; ``-100`` marks positions without a target."""

    input_ids: torch.Tensor | None = None
    """``[batch, seq]`` token ids of the current call (the encoder's for encoder-decoders)."""

    call_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """The ``smear_*`` inputs of the current call (or of the ``generate`` that made it), checked, by name."""

    encoder_summary: torch.Tensor | None = None
    """``[batch, hidden]`` fp32 masked mean of the encoder's final hidden states (decoders of encoder-decoders)."""

    packing: PackedLayout | None = None
    """When the call's rows pack several sequences: their layout. Every per-token field above then holds the padded
    batch of its sequences (``[sequences, longest]``), and the layers unpack their inputs to match."""

    routing_cache: dict[tuple[torch.nn.Module, str], RoutingDecision] | None = None
    """During ``generate``: the decision every layer made at prefill, reused for every later step."""

    recorded: dict[tuple[torch.nn.Module, str], torch.Tensor] | None = None
    """When a dict, every layer stores its routing weights here under ``(layer, adapter_name)``."""

    statistics: RoutingStatistics | None = None
    """When set, every layer reports each routing decision to it (see :mod:`peft_smear.core.routing_stats`)."""

    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    """Auxiliary losses the layers added during the current call (already weighted), by name."""

    left: dict[str, list[Any]] = field(default_factory=lambda: defaultdict(list))
    """What routers left during the current call for their method's ``finish_call``, by method name."""

    aux_losses_without_autograd: bool = False
    """Whether a layer computed an auxiliary loss of this call with autograd disabled, as reentrant gradient
    checkpointing runs its layers: the loss then trains through :mod:`peft_smear.core.aux_losses`."""

    aux_gradient_scale: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    """The gradient the model's loss passes on to the auxiliary losses' term, recorded in backward for the layers that
    gradient checkpointing recomputes (see :mod:`peft_smear.core.aux_losses`)."""

    left_without_autograd: set[str] = field(default_factory=set)
    """Names of the methods that left something for ``finish_call`` with autograd disabled: what they left cannot
    train anything (see :meth:`leave_for_finish`)."""

    _prompt_masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)
    _token_ids: dict[int | None, list[torch.Tensor]] = field(default_factory=dict, repr=False)
    _task_id_limits_checked: set[int] = field(default_factory=set, repr=False)
    _warned_unmarked_packing: bool = field(default=False, repr=False)

    def begin_model_call(self) -> None:
        """Forget the previous call's auxiliary losses."""
        self.aux_losses, self.left, self.left_without_autograd = {}, defaultdict(list), set()
        self.aux_losses_without_autograd, self.aux_gradient_scale = False, torch.zeros(())

    def set_call_inputs(self, values: dict[str, torch.Tensor]) -> None:
        """Record the checked ``smear_*`` inputs of a new call."""
        self.call_inputs = values
        self._task_id_limits_checked = set()

    def start_call(
        self,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor | None,
        input_ids: torch.Tensor | None = None,
        packing: PackedLayout | None = None,
        per_token_inputs: frozenset[str] = frozenset({ROUTING_MASK.name}),
    ) -> None:
        """Record the padding mask, token labels and token ids of a new call of the wrapped model (or encoder), and
        the layout of its sequences when its rows pack several: then every per-token input (those named in
        ``per_token_inputs`` among the ``smear_*`` inputs) is unpacked once here, and every per-example input is
        given one row per sequence."""
        if packing is not None:
            attention_mask = packing.mask
            if labels is not None and labels.dim() == 2:
                labels = packing.unpack_tokens(labels, -100, "labels")
            input_ids = None if input_ids is None else packing.unpack_tokens(input_ids, 0, "input_ids")
            self.call_inputs = {
                name: packing.unpack_tokens(value, 0, name)
                if name in per_token_inputs
                else packing.per_sequence(value, name)
                for name, value in self.call_inputs.items()
            }
        self.attention_mask, self.labels, self.input_ids, self.packing = attention_mask, labels, input_ids, packing
        self._prompt_masks, self._token_ids = {}, {}

    def call_input(self, name: str, batch_size: int) -> torch.Tensor | None:
        """The ``smear_*`` input ``name`` for a layer that sees ``batch_size`` rows (repeated per beam / returned
        sequence inside ``generate``), or ``None`` when the call has none."""
        return expand_rows(self.call_inputs.get(name), batch_size, name)

    def cached_decision(self, key: tuple[torch.nn.Module, str], batch_size: int) -> RoutingDecision | None:
        """Inside ``generate``, the decision ``key`` (a layer and adapter) made at prefill: decode steps see only the
        new token, and routing on it would both differ from training and change as the answer grows."""
        if self.routing_cache is None or key not in self.routing_cache:
            return None
        decision = self.routing_cache[key]
        if decision.weights.shape[0] != batch_size:
            raise RuntimeError(
                f"Routing cached at prefill has batch {decision.weights.shape[0]}; a generation step has {batch_size}."
            )
        return decision

    def observe(self, key: tuple[torch.nn.Module, str], decision: RoutingDecision) -> None:
        """Every decision a layer applies passes here: kept for reuse inside ``generate``, recorded when asked
        (:func:`peft_smear.get_routing_weights`), and counted by the routing statistics when they are on."""
        if self.routing_cache is not None:
            self.routing_cache[key] = decision
        if self.recorded is not None:
            self.recorded[key] = decision.weights.detach()
        if self.statistics is not None:
            self.statistics.observe(*key, decision.weights)

    def add_aux_loss(self, name: str, value: torch.Tensor) -> None:
        """Add a layer's auxiliary loss to this call's."""
        if not torch.is_grad_enabled():
            self.aux_losses_without_autograd = True
        self.aux_losses[name] = self.aux_losses[name] + value if name in self.aux_losses else value

    def leave_for_finish(self, method: str, item: Any) -> None:
        """Keep ``item`` for ``method``'s ``finish_call``, once the output exists. Kept with autograd disabled (as
        reentrant checkpointing runs the layers), it could not train anything: the call refuses it then."""
        if not torch.is_grad_enabled():
            self.left_without_autograd.add(method)
        self.left[method].append(item)

    def left_for_finish(self, method: str) -> list[Any]:
        """What ``method``'s routers left during this call, handed over once."""
        return self.left.pop(method, [])

    def token_mask_for(self, batch_size: int, seq_len: int) -> torch.Tensor | None:
        """The padding mask of the ``seq_len`` tokens a layer sees now.

        With a KV cache the model gets the mask of cached plus new tokens while layers see only the new ones, which
        are the trailing columns of the mask.
        """
        mask = self.attention_mask
        if mask is None:
            return None
        _check_covers(mask, batch_size, seq_len, "attention_mask")
        return mask[:, mask.shape[1] - seq_len :]

    def prompt_mask_for(
        self, batch_size: int, seq_len: int, prefix_length: int | None, training: bool
    ) -> torch.Tensor:
        """The tokens a prompt-routed layer pools over; see :func:`peft_smear.core.pooling.prompt_mask` for the rule.

        Computed once per call and shared by every layer. A training call that marks no prompt at all (no labels,
        no routing mask, no prefix length) would route on the response too, so it warns.
        """
        if prefix_length not in self._prompt_masks:
            routing_mask = self.call_inputs.get(ROUTING_MASK.name)
            if training and prefix_length is None and self.labels is None and routing_mask is None:
                warnings.warn(PROMPT_UNKNOWN_IN_TRAINING, stacklevel=5)
            self._warn_if_unmarked_packing(prefix_length)
            self._prompt_masks[prefix_length] = prompt_mask(
                (batch_size, seq_len), self.attention_mask, self.labels, routing_mask, prefix_length
            )
            if self.packing is not None and routing_mask is None and prefix_length is None and self.labels is not None:
                self._refuse_boundary_prompts(self._prompt_masks[prefix_length])
        mask = self._prompt_masks[prefix_length]
        if mask.shape != (batch_size, seq_len):
            raise ValueError(
                f"Prompt routing needs the whole prompt in the layer's input, but the layer sees batch {batch_size} "
                f"and {seq_len} tokens while the prompt mask has shape {tuple(mask.shape)}. Call the model on the "
                "full sequence, or use generate(), which routes once at prefill and reuses that routing."
            )
        return mask

    def _refuse_boundary_prompts(self, prompts: torch.Tensor) -> None:
        """Packing collators (TRL's, transformers' DataCollatorWithFlattening) set the label of every sequence's first
        token to -100, a boundary, not a prompt: plain-text SFT packed that way would route each sequence on its first
        token alone, where the same data unpacked has no prompt and is refused. A packed call in which every sequence's
        prompt is its first token alone is refused too (a one-token prompt among longer ones is a prompt)."""
        require(
            (prompts.sum(dim=1) != 1).any(),
            lambda: (
                "Prompt routing found that every packed sequence's prompt is its first token alone: packing marks "
                "each sequence's first label -100, so the data labels every token after it and has no prompt to "
                "route on (plain-text SFT). Train on prompt/completion data, pass smear_routing_mask, or set "
                "SmearConfig(routing_prefix_length=k) to route on the first k tokens."
            ),
        )

    def _warn_if_unmarked_packing(self, prefix_length: int | None) -> None:
        """Warn once when labels look like several sequences packed in a row that came without boundaries. Reading
        the labels would break a compiled graph, so compiled calls skip it (an uncompiled call shows it)."""
        skip = self._warned_unmarked_packing or self.packing is not None or prefix_length is not None
        if skip or torch.compiler.is_compiling():
            return
        labels = self.labels
        if ROUTING_MASK.name not in self.call_inputs and labels is not None and labels.dim() == 2:
            self._warned_unmarked_packing = several_prompts(labels, self.attention_mask)
            if self._warned_unmarked_packing:
                warnings.warn(UNMARKED_PACKING, stacklevel=6)

    def routing_token_ids(
        self, method: str, mask: torch.Tensor | None, prefix_length: int | None
    ) -> list[torch.Tensor]:
        """Each example's routing token ids (``input_ids`` where ``mask`` is set), on the host, read once per call and
        mask rule (``prefix_length`` tells prompt masks apart; ``-1``: the padding mask)."""
        if prefix_length not in self._token_ids:
            ids = self.input_ids
            if ids is None:
                raise ValueError(
                    f"routing={method!r} reads each example's token ids, but the model was called without input_ids "
                    "(e.g. with inputs_embeds). Pass input_ids."
                )
            if mask is not None and tuple(mask.shape) != tuple(ids.shape):
                raise ValueError(
                    f"routing={method!r} needs input_ids {tuple(ids.shape)} and the routing mask "
                    f"{tuple(mask.shape)} to cover the same tokens; call the model on whole sequences (generate() "
                    "routes once at prefill)."
                )
            rows, keep = ids.cpu().long(), None if mask is None else mask.cpu().bool()
            self._token_ids[prefix_length] = [row if keep is None else row[keep[i]] for i, row in enumerate(rows)]
        return self._token_ids[prefix_length]

    def check_task_ids(self, task_ids: torch.Tensor, limit: int, method: str) -> None:
        """Raise unless every task id of the call is in ``[0, limit)``. Reading the ids back synchronises host and
        device, so it happens once per call (and limit), not in every layer."""
        if limit in self._task_id_limits_checked:
            return
        require(
            ((task_ids >= 0) & (task_ids < limit)).all(),
            lambda: (
                f"smear_task_ids must be in [0, {limit}) for routing={method!r}, got {sorted(set(task_ids.tolist()))}."
            ),
        )
        self._task_id_limits_checked.add(limit)


class RouterInputs:
    """What one wrapped layer offers its router for one call: the routed tensor (the layer's input, or its output for
    expert kinds that route on it; one example per row) and everything about the call, each read only when the
    router asks. The rule of what an example is routed on is the layer's ``router_input``:

    * ``"self"``: its own input over the example's real tokens;
    * ``"prompt"``: its own input over the example's prompt tokens only (causal LMs), so the response never reaches
      the router;
    * ``"encoder"``: the encoder's final hidden states (decoder layers of encoder-decoders).
    """

    def __init__(self, layer: SmearLinear, adapter_name: str, routed: torch.Tensor) -> None:
        self.layer, self.adapter_name, self.routed = layer, adapter_name, routed
        self.context: RoutingContext = layer.routing_context
        self.router_input = layer.router_input[adapter_name]
        self.prefix_length = layer.routing_prefix_length[adapter_name]

    @property
    def batch_size(self) -> int:
        return self.routed.shape[0]

    @property
    def device(self) -> torch.device:
        return self.routed.device

    @property
    def experts(self) -> Params:
        """The adapter's expert parameters in this layer, by name (read only), for routers that score the experts."""
        return self.layer.expert_params(self.adapter_name)

    def tokens(self) -> torch.Tensor:
        """``[batch, tokens, features]`` in the activations' dtype: every token on its own, never pooled, so padding
        cannot change a real token's routing (a padded position is routed too, and its output ignored like the rest
        of it)."""
        return self.routed.reshape(self.batch_size, -1, self.routed.shape[-1])

    def summary(self) -> torch.Tensor:
        """``[batch, features]`` fp32: each example's pooled input, by the layer's ``router_input``."""
        if self.router_input == "encoder":
            summary = self.context.encoder_summary
            if summary is None:
                raise RuntimeError(
                    "This SMEAR layer is in the decoder of an encoder-decoder model and routes on the encoder's "
                    "output, but the decoder was called without encoder_hidden_states."
                )
            if summary.shape[0] != self.batch_size:
                raise ValueError(
                    f"Encoder states have batch {summary.shape[0]}, this decoder layer sees batch {self.batch_size}."
                )
            return summary
        if self.routed.dim() == 2:  # one row per example (e.g. BERT's pooler): the row is the summary
            return self.routed.float()
        return masked_mean(self.tokens(), self.token_mask())

    def token_mask(self) -> torch.Tensor | None:
        """``[batch, tokens]``: the tokens an example is routed on, its prompt for prompt routing, else its real
        tokens; ``None`` when they are all real or no token mask describes the routed positions."""
        if self.routed.dim() != 3:
            return None
        batch_size, seq_len = self.routed.shape[:2]
        if self.router_input == "prompt":
            return self.context.prompt_mask_for(batch_size, seq_len, self.prefix_length, self.layer.training)
        return self.context.token_mask_for(batch_size, seq_len)

    def call_input(self, name: str) -> torch.Tensor | None:
        """The call's ``smear_*`` input ``name``, one row per routed example, on the routed tensor's device."""
        value = self.context.call_input(name, self.batch_size)
        return None if value is None else value.to(self.device)

    def task_ids(self, method: str, limit: int | None) -> torch.Tensor:
        """``[batch]`` int64 ``smear_task_ids``, each checked to be in ``[0, limit)``."""
        task_ids = self.call_input("smear_task_ids")
        if task_ids is None:
            raise ValueError(
                f"routing={method!r} routes by task id, but the model was called without smear_task_ids "
                "(an integer tensor [batch]); add it to the inputs, e.g. with peft_smear.SmearDataCollator."
            )
        if limit is not None:
            self.context.check_task_ids(task_ids, limit, method)
        return task_ids

    def routing_token_ids(self, method: str) -> list[torch.Tensor]:
        """Each example's routing tokens' ids on the host: its prompt's for prompt routing, else its real tokens'."""
        if self.router_input == "prompt":
            mask = self.context.prompt_mask_for(
                self.batch_size, self.tokens().shape[1], self.prefix_length, self.layer.training
            )
            return self.context.routing_token_ids(method, mask, self.prefix_length)
        return self.context.routing_token_ids(method, self.context.attention_mask, -1)


def _check_covers(mask: torch.Tensor, batch_size: int, seq_len: int, name: str) -> None:
    if mask.shape[0] != batch_size or mask.shape[1] < seq_len:
        raise ValueError(
            f"SMEAR cannot pool a layer input of batch {batch_size} and {seq_len} tokens with a {name} of shape "
            f"{tuple(mask.shape)}: the mask must be [batch, tokens] and cover every token the layer sees."
        )
