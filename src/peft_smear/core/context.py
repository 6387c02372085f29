"""RoutingContext: what a router needs to know about the current batch beyond the layer's own input."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .packing import UNMARKED_PACKING, PackedLayout, several_prompts
from .pooling import expand_rows, prompt_mask, require
from .routers.base import PolicyStep, RoutingDecision


if TYPE_CHECKING:
    from .routing_stats import RoutingStatistics

PROMPT_UNKNOWN_IN_TRAINING = (
    "SMEAR prompt routing in training mode got neither token labels, nor smear_routing_mask, nor "
    "routing_prefix_length, so it routes on every real token, response included. If your loop computes the loss "
    "itself (e.g. Trainer with label_smoothing_factor), pass smear_routing_mask or set routing_prefix_length."
)


@dataclass
class RoutingContext:
    """Per-batch state shared by a :class:`~peft_smear.model.SmearModel` and all of its layers.

    The tuner fills it on every call of the wrapped model (from the call's own arguments and the ``smear_*`` inputs it
    took off the PEFT model's call); the layers only read it. It deliberately outlives the call: gradient
    checkpointing re-runs layer forwards during backward, after any per-call hook is gone, and must route exactly as
    the forward did.
    """

    attention_mask: torch.Tensor | None = None
    """``[batch, seq]`` padding mask of the current call, nonzero at real tokens (``None``: all real)."""

    labels: torch.Tensor | None = None
    """``[batch, seq]`` token labels of the current call, if any; ``-100`` marks positions without a target."""

    routing_mask: torch.Tensor | None = None
    """``[batch, seq]`` explicit ``smear_routing_mask``: the tokens prompt-routed layers pool over."""

    task_ids: torch.Tensor | None = None
    """``[batch]`` ``smear_task_ids`` of the current call, for tag routing and analysis."""

    query_embeddings: torch.Tensor | None = None
    """``[batch, embedding size]`` ``smear_query_embeddings`` of the current call: an embedding of each example's task
    description, GLIDER's global routing input."""

    encoder_summary: torch.Tensor | None = None
    """``[batch, hidden]`` fp32 masked mean of the encoder's final hidden states (decoders of encoder-decoders)."""

    routing_cache: dict[tuple[torch.nn.Module, str], RoutingDecision] | None = None
    """During ``generate``: the decision every layer made at prefill, reused for every later step."""

    recorded: dict[tuple[torch.nn.Module, str], torch.Tensor] | None = None
    """When a dict, every layer stores its routing weights here under ``(layer, adapter_name)``."""

    input_ids: torch.Tensor | None = None
    """``[batch, seq]`` token ids of the current call (the encoder's for encoder-decoders), for hash routing."""

    packing: PackedLayout | None = None
    """When the call's rows pack several sequences: their layout. Every per-token field above then holds the padded
    batch of its sequences (``[sequences, longest]``), and the layers unpack their inputs to match."""

    training_calls: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))
    """Calls of the model in training mode so far in this process: the clock of ST-Gumbel's temperature anneal and of
    the routers' warm-up. A tensor, counted in place: ``torch.compile`` would specialise on an integer and recompile
    at every training step."""

    policy_steps: list[PolicyStep] = field(default_factory=list)
    """REINFORCE records of the current call, turned into losses once the task loss is known."""

    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    """Auxiliary losses the layers added during the current call (already weighted), by name."""

    losses_without_autograd: set[str] = field(default_factory=set)
    """Names of this call's auxiliary losses (and ``"reinforce"``) that a layer computed with autograd disabled, as
    reentrant gradient checkpointing runs its layers: they could not train anything (see :meth:`add_aux_loss`)."""

    statistics: RoutingStatistics | None = None
    """When set, every layer reports each routing decision to it (see :mod:`peft_smear.routing_stats`)."""

    _prompt_masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict, repr=False)
    _token_bytes: dict[str, list[bytes]] = field(default_factory=dict, repr=False)
    _last_summary: tuple[torch.Tensor, int, tuple, torch.Tensor] | None = field(default=None, repr=False)
    _task_id_limits_checked: set[int] = field(default_factory=set, repr=False)
    _warned_unmarked_packing: bool = field(default=False, repr=False)

    def begin_model_call(self, training: bool) -> None:
        """Forget the previous call's auxiliary losses; count training calls."""
        self.policy_steps, self.aux_losses, self.losses_without_autograd = [], {}, set()
        if training:
            self.training_calls += 1

    def start_call(
        self,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor | None,
        input_ids: torch.Tensor | None = None,
        packing: PackedLayout | None = None,
    ) -> None:
        """Record the padding mask, token labels and token ids of a new call of the wrapped model (or encoder), and
        the layout of its sequences when its rows pack several (then every per-token input is unpacked once here)."""
        if packing is not None:
            attention_mask = packing.mask
            if labels is not None and labels.dim() == 2:
                labels = packing.unpack_tokens(labels, -100, "labels")
            input_ids = None if input_ids is None else packing.unpack_tokens(input_ids, 0, "input_ids")
            if self.routing_mask is not None:
                self.routing_mask = packing.unpack_tokens(self.routing_mask.bool(), False, "smear_routing_mask")
            if self.task_ids is not None:
                self.task_ids = packing.per_sequence(self.task_ids, "smear_task_ids")
            if self.query_embeddings is not None:
                self.query_embeddings = packing.per_sequence(self.query_embeddings, "smear_query_embeddings")
        self.attention_mask, self.labels, self.input_ids, self.packing = attention_mask, labels, input_ids, packing
        self._prompt_masks, self._token_bytes, self._last_summary = {}, {}, None

    def shared_summary(self, x: torch.Tensor, key: tuple, pool: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``pool()``, the pooled summary of the layer input ``x``, computed once for consecutive layers that read
        the very same tensor under the same ``key`` (the pooling rule): q/k/v, or gate/up, then pool once, not
        three or two times. One entry only, so no more than one activation is ever held.

        Under ``torch.compile`` every layer pools for itself: a tensor's version counter is data the compiler
        cannot guard on (a graph break per layer), and the compiled graph shares identical pooling anyway."""
        if torch.compiler.is_compiling():
            return pool()
        last = self._last_summary
        if last is not None and last[0] is x and last[1] == x._version and last[2] == key:
            return last[3]
        summary = pool()
        self._last_summary = (x, x._version, key, summary)
        return summary

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
        """Add a layer's auxiliary loss to this call's (see :meth:`_note_autograd`)."""
        self._note_autograd(name)
        self.aux_losses[name] = self.aux_losses[name] + value if name in self.aux_losses else value

    def add_policy_step(self, step: PolicyStep) -> None:
        """Record a REINFORCE decision, turned into losses once the task loss is known (see :meth:`_note_autograd`)."""
        self._note_autograd("reinforce")
        self.policy_steps.append(step)

    def _note_autograd(self, name: str) -> None:
        """Remember a loss computed with autograd off, so that a call that itself runs with autograd (whose loss
        would silently lack that term's gradient, as under reentrant checkpointing) can refuse it."""
        if not torch.is_grad_enabled():
            self.losses_without_autograd.add(name)

    def routing_token_bytes(self, kind: str, mask: torch.Tensor | None) -> list[bytes]:
        """Each example's routing token ids (``input_ids`` where ``mask`` is set) as bytes, computed once per call
        per ``kind`` of mask: what hash routing hashes."""
        if kind not in self._token_bytes:
            ids = self.input_ids
            if ids is None:
                raise ValueError(
                    "routing='hash' hashes each example's token ids, but the model was called without input_ids "
                    "(e.g. with inputs_embeds). Pass input_ids."
                )
            if mask is not None and tuple(mask.shape) != tuple(ids.shape):
                raise ValueError(
                    f"Hash routing needs input_ids {tuple(ids.shape)} and the routing mask {tuple(mask.shape)} to "
                    "cover the same tokens; call the model on whole sequences (generate() routes once at prefill)."
                )
            rows = ids.cpu().long()
            keep = None if mask is None else mask.cpu().bool()
            self._token_bytes[kind] = [
                (row if keep is None else row[keep[i]]).numpy().tobytes() for i, row in enumerate(rows)
            ]
        return self._token_bytes[kind]

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
        """The tokens a prompt-routed layer pools over; see :func:`peft_smear.pooling.prompt_mask` for the rule.

        Computed once per call and shared by every layer. A training call that marks no prompt at all (no labels,
        no routing mask, no prefix length) would route on the response too, so it warns.
        """
        if prefix_length not in self._prompt_masks:
            if training and prefix_length is None and self.labels is None and self.routing_mask is None:
                warnings.warn(PROMPT_UNKNOWN_IN_TRAINING, stacklevel=4)
            self._warn_if_unmarked_packing(prefix_length)
            self._prompt_masks[prefix_length] = prompt_mask(
                (batch_size, seq_len), self.attention_mask, self.labels, self.routing_mask, prefix_length
            )
        mask = self._prompt_masks[prefix_length]
        if mask.shape != (batch_size, seq_len):
            raise ValueError(
                f"Prompt routing needs the whole prompt in the layer's input, but the layer sees batch {batch_size} "
                f"and {seq_len} tokens while the prompt mask has shape {tuple(mask.shape)}. Call the model on the "
                "full sequence, or use generate(), which routes once at prefill and reuses that routing."
            )
        return mask

    def _warn_if_unmarked_packing(self, prefix_length: int | None) -> None:
        """Warn once when labels look like several sequences packed in a row that came without boundaries. Reading
        the labels would break a compiled graph, so compiled calls skip it (an uncompiled call shows it)."""
        skip = self._warned_unmarked_packing or self.packing is not None or prefix_length is not None
        if skip or torch.compiler.is_compiling():
            return
        labels = self.labels
        if self.routing_mask is None and labels is not None and labels.dim() == 2:
            self._warned_unmarked_packing = several_prompts(labels, self.attention_mask)
            if self._warned_unmarked_packing:
                warnings.warn(UNMARKED_PACKING, stacklevel=5)

    def set_routing_inputs(
        self,
        routing_mask: torch.Tensor | None,
        task_ids: torch.Tensor | None,
        query_embeddings: torch.Tensor | None = None,
    ) -> None:
        """Record the ``smear_routing_mask``, ``smear_task_ids`` and ``smear_query_embeddings`` of a new call."""
        self.routing_mask, self.task_ids, self.query_embeddings = routing_mask, task_ids, query_embeddings
        self._task_id_limits_checked = set()

    def task_ids_for(self, batch_size: int) -> torch.Tensor | None:
        """``smear_task_ids`` for a layer that sees ``batch_size`` rows (repeated per beam / returned sequence)."""
        return expand_rows(self.task_ids, batch_size, "smear_task_ids")

    def query_embeddings_for(self, batch_size: int) -> torch.Tensor | None:
        """``smear_query_embeddings`` for a layer that sees ``batch_size`` rows (repeated per beam / sequence)."""
        return expand_rows(self.query_embeddings, batch_size, "smear_query_embeddings")

    def check_task_ids(self, limit: int, method: str) -> None:
        """Raise unless every task id of the call is in ``[0, limit)``. Reading the ids back synchronises host and
        device, so it happens once per call (and limit), not in every layer."""
        if limit in self._task_id_limits_checked or self.task_ids is None:
            return
        task_ids = self.task_ids
        require(
            ((task_ids >= 0) & (task_ids < limit)).all(),
            lambda: (
                f"smear_task_ids must be in [0, {limit}) for routing={method!r}, got {sorted(set(task_ids.tolist()))}."
            ),
        )
        self._task_id_limits_checked.add(limit)


def _check_covers(mask: torch.Tensor, batch_size: int, seq_len: int, name: str) -> None:
    if mask.shape[0] != batch_size or mask.shape[1] < seq_len:
        raise ValueError(
            f"SMEAR cannot pool a layer input of batch {batch_size} and {seq_len} tokens with a {name} of shape "
            f"{tuple(mask.shape)}: the mask must be [batch, tokens] and cover every token the layer sees."
        )
