"""The vocabulary the method's modules share: what a router reads (:class:`RouterInputs`) and decides
(:class:`RoutingDecision`), how a setting
(:class:`Option`) or a ``smear_*`` input (:class:`CallInput`) is declared, and how expert parameters are passed. A
leaf: it imports nothing of the package but the value checks."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from .checks import Check


ROUTER_INPUTS = ("self", "prompt", "encoder")
"""What a layer's router pools to route an example (``SmearConfig.router_input``, resolved per layer): the layer's own
input over the example's real tokens, over its prompt tokens only (causal LMs), or the encoder's final hidden states
(decoder layers of encoder-decoders)."""

Params = Mapping[str, torch.Tensor]
"""A module's expert parameters of one adapter, by parameter name (``"smear_lora_A"`` -> ``[N, r, in]``)."""

Expert = tuple[torch.Tensor, ...]
"""One expert per example, as its kind lays it out: every tensor has the batch as its first dimension."""


@dataclass(frozen=True)
class Option:
    """One setting of a routing method or an expert kind: passed as ``SmearConfig(<name>=...)``, kept in
    ``config.routing_options`` (or ``config.expert_options``)."""

    name: str
    default: Any
    help: str
    check: Check | None = None
    """Run on every value but ``None`` when the config is built; raises a ``ValueError`` naming the option."""


def with_defaults(options: tuple[Option, ...], **defaults: Any) -> tuple[Option, ...]:
    """``options`` with the given defaults changed: for a method that shares another's router."""
    return tuple(replace(o, default=defaults[o.name]) if o.name in defaults else o for o in options)


@dataclass(frozen=True)
class CallInput:
    """A ``smear_*`` keyword of the model's call that routing reads (e.g. ``smear_task_ids``): taken off the call
    before the wrapped model sees it, checked by ``prepare``, repeated per beam in ``generate`` and per packed
    sequence. A ``smear_*`` keyword that no router declares is refused, so a typo never passes silently."""

    name: str
    help: str
    prepare: Callable[[Any], torch.Tensor]
    """The user's value as the tensor routers read; raises a ``ValueError`` that names the input otherwise."""
    per_token: bool = False
    """``[batch, tokens]`` (unpacked like the labels when rows pack several sequences) rather than one row per
    example (given per sequence, or per row for every sequence of it)."""
    example: Callable[[Any], str] | None = None
    """Python lines that compute the input for an adapter of a given config and pass it to the model, for the model
    card (``model`` and ``inputs`` are the loaded model and the tokenised batch)."""


@dataclass
class RoutingDecision:
    """How one layer applies its experts to each example of a batch."""

    weights: torch.Tensor
    """``[batch, num_experts]`` fp32: the merge weights, or the output-mixture weights when ``mixture``. Routers that
    decide per token give ``[batch, tokens, num_experts]`` output-mixture weights (``mixture`` is then set)."""

    mixture: bool = False
    """Mix the experts' outputs instead of merging their parameters."""

    expert_index: torch.Tensor | None = None
    """``[batch]``: the one expert each example uses, when there is exactly one (applied by gathering it)."""

    up_expert_index: torch.Tensor | None = None
    """``[batch]``: for kinds with a down and an up projection, the expert of the up projection, when it is not
    ``expert_index``'s."""

    output_scale: torch.Tensor | None = None
    """``[batch]`` multiplier of the expert's output (e.g. the chosen expert's probability, so the router learns)."""

    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    """Auxiliary losses of this decision, by name, already weighted (training only): the layer adds them to the
    call's and carries them through gradient checkpointing."""

    balance: tuple[torch.Tensor, float] | None = None
    """A distribution ``[batch, N]`` and a weight: the load-balancing loss the call adds for this decision once its
    layers have run, for every router at once (``router_balance``), when the decision is applied."""

    per_example_expert: Expert | None = None
    """Each example's expert (merged by ``weights``, or the chosen one), once built: kept so that a decision reused
    across calls (every step of ``generate``) builds it only once."""


def register(table: dict[str, type], cls: type, base: type, setting: str, registrar: str) -> None:
    """Put ``cls``, a ``base`` subclass, in ``table`` under its ``name``, the ``SmearConfig.<setting>`` value that
    selects it (``registrar``: the public function that does it). The same class again is harmless; another class
    under a taken name is refused."""
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"{registrar} takes a subclass of {base.__name__}, got {cls!r}.")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} needs a class attribute `name`, the SmearConfig.{setting} value.")
    if table.get(name, cls) is not cls:
        raise ValueError(f"{setting}={name!r} is already {table[name].__name__}; choose another name.")
    table[name] = cls


class RouterInputs(Protocol):
    """What one wrapped layer offers its router for one call: the routed tensor (the layer's input, or its output for
    expert kinds that route on it; one example per row), and what the call says about its examples, each computed
    only when the router asks."""

    routed: torch.Tensor
    router_input: str
    """The layer's rule for what an example is routed on, one of :data:`ROUTER_INPUTS`."""
    prefix_length: int | None
    training: bool
    experts: Params
    """The adapter's expert parameters in this layer (read only), for routers that score the experts."""
    memo: dict[Any, Any]
    """A scratch dict of the current call, shared by every layer: what a router computes once per call (a host
    read), or keeps for its method's ``finish_call``."""

    @property
    def batch_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def tokens(self) -> torch.Tensor:
        """``[batch, tokens, features]``: every token on its own, never pooled."""

    def token_mask(self) -> torch.Tensor | None:
        """``[batch, tokens]``: the tokens an example is routed on (``None``: all of them, or no token mask fits)."""

    def summary(self) -> torch.Tensor:
        """``[batch, features]`` fp32: each example's routed tokens pooled, by ``router_input``."""

    def call_input(self, name: str) -> torch.Tensor | None:
        """The call's ``smear_*`` input ``name``, one row per routed example, or ``None`` when the call has none."""

    def input_ids(self) -> torch.Tensor | None:
        """``[batch, tokens]``: the call's token ids (the encoder's for encoder-decoders), ``None`` without them."""

    def padding_mask(self) -> torch.Tensor | None:
        """``[batch, tokens]``: the call's padding mask, nonzero at real tokens (``None``: all are real)."""

    def require(self, holds: torch.Tensor, message: Callable[[], str], wait: bool = False) -> None:
        """Raise ``ValueError(message())`` unless every element of the bool tensor ``holds`` is true, without making
        the host wait for the device (read once its copy lands: at once on a CPU); ``wait``: read it now, for a
        value the call cannot go on without (an index)."""
