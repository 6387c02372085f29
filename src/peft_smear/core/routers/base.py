"""What a routing method is: one :class:`Router` subclass that holds everything about it (its options, what it reads,
its decision, its auxiliary losses, its errors, what it does once the model's output exists), and the
:class:`RoutingDecision` it hands to the experts.

A router is one ``nn.Module`` per wrapped layer and adapter, kept in the layer's ``smear_router`` ``ModuleDict`` under
the adapter's name. Its parameters are its own attributes, never nested modules: PEFT strips the adapter name from a
saved key only when it is the last or second-to-last component (``...smear_router.default.weight``), so a nested
parameter would silently stay uninitialised when loaded under another adapter name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import Check, require_integer


if TYPE_CHECKING:
    from ..config import SmearConfig
    from ..context import RouterInputs
    from ..model import ModelCall


@dataclass(frozen=True)
class Option:
    """One setting of a routing method: passed as ``SmearConfig(<name>=...)``, kept in ``config.routing_options``."""

    name: str
    default: Any
    help: str
    check: Check | None = None
    """Run on every value but ``None`` when the config is built; raises a ``ValueError`` naming the option."""


def with_defaults(options: tuple[Option, ...], **defaults: Any) -> tuple[Option, ...]:
    """``options`` with some defaults changed: a method that shares a family's options but not all its defaults."""
    unknown = set(defaults) - {option.name for option in options}
    if unknown:
        raise ValueError(f"No options {sorted(unknown)} to change the default of.")
    return tuple(dataclasses.replace(o, default=defaults.get(o.name, o.default)) for o in options)


@dataclass(frozen=True)
class CallInput:
    """A ``smear_*`` keyword of the model's call that routing reads (e.g. ``smear_task_ids``): the model takes it off
    the call before the wrapped model sees it, checks it with ``prepare``, and repeats it per beam in ``generate``
    and per packed sequence. Every ``smear_*`` keyword that no router declares is refused, so a typo never passes
    silently."""

    name: str
    help: str
    prepare: Callable[[Any], torch.Tensor]
    """The user's value as the tensor routers read; raises a ``ValueError`` that names the input otherwise."""
    per_token: bool = False
    """``[batch, tokens]`` (unpacked like the labels when rows pack several sequences) rather than one row per
    example (given per sequence, or per row for every sequence of it)."""
    example: Callable[[SmearConfig], str] | None = None
    """Python lines that compute the input for an adapter of this config and pass it to the model, for the model
    card (``model`` and ``inputs`` are the loaded model and the tokenised batch)."""


@dataclass
class RoutingDecision:
    """How one layer applies its experts to each example of a batch."""

    weights: torch.Tensor
    """``[batch, num_experts]`` fp32: the merge weights, or the output-mixture weights when ``mixture``. Routers that
    decide per token give ``[batch, tokens, num_experts]`` output-mixture weights (``mixture`` is then set)."""

    mixture: bool = False
    """Mix the experts' outputs (ensemble-style) instead of merging their parameters."""

    expert_index: torch.Tensor | None = None
    """``[batch]``: the one expert each example uses, when there is exactly one (applied by gathering it)."""

    up_expert_index: torch.Tensor | None = None
    """``[batch]``: for kinds with a down and an up projection, the expert of the up projection, when it is not
    ``expert_index``'s (Adamix draws the two independently)."""

    output_scale: torch.Tensor | None = None
    """``[batch]`` multiplier of the expert's output: Top-k's probability, ST-Gumbel's straight-through factor."""

    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    """Auxiliary losses of this decision, by name, already weighted (training only): the layer adds them to the
    call's and carries them through gradient checkpointing (see :mod:`peft_smear.core.aux_losses`)."""

    per_example_expert: tuple[torch.Tensor, ...] | None = None
    """Each example's expert (merged by ``weights``, or the chosen one), once built: kept so that a decision reused
    across calls (every step of ``generate``) builds it only once."""


def merged(weights: torch.Tensor) -> RoutingDecision:
    return RoutingDecision(weights=weights)


def mixed(weights: torch.Tensor) -> RoutingDecision:
    return RoutingDecision(weights=weights, mixture=True)


def one_expert(index: torch.Tensor, num_experts: int, output_scale: torch.Tensor | None = None) -> RoutingDecision:
    weights = F.one_hot(index, num_experts).float()
    return RoutingDecision(weights=weights, expert_index=index, output_scale=output_scale)


def require_top_k(config: SmearConfig, name: str) -> None:
    """A routing option that counts experts kept per example or token: an integer in ``[1, num_experts]``."""
    require_integer(
        name, config.routing_options[name], minimum=1, maximum=config.num_experts, maximum_name="num_experts"
    )


def top_k_renormalised(probs: torch.Tensor, k: int) -> torch.Tensor:
    """``probs [..., N]`` with all but the ``k`` largest of each row set to zero, the kept ones rescaled to sum to one
    (PHATGOOSE's and GLIDER's top-k). The gradient flows through the kept probabilities."""
    top = probs.topk(k, dim=-1).indices
    kept = probs * torch.zeros_like(probs).scatter_(-1, top, 1.0)
    return kept / kept.sum(dim=-1, keepdim=True)


class Router(nn.Module):
    """One layer's router for one adapter: ``forward(inputs)`` reads what it needs of the batch from ``inputs`` (a
    :class:`~peft_smear.core.context.RouterInputs`) and returns the :class:`RoutingDecision`.

    A new routing method is a subclass (its traits and options as class attributes) and one call of
    :func:`peft_smear.register_router`. Subclasses read their settings from the config in ``__init__`` (the config
    itself is not kept) and run in the training mode of the model (``self.training``).
    """

    name: ClassVar[str]
    """The ``SmearConfig.routing`` value that selects this method."""

    description: ClassVar[str] = ""
    """One line on what the method does with the experts (the model card's)."""

    options: ClassVar[tuple[Option, ...]] = ()
    """The method's own settings, passed to ``SmearConfig`` as keywords; setting one for another method fails."""

    options_before_declared: ClassVar[dict[str, Any]] = {}
    """The values of options added since adapters stored every method's options as top-level keys, for configs saved
    that way: what such an adapter was trained with (e.g. DSelect-k's soft mixture at inference)."""

    call_inputs: ClassVar[tuple[CallInput, ...]] = ()
    """The ``smear_*`` keywords of the model call this method reads."""

    reads_content: ClassVar[bool] = True
    """Whether routing depends on the example's tokens or states (not only on its task id, or on nothing)."""

    accepts_expert_dropout: ClassVar[bool] = False
    """Whether the method turns a probability distribution into its routing, so that experts can be dropped."""

    default_expert_dropout: ClassVar[float] = 0.0
    """``SmearConfig.expert_dropout`` when left unset (the paper's 0.1 where it helped: SMEAR and Top-k)."""

    default_num_experts: ClassVar[int] = 8
    """``SmearConfig.num_experts`` when left unset."""

    needs_task_descriptions: ClassVar[bool] = False
    """Whether the method scores experts by embeddings of task descriptions (GLIDER's global router): a bank built
    for it needs each expert's description and an embedding model."""

    exportable: ClassVar[bool] = True
    """Whether each example's output is that of one merged or chosen expert, which a fixed routing can export.
    Output mixtures and probability-scaled experts are not."""

    per_token: ClassVar[bool] = False
    """Whether the router decides for every token on its own (weights ``[batch, tokens, N]``). The layer then routes
    each call on its own tokens, every step of ``generate`` included, instead of reusing the decision made at
    prefill; such a routing is never exportable."""

    default_lr_ratio: ClassVar[float] = 1.0
    """The router's learning rate relative to the experts' when :func:`peft_smear.create_router_optimizer` is not
    told one (the paper's: 1, and 10 for Latent Skills' skill matrix)."""

    over_existing_adapters: ClassVar[bool] = False
    """Whether the method routes over a bank of existing, separately trained adapters
    (:func:`peft_smear.build_expert_bank`) rather than experts trained together with their routing: what it routes by
    comes from the finished experts (Arrow's prototypes), from training on each expert's own data (PHATGOOSE's
    gates) or from each expert's task description (GLIDER). Training it from scratch with its experts is not the
    method."""

    expert_types: ClassVar[tuple[str, ...] | None] = None
    """The ``SmearConfig.expert_type`` values the method works with (``None``: every kind)."""

    keeps_training_clock: ClassVar[bool] = False
    """Whether the router follows a schedule (a warm-up, an annealed temperature): it then counts the model's
    training calls in a buffer, ``training_calls``, saved with the adapter so that a resumed run continues the
    schedule where it stopped."""

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.task_limit = self.routed_tasks(config)  # task ids must be in [0, task_limit)
        if self.keeps_training_clock:
            # A tensor counted in place: torch.compile would specialise on an integer and recompile at every step.
            self.register_buffer("training_calls", torch.zeros((), dtype=torch.long))

    @classmethod
    def validate(cls, config: SmearConfig) -> None:
        """Check what one option alone cannot (e.g. ``top_k <= num_experts``) when the config is built; each error
        names the offending value. Every option has passed its own check already."""

    @classmethod
    def describe(cls, config: SmearConfig) -> str:
        """:attr:`description`, with this config's settings where they matter."""
        return cls.description

    @classmethod
    def routed_tasks(cls, config: SmearConfig) -> int | None:
        """How many task ids the routing accepts (``None``: it reads none, or any count is fine)."""
        return None

    @classmethod
    def finish_call(cls, call: ModelCall) -> dict[str, torch.Tensor]:
        """Auxiliary losses this method adds once the model's output exists (REINFORCE's policy terms from the
        examples' task losses, Adamix's consistency with a second pass), by name, already weighted. Called once per
        model call for every method an active adapter uses."""
        return {}

    def untrained_experts(self) -> list[int]:
        """The experts this router cannot route to by what it learned, because their part of it was never trained
        (e.g. PHATGOOSE gates still at zero): the model card names them."""
        return []

    def forward(self, inputs: RouterInputs) -> RoutingDecision:
        raise NotImplementedError
