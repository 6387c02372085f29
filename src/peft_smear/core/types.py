"""The shared vocabulary: what a router reads (:class:`RouterInputs`) and decides (:class:`RoutingDecision`), how a
setting (:class:`Option`) or ``smear_*`` input (:class:`CallInput`) is declared. A leaf: it imports only the checks."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from .checks import Check


ROUTER_INPUTS = ("self", "prompt", "encoder")
"""Resolved ``SmearConfig.router_input``: routers pool layer input over real or prompt tokens, or encoder states."""

Params = Mapping[str, torch.Tensor]
"""A module's expert parameters of one adapter, by parameter name (``"smear_lora_A"`` -> ``[N, r, in]``)."""

Expert = tuple[torch.Tensor, ...]
"""One expert per example, as its kind lays it out: every tensor has the batch as its first dimension."""


@dataclass(frozen=True)
class Option:
    """A setting of a routing method or expert kind, ``SmearConfig(<name>=...)``, kept in ``config.*_options``."""

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
    """A ``smear_*`` call keyword routing reads (e.g. ``smear_task_ids``): hidden from the wrapped model, checked by
    ``prepare``, repeated per beam in ``generate`` and per packed sequence. Undeclared ones (typos) are refused."""

    name: str
    help: str
    prepare: Callable[[Any], torch.Tensor]
    """The user's value as the tensor routers read; raises a ``ValueError`` that names the input otherwise."""
    per_token: bool = False
    """``[batch, tokens]``, unpacked like labels, not one row per example (given per sequence or per packed row)."""
    example: Callable[[Any], str] | None = None
    """Model-card Python computing a config's input and passing it to loaded ``model`` with tokenised ``inputs``."""


@dataclass
class RoutingDecision:
    """How one layer applies its experts to each example of a batch."""

    weights: torch.Tensor
    """``[batch, N]`` fp32 merge weights, or output-mixture ones if ``mixture`` (per token: ``[batch, tokens, N]``)."""
    mixture: bool = False
    """Mix the experts' outputs instead of merging their parameters."""
    expert_index: torch.Tensor | None = None
    """``[batch]``: the one expert each example uses, when there is exactly one (applied by gathering it)."""
    up_expert_index: torch.Tensor | None = None
    """``[batch]``: the up projection's expert (kinds with down and up projections), if not ``expert_index``'s."""
    output_scale: torch.Tensor | None = None
    """``[batch]`` multiplier of the expert's output (e.g. the chosen expert's probability, so the router learns)."""
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    """Weighted auxiliary losses by name (training only), added to the call's, also through gradient checkpointing."""
    routed_by: tuple[torch.Tensor, Any, int] | None = None
    """(``[batch, G, N]`` distributions, :class:`~peft_smear.core.smear.GroupRouting`, part index) when ``weights`` are
    one part of a group's: a merge writes the part's gradient there (:class:`~peft_smear.core.smear.MergeAndApply`)."""
    per_example_expert: Expert | None = None
    """Each example's merged or chosen expert, once built: a decision reused in ``generate``'s steps builds it once."""


def register(table: dict[str, type], cls: type, base: type, setting: str, registrar: str) -> None:
    """Put ``cls``, a ``base`` subclass, in ``table`` under its ``name``, the ``SmearConfig.<setting>`` value selecting
    it (``registrar``: the public caller). The same class again is harmless; another under a taken name is refused."""
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
    kinds routing on it; one example per row), and what the call says of its examples, each computed on demand."""

    routed: torch.Tensor
    router_input: str
    """The layer's rule for what an example is routed on, one of :data:`ROUTER_INPUTS`."""
    prefix_length: int | None
    training: bool
    experts: Params
    """The adapter's expert parameters in this layer (read only), for routers that score the experts."""
    memo: dict[Any, Any]
    """The call's scratch for all layers: what a router computes once (a host read) or keeps for ``finish_call``."""
    aux: Any
    """The call's :class:`~peft_smear.core.context.AuxLosses`, where SMEAR's router adds its load balancing."""

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
        """``ValueError(message())`` unless ``holds`` is all true, read with no host wait (``wait``: now, an index)."""
